"""Backward of ``scaled_dot_product_attention`` written out, for the recomputation in
:class:`~hf_division.autograd.ops.AttentionFn`.

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


def _attended(attn_mask: torch.Tensor) -> torch.Tensor:
    """Where a bool (True = attend) or additive float mask lets a query see a key."""
    return attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")


def _may_mask_whole_rows(attn_mask, tq_tk) -> bool:
    """Whether some query row may have every key masked (then sdpa gives 0 there, not NaN). Checked
    on the mask, which broadcasts and is smaller than the scores: the safe softmax is several times slower."""
    if attn_mask is None:  # sdpa's causal mask is top-left aligned: every row keeps key 0
        return False
    return bool(_attended(attn_mask).logical_not().all(-1).any()) if attn_mask.shape[-1] == tq_tk[1] else True


#: bytes of float32 scores per chunk: the T x T intermediates of one chunk stay in cache. One pass
#: over the whole batch let them spill to memory between the five passes that touch them.
CHUNK_BYTES = 4 << 20

#: query tokens per block at most (docs/DESIGN.md, "Mechanism"): a chunk holds one block's scores
#: per batch item, so long sequences stay in cache too.
QUERY_BLOCK = 128

#: query tokens per block where neighbouring blocks attend different keys (a causal mask): each
#: block leaves out the keys all its queries have masked, which smaller blocks do more often.
SKIP_BLOCK = 32


def sdpa_grads(q, k, v, dout, attn_mask=None, keep=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``(dq, dk, dv)`` of ``out = sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)`` for ``dout``,
    computed over chunks of the leading (batch) dimension (:func:`_sdpa_grads_block`)."""
    n = q.shape[0] if q.dim() == 4 else 1
    rows = q[0].numel() // q.shape[-1] // q.shape[-2] * min(q.shape[-2], QUERY_BLOCK) if n > 1 else 0
    step = max(1, CHUNK_BYTES // (rows * k.shape[-2] * 4)) if rows else n

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
    written into ``out`` (three contiguous tensors shaped as q, k, v, in their dtypes), one block
    of queries at a time (:func:`query_blocks`); ``dk`` and ``dv`` sum over the blocks.

    q ``(..., H, Tq, E)``, k ``(..., Hk, Tk, E)``, v ``(..., Hk, Tk, Ev)``, dout ``(..., H, Tq, Ev)``;
    ``attn_mask`` bool (True = attend) or additive float, broadcastable to ``(..., H, Tq, Tk)``;
    ``keep``: the dropout keep mask ``(..., H, Tq, Tk)`` (0/1 uint8), or None without dropout.
    ``enable_gqa``: ``H`` a multiple of ``Hk`` (query head i uses kv head ``i // (H // Hk)``).
    Computed in float32: float32 ``dk``, ``dv`` targets take the products directly, others a
    converted copy.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    k, v = k.float().contiguous(), v.float().contiguous()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    c = 1.0 / (1.0 - dropout_p) if keep is not None else 1.0  # out = (P * keep * c) @ V
    safe = _may_mask_whole_rows(attn_mask, (tq, tk))
    dk, dv = (o if o.dtype == torch.float32 else torch.empty(o.shape, dtype=torch.float32, device=o.device)
              for o in out[1:])
    rep, diagonals = q.shape[-3] // k.shape[-3], {}
    # the last block first: under a causal mask it attends the most keys, so its products write dk and dv whole
    for i, (t0, t1, kend) in enumerate(reversed(query_blocks(attn_mask, is_causal, tq, tk))):
        bias = _block_bias(attn_mask, is_causal, rep, (t0, t1, kend), diagonals)
        kept = None if keep is None else keep[..., t0:t1, :kend]
        direct = rep == 1 and t1 - t0 == tq and out[0].dtype == torch.float32  # dq folded is dq itself
        dq = _block_grads(q[..., t0:t1, :], dout[..., t0:t1, :], k[..., :kend, :], v[..., :kend, :], bias, kept,
                          safe, scale, (dk, dv, i == 0, out[0] if direct else None)).mul_(scale * c)
        if not direct:
            out[0][..., t0:t1, :].copy_(_unfold_heads(dq, rep))
    dk.mul_(scale * c)
    if keep is not None:
        dv.mul_(c)
    for target, g in zip(out[1:], (dk, dv)):
        if target is not g:
            target.copy_(g)
    return out


def query_blocks(attn_mask, is_causal, tq: int, tk: int) -> list[tuple[int, int, int]]:
    """``[(t0, t1, kend)]``: blocks of queries and the keys ``0 .. kend - 1`` each attends. Keys
    after ``kend`` are masked for every query of the block, so their probabilities are 0 and they
    add nothing to any gradient: sdpa's causal mask (top-left aligned: query t attends keys up to
    t) ends a block's keys at ``t1``; a mask at its queries' last attended key over the batch and
    heads. Blocks of :data:`SKIP_BLOCK` queries, joined up to :data:`QUERY_BLOCK` where they attend
    the same keys."""
    last = _last_attended(attn_mask, tq, tk)
    blocks = []
    for t0 in range(0, tq, SKIP_BLOCK):
        t1 = min(tq, t0 + SKIP_BLOCK)
        kend = min(tk, t1) if is_causal else tk
        if last is not None:  # at least one key: a block whose keys are all masked still runs its (safe) softmax
            kend = min(kend, max(1, max(last[t0:t1])))
        if blocks and blocks[-1][2] == kend and t1 - blocks[-1][0] <= QUERY_BLOCK:
            t0 = blocks.pop()[0]
        blocks.append((t0, t1, kend))
    return blocks


def _last_attended(attn_mask, tq: int, tk: int) -> list[int] | None:
    """Per query, one past its last key that some batch item or head attends (0: none); None where
    the mask does not limit keys this way (no mask, or one that broadcasts over keys)."""
    if attn_mask is None or attn_mask.shape[-1] != tk:
        return None
    allowed = _attended(attn_mask)
    anywhere = allowed.reshape(-1, *allowed.shape[-2:]).any(0)  # (Tq or 1, Tk)
    last = (anywhere * torch.arange(1, tk + 1, device=anywhere.device)).amax(-1)
    return last.expand(tq).tolist()


def _block_bias(attn_mask, is_causal, rep: int, block: tuple[int, int, int], diagonals: dict) -> list:
    """``[(k0, bias)]``: additive biases of one query block's scores, each for keys ``k0`` onwards,
    folded as its queries (:func:`_fold_heads`). Under the causal mask only keys ``t0 .. kend - 1``
    of block ``t0 .. t1`` can be masked; that corner depends only on its shape, so blocks of one
    shape share it (``diagonals``)."""
    t0, t1, kend = block
    biases = []
    if is_causal and kend - t0 > 1:
        shape = (t1 - t0, kend - t0)
        if shape not in diagonals:
            above = torch.arange(shape[1]) > torch.arange(shape[0]).unsqueeze(-1)
            diagonals[shape] = _fold_mask(_additive(above), rep, shape[0])
        biases.append((t0, diagonals[shape]))
    if attn_mask is not None:
        m = attn_mask[..., t0:t1, :] if attn_mask.dim() >= 2 and attn_mask.shape[-2] > 1 else attn_mask
        m = m[..., :kend] if m.shape[-1] > 1 else m
        biases.append((0, _fold_mask(_additive(m.logical_not()) if m.dtype == torch.bool else m, rep, t1 - t0)))
    return biases


def _block_grads(q, dout, k, v, bias: list, keep, safe: bool, scale: float, acc) -> torch.Tensor:
    """``dq`` of one block of queries (scores plus :func:`_block_bias`'s biases), float32, unscaled
    (times ``scale`` and the dropout constant to come), folded as :func:`_fold_heads` (into
    ``acc[3]`` where given); its share of ``dk`` and ``dv`` (as unscaled) added into, or for the
    first block ``acc[2]`` written as, ``acc[0]`` and ``acc[1]``, over their first keys."""
    rep = q.shape[-3] // k.shape[-3]
    q, dout = _fold_heads(q.float(), rep), _fold_heads(dout.float(), rep)
    s = torch.matmul(q * scale, k.transpose(-2, -1))  # scaling q: a T x d pass, not T x T
    for k0, b in bias:
        s[..., k0:].add_(b)
    p = _safe_softmax(s) if safe else torch.softmax(s, -1)
    del s
    dp = torch.matmul(dout, v.transpose(-2, -1))
    if keep is not None:  # the dropout constant is folded in afterwards (_sdpa_grads_block)
        keep = _fold_heads(keep, rep).to(p.dtype)  # once: two products with a uint8 mask would each convert it
        _accumulate((p * keep).transpose(-2, -1), dout, acc[1], acc[2])
        dp.mul_(keep)
    else:
        _accumulate(p.transpose(-2, -1), dout, acc[1], acc[2])
    ds = torch._softmax_backward_data(dp, p, -1, torch.float32)
    del dp, p
    _accumulate(ds.transpose(-2, -1), q, acc[0], acc[2])
    return torch.matmul(ds, k) if acc[3] is None else torch.matmul(ds, k, out=acc[3])


def _accumulate(a: torch.Tensor, b: torch.Tensor, total: torch.Tensor, first: bool) -> None:
    """``total[..., :n, :] += a @ b`` for ``a @ b`` of ``n`` rows; the first block sets ``total`` (its
    rows past ``n`` to 0), through the product itself where it covers all of ``total``."""
    n = a.shape[-2]
    if first and n == total.shape[-2]:
        torch.matmul(a, b, out=total)
        return
    if first:
        total.zero_()
    total[..., :n, :].add_(torch.matmul(a, b))


def _additive(blocked: torch.Tensor) -> torch.Tensor:
    """A bool mask (True = masked) as the float32 bias that masks by addition: -inf there, 0 elsewhere.

    Why: ``masked_fill_`` of the ``T x T`` scores was the slowest op of this backward after the
    products; adding a broadcast float bias is one vectorized pass, and the bias is built on the
    mask's own (broadcast, per-head-free) shape (docs/DESIGN.md, "Mechanism"). For finite scores
    the softmax is the same (``x + 0`` is ``x``, ``x - inf`` is ``-inf``); a NaN or infinite score
    at a masked position (a non-finite key, whose forward output is non-finite too) spreads to its
    row instead of being replaced."""
    return torch.zeros(blocked.shape, dtype=torch.float32, device=blocked.device).masked_fill_(blocked, float("-inf"))


def _fold_heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """``(..., H, T, X)`` as ``(..., H // rep, T * rep, X)``, contiguous, row ``t * rep + i`` holding
    query ``t`` of head ``i`` of a group: the ``rep`` query heads that share one key/value head
    (grouped-query attention) become one taller matrix, so each product runs against that head's
    keys as they are (no repeated copies of k and v) and the products ``dk``, ``dv`` sum over the
    group as they accumulate. Rows of one query stay together, so a block of queries is a block
    of rows."""
    return t.unflatten(-3, (-1, rep)).transpose(-3, -2).flatten(-3, -2).contiguous()


def _unfold_heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """:func:`_fold_heads` undone, as a view: ``(..., G, T * rep, X)`` to ``(..., G * rep, T, X)``."""
    return t.unflatten(-2, (-1, rep)).transpose(-3, -2).flatten(-4, -3)


def _fold_mask(mask: torch.Tensor, rep: int, tq: int) -> torch.Tensor:
    """A mask broadcastable to ``(..., H, tq, Tk)`` laid out for :func:`_fold_heads`'s
    ``(..., H // rep, tq * rep, Tk)``: each query row repeated for the heads of a group."""
    if rep == 1 or mask.dim() < 2:
        return mask
    per_head = mask.dim() >= 3 and mask.shape[-3] > 1
    if not per_head and mask.shape[-2] == 1:  # one row for every query: broadcasts as it is
        return mask
    if per_head:  # (..., G, rep, tq or 1, Tk) -> (..., G, tq, rep, Tk)
        grouped = mask.unflatten(-3, (-1, rep))
        grouped = grouped.expand(*grouped.shape[:-2], tq, grouped.shape[-1]).transpose(-3, -2)
    else:  # (..., tq, 1, Tk) -> (..., tq, rep, Tk)
        grouped = mask.unsqueeze(-2)
        grouped = grouped.expand(*grouped.shape[:-2], rep, grouped.shape[-1])
    return grouped.flatten(-3, -2)


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
    :class:`hf_division.autograd.dropout.DropoutMasks`: its ``next_mask`` is this call's). Anything else runs
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
            if self.masks is None:  # no draws recorded (none expected): recomputed as it is
                return None
            keep = self.masks.next_mask((*query.shape[:-1], key.shape[-2]))
            if keep is None:
                return None
        return _Placeholder.apply(query, key, value, attn_mask, keep, dropout_p, is_causal, scale, enable_gqa)
