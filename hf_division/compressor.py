"""DIVISION's dual-precision compressor: pure functions, no autograd, no policy.

A tensor ``x`` of shape ``(..., T, C)`` (token axis ``T``; any leading dims) is split into

* **LFC** — the mean of every ``block_size`` consecutive tokens, shape ``(M, ceil(T/b), C)``,
  stored in a cheap high-precision dtype (bf16 by default);
* **HFC** — the residual ``x - upsample(LFC)``, quantized to ``bits`` per element with a
  min/scale pair per group of ``group_size`` consecutive residual elements (fp16) and unbiased
  stochastic rounding, bit-packed into ``uint8``.

``decompress(compress(x))`` returns a tensor of ``x``'s shape and dtype whose error per element is
at most one quantization step of its group (``scale``), plus the rounding of ``x`` to its own dtype.
With ``block_size <= 1`` there is no LFC and the scheme is plain group quantization (ActNN).

Works on CPU and CUDA alike; the fused core is ``torch.compile``-able (see ``set_compile``).
"""
from __future__ import annotations

import functools
import itertools
import math
import types
import warnings
from dataclasses import dataclass

import torch

# per-group min / scale: 16 bits as in ActNN; bf16 rather than fp16 so that fp32 activations
# beyond 65504 cannot overflow it
_SCALE_DTYPE = torch.bfloat16


@dataclass
class Packed:
    """A compressed tensor. ``nbytes`` is exact: the sum of the storages it holds."""

    packed: torch.Tensor  # uint8, ceil(N / (8 / bits)) bytes; raw tensor when ``bits == 0``
    lo: torch.Tensor | None  # (n_groups,) bf16 group minimum
    scale: torch.Tensor | None  # (n_groups,) bf16 group step
    lfc: torch.Tensor | None  # (M, ceil(T / block), C) in the LFC dtype
    cscale: torch.Tensor | None  # (C,) float32 per-channel divisor of the HFC (a bound of its |values|)
    shape: torch.Size  # original shape
    dtype: torch.dtype  # original dtype
    layout: tuple | None  # (permutation to memory order, its shape, token axis in it); None: flat
    bits: int
    block_size: int
    group_size: int
    rows: torch.Tensor | None = None  # (k, C) outlier tokens kept exact, in the original dtype
    row_index: torch.Tensor | None = None  # (k,) int64 their index among the M*T tokens

    def storages(self) -> list[torch.Tensor]:
        """The tensors this object holds."""
        own = (self.packed, self.lo, self.scale, self.lfc, self.cscale, self.rows, self.row_index)
        return [t for t in own if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.storages())


# ----------------------------------------------------------------------------- bit packing
def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of values < 2**bits (length divisible by 8 // bits) into bytes."""
    if bits == 8:
        return q
    per = 8 // bits
    q = q.view(-1, per)
    out = q[:, 0].clone()
    for i in range(1, per):
        out |= q[:, i] << (bits * i)
    return out


def unpack_bits(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``(n,)`` uint8 -> ``(n * 8 // bits,)`` uint8."""
    if bits == 8:
        return p
    shifts = torch.arange(0, 8, bits, device=p.device, dtype=torch.uint8)
    return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(-1)


#: multiplying 8 bytes of 0/1 (one int64, little-endian) by this gathers them into the top byte,
#: byte i -> bit i: the same order as ``pack_bits(., 1)``, in one multiply instead of 8 shift/or passes
_GATHER_BITS = 0x0102040810204080


def pack_mask(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Any-shape bool/0-1 tensor -> (``ceil(n / 8)`` uint8 bytes, ``n``)."""
    flat = (mask != 0).reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n % 8:
        flat = torch.nn.functional.pad(flat, (0, -n % 8))
    words = flat.contiguous().view(torch.int64)  # int64 overflow wraps; only the top byte is kept
    return ((words * _GATHER_BITS) >> 56).to(torch.uint8), n


def unpack_mask(bits: torch.Tensor, n: int, shape) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: uint8 0/1 values of ``shape``."""
    return unpack_bits(bits, 1)[:n].view(shape)


# ----------------------------------------------------------------------------- noise
def noise_words(n: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` uniform random int16 values, the source of stochastic-rounding noise.

    ``torch.rand`` spends one generator call per element, which on CPU costs about as much as
    the rest of the compression. One 64-bit draw (``random_`` over the full int64 range) gives
    four independent 16-bit integers (``scripts/profile_compressor.py`` times both).
    """
    words = torch.empty(-(-n // 4), dtype=torch.int64, device=device).random_(-(2**63), None, generator=generator)
    return words.view(torch.int16)[:n]


def uniform(words: torch.Tensor) -> torch.Tensor:
    """int16 words -> float32 U(0, 1) samples ``(k + 0.5) / 65536`` (k = word + 32768).

    A value is then rounded up with a probability off by at most 2**-17 of its fraction (tested).
    """
    return words.float() * (1.0 / 65536) + (32768 + 0.5) / 65536


# odd multipliers below 2**31: products with 32-bit values stay below 2**63, so no int64 overflow
_MIX1, _MIX2 = 0x7FEB352D, 0x5BD1E995
_LOW32 = 0xFFFFFFFF


def hash_uniform(index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Counter-based U(0, 1) noise: float32 ``(k + 0.5) / 2**24`` from a 32-bit integer hash of
    ``index + seed`` (int64 tensors, broadcast). Elementwise, so inside a compiled kernel it costs
    a few integer ops per element instead of a generator draw (``scripts/profile_compressor.py``);
    a value is rounded up with a probability off by at most 2**-25 of its fraction."""
    x = (index + seed) & _LOW32
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _LOW32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _LOW32
    x = x ^ (x >> 16)
    return ((x >> 8).float() + 0.5) * (1.0 / 16777216)


def noise_seed(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A 0-d int64 seed in ``[0, 2**32)`` for :func:`hash_uniform`, drawn from ``generator``."""
    where = generator.device if generator is not None else device
    return torch.randint(0, 2**32, (), dtype=torch.int64, generator=generator, device=where).to(device)


# ----------------------------------------------------------------------------- core math
def outlier_tokens(x3: torch.Tensor, ratio: float) -> torch.Tensor | None:
    """Index (int64, among the ``M*T`` tokens of an ``(M, T, C)`` tensor) of the tokens whose max |x|
    exceeds ``ratio`` times the median token's, at most ``M*T // 64`` of them (the largest); None
    if there are none.

    Why: decoder LLMs put "massive activations" (orders of magnitude above the rest; SmolLM2: its first token, in
    a few channels) on a few tokens. Inside a block such a token dominates the LFC, and in its
    channels it sets the group ranges of every other token: one of them made a layer's weight
    gradient pure noise (docs/ARCHITECTURES.md). Kept exact, they cost at most half a bit per
    element (fp32), and nothing where there are none. Their count is data-dependent (a host sync).
    """
    r = torch.maximum(x3.amax(dim=2), x3.amin(dim=2).neg_()).view(-1)  # max |x| per token, no |x| copy
    k = max(1, r.numel() // 64)
    top, index = r.topk(min(k, r.numel()))
    keep = index[top > ratio * r.median()]
    return keep if keep.numel() else None


def _split(x3: torch.Tensor, block_size: int, lfc_dtype: torch.dtype, inv_scale: torch.Tensor | None = None):
    """(M, T, C) float32 -> (LFC in lfc_dtype (M, nb, C), HFC float32 (M, nb*b, C) padded with 0).

    ``inv_scale``: optional (C,) factors applied to the HFC in the same pass.
    """
    m, t, c = x3.shape
    nb = -(-t // block_size)
    pad = nb * block_size - t
    if pad:
        x3 = torch.nn.functional.pad(x3, (0, 0, 0, pad))
    x4 = x3.view(m, nb, block_size, c)
    sums = x4.sum(dim=2)
    if pad:
        counts = torch.full((nb, 1), float(block_size), device=x3.device)
        counts[-1] = block_size - pad
        lfc = (sums / counts).to(lfc_dtype)
    else:
        lfc = (sums * (1.0 / block_size)).to(lfc_dtype)
    lfc32 = lfc.to(torch.float32).unsqueeze(2)
    hfc = x4 - lfc32 if inv_scale is None else torch.addcmul(-(lfc32 * inv_scale), x4, inv_scale)
    if pad:  # padded tokens must not widen the group ranges
        hfc[:, -1, block_size - pad :, :] = 0
    return lfc, hfc.view(m, nb * block_size, c)


def quantize_groups(flat: torch.Tensor, seed: torch.Tensor | None, bits: int, group_size: int):
    """Flat float32 (a multiple of ``group_size``) -> (packed codes, lo, scale), one pair per group.

    ``seed``: 0-d int64 seed of the stochastic-rounding noise (:func:`noise_seed`; element ``i``
    gets ``hash_uniform(i, seed)``), or None for round-to-nearest.
    ``lo`` is rounded down and ``scale`` up to the 16-bit dtype, so every value of the group lies
    inside ``[lo, lo + levels * scale]`` and clamping never biases the rounding. The directed
    rounding stays eager: inductor may fold a float32 -> bf16 -> float32 round trip away.
    """
    g = flat.view(-1, group_size)
    lo, hi = _run_groups(minmax_groups, g.shape[0], (flat,), (group_size,), (group_size,))
    levels = (1 << bits) - 1
    lo16 = _round_to(lo, down=True)
    scale16 = _round_to((hi - lo16.float()) * (1.0 / levels), down=False)
    s32 = scale16.float()
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    base = None if seed is None else torch.arange(g.shape[0], dtype=torch.int64, device=flat.device) * group_size
    (packed,) = _run_groups(encode_groups, g.shape[0], (flat, base, seed, lo16.float(), inv), (group_size, 1, None, 1, 1),
                            (bits, group_size))
    return packed, lo16, scale16


def minmax_groups(flat, group_size: int):
    """``(lo, hi)`` per group of ``group_size`` consecutive float32 values."""
    g = flat.view(-1, group_size)
    return g.amin(dim=1), g.amax(dim=1)


def encode_groups(flat, base, seed, lo, inv, bits: int, group_size: int):
    """The elementwise part of :func:`quantize_groups`: ``(packed,)`` codes for float32 groups.
    ``base``: (groups,) int64 index of each group's first element (None: round to nearest)."""
    g = flat.view(-1, group_size)
    if base is None:
        noise = 0.5
    else:
        index = base.unsqueeze(1) + torch.arange(group_size, dtype=torch.int64, device=flat.device)
        noise = hash_uniform(index, seed)
    # y > 0 by construction, so the truncating cast is the floor; clamp guards the top code
    q = ((g - lo.unsqueeze(1)) * inv.unsqueeze(1) + noise).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return (pack_bits(q.view(-1), bits),)


def dequantize_groups(packed: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int):
    """Inverse of :func:`quantize_groups` up to rounding: flat float32 values."""
    q = unpack_bits(packed, bits).view(-1, group_size)
    return (q.float() * scale.float().unsqueeze(1) + lo.float().unsqueeze(1)).view(-1)


# ----------------------------------------------------------------------------- fused execution
# torch.compile fuses the elementwise group kernels into one loop each (several times faster than
# eager on CPU: scripts/profile_compressor.py), but only with static shapes: dynamic-shape code was several times *slower* here. So the kernels run
# compiled over fixed chunks of groups (two sizes), and eagerly on the small remainder.
_CHUNKS = (4096, 1024, 256)  # groups per compiled call (each call costs ~50 us of guards: few calls)
_fused = {"enabled": True}


def set_fused(enabled: bool) -> None:
    """Run the group kernels through ``torch.compile`` (default) or eagerly."""
    _fused["enabled"] = bool(enabled)


@functools.lru_cache(maxsize=None)
def _compiled(kernel, variant: tuple):
    """``kernel`` compiled for one ``variant`` (static arguments, chunk size, which inputs are None).

    Each variant gets a copy of the function with a code object of its own: dynamo keeps at most
    ``recompile_limit`` (8) versions per code object and runs the rest eagerly, and bit widths x
    chunk sizes x rounding modes exceed that (decoders use 4 and 8 bits, auto-precision 2, 4, 8)."""
    code = kernel.__code__.replace(co_name=f"{kernel.__name__}_v{next(_variant_ids)}")
    fn = types.FunctionType(code, kernel.__globals__, code.co_name, kernel.__defaults__, kernel.__closure__)
    return torch.compile(fn, dynamic=False)


_variant_ids = itertools.count()


def _run_groups(kernel, n_groups: int, args: tuple, per_group: tuple, static: tuple):
    """``kernel(*args, *static)`` over all groups, sliced into fixed-size chunks when fused.

    ``per_group[i]``: elements of ``args[i]`` per group (None: pass ``args[i]`` as it is).
    Each output is concatenated in group order.
    """
    if not _fused["enabled"] or n_groups < _CHUNKS[-1]:
        return kernel(*args, *static)
    pieces, start = [], 0
    absent = tuple(a is None for a in args)
    for size in _CHUNKS:
        fn = _compiled(kernel, (static, size, absent))
        while n_groups - start >= size:
            sliced = [a if k is None or a is None else a[start * k : (start + size) * k] for a, k in zip(args, per_group)]
            try:
                pieces.append(fn(*sliced, *static))
            except Exception as err:  # no C++ compiler, unsupported device, ...: stay correct, go eager
                warnings.warn(f"hf-division: torch.compile of {kernel.__name__} failed ({err!r}); using eager kernels")
                set_fused(False)
                return kernel(*args, *static)
            start += size
    if start < n_groups:
        sliced = [a if k is None or a is None else a[start * k :] for a, k in zip(args, per_group)]
        pieces.append(kernel(*sliced, *static))
    return tuple(torch.cat(parts) for parts in zip(*pieces))


def _round_to(v: torch.Tensor, down: bool) -> torch.Tensor:
    """float32 -> _SCALE_DTYPE, rounded toward -inf (``down``) or +inf."""
    r = v.to(_SCALE_DTYPE)
    rf = r.float()
    bad = rf > v if down else rf < v
    toward = torch.full_like(r, float("-inf") if down else float("inf"))
    return torch.where(bad, torch.nextafter(r, toward), r)


_FP16_MAX = torch.finfo(torch.float16).max
_MIN_CSCALE = 2.0**-100


def _lfc_rounding(lfc_dtype: torch.dtype, block_size: int) -> float:
    """Bound of an LFC row's error relative to its block's max |x|: storing it in ``lfc_dtype``
    (half an ulp, bounded by ``eps``) plus the float32 sum of ``block_size`` values."""
    return torch.finfo(lfc_dtype).eps + block_size * torch.finfo(torch.float32).eps


def _lfc_underflow(lfc_dtype: torch.dtype) -> float:
    """Absolute error of an LFC value below the dtype's normal range (the subnormal spacing)."""
    f = torch.finfo(lfc_dtype)
    return f.smallest_normal * f.eps


def compress(
    x: torch.Tensor,
    bits: int = 4,
    block_size: int = 8,
    group_size: int = 256,
    lfc_dtype: torch.dtype = torch.bfloat16,
    token_dim: int | None = -2,
    stochastic: bool = True,
    channel_scale: bool = True,
    generator: torch.Generator | None = None,
    outlier_ratio: float = 0.0,
) -> Packed:
    """Compress ``x`` (any float dtype, any layout) into a :class:`Packed`.

    ``token_dim``: the token axis (``-2`` for ``(..., T, C)``); ``None`` or ``block_size <= 1``
    disables the LFC. ``bits``: 1, 2, 4 or 8 bits per HFC element, or 0 to keep ``x`` as it is.
    ``channel_scale``: divide each HFC channel by a bound of its magnitude before grouping, so that a
    few outlier channels (common in transformer residual streams) do not set every group's range.
    ``outlier_ratio``: if > 0, tokens whose max |x| exceeds this many times the median token's are
    stored exact and left out of the LFC and HFC (:func:`outlier_tokens`); needs ``token_dim``.
    """
    shape, dtype = x.shape, x.dtype
    if bits == 0:
        return Packed(x, None, None, None, None, shape, dtype, None, 0, block_size, group_size)
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 0, 1, 2, 4 or 8, got {bits}")
    layout = None
    if token_dim is not None and x.dim() >= 2:
        x3, layout = _to_tokens(x, token_dim % x.dim())
    else:
        token_dim, x3 = None, x.reshape(1, -1, 1).float()
    use_lfc = token_dim is not None and block_size > 1
    rows = row_index = None
    if outlier_ratio > 0 and token_dim is not None and x3.shape[2] > 1:
        row_index = outlier_tokens(x3, outlier_ratio)
        if row_index is not None:
            flat_rows = x3.reshape(-1, x3.shape[2])
            rows = flat_rows[row_index].to(dtype)
            x3 = flat_rows.index_fill(0, row_index, 0.0).view(x3.shape)  # a copy: x3 may view x
    cscale = inv = None
    if use_lfc and lfc_dtype == torch.float16 and x3.abs().amax() > _FP16_MAX:
        lfc_dtype = torch.float32  # block means beyond fp16's range would store inf: widen this LFC
    if channel_scale and token_dim is not None:
        # a bound of each channel's |HFC| known before the split, so the scaling joins the split's
        # pass: with an LFC, the channel's range (an LFC row is a mean of its block) plus the LFC's
        # own rounding, which dominates a near-constant channel (a fp16 LFC flushing a tiny mean to
        # 0 made such a channel's HFC 1e24 times its range and swamped every group it shared);
        # without an LFC, max |x|
        hi, lo = x3.amax(dim=(0, 1)), x3.amin(dim=(0, 1))
        mag = torch.maximum(hi, lo.neg())
        cscale = (hi - lo) + (mag * _lfc_rounding(lfc_dtype, block_size) + _lfc_underflow(lfc_dtype)) if use_lfc else mag
        # a channel of (near) zeros: no scaling, and 1 / cscale stays finite
        cscale = torch.where(cscale > _MIN_CSCALE, cscale, torch.ones_like(cscale))
        inv = 1.0 / cscale
    lfc = None
    if use_lfc:
        lfc, x3 = _split(x3, block_size, lfc_dtype, inv)
    elif inv is not None:
        x3 = x3 * inv
    flat = x3.reshape(-1)
    n = flat.numel()
    padded = -(-n // group_size) * group_size
    if padded != n:
        flat = torch.nn.functional.pad(flat, (0, padded - n))
    seed = noise_seed(flat.device, generator) if stochastic else None
    packed, lo, scale = quantize_groups(flat, seed, bits, group_size)
    return Packed(packed, lo, scale, lfc, cscale, shape, dtype, layout, bits, block_size, group_size, rows, row_index)


def decompress(p: Packed) -> torch.Tensor:
    """Rebuild a tensor of ``p.shape`` and ``p.dtype`` (with the input's memory layout)."""
    if p.bits == 0:
        return p.packed
    per_code = p.group_size * p.bits // 8
    (flat,) = _run_groups(_dequantize_tuple, p.lo.numel(), (p.packed, p.lo, p.scale), (per_code, 1, 1), (p.bits, p.group_size))
    if p.layout is None:
        return _cast(flat[: math.prod(p.shape)].view(p.shape), p.dtype)
    perm, mem_shape, tdim = p.layout
    m, t, c = math.prod(mem_shape[:tdim]), mem_shape[tdim], math.prod(mem_shape[tdim + 1 :])
    tp = p.lfc.shape[1] * p.block_size if p.lfc is not None else t
    x = flat[: m * tp * c].view(m, tp, c)
    if p.lfc is not None:
        nb = p.lfc.shape[1]
        lfc = p.lfc.to(x.dtype).unsqueeze(2)
        x4 = x.view(m, nb, p.block_size, c)
        # one pass: LFC + HFC * cscale
        x4 = torch.addcmul(lfc, x4, p.cscale) if p.cscale is not None else x4.add_(lfc)
        x = x4.view(m, tp, c)
        if tp != t:
            x = x[:, :t].contiguous()
    elif p.cscale is not None:
        x = x.mul_(p.cscale)
    if p.rows is not None:
        x.view(-1, c).index_copy_(0, p.row_index, p.rows.to(x.dtype))
    x = _cast(x, p.dtype).reshape(mem_shape)
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return x.permute(inverse)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 rebuilt values -> ``dtype``, clamped to its finite range: a value at the edge of
    fp16's range (65504) plus its quantization error would otherwise round to inf."""
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(x.dtype).max:
        big = torch.finfo(dtype).max
        x = x.clamp_(-big, big)
    return x.to(dtype)


def _dequantize_tuple(packed, lo, scale, bits, group_size):
    return (dequantize_groups(packed, lo, scale, bits, group_size),)


def _to_tokens(x: torch.Tensor, token_dim: int):
    """View ``x`` as float32 ``(M, T, C)`` in its own memory order (no copy when dense).

    Dims are ordered by stride; ``M`` is the product of the dims before the token axis and
    ``C`` of those after it (e.g. attention q ``(B, H, T, d)`` stored as ``(B, T, H, d)`` gives
    ``(B, T, H*d)``).
    """
    perm = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    xm = x.permute(perm)
    tdim = perm.index(token_dim)
    shape = tuple(xm.shape)
    m, t, c = math.prod(shape[:tdim]), shape[tdim], math.prod(shape[tdim + 1 :])
    if tdim == len(shape) - 1:  # token axis innermost: treat each token as one channel
        c = 1
    return xm.reshape(m, t, c).float(), (tuple(perm), shape, tdim)
