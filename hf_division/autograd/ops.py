"""The autograd ops: Functions whose forward is the original op and whose saved tensors are compressed.

Each forward computes exactly what the unpatched op computes (same kernels, same RNG draws), so
training outputs are bit-identical; only what is kept for backward changes. Policy (which bits for
which kind) comes from the :class:`~hf_division.config.DivisionConfig` passed in.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from hf_division.autograd.accounting import account_tensors
from hf_division.config import DivisionConfig
from hf_division.autograd.first_order import first_order
from hf_division.autograd.forward_mode import outside
from hf_division.kernels import triton_gated
from hf_division.kernels.switches import switches
from hf_division.autograd.dropout import DropoutMasks
from hf_division.autograd.gated_product import silu_gated
from hf_division.autograd.sdpa_backward import GradientOnlySDPA
from hf_division.autograd.store import Entry, derive, keep, recomputing

_AMP_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """``(device type, enabled, dtype)`` per autocast device, as the current forward runs.

    A recomputation in backward must see the forward's autocast state: under autocast bf16 a
    Linear outputs bf16 and a mask stays float32, so the same ops run without autocast mix dtypes
    (or, with ``backward()`` called inside ``autocast``, would run in other dtypes than forward).
    """
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AMP_DEVICES)


@contextlib.contextmanager
def autocast_as(state: tuple):
    """Run the block under the autocast state captured by :func:`autocast_state`."""
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in state:
            if enabled or torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield


class LinearFn(torch.autograd.Function):
    """``fwd(x)`` for an affine layer: ``x @ weight.T + bias`` (``nn.Linear``), or
    ``x @ weight + bias`` with ``transposed`` (GPT-2's ``Conv1D``). ``fwd`` is the layer's own
    forward. Keeps ``x`` compressed, and only if the weight needs a gradient (as autograd does)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fwd: Callable, transposed: bool, config: DivisionConfig, kind: str):
        ctx.entry = keep(x, kind, config) if weight.requires_grad else None
        ctx.save_for_backward(weight)
        ctx.has_bias, ctx.transposed = bias is not None, transposed
        return not_a_view(fwd(x))

    @staticmethod
    @first_order
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            w = weight.to(grad.dtype)
            gx = grad.matmul(w.t() if ctx.transposed else w)
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.entry is not None and ctx.needs_input_grad[1]:
            x = ctx.entry.take(grad.dtype)
            x2 = x.reshape(-1, x.shape[-1])
            gw = (x2.t().matmul(g2) if ctx.transposed else g2.t().matmul(x2)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0).to(weight.dtype)
        return gx, gw, gb, None, None, None, None


def not_a_view(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a tensor autograd does not track as a view (the same storage and values). A
    Function's output that is a view made inside its forward may not be modified in place (PyTorch
    raises: its custom backward would be bypassed), and ``F.linear`` with a bias returns one for a
    contiguous 3-D input (``addmm`` then ``view``), as GPT-2's ``Conv1D`` does: models that scale a
    projection's output in place (Longformer's ``query /= sqrt(d)``) train unpatched, so they must
    under division too."""
    return torch.ops.aten._unsafe_view(out, out.shape) if out._is_view() else out


class RecomputeFn(torch.autograd.Function):
    """``y = fn(x)`` for an elementwise/normalization ``fn`` with parameters ``params``.

    Keeps ``x`` compressed; backward recomputes ``fn`` on the rebuilt ``x`` under autograd.
    ``y`` is declared derivable from the same copy, so the next layer saving ``y`` adds nothing.
    With parameters (a norm), the rebuild of ``y`` for the next layer records that recomputation
    and the backward reuses it: one normalization in backward instead of two, the same graph
    (``tests/autograd/test_fast_backward.py``).
    """

    @staticmethod
    def forward(ctx, fn: Callable, config: DivisionConfig, kind: str, exact_sign: bool, x, *params):
        y = fn(x)
        ctx.fn, ctx.entry, ctx.amp = fn, keep(x, kind, config, exact_sign), autocast_state()
        ctx.save_for_backward(*params)
        ctx.graph = {}
        shared = params and switches().shared_recomputation
        rebuild = _recorded(fn, ctx.amp, ctx.needs_input_grad[4], ctx.graph) if shared else _no_grad(fn, ctx.amp)
        derive(y, (ctx.entry,), rebuild)
        return y

    @staticmethod
    @first_order
    def backward(ctx, grad):
        params = ctx.saved_tensors
        recorded = ctx.graph.pop("xy", None)
        x = ctx.entry.take().detach().requires_grad_(ctx.needs_input_grad[4])
        if recorded is not None:  # the rebuild of y ran fn on this same rebuilt x under autograd
            x, y = recorded
        wanted = [t for t, need in zip((x, *params), ctx.needs_input_grad[4:]) if need]
        grads = iter(())
        direct = elementwise_grad(ctx.fn) if not params else None
        if direct is not None and wanted:  # the activation's own derivative: no forward recomputed
            grads = iter((direct(grad, x.detach()),))
        elif wanted:
            if recorded is None:
                with torch.enable_grad(), autocast_as(ctx.amp):
                    y = ctx.fn(x)
            grads = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True))
        out = [next(grads) if need else None for need in ctx.needs_input_grad[4:]]
        return (None, None, None, None, *out)


def _recorded(fn: Callable, amp: tuple, needs_x: bool, graph: dict):
    """``fn`` as a recipe for :func:`hf_division.autograd.store.derive` that runs under autograd and leaves
    ``(x, y)`` with their graph in ``graph`` for :meth:`RecomputeFn.backward`; returns ``y`` detached."""

    def run(x_hat):
        x = x_hat.detach().requires_grad_(needs_x)
        with torch.enable_grad(), autocast_as(amp):
            y = fn(x)
        graph["xy"] = (x, y)
        return y.detach()

    return run


def elementwise_grad(fn: Callable):
    """``grad, x -> dL/dx`` for the activations whose ATen backward needs only ``x`` (GELU, SiLU),
    given their module's bound ``forward``; None for anything else (recomputed under autograd)."""
    module = getattr(fn, "__self__", None)
    name = type(module).__name__
    if isinstance(module, torch.nn.GELU):
        return lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate=module.approximate)
    if name == "GELUActivation" and getattr(module, "act", None) is F.gelu:
        return lambda g, x: torch.ops.aten.gelu_backward(g, x)
    if isinstance(module, torch.nn.SiLU) or (name == "SiLUActivation" and type(module).forward.__module__.startswith("transformers")):
        return torch.ops.aten.silu_backward
    return None


def _no_grad(fn, amp: tuple):
    """``fn`` as a recipe for :func:`hf_division.autograd.store.derive`: no autograd, the forward's autocast state."""

    def run(*args):
        with torch.no_grad(), autocast_as(amp):
            return fn(*args)

    return run


class GatedFn(torch.autograd.Function):
    """A gated MLP's ``act(gate) * up`` (``up * act(gate)`` with ``up_first``, as Phi-3 writes it).

    Keeps ``gate`` and ``up`` compressed (the product, which the down projection saves, is
    derived from them), recomputes ``act`` in backward. ``act``: the activation's own forward.
    The product's rebuild leaves ``act(gate)`` for the backward, and SiLU's and GELU's gradient
    comes from their ATen backward (what autograd calls), so ``act`` runs once in backward.
    """

    @staticmethod
    def forward(ctx, act: Callable, up_first: bool, config: DivisionConfig, gate, up):
        a = act(gate)
        h = up * a if up_first else a * up
        ctx.act, ctx.entries = act, (keep(gate, "activation", config), keep(up, "activation", config))
        ctx.amp, ctx.acts = autocast_state(), {}
        acts, amp, silu = ctx.acts, ctx.amp, _is_silu(act)

        def product(g, u):
            if silu and triton_gated.applies(g, u):  # one pass; the backward forms silu(g) again
                return triton_gated.product(g, u)
            with torch.no_grad(), autocast_as(amp):
                a = acts["a"] = act(g)
                return u * a if up_first else a * u

        ctx.is_silu, ctx.silu = silu, silu and not any(on for _, on, _ in amp)
        derive(h, ctx.entries, product, whole=_compressed_product if ctx.silu else None)
        return h

    @staticmethod
    @first_order
    def backward(ctx, grad):
        fused = _compressed_grads(ctx.entries, grad) if ctx.silu and all(ctx.needs_input_grad[3:5]) else None
        if fused is not None:
            return None, None, None, *fused
        gate, up = (e.take() for e in ctx.entries)
        if ctx.is_silu and triton_gated.applies(grad, gate, up):  # one pass over grad, gate and up
            return None, None, None, *triton_gated.gradients(grad, gate, up, *ctx.needs_input_grad[3:5])
        a = ctx.acts.pop("a", None)
        direct = elementwise_grad(ctx.act) if switches().shared_recomputation else None
        # under autocast too: SiLU and GELU are on no autocast list, so their ATen derivative is
        # what autograd would call on the recomputed graph, to the bit
        if direct is not None:
            if a is None and ctx.needs_input_grad[4]:
                a = _no_grad(ctx.act, ctx.amp)(gate)
            g_up = grad * a if ctx.needs_input_grad[4] else None
            g_gate = direct(grad * up, gate) if ctx.needs_input_grad[3] else None
            return None, None, None, g_gate, g_up
        gate = gate.detach().requires_grad_(True)
        with torch.enable_grad(), autocast_as(ctx.amp):
            a = ctx.act(gate)
        g_up = grad * a.detach() if ctx.needs_input_grad[4] else None
        g_gate = torch.autograd.grad(a, gate, grad * up)[0] if ctx.needs_input_grad[3] else None
        return None, None, None, g_gate, g_up


def _is_silu(act: Callable) -> bool:
    return elementwise_grad(act) is torch.ops.aten.silu_backward


def _compressed_product(gate: Entry, up: Entry):
    """``silu(gate) * up`` from the two entries as held (:mod:`hf_division.autograd.gated_product`), or None."""
    return silu_gated(gate.compressed(), up.compressed())


def _compressed_grads(entries: tuple, grad):
    """GatedFn's ``(d_gate, d_up)`` from the entries as held (:mod:`hf_division.autograd.gated_product`), or None;
    the entries count as taken."""
    grads = silu_gated(*(e.compressed() for e in entries), grad)
    if grads is not None:
        for e in entries:
            e.done()
    return grads


class RngState:
    """The CPU RNG state, and that of the first CUDA device among ``tensors``, at creation;
    :meth:`restored` runs a block from it (the recomputation draws the forward's dropout)."""

    def __init__(self, tensors):
        self.devices = [t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda][:1]
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(self.devices[0]) if self.devices else None

    def tensors(self) -> list[torch.Tensor]:
        """What it holds (for accounting)."""
        return [self.cpu] + ([self.cuda] if self.cuda is not None else [])

    @contextlib.contextmanager
    def restored(self):
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.devices[0])
            yield


def _dropped(_):
    """Saved-tensor pack hook of a graph recorded only to run as the unpatched model runs, never
    backpropagated (:class:`AttentionFn`'s extra inputs, :class:`CheckpointFn`'s recorded first
    forward): it keeps nothing. Keeping the tensor as it is would leak the graph: a saved output's
    ``grad_fn`` is the node that saves it, a cycle in C++ that no ``gc.collect()`` breaks."""
    return None


def _never_unpacked(_):
    raise RuntimeError("hf-division: a graph recorded only to run as the unpatched model runs keeps nothing for backward")


def _detached(out):
    return out.detach() if isinstance(out, torch.Tensor) else out


class AttentionFn(torch.autograd.Function):
    """An attention function ``call(q, k, v, *extra) -> out``.

    Keeps q, k, v compressed (``(B, heads, T, d)``, token axis -2) and the dropout mask as bits;
    backward recomputes the attention under autograd with the same mask. The ``T x T`` maps are
    never stored, which is what makes long sequences cheap. Fused kernels that draw their own
    dropout (CUDA) are replayed from the saved RNG state instead. ``extra``: further tensors the
    attention is differentiated for (T5's ``(1, heads, T, T)`` position bias, one per stack and
    shared by its layers), kept as they are.
    """

    @staticmethod
    def forward(ctx, q, k, v, call: Callable, config: DivisionConfig, draws: bool, *extra):
        # ``draws`` False: ``call`` draws no random number (sdpa or flash attention without
        # dropout), so no RNG state is kept and no dispatch mode watches for draws, each of which
        # costs host time per op on a GPU (docs/DESIGN.md, "On a GPU")
        ctx.call, ctx.rng, ctx.amp = call, RngState([q]) if draws else None, autocast_state()
        with DropoutMasks() if draws else contextlib.nullcontext() as rec:
            if extra:
                # as the unpatched model calls it: an additive mask built from a tensor that needs
                # a gradient (T5's position bias) needs one too, and sdpa then picks another kernel
                # (on the CPU: the math one, not flash), whose output differs in the last bits. The
                # graph this records saves nothing and is dropped with the output
                leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, *extra)]
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_dropped, _never_unpacked):
                    out = call(*leaves).detach()
            else:
                out = call(q, k, v, *extra)
        ctx.masks = rec.masks if draws else []
        ctx.save_for_backward(*extra)
        ctx.entries = [keep(t, "attention", config) for t in (q, k, v)]
        account_tensors((ctx.rng.tensors() if draws else []) + [b for b, _ in ctx.masks], "attention")
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad):
        qkv = [e.take().detach().requires_grad_(need) for e, need in zip(ctx.entries, ctx.needs_input_grad[:3])]
        extra = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[6:])]
        draws = ctx.rng is not None
        with ctx.rng.restored() if draws else contextlib.nullcontext():
            with (torch.enable_grad(), DropoutMasks(replay=ctx.masks) if draws else contextlib.nullcontext() as replay,
                  autocast_as(ctx.amp)):
                # CPU: sdpa's output is not recomputed, only its gradient (hf_division.autograd.sdpa_backward)
                fast = switches().sdpa_backward and not qkv[0].is_cuda
                with GradientOnlySDPA(replay) if fast else contextlib.nullcontext():
                    out = ctx.call(*qkv, *extra)
        inputs = (*qkv, *extra)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        out_grads = [next(grads) if t.requires_grad else None for t in inputs]
        return (*out_grads[:3], None, None, None, *out_grads[3:])


class CheckpointFn(torch.autograd.Function):
    """Checkpoint a layer ``run(*args)`` keeping its tensor inputs compressed (policy of the
    residual stream, ``norm``, at ``checkpoint_bits`` at least: :meth:`DivisionConfig.for_checkpoint`)
    and the RNG state; backward rebuilds the inputs, re-runs the layer
    with the same dropout draws under autograd (nothing compressed: it is consumed at once) and
    backpropagates. Like reentrant checkpointing, gradients flow to positional tensor inputs."""

    @staticmethod
    def forward(ctx, run: Callable, config: DivisionConfig, recorded: bool, exact: frozenset, *args):
        ctx.run, ctx.rng = run, RngState(args)
        # only activations (tensors needing a gradient) are compressed: a float additive attention
        # mask (BERT eager passes it positionally) must stay exact, its -inf/-max entries would be
        # lost, and so must an attention bias that needs a gradient and carries the mask (T5's:
        # the inputs at the positions ``exact`` names, the family's ``checkpoint_exact``). An input
        # already held at fewer bits (derived from a norm's input outside the layers: BERT's first
        # layer, T5's encoder output) gets its own copy: backward recomputes the layer from it
        # (docs/DESIGN.md, "One copy per tensor")
        boundary = config.for_checkpoint()
        ctx.args = [keep(a, "norm", boundary, precise=True) if i not in exact and isinstance(a, torch.Tensor)
                    and a.is_floating_point() and a.requires_grad else a for i, a in enumerate(args)]
        account_tensors([a for a in ctx.args if isinstance(a, torch.Tensor)] + ctx.rng.tensors(), "norm")
        ctx.amp = autocast_state()
        if not recorded:
            with torch.no_grad():
                return ctx.run(*args)
        # ``recorded``: as non-reentrant checkpointing runs it, under autograd with every saved
        # tensor dropped as it is saved, so a forward that reads gradient flags reads what the
        # unpatched one reads (T5's additive mask needs a gradient there, and sdpa picks its kernel
        # by that: docs/DESIGN.md, "Bit-identical forward"); run as the recomputation runs it
        leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
        with torch.enable_grad(), recomputing(), torch.autograd.graph.saved_tensors_hooks(_dropped, _never_unpacked):
            out = ctx.run(*leaves)
        return tuple(_detached(o) for o in out) if isinstance(out, tuple) else _detached(out)

    @staticmethod
    @first_order
    def backward(ctx, *grads):
        args = []
        for a, need in zip(ctx.args, ctx.needs_input_grad[4:]):
            if isinstance(a, Entry):
                a = a.take().detach().requires_grad_(need)
            elif isinstance(a, torch.Tensor) and a.requires_grad:  # held exact: a leaf, as a rebuilt one
                a = a.detach().requires_grad_(need)
            args.append(a)
        with ctx.rng.restored():
            with torch.enable_grad(), recomputing(), autocast_as(ctx.amp):
                out = ctx.run(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None, *(a.grad if isinstance(a, torch.Tensor) and a.requires_grad else None for a in args))


# torch.compile(model): these Functions keep Python state for backward (store entries, weak
# references, finalizers) that Dynamo cannot trace (it fails with "Guard failed on the same frame
# it was created"). Marked as not compilable, each runs eagerly as a graph break and the rest of
# a compiled model is compiled (tests/test_compile.py).
for _fn in (LinearFn, RecomputeFn, GatedFn, AttentionFn, CheckpointFn):
    _fn.apply = torch.compiler.disable(outside(_fn.apply))
