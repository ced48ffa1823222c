"""Backward functions that refuse to be differentiated again, naming hf-division.

The ops keep compressed copies of what they save and compute their backward from rebuilt tensors
outside autograd (with grad mode off, as ``once_differentiable`` runs them), so a second
derivative through them does not exist.
PyTorch alone would either raise an error that does not say why (``backward(create_graph=True)``)
or, for ``torch.autograd.grad(..., create_graph=True)`` followed by a backward of the result, let
the second-order terms through these ops vanish. A backward that runs with grad mode on is one
asked to build a graph (``create_graph=True``): it raises instead (docs/GUIDE.md, "Limits and guarantees").

They also run with autocast off: each chooses its dtypes itself (float32 accumulators written with
``out=``), and a ``backward()`` called inside the forward's ``torch.autocast`` block, which PyTorch
allows, would otherwise recast their products to bfloat16 against float32 outputs (issue 41). A
recomputation in backward re-enters the forward's autocast state explicitly (``autocast_as``).
"""
from __future__ import annotations

import contextlib
import functools

import torch

HIGHER_ORDER = (
    "hf-division: higher-order gradients (create_graph=True, e.g. a gradient penalty) are not "
    "supported through compressed activations; run that forward without division: "
    "`with hf_division.exact(): ...` or hf_division.remove_division(model)"
)


#: device types whose autocast a backward switches off while it runs
AUTOCAST_DEVICES = ("cpu", "cuda")


def first_order(backward):
    """``backward`` that raises a RuntimeError naming hf-division when it is asked for a graph of
    itself, as ``once_differentiable(backward)`` would with PyTorch's message. Not wrapped in
    ``once_differentiable`` as well: with grad mode off (the only way this runs) its ``no_grad``
    block and checks change nothing, and a backward runs for each Function of every step (host
    time, docs/DESIGN.md, "On a GPU")."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(HIGHER_ORDER)
        on = [device for device in AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]
        if not on:
            return backward(ctx, *grads)
        with contextlib.ExitStack() as stack:
            for device in on:
                stack.enter_context(torch.autocast(device, enabled=False))
            return backward(ctx, *grads)

    return wrapper
