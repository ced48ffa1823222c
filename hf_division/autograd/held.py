"""The bytes a training forward holds for backward, exactly (docs/DESIGN.md, Accounting): what
autograd saves (through a saved-tensors hook), what division's ops record
(:mod:`hf_division.autograd.accounting`) and what checkpointed layers keep outside both.

It lives below the integrations because the Trainer decides ``division_checkpointing`` from it;
:mod:`hf_division.analysis.measure` is its public face.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_division.autograd.accounting import start_accounting, stop_accounting
from hf_division.autograd.store import active


def _kind_of(module: nn.Module | None) -> str:
    """Attribute a built-in saved tensor to a kind by the innermost running module."""
    if module is None:
        return "other"
    name = type(module).__name__
    if isinstance(module, nn.Linear) or name in ("Conv1D", "Linear"):
        return "linear"
    if isinstance(module, nn.Dropout):
        return "dropout"
    if "Norm" in name:
        return "norm"
    if "Attention" in name:
        return "attention"
    if module.__class__.__module__.startswith(("transformers.activations", "torch.nn.modules.activation")):
        return "activation"
    return "other"


class _Recorder:
    """Collects ``(tensor, kind)`` for every non-parameter tensor a training forward of ``model``
    keeps for backward: what autograd saves (through a saved-tensors hook; under ``offload``
    what ``save_on_cpu``'s packer returns), and what a checkpointed layer keeps outside the hooks
    (docs/DESIGN.md, Accounting)."""

    def __init__(self, model: nn.Module, offload: bool):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.saved: list[tuple[torch.Tensor, str]] = []
        self.stack: list[nn.Module] = []
        pin = any(p.is_cuda for p in model.parameters())
        self.offloader = torch.autograd.graph.save_on_cpu(pin_memory=pin) if offload else None
        modules = list(model.modules())
        self.handles = [m.register_forward_pre_hook(self.pre) for m in modules]
        self.handles += [m.register_forward_hook(self.post) for m in modules]
        self.handles += [m.register_forward_pre_hook(self.checkpointed, with_kwargs=True)
                         for m in modules if isinstance(m, GradientCheckpointingLayer)]

    def pre(self, module, args):
        self.stack.append(module)

    def post(self, module, args, out):
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    def keep(self, tensors, kind: str) -> None:
        self.saved.extend((t, kind) for t in tensors if t.untyped_storage().data_ptr() not in self.params)

    def pack(self, t):
        kept = self.offloader.pack_hook(t)[1] if self.offloader is not None else t
        self.keep([kept], _kind_of(self.stack[-1] if self.stack else None))
        # ``saved`` keeps every counted storage alive (so data_ptrs are distinct) while the caller
        # counts; the graph only gets a weak reference, because a graph holding a tensor that its
        # own grad_fn saved (an op's output) is a cycle through C++ that is never freed
        return weakref.ref(kept)

    def checkpointed(self, module, args, kwargs):
        """Transformers' checkpoint keeps the layer's arguments whole, and an RNG state; division's
        checkpoint (an instance ``forward``) compresses the floating ones, which the store counts."""
        if not (module.gradient_checkpointing and module.training):
            return
        tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        if "forward" not in module.__dict__ or not active():  # unpatched, or patched under exact()
            tensors += [a for a in args if isinstance(a, torch.Tensor)] + [torch.get_rng_state()]
        else:
            tensors += [a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()]
        self.keep(tensors, "checkpoint")

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        # every saved variable keeps a reference to ``pack`` and so to ``saved``: empty it, or the
        # counted tensors would outlive the graph
        self.saved.clear()


@dataclass
class Held:
    """Bytes a training forward holds for backward: on the compute device, and in host memory
    (what ``save_on_cpu`` moved off a CUDA device); ``by_kind`` splits their sum."""

    device_bytes: int
    host_bytes: int
    by_kind: dict

    @property
    def total(self) -> int:
        return self.device_bytes + self.host_bytes


def _bytes(held: list[tuple[torch.Tensor, str]], device: torch.device) -> Held:
    """Sums over distinct storages (all alive here, so their addresses are unique)."""
    seen, out = set(), Held(0, 0, {})
    for t, kind in held:
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        if t.device == device:
            out.device_bytes += s.nbytes()
        else:
            out.host_bytes += s.nbytes()
        out.by_kind[kind] = out.by_kind.get(kind, 0) + s.nbytes()
    return out


def held_by_forward(module: nn.Module, forward: Callable, *, offload: bool = False) -> Held:
    """What ``forward()`` (a training forward of ``module``, or of a wrapper around it) holds for
    backward: ``(tensor, kind)`` summed over distinct storages, ``module``'s parameters excluded."""
    device = next(module.parameters()).device
    recorder = _Recorder(module, offload)
    try:
        start_accounting()
        try:
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda ref: ref()):
                out = forward()
        finally:
            kept = stop_accounting()
        # a parameter the store holds by reference (a layer's input) is the model's, as in autograd's saves
        kept = [(t, kind) for t, kind in kept if t.untyped_storage().data_ptr() not in recorder.params]
        held = _bytes(recorder.saved + kept, device)
    finally:
        recorder.close()
    del out
    return held
