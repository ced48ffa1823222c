"""What every fidelity suite does: one model, one batch, one config -> bytes held and gradient cosines."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from hf_division.config import DivisionConfig
from hf_division.analysis.fidelity import gradient_cosine
from hf_division.analysis.measure import MemoryReport, measure_activation_memory


@dataclass
class Measured:
    """Bytes held for backward (baseline and division) and the gradient cosine per seed."""

    memory: MemoryReport
    cosines: list

    @property
    def cos_min(self) -> float:
        return min(self.cosines)

    @property
    def cos_mean(self) -> float:
        return sum(self.cosines) / len(self.cosines)


def measure_config(model, batch: dict, config: DivisionConfig | None = None, seeds=(0, 1, 2),
                   memory_first: bool = False) -> Measured:
    """Exact bytes held (``measure_activation_memory``) and gradient cosines (``gradient_cosine``)
    of ``config`` on ``batch``.

    ``memory_first``: which of the two runs first. The byte counts do not depend on it, but the
    memory measurement draws rounding noise, and ``gradient_cosine`` restarts the noise only when
    its first seed differs from torch's current one (docs/DESIGN.md, Bit-identical forward): each
    suite keeps the order its published figures were measured with.
    """
    if memory_first:
        memory = measure_activation_memory(model, batch, config)
        return Measured(memory, gradient_cosine(model, batch, config, seeds=tuple(seeds)))
    cosines = gradient_cosine(model, batch, config, seeds=tuple(seeds))
    return Measured(measure_activation_memory(model, batch, config), cosines)


def set_threads(threads: int | None = None) -> None:
    """Intra-op threads: ``threads``, else ``HF_DIVISION_THREADS``, else 2 (the measuring machine's cores)."""
    torch.set_num_threads(threads or int(os.environ.get("HF_DIVISION_THREADS", "2")))


def write_json(path: str | None, data, indent: int = 1) -> None:
    """Write ``data`` as JSON to ``path`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)
