"""Kernel launches per training step on the GPU's path, counted on a CPU machine: the unpatched
model against division (docs/DESIGN.md, "On a GPU").

TRITON_INTERPRET=1 python -m hf_division.bench launches [--shape smollm2] [--layers N] [--size 1x32]
    [--autocast bf16] [--out launches.json]

A Llama-shaped model of ``--shape`` (:data:`hf_division.bench.suites.cuda.SHAPES`, random weights;
``--layers`` overrides the depth) trains one step on random token ids; the step runs as on a GPU
(:func:`hf_division.analysis.launches.gpu_path`: the Triton kernels under Triton's interpreter, the
CPU-only fast paths off) and every op that would launch a kernel is counted
(:class:`~hf_division.analysis.launches.KernelCounter`). Arms: ``none``; ``division``;
``division-torch``, division with the compressor's torch kernels run eagerly instead of Triton's
(the GPU path before them). Counts do not depend on the batch's size once every saved tensor holds
at least ``min_numel`` elements (SmolLM2's shape at 1 x 32), so a small batch serves. Printed: torch kernels, Triton kernels, their sum and its ratio to the
unpatched step's, the ops that read back on the host (none but the unpatched model's own), and
the ops division adds most of. Also the host's time per saved tensor of the shape's hidden size
outside the kernels (``--host-tokens`` tokens; the launches counted but not run): what the host
adds per tensor on a GPU besides the launches themselves.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from hf_division.analysis.launches import gpu_path, step_counts
from hf_division.api import apply_division
from hf_division.bench.suites import cuda as cuda_suite
from hf_division.bench.suites.common import suite_parser
from hf_division.bench.textdata import random_tokens
from hf_division.compress.pipeline import compress, decompress
from hf_division.kernels import configured, triton_codec


def count(shape: str, layers: int | None, size: tuple[int, int], autocast) -> dict:
    """``{arm: counts}`` for one step of ``shape``, the arms of the module doc."""
    model = cuda_suite.build(shape, "cpu", layers=layers).train()
    batch = random_tokens(model.config.vocab_size, *size, seed=0)
    batch["labels"] = batch["input_ids"]
    out = {}
    with gpu_path():
        for arm in ("none", "division", "division-torch"):
            if arm == "division":
                apply_division(model)
            with configured(triton=arm != "division-torch", compile=False):
                c = step_counts(model, batch, autocast)
            out[arm] = {"torch": sum(c.ops.values()), "triton": c.triton, "readbacks": sorted(c.readbacks),
                        "ops": dict(c.ops)}
    return out


def host_us(hidden: int, tokens: int, rounds: int = 200) -> tuple[float, float]:
    """Microseconds of host time to compress and to rebuild one bf16 ``(tokens, hidden)`` tensor with
    the defaults, the kernels counted but not run (median of ``rounds``)."""
    x = torch.randn(1, tokens, hidden).bfloat16()
    kw = dict(bits=4, block_size=16, group_size=256, outlier_ratio=16.0, generator=torch.Generator().manual_seed(0))
    with gpu_path():
        p = compress(x, **kw)
        times = {"compress": [], "rebuild": []}
        with triton_codec.not_run():
            for _ in range(rounds):
                t0 = time.perf_counter()
                compress(x, **kw)
                t1 = time.perf_counter()
                decompress(p)
                times["compress"].append(t1 - t0)
                times["rebuild"].append(time.perf_counter() - t1)
    return tuple(1e6 * sorted(v)[len(v) // 2] for v in times.values())


def report(shape: str, res: dict) -> str:
    base = res["none"]["torch"] + res["none"]["triton"]
    lines = [f"{shape}: arm | torch kernels | triton kernels | total (x none) | readbacks"]
    for arm, r in res.items():
        total = r["torch"] + r["triton"]
        lines.append(f"  {arm:10s} {r['torch']:7d} {r['triton']:7d} {total:7d} ({total / base:.2f}x) "
                     f"{len(r['readbacks'])}")
    added = {op: n - res["none"]["ops"].get(op, 0) for op, n in res["division"]["ops"].items()}
    top = sorted(((n, op) for op, n in added.items() if n > 0), reverse=True)[:8]
    lines.append("  division adds most: " + ", ".join(f"{op} +{n}" for n, op in top))
    return "\n".join(lines)


def main(argv=None):
    ap = suite_parser("launches", __doc__)
    ap.add_argument("--shape", default="smollm2", choices=list(cuda_suite.SHAPES))
    ap.add_argument("--layers", type=int, help="override the shape's depth")
    ap.add_argument("--size", type=cuda_suite.parse_size, default=(1, 32))
    ap.add_argument("--autocast", default="bf16", choices=["none", "bf16"])
    ap.add_argument("--host-tokens", type=int, default=8192)
    ap.add_argument("--out")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not triton_codec.available():
        raise SystemExit("hf-division launches suite: needs Triton (pip install triton)")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("hf-division launches suite: run it with TRITON_INTERPRET=1 on a machine without CUDA")
    amp = torch.bfloat16 if args.autocast == "bf16" else None
    res = count(args.shape, args.layers, args.size, amp)
    print(report(args.shape, res), flush=True)
    hidden = cuda_suite.SHAPES[args.shape]["hidden_size"]
    compress_us, rebuild_us = host_us(hidden, args.host_tokens)
    print(f"  host per saved {args.host_tokens}x{hidden} bf16 tensor, kernels not run: compress {compress_us:.0f} us, "
          f"rebuild {rebuild_us:.0f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": argv, "shape": args.shape, "layers": args.layers, "size": args.size, "arms": res,
                       "host_us": {"compress": compress_us, "rebuild": rebuild_us}}, f, indent=1)
    return res
