"""Budget mode: the fastest way to fit a model's activations into a memory budget.

Given a model, one batch of the shape it will train on and a budget for the bytes held for
backward, :func:`suggest` measures each candidate combination of division (the model's default
policy) and Transformers' activation checkpointing of every ``n``-th layer
(``activation_checkpointing_enable(every_n_layers=n)``), plus, on an accelerator, offloading the
saved tensors to host memory (``torch.autograd.graph.save_on_cpu``): the exact bytes each one holds
(:func:`hf_division.analysis.measure.account`) and, for those that fit, the median step time measured
interleaved (:mod:`hf_division.analysis.timing`). It picks the fastest that fits (docs/GUIDE.md, "Budget
mode"). Everything is measured on the caller's model and batch, nothing is predicted, so the
answer holds for that shape; a longer sequence needs its own run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_division.api import apply_division, remove_division, restored_division, unwrap
from hf_division.config import DivisionConfig
from hf_division.analysis.measure import account
from hf_division.patching.wrappers import layer_names
from hf_division.analysis.timing import interleaved_medians, timed


@dataclass(frozen=True)
class Option:
    """One combination: division on/off, checkpoint every ``every_n`` layers (0: off), offload."""

    division: bool
    every_n: int = 0
    offload: bool = False

    @property
    def name(self) -> str:
        parts = (["division"] if self.division else []) + ([f"ckpt every {self.every_n}"] if self.every_n else [])
        return " + ".join(parts + (["save_on_cpu"] if self.offload else [])) or "none"

    def apply(self, model: nn.Module, config: DivisionConfig | None = None) -> None:
        """Put ``model`` in this option's state (offload is a context around the step: :meth:`context`)."""
        base = unwrap(model)
        remove_division(model)
        if base.is_activation_checkpointing:
            base.activation_checkpointing_disable()
        if self.every_n:
            base.activation_checkpointing_enable(every_n_layers=self.every_n)
        if self.division:
            apply_division(model, config)

    def context(self, model: nn.Module):
        """What to run the training forward under (``save_on_cpu`` for an offload option)."""
        if not self.offload:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=next(model.parameters()).is_cuda)


@dataclass
class Measured:
    option: Option
    held_bytes: int  # on the compute device
    host_bytes: int  # moved to host memory by offloading
    step_s: float | None = None  # measured only for options within the budget


@dataclass
class Suggestion:
    """Every option measured, and the fastest within ``budget_bytes`` (None if none fits)."""

    budget_bytes: int
    measured: list = field(default_factory=list)
    chosen: Measured | None = None

    def table(self) -> str:
        rows = [f"{'option':<32} {'held MiB':>9} {'host MiB':>9} {'step s':>8}  fits"]
        for m in self.measured:
            step = f"{m.step_s:>8.3f}" if m.step_s is not None else f"{'-':>8}"
            mark = "  <- chosen" if m is self.chosen else ""
            rows.append(f"{m.option.name:<32} {m.held_bytes / 2**20:>9.1f} {m.host_bytes / 2**20:>9.1f} {step}  "
                        f"{'yes' if m.held_bytes <= self.budget_bytes else 'no'}{mark}")
        rows.append(f"budget: {self.budget_bytes / 2**20:.1f} MiB held for backward")
        return "\n".join(rows)


def candidates(model: nn.Module) -> list[Option]:
    """The options worth measuring for ``model``: every n in 1, 2, 4, ... up to its layer count."""
    n_layers = len(layer_names(unwrap(model)))
    every = []
    n = 1
    while n_layers and n <= n_layers:
        every.append(n)
        n *= 2
    options = [Option(False), Option(True)]
    options += [Option(True, n) for n in reversed(every)] + [Option(False, n) for n in reversed(every)]
    if next(model.parameters()).is_cuda:  # on a CPU host memory is the device memory: nothing moves
        options.append(Option(False, offload=True))
    return options


def _step(model: nn.Module, batch: dict, option: Option) -> None:
    with option.context(model):
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def suggest(model: nn.Module, batch: dict, budget_bytes: int, config: DivisionConfig | None = None,
            rounds: int = 3, options: list[Option] | None = None) -> Suggestion:
    """Measure ``options`` (default :func:`candidates`) on ``model`` and ``batch`` and choose the
    fastest whose bytes held for backward fit ``budget_bytes``. ``config``: the division policy
    (default: the model's current one, else the defaults). The model is left as it was found."""
    if budget_bytes <= 0:
        raise ValueError(f"hf-division budget: budget_bytes must be positive, got {budget_bytes}")
    out = Suggestion(budget_bytes)
    base = unwrap(model)
    was_ckpt = _checkpointed_layers(base)
    with restored_division(model) as before:
        config = config or before
        model.train()
        for option in options or candidates(model):
            option.apply(model, config)
            torch.manual_seed(0)
            held = account(model, batch, offload=option.offload)
            out.measured.append(Measured(option, held.device_bytes, held.host_bytes))
        fits = {m.option.name: m for m in out.measured if m.held_bytes <= budget_bytes}
        device = next(model.parameters()).device.type

        def seconds(name: str) -> float:
            fits[name].option.apply(model, config)
            return timed(lambda: _step(model, batch, fits[name].option), device)

        for name, s in (interleaved_medians(list(fits), seconds, rounds) if fits else {}).items():
            fits[name].step_s = s
        out.chosen = min(fits.values(), key=lambda m: (m.step_s, m.held_bytes), default=None)
        if base.is_activation_checkpointing:
            base.activation_checkpointing_disable()
        remove_division(model)
    if any(was_ckpt.values()):  # as it was, layer by layer (``every_n_layers`` included)
        base.activation_checkpointing_enable()
        for module in base.modules():
            if id(module) in was_ckpt:
                module.gradient_checkpointing = was_ckpt[id(module)]
    return out


def _checkpointed_layers(base: nn.Module) -> dict:
    """``{id(layer): checkpointed?}`` for the model's checkpointable layers."""
    return {id(m): bool(getattr(m, "gradient_checkpointing", False)) for m in base.modules()
            if isinstance(m, GradientCheckpointingLayer)}
