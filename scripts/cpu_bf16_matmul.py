"""How this CPU multiplies bf16 matrices, by layout: what the bf16 tests and the stand-in's bf16
steps pay on a machine without AVX-512 (docs/RESULTS.md, "Planned launches"; pyproject.toml's
timeout).

python scripts/cpu_bf16_matmul.py [--rounds 3]

For each shape, milliseconds (median of ``--rounds``) of ``a @ b.T`` with ``b`` stored row-major
(a Linear's forward, ``x @ weight.T``) and ``a @ b`` (its backward's ``grad @ weight``), in bf16
and in float32. The shapes: SmolLM2's head on 376 tokens (8 short sentences) and its MLP, and the
Llama-1B width's MLP on 512 tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

#: (name, tokens, inner, outer): the forward multiplies (tokens, inner) by weight (outer, inner).T
SHAPES = [("smollm2 head", 376, 576, 49152), ("smollm2 mlp", 376, 576, 1536), ("llama-1b mlp", 512, 2048, 8192)]


def timed(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    print("shape | dtype | x @ weight.T ms | grad @ weight ms")
    for name, tokens, inner, outer in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(tokens, inner, dtype=dtype)
            weight = torch.randn(outer, inner, dtype=dtype)
            grad = torch.randn(tokens, outer, dtype=dtype)
            forward = timed(lambda: x @ weight.T, args.rounds)
            backward = timed(lambda: grad @ weight, args.rounds)
            print(f"{name} | {str(dtype).split('.')[-1]} | {forward:.1f} | {backward:.1f}")


if __name__ == "__main__":
    main()
