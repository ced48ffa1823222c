"""What every fidelity suite does: one model, one batch, one config -> bytes held and gradient cosines."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_division.config import DivisionConfig
from hf_division.analysis.fidelity import Fidelity, added_variance, seed_fidelity
from hf_division.analysis.measure import MemoryReport, measure_activation_memory

#: the suites' ``--autocast`` choices: the dtype a training forward runs under (None: float32)
AUTOCAST = {"none": None, "bf16": torch.bfloat16}


@dataclass
class Measured:
    """Bytes held for backward (baseline and division), the gradient cosine per seed, and where
    measured the per-tensor minimum and the added variance (docs/GUIDE.md, "Gradient fidelity")."""

    memory: MemoryReport
    fidelity: Fidelity
    added_variance: float | None = None

    @property
    def cosines(self) -> list:
        return self.fidelity.whole

    @property
    def tensor_min(self) -> float:
        """The lowest cosine of a tensor holding >= 1% of the gradient's norm, over the seeds."""
        return self.fidelity.worst_tensor[1]

    @property
    def cos_min(self) -> float:
        return min(self.cosines)

    @property
    def cos_mean(self) -> float:
        return sum(self.cosines) / len(self.cosines)


def measure_config(model, batch: dict, config: DivisionConfig | None = None, seeds=(0, 1, 2),
                   memory_first: bool = False, variance_batches: list[dict] | None = None) -> Measured:
    """Exact bytes held (``measure_activation_memory``) and gradient cosines (``seed_fidelity``:
    ``gradient_cosine``'s per seed, and the per-tensor minimum) of ``config`` on ``batch``; with
    ``variance_batches`` (batches of ``batch``'s size from the same data), also the added variance
    (``added_variance``, two draws per batch).

    ``memory_first``: which of the two runs first. The byte counts do not depend on it, but the
    memory measurement draws rounding noise, and ``gradient_cosine`` restarts the noise only when
    its first seed differs from torch's current one (docs/DESIGN.md, Bit-identical forward): each
    suite keeps the order its published figures were measured with.
    """
    if memory_first:
        memory = measure_activation_memory(model, batch, config)
        fidelity = seed_fidelity(model, batch, config, seeds=tuple(seeds))
    else:
        fidelity = seed_fidelity(model, batch, config, seeds=tuple(seeds))
        memory = measure_activation_memory(model, batch, config)
    added = added_variance(model, variance_batches, config) if variance_batches else None
    return Measured(memory, fidelity, added)


def suite_parser(suite: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of ``python -m hf_division.bench SUITE``, its module docstring as the help."""
    return argparse.ArgumentParser(prog=f"python -m hf_division.bench {suite}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def set_threads(threads: int | None = None) -> None:
    """Intra-op threads: ``threads``, else ``HF_DIVISION_THREADS``, else 2 (the measuring machine's cores)."""
    torch.set_num_threads(threads or int(os.environ.get("HF_DIVISION_THREADS", "2")))


def command_line(argv: list[str] | None = None) -> str:
    """``argv`` (default ``sys.argv``) as the command a reader can type: a package's ``__main__.py``
    becomes ``python -m PACKAGE``, a path under the working directory is made relative to it."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    prog = Path(argv[0])
    if prog.name == "__main__.py":
        parts, folder = [], prog.resolve().parent
        while (folder / "__init__.py").exists():
            parts.insert(0, folder.name)
            folder = folder.parent
        head = ["python", "-m", ".".join(parts)] if parts else ["python", str(prog)]
    elif prog.suffix == ".py":
        try:
            head = ["python", str(prog.resolve().relative_to(Path.cwd()))]
        except ValueError:
            head = ["python", str(prog)]
    else:
        head = [prog.name]
    return shlex.join(head + argv[1:])


def provenance(argv: list[str] | None = None) -> dict:
    """Where a result file comes from: the library's commit (``git rev-parse --short HEAD`` in this
    package's checkout, "unknown" outside one), today's date and the command line."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
        commit = done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"commit": commit, "date": datetime.date.today().isoformat(), "command": command_line(argv)}


def write_json(path: str | None, data, indent: int = 1) -> None:
    """Write ``data`` as JSON to ``path`` (nothing when ``path`` is None), with a top-level
    ``"provenance"`` key (:func:`provenance`): a dict gets the key first, a list is written as
    ``{"provenance": ..., "rows": [...]}`` (:func:`read_json` gives the list back)."""
    if path:
        if isinstance(data, dict):
            data = data if "provenance" in data else {"provenance": provenance(), **data}
        elif isinstance(data, list):
            data = {"provenance": provenance(), "rows": data}
        with open(path, "w") as f:
            json.dump(data, f, indent=indent)


def read_json(path: str):
    """What :func:`write_json` was given: a file holding only ``provenance`` and ``rows`` (a list
    written with its provenance) reads as the list; other files, with or without a
    ``"provenance"`` key, read as they are."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and set(data) == {"provenance", "rows"} and isinstance(data["rows"], list):
        return data["rows"]
    return data
