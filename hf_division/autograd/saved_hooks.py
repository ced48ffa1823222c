"""Compress whatever autograd saves inside a region, through PyTorch's saved-tensor hooks.

The dedicated ops (:mod:`hf_division.autograd.ops`) know what each op needs for backward; code that does
not go through them (a mixture-of-experts block indexing 3-D expert weights, an attention module
that computes its scores inline, a fused gated MLP) still saves tensors through autograd.
:func:`compressed_saves` installs ``torch.autograd.graph.saved_tensors_hooks`` (PyTorch docs,
"Hooks for saved tensors") so each of them goes through the same store as the ops: compressed
once per live tensor (:func:`hf_division.autograd.store.keep`), rebuilt when backward unpacks it.

Kept as they are: parameters and views of them (the optimizer holds them anyway), other leaves
(the caller's inputs), non-float tensors (indices, masks) and anything saved during a checkpoint's
recomputation (the region itself is entered only in training). What is kept raw is reported to
the byte accounting, since an enclosing measurement hook does not see saves a nested hook takes.
"""
from __future__ import annotations

import torch

from hf_division.autograd.accounting import account_tensors
from hf_division.config import DivisionConfig
from hf_division.autograd.store import Entry, in_recomputation, keep


def _is_parameter_like(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` saved by a matmul)."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def compressed_saves(config: DivisionConfig, kind: str):
    """A context manager: tensors autograd saves inside it are kept compressed as ``kind``.
    Enter it only for a training forward (the caller checks ``store.active()`` and the bits)."""

    def pack(t: torch.Tensor):
        if _is_parameter_like(t):
            return t
        # not ``store.active()``: grad mode is off inside a custom Function's forward, where
        # kernels wrapped as Functions (``grouped_mm`` experts) save their tensors
        if in_recomputation() or t.is_leaf or not t.is_floating_point():
            account_tensors([t], kind)
            return t
        return keep(t, kind, config)

    def unpack(held):
        return held.take() if isinstance(held, Entry) else held

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
