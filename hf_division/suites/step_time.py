"""Training step time: baseline vs division vs activation checkpointing, interleaved, medians.

python -m hf_division.suites step-time [--batch 32 --seq 128 --rounds 7] [--attn sdpa] [--division_<field> V ...]
python -m hf_division.suites step-time --profile [--top 25]   # where the time goes: torch.profiler, per op
python -m hf_division.suites step-time --token-chunks 1048576 4194304   # one division arm per compiled chunk size

Real MiniLM-L6. Each round times one step (forward + backward) of every method in turn, so
machine noise hits all methods alike; the report gives each method's median and its ratio to
the baseline's median.
"""
from __future__ import annotations

import argparse
import copy

import torch
from transformers import HfArgumentParser

from ..config import DivisionConfig
from .. import fused
from ..api import apply_division
from ..timing import interleaved_medians, timed
from ..zoo import build_classifier


def step(model, batch) -> None:
    model(**batch).loss.backward()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m hf_division.suites step-time", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="profile one step of baseline and division instead")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--token-chunks", type=int, nargs="*", default=[],
                    help="also time division at these compiled chunk sizes (elements; hf_division.fused.TOKEN_CHUNK)")
    args, rest = ap.parse_known_args(argv)
    (dc,) = HfArgumentParser(DivisionConfig).parse_args_into_dataclasses([a.replace("--division_", "--") for a in rest])
    torch.set_num_threads(args.threads)
    base = build_classifier("minilm", args.attn)
    methods = {"baseline": base, "division": apply_division(copy.deepcopy(base), dc)}
    ckpt = copy.deepcopy(base)
    ckpt.activation_checkpointing_enable()
    methods["checkpointing"] = ckpt
    chunks = {"division": fused.TOKEN_CHUNK}
    for size in args.token_chunks:
        chunks[f"division@{size}"] = size
        methods[f"division@{size}"] = methods["division"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(args.batch, dtype=torch.long)}
    if args.profile:
        return profile(methods, batch, args.top)

    def seconds(name):
        model = methods[name]
        fused.TOKEN_CHUNK = chunks.get(name, chunks["division"])
        dt = timed(lambda: step(model, batch))
        model.zero_grad(set_to_none=True)
        return dt

    try:
        med = interleaved_medians(list(methods), seconds, args.rounds)
    finally:
        fused.TOKEN_CHUNK = chunks["division"]
    print(f"MiniLM-L6, batch {args.batch} x {args.seq}, attn {args.attn}, {args.rounds} interleaved rounds, {args.threads} threads")
    print(f"{'method':<22} {'median s':>9} {'ratio':>6}")
    for k, v in med.items():
        print(f"{k:<22} {v:>9.3f} {v / med['baseline']:>6.2f}")



def profile(methods, batch, top):
    """Self CPU time per op of one warm step, baseline vs division, largest differences first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    per = {}
    for name in ("baseline", "division"):
        model = methods[name]
        for _ in range(2):  # warm up (torch.compile of the compressor kernels)
            step(model, batch)
        model.zero_grad(set_to_none=True)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step(model, batch)
        per[name] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
    total = {k: sum(ms for ms, _ in v.values()) for k, v in per.items()}
    print(f"self CPU ms of one step (profiler overhead included): baseline {total['baseline']:.0f}, "
          f"division {total['division']:.0f}")
    keys = set(per["baseline"]) | set(per["division"])
    diff = sorted(keys, key=lambda k: -(per["division"].get(k, (0, 0))[0] - per["baseline"].get(k, (0, 0))[0]))
    print(f"{'op':<58} {'baseline ms':>11} {'division ms':>11} {'calls b/d':>10}")
    for k in diff[:top]:
        b, d = per["baseline"].get(k, (0.0, 0)), per["division"].get(k, (0.0, 0))
        print(f"{k[:58]:<58} {b[0]:>11.1f} {d[0]:>11.1f} {b[1]:>4}/{d[1]:<5}")
