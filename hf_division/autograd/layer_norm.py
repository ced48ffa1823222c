"""``nn.LayerNorm`` with its input kept compressed and ATen's layer-norm backward run directly.

The generic path (:class:`hf_division.autograd.ops.RecomputeFn`) normalizes the rebuilt input twice in
backward: once without autograd to rebuild the output that the next Linear needs for its weight
gradient, once under autograd to backpropagate. Here both use one ``native_layer_norm`` call: its
output rebuilds the next layer's input, its mean and 1/std feed ``native_layer_norm_backward``,
which is what autograd's recomputation called with the same arguments, so the gradients are the
same to the bit (docs/DESIGN.md, "Mechanism").
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hf_division.config import DivisionConfig
from hf_division.autograd.first_order import first_order
from hf_division.autograd.forward_mode import outside
from hf_division.autograd.store import derive, keep


def takes(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.LayerNorm`` (its forward not overridden) and autocast is
    off: under autocast the recomputation must replay autocast's casts, which the generic path does."""
    return (isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward
            and not any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")))


def _normalize(x: torch.Tensor, shape: tuple, weight, bias, eps: float, stats: dict):
    """``layer_norm(x)``; its mean and 1/std are left in ``stats`` for the backward."""
    y, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, eps)
    stats["mean_rstd"] = (mean, rstd)
    return y


class LayerNormFn(torch.autograd.Function):
    """``y = layer_norm(x)`` by the module's own ``forward`` (bit-identical output), ``x`` kept as a
    norm input, ``y`` derived from that copy; backward runs ``native_layer_norm_backward``."""

    @staticmethod
    def forward(ctx, forward: Callable, shape: tuple, eps: float, config: DivisionConfig, x, weight, bias):
        y = forward(x)
        ctx.entry, ctx.shape, ctx.eps, ctx.stats = keep(x, "norm", config), shape, eps, {}
        ctx.save_for_backward(weight, bias)
        stats = ctx.stats

        def rebuild(x_hat, w=weight, b=bias):
            with torch.no_grad():
                return _normalize(x_hat, shape, w, b, eps, stats)

        derive(y, (ctx.entry,), rebuild)
        return y

    @staticmethod
    @first_order
    def backward(ctx, grad):
        weight, bias = ctx.saved_tensors
        x = ctx.entry.take()
        if "mean_rstd" not in ctx.stats:  # no later layer rebuilt the output (e.g. its weight is frozen)
            _normalize(x, ctx.shape, weight, bias, ctx.eps, ctx.stats)
        mean, rstd = ctx.stats.pop("mean_rstd")
        need = ctx.needs_input_grad
        mask = [need[4], weight is not None and need[5], bias is not None and need[6]]
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(grad, x, ctx.shape, mean, rstd, weight, bias, mask)
        return None, None, None, None, gx, gw, gb


def layer_norm(module: nn.LayerNorm, forward: Callable, config: DivisionConfig, x: torch.Tensor) -> torch.Tensor:
    """``module``'s output through :class:`LayerNormFn` (``forward``: its original forward)."""
    return LayerNormFn.apply(forward, tuple(module.normalized_shape), module.eps, config, x, module.weight, module.bias)


# as the other Functions (hf_division.autograd.ops): run eagerly under torch.compile, a graph break each
LayerNormFn.apply = torch.compiler.disable(outside(LayerNormFn.apply))
