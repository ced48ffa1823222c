#!/usr/bin/env bash
# Accuracy parity on real GLUE data with real MiniLM-L6: baseline vs division (default policy),
# identical hyper-parameters, seeds 0 1 2 (SST-2: the first 2000 train rows, 2 epochs; MRPC,
# STS-B: full train sets, 1 epoch; RTE: full train set, RTE_EPOCHS epochs (default 3: one epoch
# left MiniLM at chance; the training loss leaves 0.69 during the second); CoLA: full train set, COLA_EPOCHS epochs (default 3: after one epoch
# neither arm had learned it); dev sets full); LoRA vs LoRA+division on the SST-2 subset. Sized for
# a 2-core CPU (about 2 to 4 s per step at batch 32 on a loaded machine). Arms are interleaved so
# machine load affects them alike. Then writes the table: python scripts/parity_table.py OUT
#   usage: scripts/glue_parity.sh [GLUE_DIR=../shared/data/glue] [OUT=out/parity] [SEEDS="0 1 2"]
# (with hf-division installed: pip install -e .)
set -euo pipefail
cd "$(dirname "$0")/.."
GLUE=${1:-../shared/data/glue}
OUT=${2:-out/parity}
SEEDS=${3:-"0 1 2"}
PY=${PYTHON:-python}
MODEL=$($PY -c "from hf_division.bench.zoo import minilm_path; print(minilm_path())")
COMMON=(--model_name_or_path "$MODEL" --glue_dir "$GLUE" --do_train --do_eval --max_seq_length 128
        --pad_to_max_length false --per_device_train_batch_size 32 --per_device_eval_batch_size 128
        --warmup_steps 0.1 --weight_decay 0.01 --eval_strategy no --save_strategy no --logging_steps 25
        --report_to none --disable_tqdm true --dataloader_pin_memory false)
run() {  # run NAME ARGS...
  local dir="$OUT/$1"; shift
  if [ -f "$dir/division_report.json" ]; then echo "skip $dir (done)"; return; fi
  echo "== $dir $(date -u +%FT%TZ)"
  $PY scripts/run_glue.py "${COMMON[@]}" --output_dir "$dir" "$@" > "$dir.log" 2>&1 || { echo "FAILED: see $dir.log"; exit 1; }
  rm -f "$dir"/model.safetensors "$dir"/adapter_model.safetensors
  tail -3 "$dir.log"
}
mkdir -p "$OUT"
SST2=(--task_name sst2 --max_train_samples 2000 --num_train_epochs 2)
LORA=(--use_lora --lora_r 8 --lora_alpha 16 --lora_dropout 0.1 --learning_rate 5e-4)
# task by task (all seeds and arms of a task before the next), arms interleaved per seed
RTE_EPOCHS=${RTE_EPOCHS:-3}
COLA_EPOCHS=${COLA_EPOCHS:-3}
for job in ${JOBS:-mrpc cola stsb sst2 sst2-lora rte}; do  # JOBS="mrpc rte" runs a subset
  for seed in $SEEDS; do
    for arm in baseline division; do
      flag=(--seed "$seed"); [ "$arm" = division ] && flag+=(--division)
      case $job in
        sst2) run "sst2_${arm}_s$seed" "${SST2[@]}" --learning_rate 5e-5 "${flag[@]}" ;;
        mrpc) run "mrpc_${arm}_s$seed" --task_name mrpc --num_train_epochs 1 --learning_rate 5e-5 "${flag[@]}" ;;
        rte) run "rte_${arm}_s$seed" --task_name rte --num_train_epochs "$RTE_EPOCHS" --learning_rate 5e-5 "${flag[@]}" ;;
        cola) run "cola_${arm}_s$seed" --task_name cola --num_train_epochs "$COLA_EPOCHS" --learning_rate 5e-5 "${flag[@]}" ;;
        stsb) run "stsb_${arm}_s$seed" --task_name stsb --num_train_epochs 1 --learning_rate 5e-5 "${flag[@]}" ;;
        sst2-lora) run "sst2_lora-${arm}_s$seed" "${SST2[@]}" "${LORA[@]}" "${flag[@]}" ;;
      esac
    done
  done
done
$PY scripts/parity_table.py "$OUT"
