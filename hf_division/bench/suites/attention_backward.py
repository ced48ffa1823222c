"""The attention backward alone: sdpa's own (autograd through ``F.scaled_dot_product_attention``,
what the baseline runs) against division's written-out one (``hf_division.autograd.sdpa_backward``), in its
query blocks and in one block per chunk (its former layout), interleaved, medians.

python -m hf_division.bench attention-backward [--batch 32 --seq 128 --heads 9 --kv-heads 3 --head-dim 64]
python -m hf_division.bench attention-backward --batch 4 --seq 1024 --rounds 5   # long sequences
python -m hf_division.bench attention-backward --no-causal --dropout 0.1 --heads 12 --kv-heads 12   # BERT-like
python -m hf_division.bench attention-backward --blocks 64:64 128:128   # also these QUERY_BLOCK:SKIP_BLOCK

Every arm's gradients are checked against sdpa's autograd first (float32, relative 1e-4).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from hf_division.autograd import sdpa_backward
from hf_division.analysis.timing import interleaved_times, timed
from hf_division.bench.suites.common import suite_parser


def parser() -> argparse.ArgumentParser:
    ap = suite_parser("attention-backward", __doc__)
    for name, default in (("batch", 32), ("seq", 128), ("heads", 9), ("kv-heads", 3), ("head-dim", 64),
                          ("rounds", 15), ("threads", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--no-causal", action="store_true",
                    help="a key-padding mask (half the keys of every other item) instead")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="attention dropout: division replays a recorded keep mask")
    ap.add_argument("--blocks", nargs="*", default=[], help="also division at these QUERY_BLOCK:SKIP_BLOCK")
    return ap


def inputs(args) -> dict:
    g = torch.Generator().manual_seed(0)
    b, t, e = args.batch, args.seq, args.head_dim
    q, dout = (torch.randn(b, args.heads, t, e, generator=g) for _ in range(2))
    k, v = (torch.randn(b, args.kv_heads, t, e, generator=g) for _ in range(2))
    mask = None
    if args.no_causal:
        mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
        mask[::2, ..., t // 2 :] = False
    keep = (torch.rand(b, args.heads, t, t, generator=g) >= args.dropout).to(torch.uint8) if args.dropout else None
    return {"q": q, "k": k, "v": v, "dout": dout, "mask": mask, "keep": keep, "causal": not args.no_causal}


def autograd_backward(x: dict, p: float):
    """sdpa's forward once, then its backward as autograd runs it (the forward is not timed)."""
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    if x["keep"] is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=x["mask"], is_causal=x["causal"], enable_gqa=True)
    else:  # dropout with a given keep mask: sdpa's math, as its math path computes it
        kr, vr = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        s = (q @ kr.transpose(-2, -1)) / q.shape[-1] ** 0.5
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril() if x["causal"] else x["mask"]
        s = s.masked_fill(~mask, float("-inf"))
        out = (torch.softmax(s, -1) * x["keep"] / (1 - p)) @ vr
    return lambda: torch.autograd.grad(out, (q, k, v), x["dout"], retain_graph=True)


def division_backward(x: dict, p: float, blocks: tuple[int, int] | None):
    def run():
        former = sdpa_backward.QUERY_BLOCK, sdpa_backward.SKIP_BLOCK
        if blocks is not None:
            sdpa_backward.QUERY_BLOCK, sdpa_backward.SKIP_BLOCK = blocks
        try:
            return sdpa_backward.sdpa_grads(x["q"], x["k"], x["v"], x["dout"], x["mask"], x["keep"], p, x["causal"],
                                            None, True)
        finally:
            sdpa_backward.QUERY_BLOCK, sdpa_backward.SKIP_BLOCK = former
    return run


def arms(args, x: dict) -> dict:
    t = args.seq
    default = f"division {sdpa_backward.QUERY_BLOCK}:{sdpa_backward.SKIP_BLOCK}"
    found = {"sdpa autograd": autograd_backward(x, args.dropout), default: division_backward(x, args.dropout, None),
             f"division one block ({t}:{t})": division_backward(x, args.dropout, (t, t))}
    for spec in args.blocks:
        qb, sb = (int(n) for n in spec.split(":"))
        found[f"division {qb}:{sb}"] = division_backward(x, args.dropout, (qb, sb))
    return found


def check(found: dict) -> None:
    """Every arm's gradients against sdpa's autograd; raises naming the arm that differs."""
    ref = found["sdpa autograd"]()
    for name, fn in found.items():
        for got, want, what in zip(fn(), ref, ("dq", "dk", "dv")):
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            if not err <= 1e-4:
                raise AssertionError(f"{name}: {what} differs from sdpa's autograd by {err:.2e} (relative)")


def main(argv=None):
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    x = inputs(args)
    found = arms(args, x)
    check(found)

    times = interleaved_times(list(found), lambda name: timed(found[name]), args.rounds)
    base = statistics.median(times["sdpa autograd"])
    mask = "causal" if x["causal"] else "key-padding mask"
    print(f"attention backward, batch {args.batch} x {args.seq}, {args.heads} heads / {args.kv_heads} KV heads, "
          f"head dim {args.head_dim}, {mask}, dropout {args.dropout}, {args.rounds} interleaved rounds, "
          f"{args.threads} threads")
    print(f"{'arm':<30} {'median ms':>10} {'vs sdpa':>8}")
    rows = {}
    for name, ts in times.items():
        rows[name] = statistics.median(ts)
        print(f"{name:<30} {rows[name] * 1e3:>10.1f} {rows[name] / base:>8.2f}")
    return rows
