"""Exact accounting of the bytes a training forward holds for backward."""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .accounting import start_accounting, stop_accounting
from .config import DivisionConfig
from .api import apply_division, remove_division, restored_division, unwrap


@dataclass
class MemoryReport:
    baseline_bytes: int
    division_bytes: int
    baseline_by_kind: dict = field(default_factory=dict)
    division_by_kind: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.baseline_bytes / max(self.division_bytes, 1)

    @property
    def by_kind(self) -> dict:
        kinds = sorted(set(self.baseline_by_kind) | set(self.division_by_kind))
        return {k: (self.baseline_by_kind.get(k, 0), self.division_by_kind.get(k, 0)) for k in kinds}

    def table(self) -> str:
        rows = [f"{'kind':<12} {'baseline MiB':>13} {'division MiB':>13} {'ratio':>7}"]
        for kind, (b, d) in self.by_kind.items():
            rows.append(f"{kind:<12} {b / 2**20:>13.2f} {d / 2**20:>13.2f} {b / max(d, 1):>7.1f}")
        rows.append(
            f"{'total':<12} {self.baseline_bytes / 2**20:>13.2f} {self.division_bytes / 2**20:>13.2f} {self.ratio:>7.1f}"
        )
        return "\n".join(rows)


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


@contextlib.contextmanager
def _record_saved(model: nn.Module):
    """Collect ``(tensor, kind)`` for every non-parameter tensor autograd saves in ``model``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[nn.Module] = []
    saved: list[tuple[torch.Tensor, str]] = []

    def pre(module, args):
        stack.append(module)

    def post(module, args, out):
        if stack and stack[-1] is module:
            stack.pop()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append((t, _kind_of(stack[-1] if stack else None)))
        # ``saved`` keeps every counted storage alive (so data_ptrs are distinct) while the caller
        # counts; the graph only gets a weak reference, because a graph holding a tensor that its
        # own grad_fn saved (an op's output) is a cycle through C++ that is never freed
        return weakref.ref(t)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda ref: ref()):
            yield saved
    finally:
        for h in handles:
            h.remove()
        # every saved variable keeps a reference to ``pack`` and so to ``saved``: empty it, or the
        # counted tensors would outlive the graph
        saved.clear()


def _bytes(held: list[tuple[torch.Tensor, str]]) -> tuple[int, dict]:
    """Sum of distinct storages (all alive here, so their addresses are unique)."""
    seen, total, by_kind = set(), 0, {}
    for t, kind in held:
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
        by_kind[kind] = by_kind.get(kind, 0) + s.nbytes()
    return total, by_kind


def held_bytes(model: nn.Module, inputs: dict) -> tuple[int, dict]:
    """Bytes held for backward after one training forward of ``model`` as it is now."""
    start_accounting()
    try:
        with _record_saved(unwrap(model)) as saved:
            out = model(**inputs)
            total = _bytes(saved + stop_accounting())
    finally:
        stop_accounting()
    del out
    return total


def measure_activation_memory(model: nn.Module, inputs: dict, config: DivisionConfig | None = None) -> MemoryReport:
    """Exact bytes held for backward after one training forward, without and with division.

    ``inputs``: keyword arguments of ``model`` (e.g. a tokenizer's batch). The model is put in
    train mode for the measurement and left patched or unpatched as it was found.
    """
    with restored_division(model) as before:
        model.train()
        remove_division(model)
        rng = torch.get_rng_state()
        base, base_kinds = held_bytes(model, inputs)
        apply_division(model, config if config is not None else (before or DivisionConfig()))
        torch.set_rng_state(rng)
        div, div_kinds = held_bytes(model, inputs)
    return MemoryReport(base, div, base_kinds, div_kinds)
