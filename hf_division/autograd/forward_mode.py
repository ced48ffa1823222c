"""The mode a patched model's training forward runs under (:func:`hf_division.patching.primitives.patch_root`):
a ``TorchFunctionMode`` that sees the torch calls the model's own code makes between division's
patched modules, where no Function of ours runs."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hf_division.autograd.dropout import DropoutFn
from hf_division.autograd.store import bookkeeping, derive, lookup

#: tensor methods that may return a copy of the tensor in another dtype
CASTS = frozenset((torch.Tensor.to, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double))


class ForwardMode(TorchFunctionMode):
    """(1) Routes ``F.dropout`` (what ``nn.Dropout`` calls too) to :class:`DropoutFn` where
    autograd would keep a mask (training, grad enabled, input requiring grad, not in place), if
    ``dropout_bits``; (2) makes a dtype cast of a held tensor derivable from what holds it
    (:func:`derive_cast`)."""

    def __new__(cls, *args, **kwargs):
        # Under torch.compile, Dynamo mis-traces some models inside any TorchFunctionMode (Llama: a
        # tensor's ``.device`` read back as its shape); there, dropout is left to the compiler.
        if torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return super().__new__(cls)

    def __init__(self, dropout_bits: bool = True):
        super().__init__()
        self.dropout_bits = dropout_bits
        self.routed = 0  # dropouts routed and casts made derivable under this mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout and self.dropout_bits and torch.is_grad_enabled():
            bound = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
            x, p = bound["input"], bound.get("p", 0.5)
            if bound.get("training", True) and not bound.get("inplace", False) and 0 < p < 1 and x.requires_grad:
                self.routed += 1
                return DropoutFn.apply(x, p)
        out = func(*args, **kwargs)
        if func in CASTS and torch.is_grad_enabled() and derive_cast(args[0], out):
            self.routed += 1
        return out


_STACK = tuple(getattr(torch._C, name, None) for name in (
    "_len_torch_function_stack", "_get_function_stack_at", "_pop_torch_function_stack", "_push_on_torch_function_stack"))


def outside(apply: Callable) -> Callable:
    """An autograd Function's ``apply`` run with :class:`ForwardMode` popped off the mode stack where
    it is the innermost mode (a mode entered inside the model's forward stays).

    Why: a Function's forward runs with grad mode off, where the mode routes nothing, yet each
    torch call and tensor attribute read in it (the layer's own forward, the norm's and the
    gated product's ops) still paid the mode's Python handler: host time on a GPU, where the host
    sets the pace of a small layer's step (docs/DESIGN.md, "On a GPU")."""
    length, at, pop, push = _STACK
    if push is None:
        return apply

    def run(*args, **kwargs):
        n = length()
        if n and type(at(n - 1)) is ForwardMode:
            mode = pop()
            try:
                return apply(*args, **kwargs)
            finally:
                push(mode)
        return apply(*args, **kwargs)

    run.__name__, run.__doc__, run.__wrapped__ = apply.__name__, apply.__doc__, apply
    return run


@bookkeeping
def derive_cast(x, out) -> bool:
    """``out``, ``x`` cast to another floating dtype, becomes derivable from ``x``'s entry where
    ``x`` is held, so a consumer that keeps ``out`` stores nothing new; whether it did.

    Why: PEFT casts LoRA's input to the adapter's float32 under bf16 autocast (``_cast_input_dtype``).
    ``lora_A`` of ``down_proj`` then kept a second, 4-bit copy of the gated product that the MLP
    derives from its gate and up inputs, and ``lora_A`` of ``o_proj`` one of the attention output:
    more bytes, and the linear kind's error instead of the rebuild's (docs/DESIGN.md, "One copy per tensor, keyed on a live reference")."""
    if (out is x or not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor)
            or not x.is_floating_point() or not out.is_floating_point() or out.dtype == x.dtype
            or out.shape != x.shape or out.device != x.device or lookup(out) is not None):
        return False
    parent = lookup(x)
    if parent is None:
        return False
    derive(out, (parent,), lambda t, dtype=out.dtype: t.to(dtype))
    return True
