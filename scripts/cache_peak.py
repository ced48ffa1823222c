"""A training step's peak memory with and without the KV cache a decoder builds in training
(docs/DESIGN.md, "Bit-identical forward": division's training forward passes ``use_cache=False``
unless the caller passes ``use_cache``).

python scripts/cache_peak.py [--shape smollm2] [--layers 8] [--size 4x512] [--autocast none|bf16]

A random-init Llama of the cuda suite's ``--shape`` (``--layers`` deep, a 4,096-word vocabulary),
one training step on random tokens, its peak above the memory before it
(:func:`hf_division.bench.peak.step_peak`: the RSS high-water mark, glibc set to return freed
memory), the median of 3 steps after one, each arm in a child forked from one clean process.
Arms: ``none`` as Transformers runs it (``config.use_cache``: a cache is built); ``none`` with
``use_cache=False``; division with ``use_cache=True`` passed (the cache as the unpatched model
builds it: what division's forward held before it turned the cache off); division as it runs
(no cache). Also the cache's own bytes.
"""
from __future__ import annotations

import argparse
import os
import sys

#: glibc reads these at start-up only (hf_division.bench.peak.MALLOC_ENV; checked against it below):
#: set, before the libraries load, by running this file again
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in _MALLOC.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, **_MALLOC))

import torch  # noqa: E402

from hf_division.api import apply_division  # noqa: E402
from hf_division.bench.peak import MALLOC_ENV, forked, step_peak  # noqa: E402
from hf_division.bench.suites import cuda as cuda_suite  # noqa: E402

#: (arm, use_cache passed: None for not passed)
ARMS = [("none", None), ("none", False), ("division", True), ("division", None)]
VOCAB = 4096


def job(item: tuple) -> dict:
    (arm, use_cache), args = item
    torch.set_num_threads(2)
    model = cuda_suite.build(args.shape, "cpu", layers=args.layers, vocab_size=VOCAB).train()
    batch_size, tokens = args.size
    ids = torch.randint(0, VOCAB, (batch_size, tokens), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    if use_cache is not None:
        batch["use_cache"] = use_cache
    if arm == "division":
        apply_division(model)
    amp = args.autocast == "bf16"
    cache = [0]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(**batch)
        held = out.get("cache", out.get("past_key_values"))
        cache[0] = 0 if held is None else sum(t.numel() * t.element_size() for layer in held.layers
                                              for t in (layer.keys, layer.values))
        loss = out.loss
        del out, held
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    peaks = sorted(step_peak(step)[0] for _ in range(3))
    return {"arm": arm, "use_cache": use_cache, "peak_mib": peaks[1] / 2**20, "cache_mib": cache[0] / 2**20}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=sorted(cuda_suite.SHAPES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--size", default="4x512", help="batch x tokens")
    ap.add_argument("--autocast", default="none", choices=["none", "bf16"])
    args = ap.parse_args(argv)
    args.size = tuple(int(v) for v in args.size.split("x"))
    assert _MALLOC == MALLOC_ENV, "scripts/cache_peak.py's glibc settings differ from hf_division.bench.peak's"
    print(f"{args.shape} shape, {args.layers} layers, {args.size[0]} x {args.size[1]} tokens, autocast {args.autocast}")
    print(f"{'arm':<10} {'use_cache passed':>16} {'cache MiB':>10} {'step peak MiB':>14}")
    for r in forked(job, [(arm, args) for arm in ARMS]):
        passed = "not passed" if r["use_cache"] is None else str(r["use_cache"])
        print(f"{r['arm']:<10} {passed:>16} {r['cache_mib']:>10.2f} {r['peak_mib']:>14.1f}")


if __name__ == "__main__":
    main()
