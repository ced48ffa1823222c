"""DIVISION's dual-precision compressor: pure functions, no autograd, no policy.

A tensor ``x`` of shape ``(..., T, C)`` (token axis ``T``; any leading dims) is split into

* **LFC** — the mean of every ``block_size`` consecutive tokens, shape ``(M * ceil(T/b), C)``,
  stored in a cheap high-precision dtype (bf16 by default);
* **HFC** — the residual ``x - upsample(LFC)``, quantized to ``bits`` per element with a
  min/scale pair (bf16) per group of ``group_size`` consecutive tokens of one channel, unbiased
  stochastic rounding, bit-packed into ``uint8``.

``decompress(compress(x))`` returns a tensor of ``x``'s shape and dtype whose error per element is
at most one quantization step of its group (``scale``), plus the rounding of ``x`` to its own dtype.
Without a token axis (or with ``grouping="flat"``) the scheme is ActNN's: no LFC, groups of
``group_size`` consecutive elements in memory order.

Works on CPU and CUDA alike; the fused core is ``torch.compile``-able (see ``set_fused``).
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
    lo: torch.Tensor | None  # bf16 group minimum: (n_groups,) flat, (ceil(M*Tp / group), C) tokens
    scale: torch.Tensor | None  # bf16 group step, shaped as ``lo``
    lfc: torch.Tensor | None  # (M * ceil(T / block), C) in the LFC dtype
    shape: torch.Size  # original shape
    dtype: torch.dtype  # original dtype
    layout: tuple | None  # (permutation to memory order, its shape, token axis in it); None: flat
    bits: int
    block_size: int
    group_size: int
    rows: torch.Tensor | None = None  # (k, C) outlier tokens kept exact, in the original dtype
    row_index: torch.Tensor | None = None  # (k,) int64 their index among the M*T tokens
    grouping: str = "flat"  # "tokens": groups of tokens within one channel; "flat": consecutive elements

    def storages(self) -> list[torch.Tensor]:
        """The tensors this object holds."""
        own = (self.packed, self.lo, self.scale, self.lfc, self.rows, self.row_index)
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
    # a bool mask is already 0/1 bytes (dropout's); an offset view is copied for the int64 view below
    ready = mask.dtype == torch.bool and mask.is_contiguous() and mask.storage_offset() % 8 == 0
    flat = (mask if ready else mask != 0).reshape(-1).view(torch.uint8)
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


def _bf16_directed(v: torch.Tensor, down: bool) -> torch.Tensor:
    """float32 -> the nearest bf16 value (as float32) toward -inf (``down``) or +inf.

    On the bits, not through a cast: inductor elides a float32 -> bf16 -> float32 round trip
    inside a fused kernel. Truncating the low 16 bits rounds toward 0; one bf16 ulp more
    magnitude (+0x10000) then rounds away from 0 where that is the wanted direction."""
    i = v.view(torch.int32)
    inexact = (i & 0xFFFF) != 0
    away = inexact & ((v < 0) if down else (v > 0))
    return ((i & -65536) + away.to(torch.int32) * 65536).view(torch.float32)


def _round_lfc(v: torch.Tensor, dtype: torch.dtype):
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


def encode_tokens(x, seed, bits: int, block: int, group: int, lfc_dtype: torch.dtype):
    """Tokens ``(s * group, C)`` float32 -> ``(codes, lfc, lo, scale)``.

    ``lfc``: ``(s * group / block, C)`` block means in ``lfc_dtype`` (None when ``block <= 1``);
    ``lo``, ``scale``: ``(s, C)`` bf16, one pair per group of ``group`` tokens of one channel;
    ``codes``: the HFC's ``bits``-bit codes in token-major order, packed. ``seed``: 0-d int64 (the
    stream's seed plus the index of ``x``'s first element; None: round to nearest).

    A group lies inside one channel, so each channel's range sets only its own groups (the
    outlier channels of transformer residual streams cost the others nothing), and it spans whole
    LFC blocks, so the kernel needs no index arithmetic beyond broadcasting: one fused, vectorized
    pass over a cache-sized chunk (``group`` must be a multiple of ``block``).
    """
    n, c = x.shape
    s = n // group
    if block > 1:
        x4 = x.view(s, group // block, block, c)
        lfc, lf = _round_lfc(x4.sum(2) * (1.0 / block), lfc_dtype)
        h = (x4 - lf.unsqueeze(2)).view(s, group, c)
    else:
        lfc, h = None, x.view(s, group, c)
    levels = (1 << bits) - 1
    lo = _bf16_directed(h.amin(1), down=True)  # every value of the group lies in [lo, lo + levels * scale]
    scale = _bf16_directed((h.amax(1) - lo) * (1.0 / levels), down=False)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    if seed is None:
        noise = 0.5
    else:
        noise = hash_uniform(torch.arange(n * c, dtype=torch.int64, device=x.device).view(s, group, c), seed)
    # y >= 0 by construction, so the truncating cast is the floor; clamp guards the top code
    q = ((h - lo.unsqueeze(1)) * inv.unsqueeze(1) + noise).clamp_(0, levels).to(torch.uint8).view(-1)
    per = 8 // bits
    if q.numel() % per:
        q = torch.nn.functional.pad(q, (0, -q.numel() % per))
    return pack_bits(q, bits), None if lfc is None else lfc.view(-1, c), lo.to(_SCALE_DTYPE), scale.to(_SCALE_DTYPE)


def decode_tokens(codes, lfc, lo, scale, bits: int, block: int, group: int):
    """Inverse of :func:`encode_tokens` up to rounding: ``(s * group, C)`` float32.
    ``lfc`` (or None), ``lo``, ``scale``: float32, shaped as ``encode_tokens`` returns them."""
    s, c = lo.shape
    per = 8 // bits
    if bits == 8:
        q = codes.view(s, group, c)
    elif c % per == 0:  # unpack along the channel axis: no index arithmetic in the kernel
        shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
        q = ((codes.view(s, group, c // per).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(s, group, c)
    else:
        q = unpack_bits(codes, bits)[: s * group * c].view(s, group, c)
    if lfc is None:
        return torch.addcmul(lo.unsqueeze(1), q.float(), scale.unsqueeze(1)).view(-1, c)
    nb = group // block
    base = lo.view(s, 1, 1, c) + lfc.view(s, nb, 1, c)
    return torch.addcmul(base, q.view(s, nb, block, c).float(), scale.view(s, 1, 1, c)).view(-1, c)


def quantize_groups(flat: torch.Tensor, seed: torch.Tensor | None, bits: int, group_size: int):
    """Flat float32 (a multiple of ``group_size``) -> (packed codes, lo, scale), one pair per group.

    ``seed``: 0-d int64 seed of the stochastic-rounding noise (:func:`noise_seed`; element ``i``
    gets ``hash_uniform(i, seed)``), or None for round-to-nearest.
    ``lo`` is rounded down and ``scale`` up to the 16-bit dtype (:func:`_bf16_directed`), so every
    value of the group lies inside ``[lo, lo + levels * scale]`` and clamping never biases the rounding.
    """
    g = flat.view(-1, group_size)
    lo, hi = _run_groups(minmax_groups, g.shape[0], (flat,), (group_size,), (group_size,))
    levels = (1 << bits) - 1
    lo32 = _bf16_directed(lo, down=True)
    s32 = _bf16_directed((hi - lo32) * (1.0 / levels), down=False)
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    base = None if seed is None else torch.arange(g.shape[0], dtype=torch.int64, device=flat.device) * group_size
    (packed,) = _run_groups(encode_groups, g.shape[0], (flat, base, seed, lo32, inv), (group_size, 1, None, 1, 1),
                            (bits, group_size))
    return packed, lo32.to(_SCALE_DTYPE), s32.to(_SCALE_DTYPE)


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
# torch.compile fuses each kernel into one loop nest (several times faster than eager on CPU:
# scripts/profile_compressor.py), but only with static shapes: dynamic-shape code was many times
# *slower* here. So the kernels run compiled over fixed-size chunks and eagerly on the remainder:
# the flat (ActNN) path over _CHUNKS groups, the token path over _TOKEN_CHUNK-sized pieces.
_CHUNKS = (4096, 1024, 256)  # groups per compiled call of the flat path (few calls: each pays its guards)
_fused = {"enabled": True}


def set_fused(enabled: bool) -> None:
    """Run the group kernels through ``torch.compile`` (default) or eagerly."""
    _fused["enabled"] = bool(enabled)


@functools.lru_cache(maxsize=None)
def _compiled(kernel, variant: tuple):
    """``kernel`` compiled for one ``variant`` (static arguments and the chunk's shapes, or which
    inputs are None).

    Each variant gets a copy of the function with a code object of its own: dynamo keeps at most
    ``recompile_limit`` (8) versions per code object and runs the rest eagerly, and bit widths x
    chunk sizes x rounding modes exceed that (decoders use 4 and 8 bits, auto-precision 2, 4, 8)."""
    code = kernel.__code__.replace(co_name=f"{kernel.__name__}_v{next(_variant_ids)}")
    fn = types.FunctionType(code, kernel.__globals__, code.co_name, kernel.__defaults__, kernel.__closure__)
    # emulated casts: the LFC must be rounded to its dtype before the HFC is taken from it
    return torch.compile(fn, dynamic=False, options={"emulate_precision_casts": True})


_variant_ids = itertools.count()

#: elements per compiled call of the token kernels: a chunk stays in cache across the kernel's
#: passes (block sums, group ranges, codes); chunks 4x smaller take what is left, then one eager call
_TOKEN_CHUNK = 1 << 20


def _token_chunks(n_groups: int, c: int, group: int):
    """``(first group, groups)`` pieces covering ``n_groups``: compiled sizes, largest first, then
    an eager remainder (``groups`` negative)."""
    size = 1 << max(0, (_TOKEN_CHUNK // (group * c)).bit_length() - 1)
    start = 0
    while size >= 1 and _fused["enabled"]:
        while n_groups - start >= size:
            yield start, size
            start += size
        if size == 1:
            break
        size = max(1, size // 4)
    if start < n_groups:
        yield start, -(n_groups - start)


def _run_tokens(kernel, static: tuple, pieces, args_of) -> None:
    """``kernel(*args_of(start, groups), *static)`` for each ``(start, groups)`` piece: compiled
    for the positive sizes, eager for the remainder. The kernels write into output slices that
    ``args_of`` passes (one compiled graph serves every offset), so no concatenation follows."""
    for start, groups in pieces:
        args = args_of(start, abs(groups))
        if groups > 0 and _fused["enabled"]:
            shapes = tuple(None if a is None else (tuple(a.shape), a.dtype) for a in args)
            try:
                _compiled(kernel, (static, shapes))(*args, *static)
                continue
            except Exception as err:  # no C++ compiler, unsupported device, ...: stay correct, go eager
                warnings.warn(f"hf-division: torch.compile of {kernel.__name__} failed ({err!r}); using eager kernels")
                set_fused(False)
        kernel(*args, *static)


def _encode_into(codes, lfc, lo, scale, x, seed, bits: int, block: int, group: int, lfc_dtype: torch.dtype):
    for out, value in zip((codes, lfc, lo, scale), encode_tokens(x, seed, bits, block, group, lfc_dtype)):
        if out is not None:
            out.copy_(value)


def _decode_into(out, codes, lfc, lo, scale, bits: int, block: int, group: int):
    out.copy_(decode_tokens(codes, lfc, lo, scale, bits, block, group))


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


_FP16_MAX = torch.finfo(torch.float16).max


def compress(
    x: torch.Tensor,
    bits: int = 4,
    block_size: int = 8,
    group_size: int = 256,
    lfc_dtype: torch.dtype = torch.bfloat16,
    token_dim: int | None = -2,
    stochastic: bool = True,
    generator: torch.Generator | None = None,
    outlier_ratio: float = 0.0,
    grouping: str = "tokens",
) -> Packed:
    """Compress ``x`` (any float dtype, any layout) into a :class:`Packed`.

    ``token_dim``: the token axis (``-2`` for ``(..., T, C)``); ``None`` means none (flat groups,
    no LFC), as does ``grouping="flat"`` (ActNN's groups of consecutive elements in memory order).
    ``block_size <= 1`` disables the LFC. ``bits``: 1, 2, 4 or 8 bits per HFC element, or 0 to
    keep ``x`` as it is. With token groups, ``group_size`` tokens of one channel share a min/scale
    pair; it is rounded down to a multiple of ``block_size`` (at least one block).
    ``outlier_ratio``: if > 0, tokens whose max |x| exceeds this many times the median token's are
    stored exact and left out of the LFC and HFC (:func:`outlier_tokens`); needs ``token_dim``.
    """
    shape, dtype = x.shape, x.dtype
    if bits == 0:
        return Packed(x, None, None, None, shape, dtype, None, 0, block_size, group_size)
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 0, 1, 2, 4 or 8, got {bits}")
    if grouping not in ("tokens", "flat"):
        raise ValueError(f"grouping must be 'tokens' or 'flat', got {grouping!r}")
    if token_dim is not None and x.dim() >= 2:
        x3, layout = _to_tokens(x, token_dim % x.dim())
    else:
        x3, layout = x.reshape(1, -1, 1).float(), None
    rows = row_index = None
    if outlier_ratio > 0 and layout is not None and x3.shape[2] > 1:
        row_index = outlier_tokens(x3, outlier_ratio)
        if row_index is not None:
            flat_rows = x3.reshape(-1, x3.shape[2])
            rows = flat_rows[row_index].to(dtype)
            x3 = flat_rows.index_fill(0, row_index, 0.0).view(x3.shape)  # a copy: x3 may view x
    seed = noise_seed(x.device, generator) if stochastic else None
    if layout is None or grouping == "flat":
        flat = x3.reshape(-1)
        n = flat.numel()
        if n % group_size:
            flat = torch.nn.functional.pad(flat, (0, -n % group_size))
        packed, lo, scale = quantize_groups(flat, seed, bits, group_size)
        return Packed(packed, lo, scale, None, shape, dtype, layout, bits, 1, group_size, rows, row_index, "flat")
    block = max(1, block_size)
    if block > 1 and lfc_dtype == torch.float16 and x3.abs().amax() > _FP16_MAX:
        lfc_dtype = torch.float32  # block means beyond fp16's range would store inf: widen this LFC
    m, t, c = x3.shape
    pad = -t % block
    if pad:  # repeat the last token: the padded block's mean moves, but no group range widens
        x3 = torch.cat([x3, x3[:, -1:].expand(m, pad, c)], dim=1)
    tokens = x3.reshape(-1, c)
    group = _token_group(group_size, block, bits)
    n_full, rest = divmod(tokens.shape[0], group)
    n_groups = n_full + (rest > 0)
    code_bytes = group * c * bits // 8
    codes = torch.empty(n_full * code_bytes + -(-rest * c * bits // 8), dtype=torch.uint8, device=x.device)
    lo = torch.empty(n_groups, c, dtype=_SCALE_DTYPE, device=x.device)
    scale = torch.empty_like(lo)
    lfc = torch.empty(tokens.shape[0] // block, c, dtype=lfc_dtype, device=x.device) if block > 1 else None

    def args_of(start, groups):
        stop = start + groups
        return (codes[start * code_bytes : stop * code_bytes], None if lfc is None else lfc[start * group // block : stop * group // block],
                lo[start:stop], scale[start:stop], tokens[start * group : stop * group],
                None if seed is None else seed + start * group * c)

    _run_tokens(_encode_into, (bits, block, group, lfc_dtype), _token_chunks(n_full, c, group), args_of)
    if rest:  # a last, partial group: its own length
        _encode_into(*args_of(n_full, 1), bits, block, rest, lfc_dtype)
    return Packed(codes, lo, scale, lfc, shape, dtype, layout, bits, block, group, rows, row_index, "tokens")


def _token_group(group_size: int, block: int, bits: int) -> int:
    """Tokens per group: ``group_size`` rounded down to whole LFC blocks (at least one), then up
    to a multiple of ``8 / bits`` so that every group's codes fill whole bytes."""
    group = max(block, group_size // block * block)
    while group * bits % 8:
        group += block
    return group


def decompress(p: Packed) -> torch.Tensor:
    """Rebuild a tensor of ``p.shape`` and ``p.dtype`` (with the input's memory layout)."""
    if p.bits == 0:
        return p.packed
    if p.grouping == "flat":
        per_code = p.group_size * p.bits // 8
        (flat,) = _run_groups(_dequantize_tuple, p.lo.numel(), (p.packed, p.lo, p.scale), (per_code, 1, 1),
                              (p.bits, p.group_size))
        if p.layout is None:
            return _cast(flat[: math.prod(p.shape)].view(p.shape), p.dtype)
        perm, mem_shape, tdim = p.layout
        x = flat[: math.prod(mem_shape)].view(-1, _channels(mem_shape, tdim))
    else:
        perm, mem_shape, tdim = p.layout
        x = _decode_tokens(p, mem_shape, tdim)
    if p.rows is not None:
        x.view(-1, x.shape[-1]).index_copy_(0, p.row_index, p.rows.to(x.dtype))
    x = _cast(x, p.dtype).reshape(mem_shape)
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return x.permute(inverse)


def _channels(mem_shape, tdim: int) -> int:
    return 1 if tdim == len(mem_shape) - 1 else math.prod(mem_shape[tdim + 1 :])


def _decode_tokens(p: Packed, mem_shape, tdim: int) -> torch.Tensor:
    """Token-grouped ``p`` -> float32 ``(M, T, C)`` in memory order."""
    m, t, c = math.prod(mem_shape[:tdim]), mem_shape[tdim], _channels(mem_shape, tdim)
    block, group = p.block_size, p.group_size
    tp = -(-t // block) * block
    n_full, rest = divmod(m * tp, group)
    lo, scale = p.lo.float(), p.scale.float()
    lfc = p.lfc.float() if p.lfc is not None else None
    code_bytes = group * c * p.bits // 8
    out = torch.empty(m * tp, c, dtype=torch.float32, device=p.packed.device)

    def args_of(start, groups):
        stop = start + groups
        return (out[start * group : stop * group], p.packed[start * code_bytes : stop * code_bytes],
                None if lfc is None else lfc[start * group // block : stop * group // block], lo[start:stop], scale[start:stop])

    _run_tokens(_decode_into, (p.bits, block, group), _token_chunks(n_full, c, group), args_of)
    if rest:
        _decode_into(*args_of(n_full, 1), p.bits, block, rest)
    x = out.view(m, tp, c)
    return x[:, :t].contiguous() if tp != t else x


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
