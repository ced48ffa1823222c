"""DIVISION's and ActNN's math: pure tensor functions, no autograd, no policy, no execution plan.

What a compressed tensor holds and how the pieces fit is in :mod:`hf_division.compressor` and
docs/DESIGN.md ("Compressor"); how the kernels below are run (compiled over cache-sized chunks) is
in :mod:`hf_division.fused`. Every function here works on CPU and CUDA alike and is
``torch.compile``-able.
"""
from __future__ import annotations

import functools

import torch

#: per-group min / scale: 16 bits as in ActNN; bf16 rather than fp16 so that fp32 activations
#: beyond 65504 cannot overflow it
SCALE_DTYPE = torch.bfloat16

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


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_mask(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Any-shape bool/0-1 tensor -> (``ceil(n / 8)`` uint8 bytes, ``n``). A float element counts as
    set if any of its bits is (a 0/1 tensor has no -0.0): an integer view's ``bool()`` is one pass,
    cheaper than comparing floats with 0 (``python -m hf_division.suites compressor`` times it)."""
    # a bool mask is already 0/1 bytes (dropout's); an offset view is copied for the int64 view below
    ready = mask.dtype == torch.bool and mask.is_contiguous() and mask.storage_offset() % 8 == 0
    if not ready and mask.is_floating_point() and mask.is_contiguous():
        mask = mask.view(_SAME_SIZE_INT[mask.element_size()])
    flat = (mask if ready else mask.bool()).reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n % 8:
        flat = torch.nn.functional.pad(flat, (0, -n % 8))
    words = flat.contiguous().view(torch.int64)  # int64 overflow wraps; only the top byte is kept
    return ((words * _GATHER_BITS) >> 56).to(torch.uint8), n


@functools.lru_cache(maxsize=64)
def bit_table(device: torch.device, dtype: torch.dtype = torch.uint8, divisor: float = 1.0) -> torch.Tensor:
    """``(256, 8)``: row ``b`` holds the bits of byte ``b`` (bit ``i`` in column ``i``, the order of
    ``pack_bits(., 1)``) as ``dtype``, divided by ``divisor``. Read only: it is shared."""
    table = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    table = table.to(dtype)
    return table if divisor == 1.0 else table.div_(divisor)


def unpack_mask(bits: torch.Tensor, n: int, shape, dtype: torch.dtype = torch.uint8, divisor: float = 1.0) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: 0/1 values of ``shape`` as ``dtype`` (``uint8``), divided by
    ``divisor`` (a dropout mask's ``1 - p``: the same values as dividing the 0/1 tensor).

    One gather of a table row per byte (:func:`bit_table`) instead of a shift and a mask per bit
    plane, several times faster on CPU (``python -m hf_division.suites compressor`` times both)."""
    index = bits.int()  # index_select, not advanced indexing: several times faster on CPU
    if dtype == torch.uint8 and divisor == 1.0:
        out = bit_table(bits.device).view(torch.int64).view(-1).index_select(0, index).view(torch.uint8)  # a row: one int64
    else:
        out = bit_table(bits.device, dtype, float(divisor)).index_select(0, index).view(-1)
    return out[:n].view(shape)


# ----------------------------------------------------------------------------- noise
def noise_words(n: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` uniform random int16 values, the source of stochastic-rounding noise.

    ``torch.rand`` spends one generator call per element, which on CPU costs about as much as
    the rest of the compression. One 64-bit draw (``random_`` over the full int64 range) gives
    four independent 16-bit integers (the ``compressor`` suite times both: ``python -m hf_division.suites compressor``).
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
    (timed by ``python -m hf_division.suites compressor``); a value is rounded up with a probability
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


# ----------------------------------------------------------------------------- core math
def outlier_tokens(x3: torch.Tensor, ratio: float, absmax: torch.Tensor | None = None) -> torch.Tensor | None:
    """Index (int64, among the ``M*T`` tokens of an ``(M, T, C)`` tensor) of the tokens whose max |x|
    exceeds ``ratio`` times the median token's, at most ``M*T // 64`` of them (the largest); None
    if there are none.

    Why: decoder LLMs put "massive activations" (orders of magnitude above the rest; SmolLM2: its first token, in
    a few channels) on a few tokens. Inside a block such a token dominates the LFC, and in its
    channels it sets the group ranges of every other token: one of them made a layer's weight
    gradient pure noise (docs/DESIGN.md, "Compressor"). Kept exact, they cost at most half a bit per
    element (fp32), and nothing where there are none. Their count is data-dependent (a host sync;
    off the CPU ``compress`` keeps :func:`outlier_candidates` instead).
    """
    r = token_absmax(x3) if absmax is None else absmax
    if r.numel() and not exceeds_median(r, ratio):
        return None
    index, selected = outlier_candidates(x3, ratio, r)
    keep = index[selected]
    return keep if keep.numel() else None


def exceeds_median(r: torch.Tensor, ratio: float) -> bool:
    """Whether the largest of the scores ``r`` (non-empty, ``>= 0``) exceeds ``ratio`` times their
    median, as :func:`outlier_candidates` decides it: ``max(r) > ratio * median(r)`` in ``r``'s
    dtype, the lower median where ``n`` is even (``torch.median``), False where ``r`` holds a NaN.

    Why: most tensors have no outlier token, and selecting the median and the top ``n // 64`` is
    most of the search's time for the many tokens of a per-head ``(B, H, T, d)`` tensor. Without
    either: rounding ``ratio * v`` is monotone in ``v``, so ``ratio * median`` is the
    ``(n - 1) // 2``-th smallest of ``ratio * r``, and the largest score exceeds it exactly when
    more than ``(n - 1) // 2`` of ``ratio * r`` lie below it; one elementwise pass."""
    below = torch.count_nonzero(r * ratio < r.max())
    return int(below) > (r.numel() - 1) // 2


def outlier_candidates(x3: torch.Tensor, ratio: float, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`outlier_tokens` at a fixed size, with no host synchronisation: the index of the
    ``max(1, M*T // 64)`` tokens of largest max |x| and, for each, whether it exceeds ``ratio``
    times the median token's (the tokens :func:`outlier_tokens` returns are exactly the selected ones).
    ``absmax``: that max |x| per token ``(M*T,)`` if already computed (:func:`token_absmax` otherwise)."""
    r = token_absmax(x3) if absmax is None else absmax
    top, index = r.topk(min(max(1, r.numel() // 64), r.numel()))
    return index, top > ratio * r.median()


def token_absmax(x3: torch.Tensor) -> torch.Tensor:
    """Max |x| per token of ``(M, T, C)`` as ``(M*T,)``: NaN where a token holds a NaN."""
    return torch.maximum(x3.amax(dim=2), x3.amin(dim=2).neg_()).view(-1)  # no |x| copy


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


def block_sum(x4: torch.Tensor) -> torch.Tensor:
    """``(s, blocks, block, C)`` -> the sum over each block's tokens, added in token order from +0
    as the native encode adds them: ATen's ``sum`` over that axis orders the additions differently
    for the channels past the last whole vector, so a block mean could round to the neighbouring
    bf16 value (found for about one tensor in 25 of 3 x 70 x 300 normal draws)."""
    acc = torch.zeros_like(x4[:, :, 0])
    for i in range(x4.shape[2]):
        acc = acc + x4[:, :, i]
    return acc


def token_stats(x, bits: int, block: int, group: int, lfc_dtype: torch.dtype):
    """Tokens ``(s * group, C)`` float32 -> ``(lfc, lf, lo, scale, inv)``, the per-block and per-group
    values of :func:`encode_tokens`: ``lfc`` ``(s * group / block, C)`` block means in ``lfc_dtype``
    and ``lf`` the same values in float32 (both None when ``block <= 1``); ``lo``, ``scale`` ``(s, C)``
    float32 holding bf16 values, ``inv`` ``1 / scale`` (0 where ``scale`` is 0)."""
    n, c = x.shape
    s = n // group
    if block > 1:
        x4 = x.view(s, group // block, block, c)
        lfc, lf = round_lfc(block_sum(x4) * (1.0 / block), lfc_dtype)
        h = (x4 - lf.unsqueeze(2)).view(s, group, c)
        lfc, lf = lfc.view(-1, c), lf.view(-1, c)
    else:
        lfc = lf = None
        h = x.view(s, group, c)
    levels = (1 << bits) - 1
    lo = bf16_directed(h.amin(1), down=True)  # every value of the group lies in [lo, lo + levels * scale]
    scale = bf16_directed((h.amax(1) - lo) * (1.0 / levels), down=False)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return lfc, lf, lo, scale, inv


def code_layout(group: int, bits: int) -> tuple[torch.dtype, int]:
    """How one group's codes are stored: ``(word dtype, rows of words)``, each row ``C`` words.

    int32 words where the group fills whole words, uint8 bytes otherwise (short or partial
    groups; the last row then holds fewer codes). Words, because inductor's CPU code shifts and
    converts 8-bit lanes slowly (docs/DESIGN.md, "Compressor", why int32 words along tokens)."""
    if group * bits % 32 == 0:
        return torch.int32, group * bits // 32
    return torch.uint8, -(-group * bits // 8)


def quantize_tokens(x, lf, lo, inv, seed, bits: int, block: int, group: int):
    """Tokens ``(s * group, C)`` float32 and their :func:`token_stats` -> the HFC's codes,
    ``(s, rows, C)`` words as :func:`code_layout` says, packed along tokens (:func:`pack_tokens`).
    ``seed``: 0-d int64 (the stream's seed plus the index of ``x``'s first element; None: round to
    nearest); element ``i`` of ``x`` gets ``hash_uniform(i, seed)``."""
    n, c = x.shape
    s = n // group
    if lf is None:
        h = x.view(s, group, c)
    else:
        h = (x.view(s, group // block, block, c) - lf.view(s, group // block, 1, c)).view(s, group, c)
    if seed is None:
        noise = 0.5
    else:
        noise = hash_uniform(torch.arange(n * c, dtype=torch.int32, device=x.device).view(s, group, c), seed)
    # y >= 0 by construction, so the truncating cast is the floor; clamp guards the top code
    q = ((h - lo.unsqueeze(1)) * inv.unsqueeze(1) + noise).clamp_(0, (1 << bits) - 1).to(code_layout(group, bits)[0])
    return pack_tokens(q.view(s, group, c), bits)


def pack_tokens(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``(s, G, C)`` (values < 2**bits) in a uint8 or int32 tensor -> ``(s, R, C)`` of that
    dtype, ``per`` codes per word (``per`` = word bits / ``bits``, ``R = ceil(G / per)``): word
    ``(k, u, j)`` holds the codes of tokens ``u + i * R`` of channel ``j`` at bits ``i * bits``
    (``i < per``; tokens past ``G`` are 0). Packed along tokens, not neighbouring channels, so
    packing and unpacking are vector loops over contiguous channels (docs/DESIGN.md, "Compressor")."""
    per = q.element_size() * 8 // bits
    if per == 1:
        return q
    s, g, c = q.shape
    if g % per:
        q = torch.nn.functional.pad(q, (0, 0, 0, -g % per))
    q = q.view(s, per, -1, c)
    out = q[:, 0]
    for i in range(1, per):  # int32: the top code's shift may reach the sign bit; unpacking masks it off
        out = out | (q[:, i] << (bits * i))
    return out


def unpack_tokens(codes: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Inverse of :func:`pack_tokens`: ``(s, R, C)`` words -> ``(s, G, C)`` codes (same dtype)."""
    per = codes.element_size() * 8 // bits
    if per == 1:
        return codes
    s, rows, c = codes.shape
    shifts = torch.arange(0, per * bits, bits, dtype=codes.dtype, device=codes.device)
    q = (codes.view(s, 1, rows, c) >> shifts.view(1, per, 1, 1)) & ((1 << bits) - 1)
    return q.view(s, per * rows, c)[:, :group]


def encode_tokens(x, seed, bits: int, block: int, group: int, lfc_dtype: torch.dtype):
    """Tokens ``(s * group, C)`` float32 -> ``(codes, lfc, lo, scale)``.

    ``lfc``: ``(s * group / block, C)`` block means in ``lfc_dtype`` (None when ``block <= 1``);
    ``lo``, ``scale``: ``(s, C)`` bf16, one pair per group of ``group`` tokens of one channel;
    ``codes``: the HFC's ``bits``-bit codes packed along tokens (:func:`quantize_tokens`). ``seed``:
    0-d int64 (the stream's seed plus the index of ``x``'s first element; None: round to nearest).

    A group lies inside one channel, so each channel's range sets only its own groups (the
    outlier channels of transformer residual streams cost the others nothing), and it spans whole
    LFC blocks, so the kernels need no index arithmetic beyond broadcasting (``group`` must be a
    multiple of ``block``). :func:`token_stats` then :func:`quantize_tokens`.
    """
    lfc, lf, lo, scale, inv = token_stats(x, bits, block, group, lfc_dtype)
    codes = quantize_tokens(x, lf, lo, inv, seed, bits, block, group)
    return codes, lfc, lo.to(SCALE_DTYPE), scale.to(SCALE_DTYPE)


def decode_tokens(codes, lfc, lo, scale, bits: int, block: int, group: int):
    """Inverse of :func:`encode_tokens` up to rounding: ``(s * group, C)`` float32. ``codes`` as
    :func:`quantize_tokens` returns them; ``lfc`` (or None), ``lo``, ``scale``: float32, shaped as
    ``encode_tokens`` returns them."""
    s, c = lo.shape
    q = unpack_tokens(codes, bits, group)
    if lfc is None:
        return torch.addcmul(lo.unsqueeze(1), q.float(), scale.unsqueeze(1)).view(-1, c)
    nb = group // block
    base = lo.view(s, 1, 1, c) + lfc.view(s, nb, 1, c)
    return torch.addcmul(base, q.view(s, nb, block, c).float(), scale.view(s, 1, 1, c)).view(-1, c)


def minmax_groups(flat, group_size: int):
    """``(lo, hi)`` per group of ``group_size`` consecutive float32 values."""
    g = flat.view(-1, group_size)
    return g.amin(dim=1), g.amax(dim=1)


def encode_groups(flat, base, seed, lo, inv, bits: int, group_size: int):
    """The elementwise part of :func:`hf_division.compressor.quantize_groups`: ``(packed,)`` codes for float32 groups.
    ``base``: (groups,) int32 index of each group's first element, modulo 2**32 (None: round to nearest)."""
    g = flat.view(-1, group_size)
    if base is None:
        noise = 0.5
    else:
        index = base.unsqueeze(1) + torch.arange(group_size, dtype=torch.int32, device=flat.device)
        noise = hash_uniform(index, seed)
    # y > 0 by construction, so the truncating cast is the floor; clamp guards the top code
    q = ((g - lo.unsqueeze(1)) * inv.unsqueeze(1) + noise).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return (pack_bits(q.view(-1), bits),)


def dequantize_groups(packed: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int):
    """Inverse of :func:`hf_division.compressor.quantize_groups` up to rounding: flat float32 values."""
    q = unpack_bits(packed, bits).view(-1, group_size)
    return (q.float() * scale.float().unsqueeze(1) + lo.float().unsqueeze(1)).view(-1)


# ----------------------------------------------------------------------------- kernels run by hf_division.fused
# They write into slices of preallocated outputs, so one compiled graph serves every chunk offset
# and nothing is concatenated afterwards (docs/DESIGN.md, "Compressor").
def encode_into(codes, lfc, lo, scale, x, seed, bits: int, block: int, group: int, lfc_dtype: torch.dtype):
    """:func:`encode_tokens` of ``x`` written into ``codes`` (``(s, rows, C)``, :func:`code_layout`),
    ``lfc`` (None: no LFC), ``lo`` and ``scale``."""
    for out, value in zip((codes, lfc, lo, scale), encode_tokens(x, seed, bits, block, group, lfc_dtype)):
        if out is not None:
            out.copy_(value)


def decode_into(out, codes, lfc, lo, scale, bits: int, block: int, group: int):
    """:func:`decode_tokens` written into ``out``."""
    out.copy_(decode_tokens(codes, lfc, lo, scale, bits, block, group))


def dequantize_tuple(packed, lo, scale, bits, group_size):
    """:func:`dequantize_groups` as a 1-tuple: the flat path's runner concatenates tuples of outputs."""
    return (dequantize_groups(packed, lo, scale, bits, group_size),)

