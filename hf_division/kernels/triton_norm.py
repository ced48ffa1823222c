"""Llama's RMSNorm rebuilt and differentiated in fused Triton kernels, where the compressor's Triton
kernels run (the ``triton_rms_norm`` switch; docs/DESIGN.md, "On a GPU").

Why: :mod:`hf_division.autograd.rms_norm` writes the norm's gradient out in torch ops. On a GPU each
op is a kernel launch and a pass over the ``(tokens, C)`` tensor in float32: about ten to rebuild
the output the next Linear needs, ten more for the gradient, per norm per step. Here the rebuild is
one kernel (``y`` and ``1/rms`` from the rebuilt input) and the gradient one kernel plus the sum of
the weight gradient's partial rows: each reads its inputs once.

The values are the torch formula's to float32 rounding (the sums run in another order); the weight
gradient's partial sums follow a fixed split of the rows (:data:`PROGRAMS`), so a step gives the
same gradient on every device and every run.
"""
from __future__ import annotations

import functools

import torch

from hf_division.kernels import triton_codec
from hf_division.kernels.triton_codec import ROUNDED, pow2
from hf_division.kernels.switches import switches

#: the widest row the kernels take whole (wider norms keep the torch formula): a row of 8192 is 32
#: values a thread of the 8 warps, the most the gradient kernel holds without spilling registers
#: (docs/DESIGN.md, "On a GPU": registers)
MAX_WIDTH = 8192
#: values per program's tile: rows of the width rounded up to a power of 2, at least one; 8 a
#: thread, which keeps the gradient kernel within 128 registers up to rows of 2048
TILE = 2048
#: programs of the gradient kernel at most: each sums its rows' share of the weight gradient, and
#: the launcher adds the programs' rows (a fixed split, whatever the device)
PROGRAMS = 512


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the norm of ``x`` (``(..., C)``) with ``weight`` (``(C,)``) goes through the kernels:
    the switch on, the compressor's Triton kernels running on ``x``'s device, ``x`` and ``weight``
    in dtypes the kernels round to, ``x`` at most :data:`MAX_WIDTH` wide, ``weight`` one contiguous row."""
    return (switches().triton_rms_norm and triton_codec.applies(x.device) and x.dtype in ROUNDED
            and weight.dtype in ROUNDED and 0 < x.shape[-1] <= MAX_WIDTH and weight.dim() == 1
            and weight.is_contiguous())


def _tile(c: int) -> tuple[int, int]:
    """``(rows, row width)`` of a program's tile for width ``c``."""
    bc = pow2(c)
    return max(1, TILE // bc), bc


@functools.lru_cache(maxsize=None)
def _promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.promote_types(a, b)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def rebuild(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: the module's output for ``x`` (``weight * (x * rstd)`` with ``x * rstd`` in
    ``x``'s dtype, ``y`` in the two dtypes' promotion) and ``rstd = 1/sqrt(mean(x^2) + eps)`` per row
    (float32, ``(N,)``); one launch."""
    x2 = _rows(x)
    n, c = x2.shape
    y = torch.empty(x.shape, dtype=_promoted(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    rows, bc = _tile(c)
    if n:
        eps = float(eps)
        key = ("rms_rebuild", n, c, eps, x.dtype, weight.dtype, y.dtype)
        launch = triton_codec.planned(key, lambda: triton_codec.Launch(
            "rms_rebuild", (-(-n // rows),), dict(XD=ROUNDED[x.dtype], YD=ROUNDED[y.dtype], ROWS=rows, BC=bc)))
        launch(x2, weight, y, rstd, n, c, eps)
    return y, rstd


def gradients(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype,
              need_x: bool, need_w: bool):
    """``(dx in dtype, dweight in weight's dtype)`` for the output's gradient ``grad`` from the input
    ``x`` and :func:`rebuild`'s ``rstd`` (None where not needed); one launch, and the sum of the
    weight gradient's partial rows."""
    g2, x2 = _rows(grad), _rows(x)
    n, c = x2.shape
    rows, bc = _tile(c)
    blocks = -(-n // rows)
    iters = pow2(-(-blocks // PROGRAMS))
    programs = -(-blocks // iters)
    dx = torch.empty(grad.shape, dtype=dtype, device=grad.device) if need_x else None
    part = torch.empty(programs, c, dtype=torch.float32, device=grad.device) if need_w else None
    if n and (need_x or need_w):
        key = ("rms_grad", n, c, programs, iters, need_x, need_w, dtype, grad.dtype, x.dtype, weight.dtype)
        launch = triton_codec.planned(key, lambda: triton_codec.Launch("rms_grad", (programs,), dict(
            NEED_X=need_x, NEED_W=need_w, DXD=ROUNDED[dtype], ITERS=iters, ROWS=rows, BC=bc)))
        launch(g2, x2, rstd, weight, x2 if dx is None else dx, rstd if part is None else part, n, c)
    gw = None
    if need_w:
        gw = part.sum(0).to(weight.dtype) if n else torch.zeros_like(weight)
    return dx, gw
