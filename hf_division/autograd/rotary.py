"""The rotary position embedding of a training forward in one pass, and its backward in one: native
on the CPU, a Triton kernel where the compressor's Triton kernels run.

Transformers' decoders (Llama, Mistral, Qwen, Gemma, Phi-3) rotate q and k with their modeling
module's ``apply_rotary_pos_emb(q, k, cos, sin)``: ``x * cos + rotate_half(x) * sin``. Under
autograd its backward is about eight ATen passes per tensor (two products, the concatenation's two
slices each written into a zero-filled tensor, a negation, the sums). ``hfd_rotary`` (the CPU's) and
``rotary_kernel`` (Triton's, q and k in one launch) compute the same values in one pass each way,
product by product and sum by sum as ATen rounds them (docs/DESIGN.md, "Mechanism", the rotary
embedding; "On a GPU"); nothing is held for backward but ``cos`` and ``sin``, which autograd keeps too.

The function is a module global that the attention's forward looks up, so it cannot be replaced
per instance: :func:`install` puts a wrapper in its place which runs the original everywhere except
inside :func:`enabled` (a division-patched attention module's training forward,
``patching.patch_rotary``), and :func:`uninstall` puts the original back after its last user. A
function is taken only if it computes, on probes, exactly what :func:`reference` (the formula the
kernels compute) computes (:func:`matches`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading

import torch

from hf_division.kernels import native, triton_codec, triton_rotary
from hf_division.autograd.first_order import first_order
from hf_division.kernels.switches import switches

NAME = "apply_rotary_pos_emb"

_inside = contextvars.ContextVar("hf_division_rotary", default=False)
# Reentrant: uninstall also runs as a finalizer (a patched model collected), and a collection can
# start at any allocation in the thread that holds the lock, install's probes included; with a
# plain lock that thread would wait for itself.
_lock = threading.RLock()
_installed: dict = {}  # (module name, function name) -> [original, wrapper, users]
_checked: dict = {}  # original function -> whether it matched the kernel on the probes


@contextlib.contextmanager
def enabled():
    """Let installed wrappers use the kernel for calls made inside this block (this thread or task)."""
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)


class RotaryFn(torch.autograd.Function):
    """``apply_rotary_pos_emb(q, k, cos, sin)`` as the kernels compute it, forward and backward:
    the native pass on the CPU, Triton's launch where the compressor's Triton kernels run
    (:mod:`hf_division.kernels.triton_rotary`: q and k in one launch each way)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtypes, ctx.triton = (q.dtype, k.dtype), triton_rotary.applies(q, k, cos)
        if ctx.triton:
            return tuple(triton_rotary.rotate([(q, None), (k, None)], cos, sin, False))
        return native.rotary(q, cos, sin, False), native.rotary(k, cos, sin, False)

    @staticmethod
    @first_order
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        if ctx.triton:
            wanted = [(g, dtype) for g, dtype, n in zip((grad_q, grad_k), ctx.dtypes, need) if n]
            got = iter(triton_rotary.rotate(wanted, cos, sin, True) if wanted else ())
            return (next(got) if need[0] else None), (next(got) if need[1] else None), None, None
        dq = native.rotary(grad_q, cos, sin, True) if need[0] else None
        dk = native.rotary(grad_k, cos, sin, True) if need[1] else None
        return dq, dk, None, None


def reference(q, k, cos, sin):
    """Transformers' Llama formula, ``x * cos + rotate_half(x) * sin`` for q and k (``cos`` and
    ``sin`` unsqueezed at dim 1), written out in torch ops: what a modeling function must compute,
    and the kernels do, to the bit (:func:`matches`)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def turn(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + turn(q) * sin, k * cos + turn(k) * sin


def takes(q, k, cos, sin) -> bool:
    """Whether :class:`RotaryFn` takes this call: a training forward, q and k ``(b, heads, t, e)``,
    cos and sin ``(b or 1, t, e)`` (``unsqueeze_dim`` 1, the whole head rotated: Phi-3's partial
    rotary passes a shorter ``cos``) with unit last strides, none of them a tensor subclass; and
    either Triton's kernel (:func:`hf_division.kernels.triton_rotary.applies`) or, on the CPU in
    float32, the native one. Where the compressor's Triton kernels run the native one is never taken."""
    if not (switches().rotary and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return False
    tensors = (q, k, cos, sin)
    if any(type(t) is not torch.Tensor for t in tensors) or any(t.stride(-1) != 1 for t in tensors):
        return False
    if not (q.requires_grad or k.requires_grad) or cos.requires_grad or sin.requires_grad:
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or cos.stride() != sin.stride():
        return False
    b, _, t, e = q.shape
    if not (e % 2 == 0 and k.shape[0] == b and k.shape[2:] == (t, e) and cos.shape[1:] == (t, e)
            and cos.shape[0] in (1, b) and sin.dtype == cos.dtype):
        return False
    if triton_codec.applies(q.device):
        return triton_rotary.applies(q, k, cos)
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and native.kernels() is not None)


def _wrap(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not torch.compiler.is_compiling() and _inside.get() and not args and set(kwargs) <= {"unsqueeze_dim"} \
                and kwargs.get("unsqueeze_dim", 1) == 1 and takes(q, k, cos, sin):
            return RotaryFn.apply(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    return apply_rotary_pos_emb


def matches(fn) -> bool:
    """Whether ``fn(q, k, cos, sin)`` and its gradients equal :func:`reference`'s on probes
    (checked once per function): transposed q as the attention makes it, grouped k, cos shared by
    the batch or not. The kernels' own equality with :func:`reference` is the tests'."""
    if fn not in _checked:
        _checked[fn] = _probe(fn)
    return _checked[fn]


def _probe(fn) -> bool:
    gen = torch.Generator().manual_seed(0)
    for batch_cos in (1, 2):
        q = torch.randn(2, 5, 3, 8, generator=gen).transpose(1, 2).requires_grad_()
        k = torch.randn(2, 1, 5, 8, generator=gen).requires_grad_()
        cos, sin = (torch.randn(batch_cos, 5, 8, generator=gen) for _ in range(2))
        grads = torch.randn(2, 3, 5, 8, generator=gen), torch.randn(2, 1, 5, 8, generator=gen)
        try:
            with torch.enable_grad():
                theirs, ours = fn(q, k, cos, sin), reference(q, k, cos, sin)
                if not all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True)):
                    return False
                expected = torch.autograd.grad(theirs, (q, k), grads)
                got = torch.autograd.grad(ours, (q, k), grads)
        except (RuntimeError, TypeError, ValueError):
            return False
        if not all(torch.equal(a, b) for a, b in zip(expected, got)):
            return False
    return True


def install(module, name: str = NAME) -> bool:
    """Put the wrapper in place of ``module.<name>`` (once; each call adds a user); False, and
    nothing changed, where the function is missing or does not match the kernel."""
    key = (module.__name__, name)
    with _lock:
        entry = _installed.get(key)
        if entry is not None:
            entry[2] += 1  # before anything that allocates: an uninstall run meanwhile sees this user
            return True
        original = getattr(module, name, None)
        if not callable(original) or not matches(original):
            return False
        entry = _installed[key] = [original, _wrap(original), 1]
        setattr(module, name, entry[1])
    return True


def users(module, name: str = NAME) -> int:
    """How many :func:`install` calls on ``module.<name>`` are not yet undone (0: the original is there)."""
    entry = _installed.get((module.__name__, name))
    return 0 if entry is None else entry[2]


def uninstall(module, name: str = NAME) -> None:
    """Remove one user of :func:`install`; the last puts the original back, unless something else
    has replaced the wrapper since (then that stays)."""
    key = (module.__name__, name)
    with _lock:
        entry = _installed.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            if getattr(module, name, None) is entry[1]:
                setattr(module, name, entry[0])
            del _installed[key]
