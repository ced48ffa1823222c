"""DIVISION's dual-precision compressor: ``compress`` / ``decompress``, no autograd, no policy.

A tensor ``x`` of shape ``(..., T, C)`` (token axis ``T``; any leading dims) is split into

* **LFC**: the mean of every ``block_size`` consecutive tokens, shape ``(M * ceil(T/b), C)``,
  stored in a cheap high-precision dtype (bf16 by default);
* **HFC**: the residual ``x - upsample(LFC)``, quantized to ``bits`` per element with a
  min/scale pair (bf16) per group of ``group_size`` consecutive tokens of one channel, unbiased
  stochastic rounding, bit-packed into ``uint8``.

``decompress(compress(x))`` returns a tensor of ``x``'s shape and dtype whose error per element is
at most one quantization step of its group (``scale``), plus the rounding of ``x`` to its own dtype.
Without a token axis (or with ``grouping="flat"``) the scheme is ActNN's: no LFC, groups of
``group_size`` consecutive elements in memory order.

One pipeline, read top to bottom in :func:`compress`: the tensor viewed as ``(M, T, C)`` tokens,
the tokens held exact split off once, one backend picked (:func:`.backends.pick`), one encode,
one bundle. The math is :mod:`hf_division.quant`; how it runs is the backend's.
"""
from __future__ import annotations

import functools
import math

import torch

from hf_division.compress.backends import Backend, pick
from hf_division.quant.exact_tokens import outlier_tokens, split_leading, split_outliers, split_static, zero_rows
from hf_division.quant.packed import FLAT, GROUPINGS, TOKENS, Layout, Packed, token_group
from hf_division.compress.noise import tensor_seed
from hf_division.kernels.triton_codec import device_path

__all__ = ["Layout", "Packed", "cast_finite", "compress", "compress_row_scaled", "decompress"]

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
    grouping: str = TOKENS,
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
    stored exact and left out of the LFC and HFC (:func:`~hf_division.quant.exact_tokens.outlier_tokens`);
    needs ``token_dim``. ``exact_tokens``: the first tokens of each row kept exact likewise.
    ``static_rows``: split the exact tokens (outliers, ``exact_tokens``) at a fixed capacity, with
    no host synchronisation: every outlier candidate's row is held, a mask says which are exact
    (:func:`~hf_division.quant.exact_tokens.outlier_candidates`). The rebuilt tensor is the same; the
    rows cost up to ``1/64`` of the tokens in ``x``'s dtype. None: on the GPU's path
    (:func:`~hf_division.kernels.triton_codec.device_path`: every device but the CPU, where a
    readback costs nothing) (docs/DESIGN.md, "Compressor").
    """
    if bits == 0:
        return Packed.kept(x, block_size, group_size)
    _check(bits, grouping)
    # 1. the tokens: x as (M, T, C) in its own memory order, or one flat run
    x3, layout = _as_tokens(x, token_dim)
    by_tokens = layout is not None and grouping == TOKENS
    ratio = outlier_ratio if layout is not None and x3.shape[2] > 1 else 0.0
    lead = exact_tokens if by_tokens else 0
    if lead >= x3.shape[1] > 0:  # every token exact: nothing to compress
        return Packed.kept(x, block_size, group_size)
    block = max(1, min(block_size, x3.shape[1])) if by_tokens else 1  # a row shorter than a block is one block
    gpu = device_path(x.device)  # no readback: exact rows at a fixed capacity, seeds drawn in blocks
    static = gpu if static_rows is None else static_rows
    seed = tensor_seed(x.device, generator, blocks=gpu) if stochastic else None
    if not by_tokens:  # ActNN's flat groups, after any exact rows are split off
        backend = pick(x.device, FLAT, None)
        x3, exact = _split_exact(x3.float(), ratio, 0, static, x.dtype, backend)
        return _no_larger(_encode_flat(backend, x, x3, layout, seed, bits, group_size, exact), x)
    backend = pick(x.device, TOKENS, lfc_dtype if block > 1 else None)
    x3 = x3 if backend.any_dtype else x3.float()
    group = token_group(group_size, block, bits)
    # 2. the exact tokens, split off once; 3. one encode
    if ratio > 0 and not static and not lead and backend.scores_in_encode:
        enc, exact = _encode_then_split(backend, x3, seed, bits, block, group, lfc_dtype, ratio, x.dtype)
    elif ratio > 0 and static and not lead and backend.whole:  # chosen by the backend, copied in its encode
        rows = backend.exact_tokens(x3, ratio)
        exact = _held_rows(rows)
        enc = backend.encode_tokens(x3, seed, bits, block, group, _lfc_dtype(x, x3, block, lfc_dtype, static),
                                    exact=rows)
    else:
        x3, exact = _split_exact(x3, ratio, lead, static, x.dtype, backend)
        lfc = _lfc_dtype(x, x3, block, lfc_dtype, static)
        backend = pick(x.device, TOKENS, lfc if block > 1 else None)
        enc = backend.encode_tokens(x3, seed, bits, block, group, lfc)
    # 4. one bundle, unless it holds no fewer bytes than x
    return _no_larger(Packed(packed=enc.codes, lo=enc.lo, scale=enc.scale, lfc=enc.lfc, shape=x.shape, dtype=x.dtype,
                             layout=layout, bits=bits, block_size=block, group_size=group, grouping=TOKENS, **exact), x)


def compress_row_scaled(x: torch.Tensor, row_scale: torch.Tensor, bits: int, block_size: int, group_size: int,
                        lfc_dtype: torch.dtype, stochastic: bool = True, generator: torch.Generator | None = None,
                        **policy) -> Packed | None:
    """``compress(x / row_scale, ...)`` with ``row_scale`` (``x.shape[:-1] + (1,)``, float32,
    contiguous) held in the result, which rebuilds ``x``: the same codes and values as dividing
    first and multiplying after (then clamping to ``x``'s dtype and casting to it), with the
    division and the product inside the kernels' passes instead of passes of their own over the
    tensor. Outlier tokens (``policy``'s ``outlier_ratio``) are those of the divided values, held
    as the rows that dividing then multiplying rebuilds. None where that does not apply (the
    caller divides instead): a backend that does not scale rows (the native kernels take
    contiguous float32 CPU tensors, the Triton kernels a tensor whose tokens are in memory order,
    with no leading tokens kept exact), not token groups, or every token kept exact
    (``exact_tokens``)."""
    lead = policy.get("exact_tokens", 0)
    if policy.get("grouping", TOKENS) != TOKENS or not bits or x.dim() < 2 or lead >= x.shape[-2]:
        return None
    block = max(1, min(block_size, x.shape[-2]))
    backend = pick(x.device, TOKENS, lfc_dtype if block > 1 else None)
    if not backend.scales_rows or not (backend.any_dtype or (x.dtype == torch.float32 and x.is_contiguous())):
        return None
    if backend.whole and (lead or _token_layout(x.shape, x.stride(), x.dim() - 2)[0] is not None):
        return None  # the kernels index the scales by token in memory order
    x3, layout = _as_tokens(x, x.dim() - 2)
    ratio = policy.get("outlier_ratio", 0.0) if x3.shape[2] > 1 else 0.0
    seed = tensor_seed(x.device, generator, blocks=device_path(x.device)) if stochastic else None
    group = token_group(group_size, block, bits)
    if backend.whole:  # at a fixed capacity, chosen by the backend: no readback
        rows = backend.exact_tokens(x3, ratio, row_scale) if ratio > 0 else None
        # the LFC's dtype as compressing the float32 quotient at a fixed capacity gives (_lfc_dtype)
        lfc_dtype = torch.float32 if block > 1 and lfc_dtype == torch.float16 else lfc_dtype
        enc = backend.encode_tokens(x3, seed, bits, block, group, lfc_dtype, row_scale, exact=rows)
        exact = _held_rows(rows)
    elif lead:
        enc, exact, row_scale = _split_then_encode_scaled(backend, x3, seed, bits, block, group, lfc_dtype, ratio,
                                                          row_scale, lead)
    else:
        enc, exact = _encode_then_split(backend, x3, seed, bits, block, group, lfc_dtype, ratio, x.dtype, row_scale)
    p = Packed(packed=enc.codes, lo=enc.lo, scale=enc.scale, lfc=enc.lfc, shape=x.shape, dtype=x.dtype, layout=layout,
               bits=bits, block_size=block, group_size=group, grouping=TOKENS, **exact)
    kept = _no_larger(p, x)  # as for x / row_scale: the caller keeps x whole where not smaller
    if kept.bits:
        kept.row_scale = row_scale
    return kept


def decompress(p: Packed) -> torch.Tensor:
    """Rebuild a tensor of ``p.shape`` and ``p.dtype`` (with the input's memory layout)."""
    if p.bits == 0:
        return p.packed
    layout = p.layout
    backend = pick(p.packed.device, p.grouping, None if p.lfc is None else p.lfc.dtype)
    if backend.whole:  # the tokens in p's dtype (times the row scale), exact rows in place
        return backend.rebuild_tokens(p).reshape(layout.shape).permute(layout.inverse())
    if p.grouping == FLAT:
        flat = backend.decode_flat(p)
        if layout is None:
            return cast_finite(flat[: math.prod(p.shape)].view(p.shape), p.dtype)
        x = flat[: math.prod(layout.shape)].view(-1, layout.channels)
    else:
        x = backend.decode_tokens(p)
    if p.rows is not None:  # the exact tokens back in their places
        tokens = x.view(-1, x.shape[-1])
        rows = p.rows.to(x.dtype)
        if p.row_keep is not None:  # held at capacity: rows not marked exact keep their rebuilt value
            rows = torch.where(p.row_keep[:, None], rows, tokens[p.row_index])
        tokens.index_copy_(0, p.row_index, rows)
    return cast_finite(x, p.dtype).reshape(layout.shape).permute(layout.inverse())


def cast_finite(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 rebuilt values (in place) -> ``dtype``, clamped to its finite range: a value at the edge of
    fp16's range (65504) plus its quantization error would otherwise round to inf."""
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(x.dtype).max:
        big = torch.finfo(dtype).max
        x = x.clamp_(-big, big)
    return x.to(dtype)


# ----------------------------------------------------------------------------- the steps
def _check(bits: int, grouping: str) -> None:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 0, 1, 2, 4 or 8, got {bits}")
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")


def _lfc_dtype(x: torch.Tensor, x3: torch.Tensor, block: int, lfc_dtype: torch.dtype, static: bool) -> torch.dtype:
    """The LFC's dtype: float32 where an fp16 one would store inf (block means beyond its range;
    at a fixed capacity, ``static``, for every tensor not itself fp16, with no readback)."""
    if block > 1 and lfc_dtype == torch.float16 and x.dtype != torch.float16 and (static or x3.abs().amax() > _FP16_MAX):
        return torch.float32
    return lfc_dtype


def _as_tokens(x: torch.Tensor, token_dim: int | None) -> tuple[torch.Tensor, Layout | None]:
    """View ``x`` as ``(M, T, C)`` in its own memory order and dtype (no copy when dense), and its
    :class:`Layout` (e.g. attention q ``(B, H, T, d)`` stored as ``(B, T, H, d)`` gives ``(B, T, H*d)``);
    without a token axis, ``(1, N, 1)`` and None."""
    if token_dim is None or x.dim() < 2:
        return x.reshape(1, -1, 1), None
    perm, layout = _token_layout(x.shape, x.stride(), token_dim % x.dim())
    return (x if perm is None else x.permute(perm)).reshape(layout.rows), layout


@functools.lru_cache(maxsize=1024)
def _token_layout(shape: tuple, strides: tuple, token_dim: int) -> tuple[tuple | None, Layout]:
    """:func:`_as_tokens`' permutation (None: the identity) and :class:`Layout` for a tensor of
    ``shape`` and ``strides``; cached: it runs for every saved tensor, with the few shapes and
    strides of one model (docs/DESIGN.md, "On a GPU": host time). A dimension of size 1 sorts as
    in a contiguous tensor, whatever its stride: its stride is never used to address an element,
    and a transposed ``(1, B, C)`` (SigLIP's pooling head) came out as ``(1, 1, B*C)``, one token,
    where its row scales were ``B``."""
    after = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        after[d] = after[d + 1] * shape[d + 1]
    perm = tuple(sorted(range(len(shape)), key=lambda d: (-(strides[d] if shape[d] != 1 else after[d]), d)))
    layout = Layout(perm, tuple(shape[d] for d in perm), perm.index(token_dim))
    return (None if perm == tuple(range(len(shape))) else perm), layout


def _held_rows(found: dict | None) -> dict:
    """The Packed fields of the exact rows a backend found at a fixed capacity (``exact_tokens``;
    None: none searched)."""
    if found is None:
        return dict(rows=None, row_index=None)
    return dict(rows=found["rows"], row_index=found["row_index"], row_keep=found["row_keep"])


def _split_exact(x3: torch.Tensor, ratio: float, lead: int, static: bool, dtype: torch.dtype, backend: Backend,
                 scale: torch.Tensor | None = None):
    """``(what is left to encode, Packed fields of the exact rows)``: outlier tokens (scored by
    ``backend``) and the first ``lead`` tokens of each row, at a data-dependent count or, ``static``,
    at a fixed capacity. ``scale`` (``(M*T,)``, not ``static``): what a row-scaled encode will divide
    each token by; the outliers are then those of ``x3 / scale`` and the rows ``(x / s) * s``."""
    if static and (ratio > 0 or lead > 0):
        score = backend.token_absmax(x3) if ratio > 0 else None
        x3, rows, row_index, row_keep = split_static(x3, ratio, lead, dtype, score)
        return x3, dict(rows=rows, row_index=row_index, row_keep=row_keep)
    rows = row_index = None
    if ratio > 0:
        score = backend.token_absmax(x3)
        score = score if scale is None else score / scale
        x3, rows, row_index = split_outliers(x3, ratio, dtype, score, scale)
    if lead > 0:
        x3, rows, row_index = split_leading(x3, lead, dtype, rows, row_index, scale)
    return x3, dict(rows=rows, row_index=row_index)


def _encode_then_split(backend: Backend, x3: torch.Tensor, seed, bits: int, block: int, group: int,
                       lfc_dtype: torch.dtype, ratio: float, dtype: torch.dtype, row_scale: torch.Tensor | None = None):
    """``(Encoded, exact rows)`` for a backend that scores tokens in its encode: encode first, and
    only where outlier tokens turn up, split them off and encode again without them. The same
    bytes as splitting first (:func:`_split_exact`) then encoding.

    Why: the score's own pass re-read the whole tensor from memory, and most tensors hold no
    outlier token (docs/DESIGN.md, "Native CPU kernels"). For ``x / s``: max |x / s| is
    max |x| / s (division by s > 0 keeps the order)."""
    first = backend.encode_tokens(x3, seed, bits, block, group, lfc_dtype, row_scale, score=ratio > 0)
    none = dict(rows=None, row_index=None)
    if not ratio:
        return first, none
    scale = None if row_scale is None else row_scale.view(-1)
    row_index = outlier_tokens(x3, ratio, first.absmax if scale is None else first.absmax / scale)
    if row_index is None:
        return first, none
    x3, rows = zero_rows(x3, row_index, dtype, scale)
    return backend.encode_tokens(x3, seed, bits, block, group, lfc_dtype, row_scale), dict(rows=rows, row_index=row_index)


def _split_then_encode_scaled(backend: Backend, x3: torch.Tensor, seed, bits: int, block: int, group: int,
                              lfc_dtype: torch.dtype, ratio: float, row_scale: torch.Tensor, lead: int):
    """``(Encoded, exact rows, row scale)`` for ``x3 / row_scale`` with its first ``lead`` tokens
    of each row kept exact: what :func:`_split_exact` then an encode of the divided tensor give,
    codes and rebuild, with the division inside the encode. The outliers are scored before the
    encode (a separate pass: they must leave what is encoded before the leading tokens are
    replaced by their neighbour, as in the divided path); the scale of a replaced token becomes
    its neighbour's, so the encode divides the copy by the scale it was divided by there."""
    x3, exact = _split_exact(x3, ratio, lead, False, torch.float32, backend, row_scale.reshape(-1))
    s3 = row_scale.reshape(x3.shape[0], x3.shape[1], 1).clone()
    s3[:, :lead] = s3[:, lead : lead + 1]
    s3 = s3.view(row_scale.shape)
    return backend.encode_tokens(x3, seed, bits, block, group, lfc_dtype, s3), exact, s3


def _encode_flat(backend: Backend, x: torch.Tensor, x3: torch.Tensor, layout: Layout | None, seed, bits: int,
                 group_size: int, exact: dict) -> Packed:
    """ActNN's flat groups of ``x3``'s elements in memory order, the last group padded."""
    flat = x3.reshape(-1)
    group = min(group_size, -(-flat.numel() // 8) * 8)  # one group at most: no padding beyond it
    if flat.numel() % group:
        flat = torch.nn.functional.pad(flat, (0, -flat.numel() % group))
    enc = backend.encode_flat(flat, seed, bits, group)
    return Packed(packed=enc.codes, lo=enc.lo, scale=enc.scale, shape=x.shape, dtype=x.dtype, layout=layout, bits=bits,
                  block_size=1, group_size=group, grouping=FLAT, **exact)


def _no_larger(p: Packed, x: torch.Tensor) -> Packed:
    """``p``, or ``x`` kept as it is (``bits == 0``) when ``p`` would hold as many bytes or more:
    short rows padded to a block, tiny groups and narrow dtypes at 8 bits can cost more than the
    tensor (docs/GUIDE.md, "Limits and guarantees")."""
    if p.own_bytes < x.numel() * x.element_size():
        return p
    return Packed.kept(x, p.block_size, p.group_size)
