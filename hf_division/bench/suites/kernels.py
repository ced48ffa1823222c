"""What each Triton kernel takes of an H200's multiprocessor, without a GPU (docs/DESIGN.md, "On a
GPU": registers).

python -m hf_division.bench kernels [--arch 90] [--tokens 8192] [--out kernels.json]

Every kernel variant :func:`hf_division.kernels.triton_codec.compile_variants` compiles, for sm_90:
warps, registers per thread, stack bytes (spilled registers), machine instructions, and the
programs and warps a multiprocessor holds at once (:mod:`hf_division.analysis.gpu_resources`). Then
the programs the compressor's launches spread a saved tensor over, for ``--tokens`` tokens at the
widths of the SmolLM2 and Llama-3.2-1B shapes with the defaults (4 bits, groups of 256 tokens, an
LFC of 16-token blocks), against what an H200's 132 multiprocessors hold at once. Run it without
``TRITON_INTERPRET`` (the kernels compile; nothing runs).
"""
from __future__ import annotations

import json
import os
import sys

from hf_division.analysis import gpu_resources
from hf_division.bench.suites import cuda as cuda_suite
from hf_division.bench.suites.common import command_line, suite_parser
from hf_division.config import DEFAULTS, DivisionConfig
from hf_division.kernels import triton_codec

#: the compressor's kernels for a saved tensor with the defaults -> the variant whose resources they take
LAUNCHES = {"score": "score", "encode": "encode", "decode": "decode"}


def spread(tokens: int, shapes=("smollm2", "llama-1b")) -> list[dict]:
    """Per shape and width: the programs of each of :data:`LAUNCHES` for one saved ``(tokens, width)``
    tensor with the defaults."""
    group, block, bits = DivisionConfig().group_size, DEFAULTS["block_size"], DEFAULTS["linear_bits"]
    rows = []
    for shape in shapes:
        s = cuda_suite.SHAPES[shape]
        for width in (s["hidden_size"], s["intermediate_size"]):
            n_full, rest = divmod(-(-tokens // block) * block, group)
            grid = triton_codec.group_launch(width, n_full, rest, group, bits, block)[2]
            score = triton_codec.score_grid(tokens, width)
            rows.append({"shape": shape, "width": width, "programs": {"score": score[0], "encode": grid[0] * grid[1],
                                                                       "decode": grid[0] * grid[1]}})
    return rows


def report(res: dict) -> str:
    lines = [f"sm_{res['arch']}, Triton {res['triton']}: per kernel variant, resources and programs held at once "
             "by one multiprocessor",
             f"  {'variant':32s} {'warps':>5s} {'regs':>5s} {'stack B':>7s} {'instrs':>7s} {'blocks':>6s} {'warps/SM':>8s}"]
    for variant, u in res["variants"].items():
        lines.append(f"  {variant:32s} {u['warps']:5d} {u['registers']:5d} {u['stack']:7d} {u['instructions']:7d} "
                     f"{u['resident']:6d} {u['resident_warps']:8d}")
    lines.append(f"programs per launch for one saved {res['tokens']}-token tensor (defaults), and in waves of what "
                 f"{gpu_resources.H200_SMS} multiprocessors hold at once:")
    for row in res["spread"]:
        cells = [f"{k} {n} ({n / (gpu_resources.H200_SMS * res['variants'][LAUNCHES[k]]['resident']):.2f})"
                 for k, n in row["programs"].items()]
        lines.append(f"  {row['shape']:9s} width {row['width']:5d}: " + ", ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    ap = suite_parser("kernels", __doc__)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: H100/H200)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the saved tensor whose launches are spread")
    ap.add_argument("--out")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not triton_codec.available():
        raise SystemExit("hf-division kernels suite: needs Triton (pip install triton)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("hf-division kernels suite: run it without TRITON_INTERPRET (the kernels compile)")
    import triton

    usage = gpu_resources.report(args.arch)
    res = {"command": command_line(None if argv is None else ["hf_division/bench/__main__.py", "kernels", *argv]),
           "arch": args.arch, "triton": triton.__version__, "tokens": args.tokens,
           "variants": {v: u.row() for v, u in usage.items()}, "spread": spread(args.tokens)}
    print(report(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res
