"""Where compression time goes on this machine (docs/DESIGN.md, Compressor).

python -m hf_division.bench compressor [--threads 2]

Times (median of 7) for a (32, 128, 1536) float32 tensor: compress/decompress with DIVISION's
token groups (4 bits, LFC over 16 tokens, and without LFC as BERT-family encoders store them) and
ActNN's flat groups (2 bits), eager, fused (torch.compile over cache-sized chunks) and with the
native CPU kernels (token groups; also rounding to nearest, and with the outlier search that
``outlier_ratio`` turns on, as the default policy does: its score read in the encode's first pass,
beside the separate score pass that it replaces); the token kernel compiled whole in one call with static
and dynamic shapes (why chunks); and the random sources: torch.rand_like, our 16-bit noise, and
bernoulli_ (dropout's draw); dropout-mask bits: packing a float 0/1 draw through an integer view
against comparing it with 0 first, unpacking by a table-row gather against a shift per bit plane.
"""
from __future__ import annotations

import time

import torch

from hf_division.kernels import native
from hf_division.compress.pipeline import compress, decompress
from hf_division.kernels import configure, configured
from hf_division.quant.codecs import encode_tokens
from hf_division.quant.rounding import noise_words, uniform
from hf_division.quant.packing import pack_mask, unpack_bits, unpack_mask
from hf_division.analysis.timing import median_time
from hf_division.bench.suites.common import set_threads, suite_parser


def compressor_times(x) -> dict:
    """compress/decompress seconds per grouping: eager, fused (torch.compile) and, for token
    groups, the native CPU kernels (hf_division.kernels.native; the default on the CPU)."""
    rows = {}
    kernels = {"eager": (False, False), "fused": (False, True), "native": (True, True)}
    for name, kw in (("division, tokens", dict(bits=4, block_size=16)), ("division, tokens, no LFC", dict(bits=4, block_size=1)),
                     ("actnn, flat", dict(bits=2, grouping="flat"))):
        for how, (use_native, fused) in kernels.items():
            if how == "native" and ("flat" in name or native.kernels() is None):
                continue
            with configured(native=use_native, compile=fused):
                p = compress(x, **kw)
                decompress(p)  # warm-up (compiles the chunk kernels when fused)
                rows[f"compress ({name}, {how})"] = median_time(lambda: compress(x, **kw))
                rows[f"decompress ({name}, {how})"] = median_time(lambda: decompress(p))
                if how == "native":  # what the rounding noise costs: the same encode rounding to nearest
                    rows[f"compress ({name}, {how}, nearest)"] = median_time(lambda: compress(x, stochastic=False, **kw))
                    rows[f"compress ({name}, {how}, outlier search)"] = median_time(
                        lambda: compress(x, outlier_ratio=16.0, **kw))
    if native.kernels() is not None:  # the outlier search's score as a pass of its own (the former order)
        tokens = x.reshape(-1, x.shape[-2], x.shape[-1])
        rows["outlier score, max |x| per token (native)"] = median_time(lambda: native.token_absmax(tokens))
    return rows


def whole_tensor_times(x) -> dict:
    """The token kernel compiled over the whole tensor in one call (compile warm-up included)."""
    rows = {}
    seed = torch.tensor(12345)
    tokens = x.view(-1, 1536)
    for dynamic in (False, True):
        compiled = torch.compile(encode_tokens, dynamic=dynamic)
        t0 = time.perf_counter()
        compiled(tokens, seed, 4, 16, 256, torch.bfloat16)
        rows[f"  (torch.compile dynamic={dynamic} warm-up, s)"] = time.perf_counter() - t0
        rows[f"encode_tokens, whole tensor (dynamic={dynamic})"] = median_time(lambda: compiled(tokens, seed, 4, 16, 256, torch.bfloat16))
    return rows


def mask_times(x) -> dict:
    """Dropout-mask bits of a draw shaped as ``x``: pack and unpack, each against the former way."""
    draw = torch.empty_like(x).bernoulli_(0.9)
    bits, n = pack_mask(draw)
    return {
        "pack_mask, float draw (integer view)": median_time(lambda: pack_mask(draw)),
        "pack_mask(draw != 0) (float compare first)": median_time(lambda: pack_mask(draw != 0)),
        "unpack_mask (table-row gather)": median_time(lambda: unpack_mask(bits, n, x.shape)),
        "unpack_bits(., 1) (shift per bit plane)": median_time(lambda: unpack_bits(bits, 1)),
        "unpack_mask to float / 0.9 (dropout noise)": median_time(lambda: unpack_mask(bits, n, x.shape, x.dtype, 0.9)),
        "unpack_bits(., 1).to(float).div_(0.9)": median_time(lambda: unpack_bits(bits, 1)[:n].to(x.dtype).div_(0.9)),
    }


def main(argv=None):
    ap = suite_parser("compressor", __doc__)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    x = torch.randn(32, 128, 1536)
    n = x.numel()
    rows = {**compressor_times(x), **whole_tensor_times(x)}
    configure(compile=True)
    rows["torch.rand_like"] = median_time(lambda: torch.rand_like(x))
    rows["noise_words + uniform (16-bit)"] = median_time(lambda: uniform(noise_words(n, x.device)))
    rows["bernoulli_ (dropout draw)"] = median_time(lambda: torch.empty_like(x).bernoulli_(0.9))
    rows.update(mask_times(x))
    print(f"tensor (32, 128, 1536) float32 = {n / 1e6:.1f} M elements, {args.threads} threads")
    print(f"{'what':<46} {'ms':>8} {'ns/element':>11}")
    for k, v in rows.items():
        if k.startswith("  "):
            print(f"{k:<46} {v:>8.1f}")
        else:
            print(f"{k:<46} {v * 1e3:>8.1f} {v * 1e9 / n:>11.2f}")
