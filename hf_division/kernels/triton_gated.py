"""A SiLU-gated MLP's product and gradients in one Triton kernel each, where the compressor's Triton
kernels run (the ``triton_gated`` switch; docs/DESIGN.md, "On a GPU").

Why: :class:`hf_division.autograd.ops.GatedFn` rebuilds ``gate`` and ``up`` in backward; in torch ops
the product the down projection needs is ``silu(gate)``, kept for the gradient, and a product, and
the gradients are three more products and ``silu_backward``: five kernels, each a pass over
``(tokens, intermediate)`` tensors, the widest a decoder saves, and ``silu(gate)`` held between them.
Here the product is one pass over ``gate`` and ``up``, and both gradients one pass over the
gradient, ``gate`` and ``up``; ``silu(gate)`` is formed again inside it, not kept.

The values are torch's ops' to the rounding of their dtype: each intermediate is rounded where
torch rounds it (``silu(gate)`` to gate's dtype, each product to its result's), and only the
exponential's own rounding differs.
"""
from __future__ import annotations

import torch

from hf_division.kernels import triton_codec
from hf_division.kernels.triton_codec import ROUNDED
from hf_division.kernels.switches import switches

#: elements per program
BLOCK = 1024


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take ``tensors`` (gate, up and, for the gradients, the gradient): the
    switch on, the compressor's Triton kernels running on their device, one floating dtype and one
    shape."""
    first = tensors[0]
    return (switches().triton_gated and triton_codec.applies(first.device) and first.dtype in ROUNDED
            and all(t.dtype == first.dtype and t.shape == first.shape and t.device == first.device for t in tensors))


def _grid(n: int) -> tuple:
    return (-(-n // BLOCK),)


def product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; one launch."""
    g, u = gate.contiguous(), up.contiguous()
    h = torch.empty_like(g)
    n = g.numel()
    if n:
        launch = triton_codec.planned(("silu_mul", n, BLOCK, g.dtype, u.dtype), lambda: triton_codec.Launch(
            "silu_mul", _grid(n), dict(D=ROUNDED[g.dtype], BLOCK=BLOCK)))
        launch(g, u, h, n)
    return h


def gradients(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, need_gate: bool, need_up: bool):
    """``(d_gate, d_up)`` of ``silu(gate) * up`` for ``grad`` (None where not needed); one launch."""
    d, g, u = grad.contiguous(), gate.contiguous(), up.contiguous()
    dg = torch.empty_like(g) if need_gate else None
    du = torch.empty_like(g) if need_up else None
    n = g.numel()
    if n and (need_gate or need_up):
        launch = triton_codec.planned(("silu_mul_grad", n, BLOCK, need_gate, need_up, d.dtype, g.dtype, u.dtype),
                                      lambda: triton_codec.Launch("silu_mul_grad", _grid(n), dict(
                                          NEED_G=need_gate, NEED_U=need_up, D=ROUNDED[g.dtype], BLOCK=BLOCK)))
        launch(d, g, u, g if dg is None else dg, g if du is None else du, n)
    return dg, du
