"""Llama's RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``) with its input kept compressed and
its gradient written out.

The generic path (:class:`hf_division.autograd.ops.RecomputeFn`) runs the module's forward on the rebuilt
input under autograd (a square, a mean, an rsqrt and two products, each a pass over the tensor
and a node of the graph) and differentiates that graph. Here backward forms ``1/rms`` once per
token (one ``vector_norm`` pass) for both the rebuilt output the next Linear needs and the gradient::

    x_n = x * rstd,   y = w * x_n,
    dx  = rstd * (g*w - x_n * mean(g*w * x_n)),   dw = sum over tokens of g * x_n

the gradient autograd takes through the module, to float32 rounding (docs/DESIGN.md,
"Mechanism"). Where the compressor's Triton kernels run, :mod:`hf_division.kernels.triton_norm`'s
two kernels compute the same in two launches instead of about twenty torch ops. Which modules
compute that formula is checked on probes when a model is patched (:func:`eps_of`); the others
(Gemma's ``1 + weight``, norms with a bias) keep the generic path.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hf_division.config import DivisionConfig
from hf_division.autograd.first_order import first_order
from hf_division.autograd.forward_mode import outside
from hf_division.kernels import triton_norm
from hf_division.kernels.switches import switches
from hf_division.autograd.store import derive, keep


def eps_of(module: nn.Module) -> float | None:
    """``module``'s eps if it computes Llama's RMSNorm: one 1-D ``weight``, no other parameter or
    submodule, an ``eps`` or ``variance_epsilon`` attribute, and outputs that match the formula
    on random probes (float32, CPU; its own weight stands aside). None otherwise."""
    params = dict(module.named_parameters(recurse=False)) if isinstance(module, nn.Module) else {}
    weight = params.get("weight")
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (weight is None or weight.dim() != 1 or len(params) != 1 or next(module.children(), None) is not None
            or not isinstance(eps, float) or eps <= 0):
        return None
    g = torch.Generator().manual_seed(0)
    w = torch.rand(weight.shape[0], generator=g) + 0.5
    # one probe where eps is negligible, one where it is the size of mean(x^2): a module that reads
    # another eps than the one found fails there
    for scale in (3.0, eps**0.5):
        x = torch.randn(2, 3, weight.shape[0], generator=g) * scale
        try:
            with torch.no_grad():  # a patched forward runs the original one without grad
                y = torch.func.functional_call(module, {"weight": w}, (x,), strict=False)
        except Exception:  # noqa: BLE001 - any module that cannot run the probe keeps the generic path
            return None
        ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        if not (isinstance(y, torch.Tensor) and y.shape == ref.shape and torch.allclose(y, ref, rtol=1e-5, atol=1e-6)):
            return None
    return eps


def takes(eps: float | None) -> bool:
    """Whether a module :func:`eps_of` found (``eps``) takes this path now: the ``rms_norm_backward``
    switch on (off: the generic recomputation). Under autocast too: the formula runs in float32,
    which autocast leaves alone (none of its ops is on an autocast list), and the module's own
    forward still makes the output; the generic path's recomputation under autograd is what made
    a bf16 step's host time (docs/DESIGN.md, "On a GPU")."""
    return eps is not None and switches().rms_norm_backward


def normalize(x: torch.Tensor, weight: torch.Tensor, eps: float, stats: dict) -> torch.Tensor:
    """The module's output for ``x``; what the backward needs (:func:`gradients`) left in ``stats``:
    ``1/rms`` (float32) with ``x`` where the fused Triton kernels run (:mod:`hf_division.kernels.triton_norm`),
    else with ``x_n`` (float32)."""
    if triton_norm.applies(x, weight):
        y, rstd = triton_norm.rebuild(x, weight, eps)
        stats["rebuilt"] = (True, x, rstd)
        return y
    x32 = x.float()
    rstd = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).pow_(2).div_(x.shape[-1]).add_(eps).rsqrt_()
    xn = x32 * rstd
    stats["rebuilt"] = (False, xn, rstd)
    return weight * xn.to(x.dtype)  # the module's own dtype rule: the normalized input cast back, then scaled


def gradients(grad: torch.Tensor, rebuilt: tuple, weight: torch.Tensor, dtype: torch.dtype, need_x: bool,
              need_w: bool):
    """``(dx in dtype, dweight)`` for the output's gradient ``grad``, from what :func:`normalize`
    left (None where not needed)."""
    fused, xn, rstd = rebuilt
    if fused:
        return triton_norm.gradients(grad, xn, rstd, weight, dtype, need_x, need_w)
    g = grad.float()
    gw = (g * xn).sum(tuple(range(g.dim() - 1))).to(weight.dtype) if need_w else None
    gx = None
    if need_x:
        gy = g * weight.float()
        mean = torch.linalg.vecdot(gy, xn, dim=-1).unsqueeze_(-1).mul_(-1.0 / xn.shape[-1])
        gx = torch.addcmul(gy, xn, mean).mul_(rstd).to(dtype)
    return gx, gw


class RMSNormFn(torch.autograd.Function):
    """``y = forward(x)`` (the module's own forward: bit-identical output), ``x`` kept as a norm
    input, ``y`` derived from that copy; backward differentiates the formula directly."""

    @staticmethod
    def forward(ctx, forward: Callable, eps: float, config: DivisionConfig, x, weight):
        y = forward(x)
        ctx.entry, ctx.eps, ctx.stats, ctx.dtype = keep(x, "norm", config), eps, {}, x.dtype
        ctx.save_for_backward(weight)
        stats = ctx.stats

        def rebuild(x_hat, w=weight):
            with torch.no_grad():
                return normalize(x_hat, w, eps, stats)

        derive(y, (ctx.entry,), rebuild)
        return y

    @staticmethod
    @first_order
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        x = ctx.entry.take()
        if "rebuilt" not in ctx.stats:  # no later layer rebuilt the output (e.g. its weight is frozen)
            normalize(x, weight, ctx.eps, ctx.stats)
        gx, gw = gradients(grad, ctx.stats.pop("rebuilt"), weight, ctx.dtype, ctx.needs_input_grad[3],
                           ctx.needs_input_grad[4])
        return None, None, None, gx, gw


def rms_norm(module: nn.Module, forward: Callable, eps: float, config: DivisionConfig, x: torch.Tensor) -> torch.Tensor:
    """``module``'s output through :class:`RMSNormFn` (``forward``: its original forward)."""
    return RMSNormFn.apply(forward, eps, config, x, module.weight)


# as the other Functions (hf_division.autograd.ops): run eagerly under torch.compile, a graph break each
RMSNormFn.apply = torch.compiler.disable(outside(RMSNormFn.apply))
