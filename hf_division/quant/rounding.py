"""Rounding: the counter-based stochastic-rounding noise, and float32 values rounded to bf16 in a
chosen direction (group ranges) or to nearest (block means).

Pure tensor functions (docs/DESIGN.md, "Compressor" and "Rounding noise").
"""
from __future__ import annotations

import torch


#: per-group min / scale: 16 bits as in ActNN; bf16 rather than fp16 so that fp32 activations
#: beyond 65504 cannot overflow it
SCALE_DTYPE = torch.bfloat16


def noise_words(n: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` uniform random int16 values, the source of stochastic-rounding noise.

    ``torch.rand`` spends one generator call per element, which on CPU costs about as much as
    the rest of the compression. One 64-bit draw (``random_`` over the full int64 range) gives
    four independent 16-bit integers (the ``compressor`` suite times both: ``python -m hf_division.bench compressor``).
    """
    words = torch.empty(-(-n // 4), dtype=torch.int64, device=device).random_(-(2**63), None, generator=generator)
    return words.view(torch.int16)[:n]


def uniform(words: torch.Tensor) -> torch.Tensor:
    """int16 words -> float32 U(0, 1) samples ``(k + 0.5) / 65536`` (k = word + 32768).

    A value is then rounded up with a probability off by at most 2**-17 of its fraction (tested).
    """
    return words.float() * (1.0 / 65536) + (32768 + 0.5) / 65536


# odd multipliers below 2**31, so Python hands them to int32 tensors as int32
_MIX1, _MIX2 = 0x7FEB352D, 0x5BD1E995


_LOW32 = 0xFFFFFFFF


def wrap_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 -> int32 with the same low 32 bits (two's complement), without relying on how a
    narrowing cast treats values beyond int32's range."""
    return (((v & _LOW32) ^ 0x80000000) - 0x80000000).to(torch.int32)


def hash_uniform(index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Counter-based U(0, 1) noise: float32 ``(k + 0.5) / 2**24`` from a 32-bit integer hash of
    ``index + seed`` (``index`` int32, ``seed`` a 0-d int64; the sum taken modulo 2**32). Elementwise,
    so inside a compiled kernel it costs a few integer ops per element instead of a generator draw
    (timed by ``python -m hf_division.bench compressor``); a value is rounded up with a probability
    off by at most 2**-25 of its fraction.

    Why int32: the hash is defined modulo 2**32, and CPUs without 64-bit vector multiplies (AVX2)
    ran the same hash in int64 several times slower, most of the compressor's time (docs/DESIGN.md,
    "Compressor"). Products wrap modulo 2**32 on both CPU and CUDA; right shifts are arithmetic on
    int32, so each is masked to its logical result."""
    x = index.to(torch.int32) + wrap_int32(seed)
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MIX1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MIX2
    x = x ^ ((x >> 16) & 0xFFFF)
    return (((x >> 8) & 0xFFFFFF).float() + 0.5) * (1.0 / 16777216)


def noise_seed(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A 0-d int64 seed in ``[0, 2**32)`` for :func:`hash_uniform`, drawn from ``generator``."""
    where = generator.device if generator is not None else device
    return torch.randint(0, 2**32, (), dtype=torch.int64, generator=generator, device=where).to(device)


def bf16_directed(v: torch.Tensor, down: bool) -> torch.Tensor:
    """float32 -> the nearest bf16 value (as float32) toward -inf (``down``) or +inf.

    On the bits, not through a cast: inductor elides a float32 -> bf16 -> float32 round trip
    inside a fused kernel. Truncating the low 16 bits rounds toward 0; one bf16 ulp more
    magnitude (+0x10000) then rounds away from 0 where that is the wanted direction."""
    i = v.view(torch.int32)
    inexact = (i & 0xFFFF) != 0
    away = inexact & ((v < 0) if down else (v > 0))
    return ((i & -65536) + away.to(torch.int32) * 65536).view(torch.float32)


def round_lfc(v: torch.Tensor, dtype: torch.dtype):
    """float32 block means -> (stored in ``dtype``, the same values as float32).

    bf16 rounds to nearest-even on the bits: inductor's CPU code for a bf16 cast made the whole
    kernel several times slower when we timed it, and inside a fused kernel inductor may elide
    the round trip (the kernels are compiled with emulated casts for the other dtypes)."""
    if dtype == torch.float32:
        return v, v
    if dtype != torch.bfloat16:
        stored = v.to(dtype)
        return stored, stored.float()
    i = v.view(torch.int32)
    bits = (i + 0x7FFF + ((i >> 16) & 1)) & -65536
    rounded = torch.where(v == v, bits.view(torch.float32), v)  # NaN stays NaN
    return (rounded.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16), rounded
