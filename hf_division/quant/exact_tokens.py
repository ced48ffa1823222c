"""Tokens held exact beside the codes, split off before the encode: outlier tokens (``outlier_ratio``)
and leading tokens (``exact_tokens``), at a data-dependent count on the CPU or at a fixed size
elsewhere. Pure tensor functions over the ``(M, T, C)`` float32 view that
:func:`hf_division.compress.pipeline.compress` encodes: each returns what is left to compress, the exact
rows and their index among the ``M*T`` tokens (docs/DESIGN.md, "Compressor").
"""
from __future__ import annotations

import torch



def split_outliers(x3: torch.Tensor, ratio: float, dtype: torch.dtype, absmax: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None):
    """``(x3 with its outlier tokens zeroed, those tokens in dtype, their index)``; x3 unchanged
    (and no copy) when there are none. ``absmax``: the score, max |x| per token, if a kernel
    computed it (:func:`token_absmax` otherwise). ``scale``: as in :func:`zero_rows`."""
    row_index = outlier_tokens(x3, ratio, absmax)
    if row_index is None:
        return x3, None, None
    return (*zero_rows(x3, row_index, dtype, scale), row_index)


def zero_rows(x3: torch.Tensor, row_index: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None):
    """``(x3 with the tokens row_index zeroed, a copy; those tokens' rows)``. The rows are in
    ``dtype``, or, with ``scale`` (``(M*T,)``, what the encode divides each token by), ``(x / s) * s``:
    what dividing first and multiplying the rebuild gives there (``compress_row_scaled``)."""
    flat = x3.reshape(-1, x3.shape[2])
    rows = _exact_rows(flat, row_index, dtype, scale)
    return flat.index_fill(0, row_index, 0.0).view(x3.shape), rows  # a copy: x3 may view the input


def _exact_rows(flat: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None):
    """The tokens ``index`` of ``flat`` ``(M*T, C)`` as held exact: in ``dtype``, or ``(x / s) * s``
    with ``scale`` (:func:`zero_rows`)."""
    if scale is None:
        return flat[index].to(dtype)
    picked = scale[index].view(-1, 1)
    return flat[index] / picked * picked


def split_leading(x3: torch.Tensor, k: int, dtype: torch.dtype, rows, row_index, scale: torch.Tensor | None = None):
    """``x3`` with the first ``k`` tokens of each of its ``M`` rows kept exact (added to the
    outlier rows already split off, if any) and replaced, in what is compressed, by token ``k``:
    a copy of a neighbour moves neither its block's LFC much nor any group's range (a zeroed row
    would put ``-mean`` of its block into the HFC, widening the range of smooth tensors).
    ``scale`` (``(M*T,)``): the rows as :func:`zero_rows` holds them for a row-scaled encode."""
    m, t, c = x3.shape
    lead = (torch.arange(m, device=x3.device)[:, None] * t + torch.arange(k, device=x3.device)).reshape(-1)
    if row_index is not None:  # outliers already zeroed in x3: take their exact rows from ``rows``
        fresh = ~torch.isin(lead, row_index)
        lead = lead[fresh]
    new_rows = _exact_rows(x3.reshape(-1, c), lead, dtype, scale)
    x3 = x3.clone() if row_index is None else x3  # x3 may view the input
    x3[:, :k] = x3[:, k : k + 1]
    if row_index is None:
        return x3, new_rows, lead
    return x3, torch.cat([rows, new_rows]), torch.cat([row_index, lead])


def split_static(x3: torch.Tensor, ratio: float, k: int, dtype: torch.dtype, absmax: torch.Tensor | None = None):
    """What :func:`split_outliers` then :func:`split_leading` do, at a fixed size: ``(x3 to
    compress, rows, row_index, row_keep)``. Every outlier candidate's exact row is held; the
    selected ones are zeroed in what is compressed, and ``row_keep`` marks them (a candidate that is
    also a leading token is marked too, so both writes of that token in ``decompress`` agree)."""
    m, t, c = x3.shape
    flat = x3.reshape(-1, c)
    index, keep, out = [], [], flat
    lead = (torch.arange(m, device=x3.device)[:, None] * t + torch.arange(k, device=x3.device)).reshape(-1) if k else None
    if ratio > 0:
        cand, selected = outlier_candidates(x3, ratio, absmax)
        picked = flat[cand]
        out = flat.index_copy(0, cand, torch.where(selected[:, None], torch.zeros_like(picked), picked))
        index.append(cand)
        keep.append(selected if lead is None else selected | torch.isin(cand, lead))
    if lead is not None:
        out = out.clone() if out is flat else out  # x3 may view the input
        out3 = out.view(m, t, c)
        out3[:, :k] = out3[:, k : k + 1]
        index.append(lead)
        keep.append(torch.ones_like(lead, dtype=torch.bool))
    row_index = torch.cat(index)
    return out.view(m, t, c), flat[row_index].to(dtype), row_index, torch.cat(keep)


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
