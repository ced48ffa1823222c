"""Dropout's draws on the CPU: ATen's ``bernoulli_`` against the native draw as bits (docs/DESIGN.md, "Dropout draws").

python -m hf_division.bench draws [--threads 1 2] [--rounds 7]

Per tensor of a MiniLM-L6 training step at batch 32 x 128 (attention probabilities (32, 12, 128,
128), hidden states (32, 128, 384)), median seconds of: ATen's ``torch.empty(shape).bernoulli_(0.9)``
(what the baseline's dropout does), the native draw as packed bits (``hf_division.kernels.native.bernoulli_bits``,
what division's hidden dropout keeps) and, for the attention map, the bits filled into the 0/1 float
tensor sdpa multiplies by (``fill_draws``). Then the draws of one such step (6 attention maps, 13
hidden-state masks) summed, and a check that both give the same bits and the same generator state.
"""
from __future__ import annotations


import torch

from hf_division.kernels import native
from hf_division.quant.packing import pack_mask
from hf_division.analysis.timing import median_time
from hf_division.bench.suites.common import set_threads, suite_parser

#: one MiniLM-L6 step at 32 x 128: (shape, how many such draws)
STEP = {"attention (32, 12, 128, 128)": ((32, 12, 128, 128), 6), "hidden (32, 128, 384)": ((32, 128, 384), 13)}


def same_draws(shape, p: float = 0.9) -> bool:
    """Native bits and generator state after them equal to ATen's, from the same seed."""
    torch.manual_seed(0)
    ours, ours_state = native.bernoulli_bits(torch.Size(shape).numel(), p), torch.get_rng_state()
    torch.manual_seed(0)
    theirs, theirs_state = pack_mask(torch.empty(shape).bernoulli_(p))[0], torch.get_rng_state()
    return torch.equal(ours, theirs) and torch.equal(ours_state, theirs_state)


def draw_times(shape, rounds: int) -> dict:
    n = torch.Size(shape).numel()
    target = torch.empty(shape)
    bits = native.bernoulli_bits(n, 0.9)
    return {"aten": median_time(lambda: torch.empty(shape).bernoulli_(0.9), rounds),
            "bits": median_time(lambda: native.bernoulli_bits(n, 0.9), rounds),
            "fill": median_time(lambda: native.fill_draws(target, bits), rounds)}


def main(argv=None):
    ap = suite_parser("draws", __doc__)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    if not native.draws_match_aten():
        print("the native draws are off here (no C compiler, or ATen draws otherwise in this build): nothing to time")
        return {}
    rows = {}
    for threads in args.threads:
        set_threads(threads)
        step = {"aten": 0.0, "native": 0.0}
        for name, (shape, count) in STEP.items():
            t = draw_times(shape, args.rounds)
            n = torch.Size(shape).numel()
            native_s = t["bits"] + (t["fill"] if name.startswith("attention") else 0.0)
            step["aten"] += count * t["aten"]
            step["native"] += count * native_s
            rows[(threads, name)] = t
            print(f"{threads} threads, {name}: ATen bernoulli_ {t['aten'] * 1e3:.1f} ms ({t['aten'] * 1e9 / n:.2f} ns/element), "
                  f"native bits {t['bits'] * 1e3:.1f} ms ({t['bits'] * 1e9 / n:.2f} ns/element), "
                  f"filled into 0/1 float {t['fill'] * 1e3:.1f} ms; same draws and stream: {same_draws(shape)}")
        rows[(threads, "step")] = step
        print(f"{threads} threads, one MiniLM step's draws (6 attention maps, 13 hidden masks): ATen {step['aten'] * 1e3:.0f} ms, "
              f"native {step['native'] * 1e3:.0f} ms ({step['aten'] / step['native']:.1f}x)")
    return rows
