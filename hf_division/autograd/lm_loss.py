"""The causal-LM loss without its vocabulary-sized tensors held for backward.

Transformers computes a causal LM's loss as ``cross_entropy(lm_head(h).float(), labels)``:
autograd then keeps the ``(tokens, vocab)`` log-probabilities in float32 until backward, the
largest tensor a decoder's training step holds. :class:`CausalLMLossFn` computes the same loss
from the logits the model produced (so the forward does no extra work), keeps only the LM head's
input ``h``, the per-token log-sum-exp and the labels, and recomputes the logits in backward one
token chunk at a time (docs/DESIGN.md, "Causal-LM loss"). Nothing here compresses: the head's
input is one ``(tokens, hidden)`` tensor, small next to the vocabulary.

How the model is wired to it (its LM head tags the logits it returns, its loss function reads
the tag) is :func:`hf_division.patching.primitives.patch_causal_lm_loss`.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from hf_division.autograd.first_order import first_order
from hf_division.autograd.sdpa_backward import CHUNK_BYTES

__all__ = ["CausalLMLossFn", "causal_lm_loss", "head_of", "tag_logits"]

# id(logits) -> (weak ref to logits, LM head input, weak ref to the head, logits' version). Keyed by
# id and checked against a live reference, as the store does (docs/DESIGN.md, "One copy per tensor").
_HEADS: dict = {}


def tag_logits(logits: torch.Tensor, hidden: torch.Tensor, head: torch.nn.Module) -> None:
    """Record that ``logits == head(hidden)``, so the loss can be computed from ``hidden``."""
    key = id(logits)

    def drop(ref, key=key):
        if _HEADS.get(key, (None,))[0] is ref:
            del _HEADS[key]

    _HEADS[key] = (weakref.ref(logits, drop), hidden, weakref.ref(head), logits._version)


def head_of(logits: torch.Tensor):
    """``(hidden, head)`` if ``logits`` is the unmodified output of a tagged LM head, else None."""
    found = _HEADS.get(id(logits))
    if found is None or found[0]() is not logits or found[3] != logits._version:
        return None  # not a head's output, or changed in place since (e.g. scaled)
    head = found[2]()
    return None if head is None else (found[1], head)


def token_rows(vocab: int, itemsize: int = 4) -> int:
    """Tokens per chunk so that one chunk's float32 logits stay near ``CHUNK_BYTES`` x 8."""
    return max(16, (CHUNK_BYTES * 8) // max(1, vocab * itemsize))


def shifted_targets(labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """Next-token targets as ``ForCausalLMLoss`` builds them: ``labels`` shifted left, the last
    position ``ignore_index``; pre-shifted ``shift_labels`` (sequence parallelism) as given."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


class CausalLMLossFn(torch.autograd.Function):
    """``sum_t [lse(z_t) - z_t[y_t]] / denominator`` over the tokens whose target is not ignored,
    with ``z = logits = hidden @ weight.T + bias`` (computed by the caller, passed in detached).

    ``denominator``: the number of counted tokens (mean, as ``cross_entropy``), or the Trainer's
    ``num_items_in_batch`` (a sum divided by it, as Transformers' ``fixed_cross_entropy``).
    Backward rebuilds ``z`` per token chunk in the dtype the head computed it in (autocast's):
    ``dz = (softmax(z) - onehot(y)) * g / denominator``, then ``dh = dz @ W``, ``dW = dz.T @ h``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, logits, targets, ignore_index: int, num_items):
        flat = logits.detach().reshape(-1, logits.shape[-1])
        valid = targets != ignore_index
        safe = targets.masked_fill(~valid, 0)
        wide = torch.promote_types(flat.dtype, torch.float32)  # float32 as Transformers' loss; float64 stays
        lse = torch.empty(flat.shape[0], dtype=wide, device=flat.device)
        logp = torch.empty((flat.shape[0], 1), dtype=wide, device=flat.device)
        step = token_rows(flat.shape[1])
        for start in range(0, flat.shape[0], step):
            rows = slice(start, start + step)
            z = flat[rows].to(wide)
            # each row's log-probability as cross_entropy's log_softmax computes it (row by row, so a
            # chunk of rows gives the same values as the whole); the log-sum-exp backward needs
            # follows from it (one fused pass: torch.logsumexp took 2.6x as long; the logits are the
            # head's own output, finite, so the difference is too)
            target = safe[rows, None]
            picked = F.log_softmax(z, dim=-1).gather(1, target)
            logp[rows] = picked
            lse[rows] = (z.gather(1, target) - picked).squeeze(1)
        # the loss as Transformers' own, to the bit: nll_loss over the picked log-probabilities sums
        # them in the order and with the reduction cross_entropy's nll_loss uses over the full rows
        # (docs/DESIGN.md, "Causal-LM loss")
        picked_targets = torch.zeros_like(targets).masked_fill_(~valid, ignore_index)
        if num_items is None:
            denominator = valid.sum()
            loss = F.nll_loss(logp, picked_targets, ignore_index=ignore_index, reduction="mean")
        else:
            denominator = torch.as_tensor(num_items, device=flat.device)
            loss = F.nll_loss(logp, picked_targets, ignore_index=ignore_index, reduction="sum") / denominator
        ctx.save_for_backward(hidden, weight, bias, lse, safe, valid, denominator)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    @first_order
    def backward(ctx, grad):
        hidden, weight, bias, lse, safe, valid, denominator = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = ctx.logits_dtype  # what the head computed in: the autocast dtype, else the weight's
        w = weight.to(dtype)  # cast once, not per chunk
        b = None if bias is None else bias.to(dtype)
        h2 = hidden.reshape(-1, hidden.shape[-1])
        wide = lse.dtype
        scale = (grad / denominator).to(wide)
        gh = torch.empty(h2.shape, dtype=hidden.dtype, device=h2.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_w else None
        gb = torch.zeros(weight.shape[0], dtype=wide, device=weight.device) if need_b else None
        step = token_rows(weight.shape[0])
        for start in range(0, h2.shape[0], step):
            rows = slice(start, start + step)
            h = h2[rows].to(dtype)
            dz = F.linear(h, w, b).to(wide).sub_(lse[rows, None]).exp_()
            dz[torch.arange(dz.shape[0], device=dz.device), safe[rows]] -= 1.0
            dz.mul_((valid[rows] * scale)[:, None])
            if gw is not None:
                gw.addmm_(dz.t(), h.to(wide))
            if gb is not None:
                gb += dz.sum(0)
            if gh is not None:
                gh[rows] = dz.to(dtype).matmul(w)
        out_h = gh.view(hidden.shape) if gh is not None else None
        out_w = gw.to(weight.dtype) if gw is not None else None
        out_b = gb.to(bias.dtype) if gb is not None else None
        return out_h, out_w, out_b, None, None, None, None


def causal_lm_loss(logits, labels, ignore_index: int = -100, shift_labels=None, num_items_in_batch=None):
    """``ForCausalLMLoss`` of tagged ``logits`` through :class:`CausalLMLossFn`; None if untagged."""
    found = head_of(logits)
    if found is None:
        return None
    hidden, head = found
    targets = shifted_targets(labels, ignore_index, shift_labels).to(logits.device)
    return CausalLMLossFn.apply(hidden, head.weight, head.bias, logits, targets, ignore_index, num_items_in_batch)
