"""Exact accounting of the bytes a training forward holds for backward."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_division.config import DivisionConfig
from hf_division.api import apply_division, remove_division, restored_division, unwrap
from hf_division.autograd.held import Held, held_by_forward


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


def account(model: nn.Module, inputs: dict, *, autocast: torch.dtype | None = None, offload: bool = False) -> Held:
    """What one training forward of ``model``, as it is now, holds for backward.

    ``autocast``: run the forward under ``torch.autocast`` to this dtype; ``offload``: under
    ``torch.autograd.graph.save_on_cpu`` (pinned on CUDA), whose packed copies are counted.
    """
    inner = unwrap(model)
    device = next(inner.parameters()).device
    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()

    def forward():
        with amp:
            return model(**inputs)

    return held_by_forward(inner, forward, offload=offload)


def held_bytes(model: nn.Module, inputs: dict) -> tuple[int, dict]:
    """``(bytes, bytes per kind)`` held for backward after one training forward of ``model`` as it is now."""
    held = account(model, inputs)
    return held.total, held.by_kind


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
