"""The batch's padding positions, known within a training forward, and the saved tensors' padding
tokens that are exactly zero, rebuilt as zeros (docs/DESIGN.md, "Policy": zero padding tokens)."""
from __future__ import annotations

import contextlib
import threading

import torch

from hf_division.kernels.triton_codec import device_path


class _Padding(threading.local):
    """The padding positions ``(batch index, token index)`` of the batch whose training forward
    runs in this thread (None: no padding, or not known)."""

    positions = None
    shape = None


_padding = _Padding()


@contextlib.contextmanager
def padding_of(attention_mask):
    """Within a training forward: the batch's padding positions, from its 2-D attention mask (0 =
    padding), for :func:`zero_padding_tokens`. Read on the CPU's path only, where it costs no sync."""
    positions = shape = None
    if (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and not device_path(attention_mask.device)
            and not attention_mask.dtype.is_floating_point):
        pads = (attention_mask == 0).nonzero()
        if len(pads):
            positions, shape = (pads[:, 0], pads[:, 1]), tuple(attention_mask.shape)
    before = _padding.positions, _padding.shape
    _padding.positions, _padding.shape = positions, shape
    try:
        yield
    finally:
        _padding.positions, _padding.shape = before


def zero_padding_tokens(t: torch.Tensor):
    """``(batch index, token index, token dim)`` of the padding tokens whose values in ``t`` are all
    exactly zero, or None. Why: a padding token whose embedding is zero (``padding_idx``) stays zero
    through the layers, a norm's Jacobian there is ``1/sqrt(eps)``, and under left padding the last
    padding token predicts the first real one: its gradient is then orders of magnitude above the
    real tokens', and quantization noise in place of its zeros moved whole weight gradients (the
    matrix test's left-padded Gemma 3, cosine 0.84). Rebuilt as zeros, they cost no error; found
    among the padding positions only, so an unpadded batch pays nothing."""
    if _padding.positions is None or t.dim() < 3:
        return None
    batch, tokens = _padding.shape
    dim = next((d for d in (1, 2) if t.shape[0] == batch and t.shape[d] == tokens), None)
    if dim is None:
        return None
    b, i = _padding.positions
    # one element per padding token first: where it is not zero (padding by an end-of-text token,
    # the common case) the token is not read further, so a padded batch pays a gather of scalars
    rest = (0,) * (t.dim() - 1 - dim)
    first = t[(b, i, *rest)] if dim == 1 else t[(b, 0, i, *rest)]
    maybe = (first == 0).nonzero().squeeze(1)
    if not len(maybe):
        return None
    b, i = b[maybe], i[maybe]
    rows = t[b, i] if dim == 1 else t[b, :, i]
    zero = (rows == 0).flatten(1).all(1)
    if not zero.any():
        return None
    return b[zero], i[zero], dim


def zero_tokens(value: torch.Tensor, b: torch.Tensor, i: torch.Tensor, dim: int) -> torch.Tensor:
    if dim == 1:
        value[b, i] = 0
    else:
        value[b, :, i] = 0
    return value
