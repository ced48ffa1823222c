"""Dropout with its mask kept as bits: ``F.dropout`` routed to :class:`DropoutFn`, and the draws
inside an op (sdpa's math path) recorded as bits and replayed (docs/DESIGN.md, "Dropout masks as
bits, or not at all" and "Dropout draws").

The forward's output is the unpatched one to the bit; on the CPU the draws come from the native
kernel where it gives ATen's own (:func:`hf_division.kernels.native.bernoulli_bits`).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_division.autograd.accounting import account_tensors
from hf_division.kernels.native import bernoulli_bits, draws_apply, fill_draws, masked_scale, pack_mask
from hf_division.autograd.first_order import first_order
from hf_division.quant.packing import unpack_mask
from hf_division.autograd.store import bookkeeping, derive, lookup


class DropoutFn(torch.autograd.Function):
    """``F.dropout(x, p, training=True)`` with the mask kept as 1 bit per element.

    Reproduces ATen's own arithmetic so the output is bit-identical: on CPU
    ``x * bernoulli(1 - p) / (1 - p)``, elsewhere the fused ``native_dropout``. On CPU the draws
    come as bits from the native kernel where it gives ATen's own (:func:`hf_division.kernels.native.bernoulli_bits`).
    """

    @staticmethod
    def forward(ctx, x, p: float):
        ctx.shape, ctx.p, ctx.dtype = x.shape, p, x.dtype
        if x.is_cuda or x.device.type not in ("cpu", "meta"):
            out, keep_mask = torch.native_dropout(x, p, True)
        elif draws_apply(x, 1 - p):
            return DropoutFn.drawn_as_bits(ctx, x)
        else:
            keep_mask = torch.empty_like(x).bernoulli_(1 - p)
            keep_mask.div_(1 - p)  # the noise tensor: kept values 1 / (1 - p), dropped ones 0
            out = x * keep_mask
        DropoutFn.hold(ctx, x, keep_mask, out)
        return out

    @staticmethod
    @bookkeeping
    def drawn_as_bits(ctx, x) -> torch.Tensor:
        """The CPU forward with ATen's draws made as bits by the native kernel: no 0/1 tensor to
        draw element by element and pack (docs/DESIGN.md, "Dropout draws")."""
        ctx.bits, ctx.n = bernoulli_bits(x.numel(), 1 - ctx.p), x.numel()
        out = DropoutFn.noise_times(ctx, x)
        DropoutFn.held(ctx, x, out)
        return out

    @staticmethod
    @bookkeeping
    def hold(ctx, x, keep_mask, out) -> None:
        """Keep the mask as bits."""
        ctx.bits, ctx.n = pack_mask(keep_mask)
        DropoutFn.held(ctx, x, out)

    @staticmethod
    def held(ctx, x, out) -> None:
        """Account the bits; ``out`` becomes derivable from ``x``'s entry where ``x`` is held."""
        account_tensors([ctx.bits], "dropout")
        parent = lookup(x)
        if parent is not None:
            derive(out, (parent,), lambda t, c=ctx: DropoutFn.noise_times(c, t), extra=[ctx.bits])

    @staticmethod
    def noise_times(ctx, t: torch.Tensor) -> torch.Tensor:
        """``t`` times the forward's noise tensor (its kept values ``1 / (1 - p)``, the rest 0)."""
        return masked_scale(t, ctx.bits, ctx.n, ctx.shape, ctx.dtype, 1 - ctx.p)

    @staticmethod
    @first_order
    def backward(ctx, grad):
        return DropoutFn.noise_times(ctx, grad), None


class DropoutMasks(TorchDispatchMode):
    """Records the Bernoulli draws of dropout inside an op as bits, or replays recorded ones.

    Dropout on CPU (``F.dropout`` and the math path of ``scaled_dot_product_attention``) draws
    its mask with ``bernoulli_``, an expensive draw per element: replaying the bits in backward is
    several times cheaper than redrawing them from a restored RNG state (docs/DESIGN.md,
    "Mechanism: custom autograd Functions at module level").
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # PyTorch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless this says False:
        # about 25 us per op, most of the attention's cost at short sequences. Dynamo never reaches
        # this mode: it runs inside AttentionFn, which torch.compile does not trace (bottom of hf_division/autograd/ops.py).
        return False

    def __init__(self, replay: list | None = None):
        super().__init__()
        self.masks = [] if replay is None else replay
        self.replay = replay is not None
        self.used = 0

    def next_mask(self, shape) -> torch.Tensor | None:
        """Replaying: the next recorded keep mask (0/1 uint8 of ``shape``), or None if none is left."""
        if not self.replay or self.used >= len(self.masks):
            return None
        bits, n = self.masks[self.used]
        self.used += 1
        return unpack_mask(bits, n, shape)

    def draw(self, func, args, kwargs) -> torch.Tensor:
        """Run the draw ``func(*args, **kwargs)`` (``bernoulli_``) and record its bits; by the native
        kernel where it gives ATen's own draws."""
        bound = dict(zip(("self", "p", "generator"), args), **kwargs)
        target, p = bound["self"], bound.get("p", 0.5)
        if draws_apply(target, p, bound.get("generator")):
            bits = bernoulli_bits(target.numel(), p)
            self.masks.append((bits, target.numel()))
            return fill_draws(target, bits)
        out = func(*args, **kwargs)
        self.masks.append(pack_mask(out))
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.bernoulli_.float:
            target = args[0]
            mask = self.next_mask(target.shape)
            if mask is not None:
                return target.copy_(mask)
            return self.draw(func, args, kwargs)
        return func(*args, **kwargs)


# torch.compile(model): as the Functions of hf_division/autograd/ops.py, DropoutFn keeps Python state for
# backward that Dynamo cannot trace; it runs eagerly as a graph break (tests/test_compile.py).
DropoutFn.apply = torch.compiler.disable(DropoutFn.apply)
