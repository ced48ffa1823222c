"""A SiLU-gated MLP's product ``silu(gate) * up`` and its gradients, computed from ``gate`` and ``up``
as compressed.

:class:`~hf_division.autograd.ops.GatedFn` keeps ``gate`` and ``up`` compressed. In backward the down
projection needs the product and the gate needs ``silu'(gate)``; rebuilt tensor by tensor that is
two decodes written out in float32, the activation, the product, and three passes for the
gradients, each reading whole ``(tokens, intermediate)`` tensors that are no longer in cache
(docs/DESIGN.md, "Gated MLP"). The native kernel rebuilds both operands tile by tile in cache and
writes only what is asked for: the product, or the two gradients.

It applies on CPU to float32 tensors whose two entries are token-grouped without LFC (block 1,
the ``activation`` kind's default), in the same layout; anything else returns None and the caller
rebuilds the tensors.
"""
from __future__ import annotations

import math

import torch

from hf_division.kernels import native
from hf_division.kernels.switches import switches
from hf_division.quant.packed import Packed

def applies(gate: Packed | None, up: Packed | None) -> bool:
    """Whether :func:`silu_gated` takes these two compressed operands (and the ``gated_from_codes``
    switch is on; off, GatedFn rebuilds ``gate`` and ``up``)."""
    if not switches().gated_from_codes or gate is None or up is None:
        return False
    # equal layouts (permutation and permuted shape) mean equal shapes and strides
    return all(_takes(p) for p in (gate, up)) and gate.layout == up.layout and gate.group_size == up.group_size \
        and native.applies(gate.packed.device, None)


def _takes(p: Packed) -> bool:
    return (p.grouping == "tokens" and p.bits > 0 and p.block_size == 1 and p.lfc is None and p.row_scale is None
            and p.row_keep is None and p.dtype == torch.float32)


def silu_gated(gate: Packed, up: Packed, grad: torch.Tensor | None = None):
    """``silu(gate) * up`` (``grad`` None), else ``(d_gate, d_up)`` for ``grad`` (d loss / d product),
    shaped and strided as the compressed tensors were; None where :func:`applies` says no."""
    if not applies(gate, up) or (grad is not None and (grad.dtype != torch.float32 or grad.shape != gate.shape)):
        return None
    layout = gate.layout
    n = math.prod(layout.shape) // layout.channels
    c = layout.channels
    count = 1 if grad is None else 2
    out = tuple(torch.empty(n, c, dtype=torch.float32) for _ in range(count))
    g = None if grad is None else grad.permute(layout.perm).reshape(n, c).contiguous()
    native.silu_gated(n, c, gate.group_size, _operand(gate, n), _operand(up, n), g, out)
    shaped = tuple(t.view(layout.shape).permute(layout.inverse()) for t in out)
    return shaped[0] if grad is None else shaped


def _operand(p: Packed, n: int) -> tuple:
    """``p`` as the kernel reads it; outlier tokens as a per-token slot into their exact rows."""
    slot = rows = None
    if p.rows is not None and p.row_index.numel():
        slot = torch.full((n,), -1, dtype=torch.int32)
        slot[p.row_index] = torch.arange(p.row_index.numel(), dtype=torch.int32)
        rows = p.rows.contiguous()  # in p.dtype, float32 (_takes)
    return p.packed, p.lo, p.scale, p.bits, slot, rows
