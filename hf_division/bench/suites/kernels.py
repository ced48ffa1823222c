"""What each Triton kernel takes of an H200's multiprocessor, without a GPU (docs/DESIGN.md, "On a
GPU": registers).

python -m hf_division.bench kernels [--arch 90] [--out kernels.json]
python -m hf_division.bench kernels --step [--shape smollm2] [--layers 1] [--size 8x1024] [--checkpointing]
    [--out step.json]

Every kernel variant :func:`hf_division.kernels.triton_variants.compile_variants` compiles, for sm_90:
warps, registers per thread, stack bytes (spilled registers), machine instructions, and the
programs and warps a multiprocessor holds at once (:mod:`hf_division.analysis.gpu_resources`): fixed
variants, aligned or not as declared, each branch compiled.

``--step``: instead, the kernels one training step of the shape (random-init, its widths, ``--layers``
of its layers, a small vocabulary; bf16 autocast, division's defaults; with Transformers' gradient
checkpointing too, ``--checkpointing``) compiles, each as Triton's
dispatch specializes it for the step's own tensors and integers (16-byte alignment, an integer 1
made a constant), on a simulated sm_90 device (:mod:`hf_division.analysis.simulated_cuda`): the
binaries a GPU would load for that shape and batch, and each launch's programs against what an
H200's 132 multiprocessors hold of them at once (waves). Run it without ``TRITON_INTERPRET`` (the
kernels compile; nothing runs on a GPU).
"""
from __future__ import annotations

import os
import sys

import torch

from hf_division.analysis import gpu_resources
from hf_division.analysis.launches import gpu_path, train_step
from hf_division.analysis.simulated_cuda import simulated_cuda
from hf_division.bench.suites import cuda as cuda_suite
from hf_division.bench.suites.common import command_line, suite_parser, write_json
from hf_division.bench.textdata import random_tokens
from hf_division.config import DivisionConfig
from hf_division.kernels import triton_codec


def step_kernels(shape: str, layers: int, size: tuple[int, int], checkpointing: bool = False) -> dict:
    """The module doc's ``--step``: ``binaries``, per kernel binary the step loads, its name,
    constexprs and :class:`~hf_division.analysis.gpu_resources.Usage` row; ``launches``, per
    launch its binary's index and its programs."""
    vocab = 512
    model = cuda_suite.build(shape, "cpu", layers=layers, vocab_size=vocab).train()
    cuda_suite.set_arm(model, "division + checkpointing" if checkpointing else "division", DivisionConfig())
    batch = random_tokens(vocab, *size, seed=0)
    batch["labels"] = batch["input_ids"]
    with gpu_path(), simulated_cuda(keep=False, grids=True) as launched:
        train_step(model, batch, torch.bfloat16)
    index = {id(b): i for i, b in enumerate(launched.binaries)}
    binaries = [{"kernel": b.name, "constants": b.constants, **gpu_resources.usage_of(b.cubin, b.num_warps).row()}
                for b in launched.binaries]
    launches = [{"binary": index[id(b)], "programs": g[0] * g[1] * g[2]} for b, g in launched.grids]
    return {"binaries": binaries, "launches": launches}


def step_report(res: dict) -> str:
    """Per kernel: its binaries (specializations) and their registers, most stack bytes, fewest
    resident warps and most instructions; its launches in the step and their programs, in waves
    of what :data:`~hf_division.analysis.gpu_resources.H200_SMS` multiprocessors hold at once."""
    lines = [f"sm_{res['arch']}, Triton {res['triton']}: the kernels one step of {res['shape']} ({res['layers']} "
             f"layers, {res['size'][0]}x{res['size'][1]} tokens{', checkpointing' if res['checkpointing'] else ''}) "
             "compiles and launches, by kernel"]
    binaries = res["binaries"]
    for name in dict.fromkeys(b["kernel"] for b in binaries):
        rows = [b for b in binaries if b["kernel"] == name]
        regs = sorted(r["registers"] for r in rows)
        waves = sorted(n["programs"] / (gpu_resources.H200_SMS * binaries[n["binary"]]["resident"])
                       for n in res["launches"] if binaries[n["binary"]]["kernel"] == name)
        lines.append(f"  {name:22s} {len(rows):2d} binaries: registers {regs[0]:3d}-{regs[-1]:<3d} stack "
                     f"{max(r['stack'] for r in rows):4d} B, warps/SM >= {min(r['resident_warps'] for r in rows):2d}, "
                     f"instructions <= {max(r['instructions'] for r in rows):5d}; {len(waves):3d} launches, waves "
                     f"{waves[0]:.2f} / {waves[len(waves) // 2]:.2f} / {waves[-1]:.2f} (min / median / max)")
    return "\n".join(lines)


def report(res: dict) -> str:
    lines = [f"sm_{res['arch']}, Triton {res['triton']}: per kernel variant, resources and programs held at once "
             "by one multiprocessor",
             f"  {'variant':32s} {'warps':>5s} {'regs':>5s} {'stack B':>7s} {'instrs':>7s} {'blocks':>6s} {'warps/SM':>8s}"]
    for variant, u in res["variants"].items():
        lines.append(f"  {variant:32s} {u['warps']:5d} {u['registers']:5d} {u['stack']:7d} {u['instructions']:7d} "
                     f"{u['resident']:6d} {u['resident_warps']:8d}")
    return "\n".join(lines)


def main(argv=None):
    ap = suite_parser("kernels", __doc__)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: H100/H200)")
    ap.add_argument("--step", action="store_true", help="the kernels one training step compiles (the module doc)")
    ap.add_argument("--shape", default="smollm2", choices=sorted(cuda_suite.SHAPES), help="--step: the model's shape")
    ap.add_argument("--layers", type=int, default=1, help="--step: layers of the shape built")
    ap.add_argument("--size", type=cuda_suite.parse_size, default=(8, 1024), help="--step: batch x tokens")
    ap.add_argument("--checkpointing", action="store_true", help="--step: with Transformers' gradient checkpointing")
    ap.add_argument("--out")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not triton_codec.available():
        raise SystemExit("hf-division kernels suite: needs Triton (pip install triton)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("hf-division kernels suite: run it without TRITON_INTERPRET (the kernels compile)")
    import triton

    res = {"command": command_line(None if argv is None else ["hf_division/bench/__main__.py", "kernels", *argv]),
           "arch": args.arch, "triton": triton.__version__}
    if args.step:
        if args.arch != 90:
            raise SystemExit("hf-division kernels suite: --step compiles for the simulated device's sm_90 only")
        res.update(shape=args.shape, layers=args.layers, size=list(args.size), checkpointing=args.checkpointing,
                   **step_kernels(args.shape, args.layers, args.size, args.checkpointing))
        print(step_report(res), flush=True)
    else:
        usage = gpu_resources.report(args.arch)
        res.update(variants={v: u.row() for v, u in usage.items()})
        print(report(res), flush=True)
    write_json(args.out, res)
    return res
