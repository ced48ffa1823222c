"""Gradient fidelity: cosine between the exact gradient and the division gradient."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from hf_division.config import DivisionConfig
from hf_division.api import apply_division, remove_division, restored_division
from hf_division.compress.noise import reseed


def flat_grad(model: torch.nn.Module, inputs: dict, seed: int, autocast: torch.dtype | None = None, *,
              reseed_noise: bool = False, select: Callable[[str], bool] | None = None,
              noise_seed: int | None = None) -> torch.Tensor:
    """All parameter gradients of one training step on ``inputs`` (``labels`` included), flattened
    to float64 (sums over millions of entries stay exact enough for a cosine).

    ``seed`` seeds torch (same seed: same dropout masks). ``autocast``: a dtype to run the forward
    under ``torch.autocast`` with (the backward runs outside it, as in a training loop).
    ``reseed_noise``: also restart the rounding noise from ``seed``, so the gradient does not depend
    on what ran before in the process (docs/DESIGN.md, Bit-identical forward). ``noise_seed``:
    restart it from this seed instead, with the dropout masks still those of ``seed`` (noise
    draws of one step). ``select``: keep only the parameters whose name it accepts (e.g. a PEFT
    adapter's).
    """
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if noise_seed is not None or reseed_noise:
        reseed(seed if noise_seed is None else noise_seed)
    device = next(model.parameters()).device.type
    amp = torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with amp:
        loss = model(**inputs).loss
    loss.backward()
    grads = [p.grad.flatten().double() for name, p in model.named_parameters()
             if p.grad is not None and (select is None or select(name))]
    model.zero_grad(set_to_none=True)
    return torch.cat(grads)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two flat vectors in float64: in float32 the sums over the millions of entries of a
    model's gradient can put an exact match above 1."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def gradient_cosine(model, inputs: dict, config: DivisionConfig | None = None, seeds=(0, 1, 2), *,
                    select: Callable[[str], bool] | None = None) -> list[float]:
    """Cosine of the division gradient to the exact one, per seed (same dropout masks: same seed).
    ``select``: of the parameters whose name it accepts only (as in :func:`flat_grad`)."""
    out = []
    with restored_division(model) as before:
        for seed in seeds:
            remove_division(model)
            exact = flat_grad(model, inputs, seed, select=select)
            apply_division(model, config or before or DivisionConfig())
            out.append(cosine(exact, flat_grad(model, inputs, seed, select=select)))
    return out
