"""Gradient fidelity: cosine between the exact gradient and the division gradient."""
from __future__ import annotations

import torch

from .config import DivisionConfig
from .api import apply_division, remove_division, restored_division


def flat_grad(model: torch.nn.Module, inputs: dict, seed: int) -> torch.Tensor:
    """All parameter gradients of one training step on ``inputs`` (``labels`` included), flattened."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(**inputs).loss.backward()
    grads = [p.grad.flatten().float() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return torch.cat(grads)


def gradient_cosine(model, inputs: dict, config: DivisionConfig | None = None, seeds=(0, 1, 2)) -> list[float]:
    """Cosine of the division gradient to the exact one, per seed (same dropout masks: same seed)."""
    out = []
    with restored_division(model) as before:
        for seed in seeds:
            remove_division(model)
            exact = flat_grad(model, inputs, seed)
            apply_division(model, config or before or DivisionConfig())
            approx = flat_grad(model, inputs, seed)
            # float64: in float32, over the 42M gradient entries of a Llama-shaped model, the
            # cosine came out as 1.0029 for a true 0.9977
            out.append(torch.nn.functional.cosine_similarity(exact.double(), approx.double(), dim=0).item())
    return out
