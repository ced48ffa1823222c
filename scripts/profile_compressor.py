"""Where compression time goes on this machine: the numbers quoted in docs/DESIGN.md.

python scripts/profile_compressor.py [--numel 6291456] [--threads 2]

Times (median of 7) for a (32, 128, 1536) float32 tensor: compress/decompress eager and fused
(chunked torch.compile), the compressor core compiled in one call with static and dynamic shapes,
and the random sources: torch.rand_like, our 16-bit noise, and bernoulli_ (dropout's draw).
"""
import argparse
import statistics
import time

import torch

from hf_division import compressor
from hf_division.compressor import _split, compress, decompress, noise_words, quantize_groups, uniform


def timeit(fn, k=7):
    fn()
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def core(x3, words):
    lfc, h = _split(x3, 16, torch.bfloat16)
    return quantize_groups(h.reshape(-1), words, 4, 256), lfc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    x = torch.randn(32, 128, 1536)
    n = x.numel()
    p = compress(x)
    noise = noise_words(n, x.device)
    rows = {}
    for fused in (False, True):
        compressor.set_fused(fused)
        compress(x), decompress(p)  # warm-up (compiles the chunk kernels when fused)
        rows[f"compress (default config, fused={fused})"] = timeit(lambda: compress(x))
        rows[f"decompress (fused={fused})"] = timeit(lambda: decompress(p))
    compressor.set_fused(False)  # below: the whole core as one function, eager or compiled whole
    rows["core: split + quantize, one call (eager)"] = timeit(lambda: core(x, noise))
    for dynamic in (False, True):
        compiled = torch.compile(core, dynamic=dynamic)
        t0 = time.perf_counter()
        compiled(x, noise)
        rows[f"  (torch.compile dynamic={dynamic} warm-up, s)"] = time.perf_counter() - t0
        rows[f"core: split + quantize, one call (compile, dynamic={dynamic})"] = timeit(lambda: compiled(x, noise))
    compressor.set_fused(True)
    rows["torch.rand_like"] = timeit(lambda: torch.rand_like(x))
    rows["noise_words + uniform (16-bit)"] = timeit(lambda: uniform(noise_words(n, x.device)))
    rows["bernoulli_ (dropout draw)"] = timeit(lambda: torch.empty_like(x).bernoulli_(0.9))
    print(f"tensor (32, 128, 1536) float32 = {n / 1e6:.1f} M elements, {args.threads} threads")
    print(f"{'what':<42} {'ms':>8} {'ns/element':>11}")
    for k, v in rows.items():
        if k.startswith("  "):
            print(f"{k:<42} {v:>8.1f}")
        else:
            print(f"{k:<42} {v * 1e3:>8.1f} {v * 1e9 / n:>11.2f}")


if __name__ == "__main__":
    main()
