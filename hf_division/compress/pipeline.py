"""DIVISION's dual-precision compressor: ``compress`` / ``decompress``, no autograd, no policy.

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

The math is in :mod:`hf_division.quant.codecs`, how it runs (compiled chunks) in
:mod:`hf_division.kernels.compiled`; this module lays tensors out and bundles the pieces (:class:`Packed`).
"""
from __future__ import annotations

import math
import torch
from hf_division.kernels import native
from hf_division.kernels.compiled import run_groups, run_tokens, token_chunks, tune
from hf_division.quant.rounding import SCALE_DTYPE, bf16_directed, noise_seed, wrap_int32
from hf_division.quant.packing import code_layout
from hf_division.quant.codecs import decode_into, dequantize_tuple, encode_groups, encode_into, minmax_groups
from hf_division.quant.exact_tokens import outlier_tokens
from hf_division.quant.exact_tokens import split_leading, split_outliers, split_static, zero_rows
from hf_division.quant.packed import Layout, Packed


# The codes are read once per code of a word (8 times at 4 bits), above inductor's default of 4
# reads, beyond which it writes them out as int32 and packs them in a second loop (docs/DESIGN.md,
# "Compressor"). The flat kernels are slower with it: only this one gets it.
tune(encode_into, realize_reads_threshold=64)


__all__ = ["Layout", "Packed", "cast_finite", "compress", "decompress", "quantize_groups"]


def quantize_groups(flat: torch.Tensor, seed: torch.Tensor | None, bits: int, group_size: int):
    """Flat float32 (a multiple of ``group_size``) -> (packed codes, lo, scale), one pair per group.

    ``seed``: 0-d int64 seed of the stochastic-rounding noise (:func:`~hf_division.quant.rounding.noise_seed`;
    element ``i`` gets ``hash_uniform(i, seed)``), or None for round-to-nearest.
    ``lo`` is rounded down and ``scale`` up to the 16-bit dtype (:func:`~hf_division.quant.rounding.bf16_directed`),
    so every value of the group lies inside ``[lo, lo + levels * scale]`` and clamping never biases
    the rounding.
    """
    g = flat.view(-1, group_size)
    lo, hi = run_groups(minmax_groups, g.shape[0], (flat,), (group_size,), (group_size,))
    levels = (1 << bits) - 1
    lo32 = bf16_directed(lo, down=True)
    s32 = bf16_directed((hi - lo32) * (1.0 / levels), down=False)
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    base = None if seed is None else wrap_int32(torch.arange(g.shape[0], dtype=torch.int64, device=flat.device) * group_size)
    (packed,) = run_groups(encode_groups, g.shape[0], (flat, base, seed, lo32, inv), (group_size, 1, None, 1, 1),
                           (bits, group_size))
    return packed, lo32.to(SCALE_DTYPE), s32.to(SCALE_DTYPE)


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
    exact_tokens: int = 0,
    static_rows: bool | None = None,
) -> Packed:
    """Compress ``x`` (any float dtype, any layout) into a :class:`Packed`.

    ``token_dim``: the token axis (``-2`` for ``(..., T, C)``); ``None`` means none (flat groups,
    no LFC), as does ``grouping="flat"`` (ActNN's groups of consecutive elements in memory order).
    ``block_size <= 1`` disables the LFC. ``bits``: 1, 2, 4 or 8 bits per HFC element, or 0 to
    keep ``x`` as it is. With token groups, ``group_size`` tokens of one channel share a min/scale
    pair; it is rounded down to a multiple of ``block_size`` (at least one block).
    ``outlier_ratio``: if > 0, tokens whose max |x| exceeds this many times the median token's are
    stored exact and left out of the LFC and HFC (:func:`~hf_division.quant.exact_tokens.outlier_tokens`); needs
    ``token_dim``.
    ``static_rows``: split the exact tokens (outliers, ``exact_tokens``) at a fixed capacity, with
    no host synchronisation: every outlier candidate's row is held, a mask says which are exact
    (:func:`~hf_division.quant.exact_tokens.outlier_candidates`). The rebuilt tensor is the same; the rows cost
    up to ``1/64`` of the tokens in ``x``'s dtype. None: on every device but the CPU, where a
    readback costs nothing (docs/DESIGN.md, "Compressor").
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
    rows = row_index = row_keep = None
    static = x.device.type != "cpu" if static_rows is None else static_rows
    ratio = outlier_ratio if layout is not None and x3.shape[2] > 1 else 0.0
    lead = exact_tokens if layout is not None and grouping == "tokens" else 0
    if lead >= x3.shape[1] > 0:  # every token exact: nothing to compress
        return Packed(x, None, None, None, shape, dtype, None, 0, block_size, group_size)
    scored = (ratio > 0 and not static and not lead and grouping == "tokens"
              and _native_encodes(x3.device, block_size, x3.shape[1], lfc_dtype))
    if static and (ratio > 0 or lead > 0):
        x3, rows, row_index, row_keep = split_static(x3, ratio, lead, dtype, _score(x3) if ratio > 0 else None)
    else:
        if ratio > 0 and not scored:
            x3, rows, row_index = split_outliers(x3, ratio, dtype, _score(x3))
        if lead > 0:
            x3, rows, row_index = split_leading(x3, lead, dtype, rows, row_index)
    seed = noise_seed(x.device, generator) if stochastic else None
    if layout is None or grouping == "flat":
        group = min(group_size, -(-x3.numel() // 8) * 8)  # one group at most: no padding beyond it
        packed, lo, scale = _compress_flat(x3, seed, bits, group)
        return _no_larger(Packed(packed, lo, scale, None, shape, dtype, layout, bits, 1, group, rows, row_index, "flat",
                                 row_keep), x)
    block = max(1, min(block_size, x3.shape[1]))  # a row shorter than a block is one block, not padded
    group = _token_group(group_size, block, bits)
    if scored:
        codes, lfc, lo, scale, rows, row_index = _encode_then_split(x3, seed, bits, block, group, lfc_dtype, ratio,
                                                                    dtype)
    else:
        if block > 1 and lfc_dtype == torch.float16 and dtype != torch.float16 and (static or x3.abs().amax() > _FP16_MAX):
            lfc_dtype = torch.float32  # block means beyond fp16's range would store inf: widen this LFC
        codes, lfc, lo, scale = _compress_tokens(x3, seed, bits, block, group, lfc_dtype)
    return _no_larger(Packed(codes, lo, scale, lfc, shape, dtype, layout, bits, block, group, rows, row_index, "tokens",
                             row_keep), x)


def compress_row_scaled(x: torch.Tensor, row_scale: torch.Tensor, bits: int, block_size: int, group_size: int,
                        lfc_dtype: torch.dtype, stochastic: bool = True, generator: torch.Generator | None = None,
                        **policy) -> Packed | None:
    """``compress(x / row_scale, ...)`` with ``row_scale`` (``x.shape[:-1] + (1,)``, float32) held in
    the result, which rebuilds ``x``: the same codes and values as dividing first and multiplying
    after, with the division and the product inside the native kernels' passes instead of two more
    passes over the tensor. Outlier tokens (``policy``'s ``outlier_ratio``) are those of the divided
    values, held as the rows that dividing then multiplying rebuilds. None where that does not apply
    (the caller divides instead): not a contiguous float32 CPU tensor, not token groups, or leading
    tokens kept exact (``exact_tokens``)."""
    if (policy.get("exact_tokens", 0) or policy.get("grouping", "tokens") != "tokens" or not bits
            or x.dtype != torch.float32 or not x.is_contiguous() or x.dim() < 2
            or not _native_encodes(x.device, block_size, x.shape[-2], lfc_dtype)):
        return None
    x3, layout = _to_tokens(x, x.dim() - 2)
    ratio = policy.get("outlier_ratio", 0.0) if x3.shape[2] > 1 else 0.0
    seed = noise_seed(x.device, generator) if stochastic else None
    block = max(1, min(block_size, x3.shape[1]))
    group = _token_group(group_size, block, bits)
    codes, lfc, lo, scale, rows, row_index = _encode_then_split(x3, seed, bits, block, group, lfc_dtype, ratio,
                                                                x.dtype, row_scale)
    p = Packed(codes, lo, scale, lfc, x.shape, x.dtype, layout, bits, block, group, rows, row_index, "tokens")
    kept = _no_larger(p, x)  # as for x / row_scale: the caller keeps x whole where not smaller
    if kept.bits:
        kept.row_scale = row_scale
    return kept


def _score(x3: torch.Tensor) -> torch.Tensor | None:
    """The outlier search's score, max |x| per token, from the native pass where it takes ``x3``
    (None: the search computes it in torch)."""
    return native.token_absmax(x3)


def _native_encodes(device: torch.device, block_size: int, tokens: int, lfc_dtype: torch.dtype) -> bool:
    """Whether the native encode takes rows of ``tokens`` tokens on ``device`` with this LFC (none
    where a row is one block or less): where :func:`_encode_then_split` and the row scales apply."""
    return native.applies(device, lfc_dtype if min(block_size, tokens) > 1 else None)


def _encode_then_split(x3: torch.Tensor, seed, bits: int, block: int, group: int, lfc_dtype: torch.dtype,
                       ratio: float, dtype: torch.dtype, row_scale: torch.Tensor | None = None):
    """``(codes, lfc, lo, scale, rows, row_index)``: the outlier tokens of ``x3`` (``/ row_scale``)
    split off, then the rest encoded (native kernels), the same bytes as
    :func:`~hf_division.quant.exact_tokens.split_outliers` then :func:`_compress_tokens`. In the other
    order: the encode's first pass scores each token as it reads it, and only where outlier tokens
    turn up is ``x3`` encoded again without them.

    Why: the score's own pass re-read the whole tensor from memory, and most tensors hold no
    outlier token (docs/DESIGN.md, "Native CPU kernels"). For ``x / s``: max |x / s| is
    max |x| / s (division by s > 0 keeps the order)."""
    first = _compress_tokens(x3, seed, bits, block, group, lfc_dtype, row_scale, score=ratio > 0)
    if not ratio:
        return (*first, None, None)
    scale = None if row_scale is None else row_scale.view(-1)
    row_index = outlier_tokens(x3, ratio, first[4] if scale is None else first[4] / scale)
    if row_index is None:
        return (*first[:4], None, None)
    x3, rows = zero_rows(x3, row_index, dtype, scale)
    return (*_compress_tokens(x3, seed, bits, block, group, lfc_dtype, row_scale), rows, row_index)


def _no_larger(p: Packed, x: torch.Tensor) -> Packed:
    """``p``, or ``x`` kept as it is (``bits == 0``) when ``p`` would hold as many bytes or more:
    short rows padded to a block, tiny groups and narrow dtypes at 8 bits can cost more than the
    tensor (docs/GUIDE.md, "Guarantees")."""
    if p.nbytes < x.numel() * x.element_size():
        return p
    return Packed(x, None, None, None, p.shape, p.dtype, None, 0, p.block_size, p.group_size)


def _compress_flat(x3: torch.Tensor, seed, bits: int, group_size: int):
    flat = x3.reshape(-1)
    n = flat.numel()
    if n % group_size:
        flat = torch.nn.functional.pad(flat, (0, -n % group_size))
    return quantize_groups(flat, seed, bits, group_size)


def _compress_tokens(x3: torch.Tensor, seed, bits: int, block: int, group: int, lfc_dtype: torch.dtype, row_scale=None,
                     score: bool = False):
    """``(M, T, C)`` float32 -> ``(codes, lfc, lo, scale)`` in token groups of ``group`` tokens
    (of ``x3 / row_scale`` where given: native kernels only, :func:`compress_row_scaled`); with
    ``score`` (native kernels only), one more: max |x3| per token, read in the encode's first pass."""
    m, t, c = x3.shape
    n = m * (-(-t // block) * block)
    n_full, rest = divmod(n, group)
    dev = x3.device
    codes = torch.empty(_code_bytes(n_full, group, bits, c) + _code_bytes(1, rest, bits, c), dtype=torch.uint8, device=dev)
    lo = torch.empty(n_full + (rest > 0), c, dtype=SCALE_DTYPE, device=dev)
    scale = torch.empty_like(lo)
    lfc = torch.empty(n // block, c, dtype=lfc_dtype, device=dev) if block > 1 else None
    if native.applies(dev, None if lfc is None else lfc_dtype):  # padding and all, in one call
        absmax = native.encode_tokens(x3, codes, lfc, lo, scale, None if seed is None else int(seed), bits, block,
                                      group, row_scale, score)
        return (codes, lfc, lo, scale, absmax) if score else (codes, lfc, lo, scale)
    if n != m * t:  # repeat the last token: the padded block's mean moves, but no group range widens
        x3 = torch.cat([x3, x3[:, -1:].expand(m, n // m - t, c)], dim=1)
    tokens = x3.reshape(-1, c)
    full, last = _code_views(codes, n_full, rest, group, bits, c)

    def args_of(start, groups, words=None):
        stop = start + groups
        return (full[start:stop] if words is None else words,
                None if lfc is None else lfc[start * group // block : stop * group // block],
                lo[start:stop], scale[start:stop], tokens[start * group : stop * group],
                None if seed is None else seed + start * group * c)

    run_tokens(encode_into, (bits, block, group, lfc_dtype), token_chunks(n_full, c, group), args_of)
    if rest:  # a last, partial group: its own length
        encode_into(*args_of(n_full, 1, last), bits, block, rest, lfc_dtype)
    return codes, lfc, lo, scale


def _code_bytes(n_groups: int, group: int, bits: int, c: int) -> int:
    """Bytes of the codes of ``n_groups`` groups of ``group`` tokens x ``c`` channels
    (:func:`~hf_division.quant.packing.code_layout`; 0 for ``group == 0``)."""
    dtype, rows = code_layout(group, bits)
    return n_groups * rows * c * dtype.itemsize


def _code_views(codes: torch.Tensor, n_full: int, rest: int, group: int, bits: int, c: int):
    """``codes`` (uint8, flat) as ``(the full groups' words (n_full, rows, C), the partial group's
    (1, rows, C) or None)``, each in its :func:`~hf_division.quant.packing.code_layout` dtype."""
    split = _code_bytes(n_full, group, bits, c)
    dtype, rows = code_layout(group, bits)
    full = codes[:split].view(dtype).view(n_full, rows, c)
    if not rest:
        return full, None
    dtype, rows = code_layout(rest, bits)
    return full, codes[split:].view(dtype).view(1, rows, c)


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
    layout = p.layout
    if p.grouping == "flat":
        per_code = p.group_size * p.bits // 8
        (flat,) = run_groups(dequantize_tuple, p.lo.numel(), (p.packed, p.lo, p.scale), (per_code, 1, 1),
                             (p.bits, p.group_size))
        if layout is None:
            return cast_finite(flat[: math.prod(p.shape)].view(p.shape), p.dtype)
        x = flat[: math.prod(layout.shape)].view(-1, layout.channels)
    else:
        x = _decode_tokens(p, layout)
    if p.rows is not None:
        tokens = x.view(-1, x.shape[-1])
        rows = p.rows.to(x.dtype)
        if p.row_keep is not None:  # held at capacity: rows not marked exact keep their rebuilt value
            rows = torch.where(p.row_keep[:, None], rows, tokens[p.row_index])
        tokens.index_copy_(0, p.row_index, rows)
    return cast_finite(x, p.dtype).reshape(layout.shape).permute(layout.inverse())


def _decode_tokens(p: Packed, layout: Layout) -> torch.Tensor:
    """Token-grouped ``p`` -> float32 ``(M, T, C)`` in memory order."""
    tdim = layout.token_dim
    m, t, c = math.prod(layout.shape[:tdim]), layout.shape[tdim], layout.channels
    block, group = p.block_size, p.group_size
    if native.applies(p.packed.device, None if p.lfc is None else p.lfc.dtype):
        out = torch.empty(m, t, c, dtype=torch.float32)
        native.decode_tokens(out, p.packed, p.lfc, p.lo, p.scale, p.bits, block, group, p.row_scale)
        return out
    tp = -(-t // block) * block
    n_full, rest = divmod(m * tp, group)
    lo, scale = p.lo.float(), p.scale.float()
    lfc = p.lfc.float() if p.lfc is not None else None
    full, last = _code_views(p.packed, n_full, rest, group, p.bits, c)
    out = torch.empty(m * tp, c, dtype=torch.float32, device=p.packed.device)

    def args_of(start, groups, words=None):
        stop = start + groups
        return (out[start * group : stop * group], full[start:stop] if words is None else words,
                None if lfc is None else lfc[start * group // block : stop * group // block], lo[start:stop], scale[start:stop])

    run_tokens(decode_into, (p.bits, block, group), token_chunks(n_full, c, group), args_of)
    if rest:
        decode_into(*args_of(n_full, 1, last), p.bits, block, rest)
    x = out.view(m, tp, c)
    x = x[:, :t].contiguous() if tp != t else x
    return x if p.row_scale is None else x * p.row_scale.view(m, t, 1)


def cast_finite(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 rebuilt values (in place) -> ``dtype``, clamped to its finite range: a value at the edge of
    fp16's range (65504) plus its quantization error would otherwise round to inf."""
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(x.dtype).max:
        big = torch.finfo(dtype).max
        x = x.clamp_(-big, big)
    return x.to(dtype)


def _to_tokens(x: torch.Tensor, token_dim: int):
    """View ``x`` as float32 ``(M, T, C)`` in its own memory order (no copy when dense), and its
    :class:`Layout` (e.g. attention q ``(B, H, T, d)`` stored as ``(B, T, H, d)`` gives ``(B, T, H*d)``)."""
    perm = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    xm = x.permute(perm)
    layout = Layout(tuple(perm), tuple(xm.shape), perm.index(token_dim))
    tdim = layout.token_dim
    m, t = math.prod(layout.shape[:tdim]), layout.shape[tdim]
    return xm.reshape(m, t, layout.channels).float(), layout
