"""DIVISION's and ActNN's math: pure tensor functions, no autograd, no policy, no execution plan.

What a compressed tensor holds and how the pieces fit is in :mod:`hf_division.compress.pipeline` and
docs/DESIGN.md ("Compressor"); how the kernels below are run (compiled over cache-sized chunks) is
in :mod:`hf_division.kernels.compiled`. Every function here works on CPU and CUDA alike and is
``torch.compile``-able.
"""
from __future__ import annotations

import torch
from hf_division.quant.packing import code_layout, pack_bits, pack_tokens, unpack_bits, unpack_tokens
from hf_division.quant.rounding import SCALE_DTYPE, bf16_directed, hash_uniform, round_lfc


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
    """The elementwise part of :meth:`hf_division.compress.backends.TorchBackend.encode_flat`: ``(packed,)`` codes for float32 groups.
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
    """Inverse of :meth:`hf_division.compress.backends.TorchBackend.encode_flat` up to rounding: flat float32 values."""
    q = unpack_bits(packed, bits).view(-1, group_size)
    return (q.float() * scale.float().unsqueeze(1) + lo.float().unsqueeze(1)).view(-1)


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
