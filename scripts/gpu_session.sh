#!/usr/bin/env bash
# One call on a lent GPU machine (docs/GUIDE.md, "On a GPU"): the GPU's guarantees, the side-by-side
# table, where each arm's step goes, then the kernels' tests, each under its own time limit, logs and
# JSON under $OUT (default ./gpu_out).
#   bash scripts/gpu_session.sh            # at most LIMIT seconds, 585 (the device tool's limit per call is 600)
#   QUICK=1 bash scripts/gpu_session.sh    # the suite's --quick: about 4 minutes
#   SET='{"linear_group_size": 32, "linear_block_size": 1}' bash scripts/gpu_session.sh   # division's config
# Runs from the checkout (PYTHONPATH=.); needs torch with CUDA, Triton, Transformers >= 5.23, peft.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
LIMIT="${LIMIT:-585}"
left() { echo $(( LIMIT - SECONDS )); }  # what a step after the table may take (bash's SECONDS: since start)
export PYTHONPATH=.
# wheels carried in .whl come first: the lent machines' Transformers (5.17) is older than the
# package's floor (docs/GUIDE.md, "On a GPU")
if ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl failed"; exit 1; }
  export PYTHONPATH=/tmp/site:.
fi
# kernels compiled on the CPU machine (scripts/prewarm_triton_cache.sh), where carried: Triton then
# loads what its key finds instead of compiling it; a copy, Triton writes there
if [ -d .triton_cache ] && [ -z "${TRITON_CACHE_DIR:-}" ]; then
  mkdir -p /tmp/triton_cache && cp -r .triton_cache/. /tmp/triton_cache/ && export TRITON_CACHE_DIR=/tmp/triton_cache
fi
cache_entries() { [ -n "${TRITON_CACHE_DIR:-}" ] && find "$TRITON_CACHE_DIR" -mindepth 1 -maxdepth 1 | wc -l; }
C0=$(cache_entries)
python - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import torch, transformers, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "triton", triton.__version__, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
PY
# 0. kept kernels launched by hf_division/kernels/launcher.py against Triton's dispatch, to the bit: where
#    they differ (or the test cannot run), everything after runs with the launcher off, so the figures hold
timeout 90 python -m pytest -q tests/test_cuda.py -k kept_kernels 2>&1 | tail -5 | tee "$OUT/test_launcher.txt"
LAUNCHER_TEST=${PIPESTATUS[0]}
CUDA_TESTS=(tests/test_cuda.py)
if [ "$LAUNCHER_TEST" != 0 ]; then
  export HF_DIVISION_TRITON_LAUNCH=0
  CUDA_TESTS+=(-k "not kept_kernels")  # already reported: -x would stop the rest at it
  echo "the launcher's test did not pass: HF_DIVISION_TRITON_LAUNCH=0 from here" | tee -a "$OUT/test_launcher.txt"
fi
# 0b. the RMSNorm's, the gated MLP's and the rotary embedding's Triton kernels (hf_division/kernels/triton_norm.py,
#     triton_gated.py, triton_rotary.py) against torch's ops on the device (not the property tests: each of their
#     widths is a compile), where they fail, everything after runs with torch's ops
timeout 120 python -m pytest -q tests/kernels/test_triton_norm.py tests/kernels/test_triton_gated.py \
  tests/kernels/test_triton_rotary.py -k "not no_further_than and not transformers_to_the_bit" 2>&1 | tail -5 \
  | tee "$OUT/test_fused.txt"
FUSED_TEST=${PIPESTATUS[0]}
if [ "$FUSED_TEST" != 0 ]; then
  export HF_DIVISION_TRITON_RMS_NORM=0 HF_DIVISION_TRITON_GATED=0 HF_DIVISION_TRITON_ROTARY=0
  echo "the fused kernels' tests did not pass: HF_DIVISION_TRITON_RMS_NORM=0 HF_DIVISION_TRITON_GATED=0" \
    "HF_DIVISION_TRITON_ROTARY=0 from here" | tee -a "$OUT/test_fused.txt"
fi
# 1. correctness on the device: the kernels' codes, no host sync, a CUDA-graph step, and the suite's smoke
timeout 120 python -m pytest -q -x "${CUDA_TESTS[@]}" 2>&1 | tail -25 | tee "$OUT/test_cuda.txt"
C1=$(cache_entries)
# 2. the table: five arms at the SmolLM2 and Llama-1B shapes (--quick: SmolLM2 only)
ARGS=(--out "$OUT/cuda.json" --budget-s 300)
[ "${QUICK:-0}" = 1 ] && ARGS+=(--quick)
[ -n "${SET:-}" ] && ARGS+=(--set "$SET")
TABLE_S=$(( $(left) < 380 ? $(left) : 380 ))  # what is left of LIMIT where the steps before took long
timeout "$TABLE_S" python -m hf_division.bench cuda "${ARGS[@]}" 2>&1 | grep -v "^\[transformers\]" | tee "$OUT/cuda.txt"
[ -n "$C0" ] && echo "Triton cache: $C0 entries carried; the tests added $(( C1 - C0 )), the table $(( $(cache_entries) - C1 ))" \
  | tee -a "$OUT/versions.txt"
# 3. where each arm's step time goes at the SmolLM2 shape: launches, kernel time, the costliest kernels
[ "$(left)" -gt 30 ] && timeout "$(left)" python scripts/cuda_profile.py 2>&1 | grep -v "^\[transformers\]" \
  | tee "$OUT/profile.txt"
# 4. the kernels' own tests on CUDA tensors, as time allows
[ "$(left)" -gt 20 ] && timeout "$(left)" python -m pytest -q tests/test_triton.py -k "not compile_for_an_h200" \
  2>&1 | tail -5 | tee "$OUT/test_triton.txt"
