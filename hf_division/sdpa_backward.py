"""Backward of ``scaled_dot_product_attention`` written out, for the recomputation in
:class:`~hf_division.ops.AttentionFn`.

Recomputing attention under autograd (what AttentionFn does in general) runs the whole forward
again, ``P @ V`` included, and then its backward. Only the gradients are wanted, so on CPU the
recomputation intercepts ``F.scaled_dot_product_attention`` (a ``TorchFunctionMode``) and returns
a placeholder whose backward computes ``dq, dk, dv`` directly from ``q, k, v``, the mask and the
recorded dropout bits: the output product is skipped and the softmax is formed once.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_softmax = getattr(torch, "_safe_softmax", None)  # rows with every key masked give 0, as sdpa's math path


def _safe_softmax(s):
    return _softmax(s, -1) if _softmax is not None else torch.softmax(s, -1).nan_to_num_(0.0)


def _may_mask_whole_rows(attn_mask, tq_tk) -> bool:
    """Whether some query row may have every key masked (then sdpa gives 0 there, not NaN). Checked
    on the mask, which broadcasts and is smaller than the scores: the safe softmax is several times slower."""
    if attn_mask is None:  # sdpa's causal mask is top-left aligned: every row keeps key 0
        return False
    blocked = attn_mask.logical_not() if attn_mask.dtype == torch.bool else attn_mask == float("-inf")
    return bool(blocked.all(-1).any()) if attn_mask.shape[-1] == tq_tk[1] else True


#: bytes of float32 scores per chunk: the T x T intermediates of one chunk stay in cache. One pass
#: over the whole batch let them spill to memory between the five passes that touch them.
CHUNK_BYTES = 4 << 20


def sdpa_grads(q, k, v, dout, attn_mask=None, keep=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``(dq, dk, dv)`` of ``out = sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)`` for ``dout``,
    computed over chunks of the leading (batch) dimension (:func:`_sdpa_grads_block`)."""
    n = q.shape[0] if q.dim() == 4 else 1
    per_item = q[0].numel() // q.shape[-1] * k.shape[-2] * 4 if n > 1 else 0
    step = max(1, CHUNK_BYTES // per_item) if per_item else n

    def part(t, i):  # batch-sized tensors are sliced; broadcast ones (mask of batch 1) passed whole
        return t[i : i + step] if t is not None and t.dim() == 4 and t.shape[0] == n else t

    # each chunk's gradients written into its rows of the whole ones: a cat would copy them again
    grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    for i in range(0, n, step):
        _sdpa_grads_block(part(q, i), part(k, i), part(v, i), part(dout, i), part(attn_mask, i), part(keep, i),
                          dropout_p, is_causal, scale, enable_gqa, out=[part(g, i) for g in grads])
    return grads


def _sdpa_grads_block(q, k, v, dout, attn_mask, keep, dropout_p, is_causal, scale, enable_gqa, out):
    """``(dq, dk, dv)`` of ``out = sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)`` for ``dout``,
    written into ``out`` (three contiguous tensors shaped as q, k, v, in their dtypes).

    q ``(..., H, Tq, E)``, k ``(..., Hk, Tk, E)``, v ``(..., Hk, Tk, Ev)``, dout ``(..., H, Tq, Ev)``;
    ``attn_mask`` bool (True = attend) or additive float, broadcastable to ``(..., H, Tq, Tk)``;
    ``keep``: the dropout keep mask ``(..., H, Tq, Tk)`` (0/1 uint8), or None without dropout.
    ``enable_gqa``: ``H`` a multiple of ``Hk`` (query head i uses kv head ``i // (H // Hk)``).
    Computed in float32: float32 targets take the products directly (``out=``), others a
    converted copy.
    """
    shape = q.shape
    rep = q.shape[-3] // k.shape[-3]
    # contiguous once: each product below would otherwise copy a strided (B, T, H, d) view again
    q, dout = _fold_heads(q.float(), rep), _fold_heads(dout.float(), rep)
    k, v = k.float().contiguous(), v.float().contiguous()
    scale = 1.0 / math.sqrt(shape[-1]) if scale is None else scale
    s = torch.matmul(q * scale, k.transpose(-2, -1))  # scaling q: a T x d pass, not T x T
    if is_causal:
        above = torch.ones(shape[-2], k.shape[-2], dtype=torch.bool, device=s.device).triu_(1)
        s.add_(_fold_mask(_additive(above), rep, shape[-2]))
    whole_rows = _may_mask_whole_rows(attn_mask, (shape[-2], k.shape[-2]))
    if attn_mask is not None:
        s.add_(_fold_mask(_additive(attn_mask.logical_not()) if attn_mask.dtype == torch.bool else attn_mask, rep,
                          shape[-2]))
    p = _safe_softmax(s) if whole_rows else torch.softmax(s, -1)
    del s
    ds_scale = scale
    direct = all(t.dtype == torch.float32 for t in out)
    dq_out, dk_out, dv_out = (out[0].view(q.shape), out[1], out[2]) if direct else (None, None, None)
    if keep is not None:  # out = (P * keep / (1 - p_drop)) @ V: the constant is folded into the products
        c = 1.0 / (1.0 - dropout_p)
        keep = _fold_heads(keep, rep).to(p.dtype)  # once: two products with a uint8 mask would each convert it
        dv = _matmul((p * keep).transpose(-2, -1), dout, dv_out).mul_(c)
        dp = torch.matmul(dout, v.transpose(-2, -1)).mul_(keep)
        ds_scale = scale * c
    else:
        dv = _matmul(p.transpose(-2, -1), dout, dv_out)
        dp = torch.matmul(dout, v.transpose(-2, -1))
    ds = torch._softmax_backward_data(dp, p, -1, torch.float32)
    del dp, p
    dq = _matmul(ds, k, dq_out).mul_(ds_scale)
    dk = _matmul(ds.transpose(-2, -1), q, dk_out).mul_(ds_scale)
    if not direct:
        for target, g in zip(out, (dq.reshape(shape), dk, dv)):
            target.copy_(g)
    return out


def _additive(blocked: torch.Tensor) -> torch.Tensor:
    """A bool mask (True = masked) as the float32 bias that masks by addition: -inf there, 0 elsewhere.

    Why: ``masked_fill_`` of the ``T x T`` scores was the slowest op of this backward after the
    products; adding a broadcast float bias is one vectorized pass, and the bias is built on the
    mask's own (broadcast, per-head-free) shape (docs/DESIGN.md, "Mechanism"). For finite scores
    the softmax is the same (``x + 0`` is ``x``, ``x - inf`` is ``-inf``); a NaN or infinite score
    at a masked position (a non-finite key, whose forward output is non-finite too) spreads to its
    row instead of being replaced."""
    return torch.zeros(blocked.shape, dtype=torch.float32, device=blocked.device).masked_fill_(blocked, float("-inf"))


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)


def _fold_heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """``(..., H, T, X)`` as ``(..., H // rep, rep * T, X)``, contiguous: the ``rep`` query heads
    that share one key/value head (grouped-query attention) become one taller matrix, so each
    product runs against that head's keys as they are (no repeated copies of k and v) and the
    products ``dk``, ``dv`` sum over the group as they accumulate."""
    return t.unflatten(-3, (-1, rep)).flatten(-3, -2).contiguous()


def _fold_mask(mask: torch.Tensor, rep: int, tq: int) -> torch.Tensor:
    """A mask broadcastable to ``(..., H, tq, Tk)`` laid out for :func:`_fold_heads`'s
    ``(..., H // rep, rep * tq, Tk)``: its query rows repeated for each head of a group."""
    if rep == 1 or mask.dim() < 2:
        return mask
    per_head = mask.dim() >= 3 and mask.shape[-3] > 1
    if not per_head and mask.shape[-2] == 1:  # one row for every query: broadcasts as it is
        return mask
    grouped = mask.unflatten(-3, (-1, rep)) if per_head else mask.unsqueeze(-3)  # (..., G, rep or 1, tq or 1, Tk)
    return grouped.expand(*grouped.shape[:-3], rep, tq, grouped.shape[-1]).flatten(-3, -2)


class _Placeholder(torch.autograd.Function):
    """Stands for sdpa's output in the recomputation: no value, only the backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, keep, dropout_p, is_causal, scale, enable_gqa):
        ctx.save_for_backward(q, k, v)
        ctx.args = mask, keep, dropout_p, is_causal, scale, enable_gqa
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = sdpa_grads(q, k, v, dout, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


class GradientOnlySDPA(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :class:`_Placeholder` where it can: CPU tensors,
    a mask that needs no gradient, and dropout bits recorded by ``masks`` (a replaying
    :class:`hf_division.dropout.DropoutMasks`: its ``next_mask`` is this call's). Anything else runs
    as it is."""

    def __init__(self, masks):
        super().__init__()
        self.masks = masks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            routed = self._route(*args, **kwargs)
            if routed is not None:
                return routed
        return func(*args, **kwargs)

    def _route(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "cpu" or (isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad):
            return None
        keep = None
        if dropout_p > 0:
            keep = self.masks.next_mask((*query.shape[:-1], key.shape[-2]))
            if keep is None:
                return None
        return _Placeholder.apply(query, key, value, attn_mask, keep, dropout_p, is_causal, scale, enable_gqa)
