"""Gradient fidelity: how far division's gradient is from the exact one, measured three ways
(docs/GUIDE.md, "Gradient fidelity"): the whole gradient's cosine, minimum over noise draws; the
per-tensor cosine, minimum over the tensors that carry the gradient; and division's added variance
against the minibatch's own sampling variance (GACT's criterion: an added 10% is a 10% smaller
effective batch)."""
from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch

from hf_division.config import DivisionConfig
from hf_division.api import apply_division, remove_division, restored_division
from hf_division.compress.noise import reseed


def hooked_backward(model: torch.nn.Module, batch: dict, handles: list) -> None:
    """One forward and backward of ``model`` on ``batch`` (gradients zeroed first) for the hooks
    ``handles`` registered, which are removed afterwards, also when the step fails: how the
    analyses read what a layer sees (``first_token``, ``gated_mlp``)."""
    try:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    finally:
        for h in handles:
            h.remove()


def named_grads(model: torch.nn.Module, inputs: dict, seed: int, autocast: torch.dtype | None = None, *,
                reseed_noise: bool = False, select: Callable[[str], bool] | None = None,
                noise_seed: int | None = None, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of one training step, flattened to ``dtype``, by name (arguments as
    :func:`flat_grad`); parameters without a gradient are left out. ``dtype=torch.float32`` keeps a
    float32 gradient as it is, at half the memory; the cosines below still add in float64."""
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
    grads = {name: p.grad.flatten().to(dtype, copy=True) for name, p in model.named_parameters()
             if p.grad is not None and (select is None or select(name))}
    model.zero_grad(set_to_none=True)
    return grads


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
    grads = named_grads(model, inputs, seed, autocast, reseed_noise=reseed_noise, select=select, noise_seed=noise_seed)
    return torch.cat(list(grads.values()))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two flat vectors in float64: in float32 the sums over the millions of entries of a
    model's gradient can put an exact match above 1. The dot product over the two norms, each
    clamped to 1e-8 as ``torch.nn.functional.cosine_similarity`` clamps them (a zero vector reads
    0): that function also writes both vectors out normalized, which on a whole model's gradient
    took twenty times as long as the cosine itself."""
    a, b = a.double(), b.double()
    return (a @ b / (a.norm().clamp_min(1e-8) * b.norm().clamp_min(1e-8))).item()


def gradient_cosine(model, inputs: dict, config: DivisionConfig | None = None, seeds=(0, 1, 2), *,
                    select: Callable[[str], bool] | None = None) -> list[float]:
    """Cosine of the division gradient to the exact one, per seed (same dropout masks: same seed).
    ``select``: of the parameters whose name it accepts only (as in :func:`flat_grad`)."""
    return seed_fidelity(model, inputs, config, seeds, select=select).whole


@dataclass
class Fidelity:
    """Division's gradient against the exact one over noise draws (see :func:`gradient_fidelity`)."""

    whole: list[float]  # cosine of the whole gradient, per draw
    per_tensor: dict[str, float]  # minimum over draws of each carrying tensor's cosine
    missing: list[str] = field(default_factory=list)  # tensors with an exact gradient and none under division

    @property
    def worst(self) -> float:
        """The minimum whole-gradient cosine over the draws."""
        return min(self.whole)

    @property
    def median(self) -> float:
        return statistics.median(self.whole)

    @property
    def worst_tensor(self) -> tuple[str, float]:
        """``(name, cosine)`` of the carrying tensor with the lowest cosine in any draw."""
        return min(self.per_tensor.items(), key=lambda item: item[1]) if self.per_tensor else ("", 1.0)

    def summary(self) -> str:
        name, cos = self.worst_tensor
        return (f"cosine min {self.worst:.4f} median {self.median:.4f} over {len(self.whole)} draws; "
                f"per-tensor min {cos:.4f} ({name})" + (f"; no gradient: {self.missing}" if self.missing else ""))


def gradient_fidelity(model, inputs: dict, config: DivisionConfig | None = None, draws: int = 20, *, seed: int = 0,
                      autocast: torch.dtype | None = None, select: Callable[[str], bool] | None = None,
                      share: float = 0.01, dtype: torch.dtype = torch.float64) -> Fidelity:
    """Division's gradient on ``inputs`` against the exact one (the model unpatched, same dropout
    masks) over ``draws`` rounding-noise draws: the whole-gradient cosine per draw, and per tensor
    the minimum cosine over the draws, for the tensors holding at least ``share`` of the exact
    gradient's norm (the others can point anywhere without moving the step). The model is left
    patched or not as it was found. ``dtype``: how the gradients are held between passes
    (:func:`named_grads`; float32 for a model whose float64 copies would not fit twice in memory)."""
    with restored_division(model) as before:
        remove_division(model)
        exact = named_grads(model, inputs, seed, autocast, select=select, dtype=dtype)
        apply_division(model, config or before or DivisionConfig())
        found = Fidelity([], {})
        for draw in range(draws):
            got = named_grads(model, inputs, seed, autocast, select=select, noise_seed=1000 + draw, dtype=dtype)
            _add_draw(found, exact, got, share)
            del got  # before the next draw's copy is made: one copy of the gradient at a time
    return found


def precision_reference(model, inputs: dict, autocast: torch.dtype, *, seed: int = 0,
                        select: Callable[[str], bool] | None = None, share: float = 0.01) -> Fidelity:
    """The unpatched model's own ``autocast`` gradient against its float32 gradient (same dropout
    masks), in :class:`Fidelity`'s terms (one draw): how far the reduced-precision gradient that
    division is compared with already lies from the float32 one, tensor by tensor. The model is
    left patched or not as it was found."""
    with restored_division(model):
        remove_division(model)
        found = Fidelity([], {})
        # the carrying tensors are the autocast gradient's, as in gradient_fidelity under autocast
        _add_draw(found, named_grads(model, inputs, seed, autocast, select=select),
                  named_grads(model, inputs, seed, None, select=select), share)
    return found


def _add_draw(found: Fidelity, exact: dict, got: dict, share: float) -> None:
    """One division gradient ``got`` against ``exact`` into ``found``: its whole cosine, each
    carrying tensor's minimum (a missing one counts 0), the tensors without a gradient."""
    found.missing = sorted(set(found.missing) | (set(exact) - set(got)))
    # the whole gradient's cosine from per-tensor float64 sums: no flat copy of either gradient
    dot = exact_sq = got_sq = torch.zeros((), dtype=torch.float64)
    per_tensor = {}
    for n, g in exact.items():
        e = g.double()
        d = got[n].double() if n in got else torch.zeros_like(e)
        e_dot_d, e_sq, d_sq = e.dot(d), e.dot(e), d.dot(d)
        dot, exact_sq, got_sq = dot + e_dot_d, exact_sq + e_sq, got_sq + d_sq
        per_tensor[n] = (e_sq.sqrt(), _cosine_of_sums(e_dot_d, e_sq, d_sq))
    found.whole.append(_cosine_of_sums(dot, exact_sq, got_sq))
    norm = exact_sq.sqrt()
    for n, (e_norm, c) in per_tensor.items():
        if e_norm >= share * norm:
            found.per_tensor[n] = min(found.per_tensor.get(n, 1.0), c)


def _cosine_of_sums(dot: torch.Tensor, a_sq: torch.Tensor, b_sq: torch.Tensor) -> float:
    """``a.b / (|a| |b|)`` from the float64 sums ``a.b``, ``|a|^2``, ``|b|^2`` (0 where either is 0)."""
    return (dot / (a_sq.sqrt() * b_sq.sqrt()).clamp_min(1e-300)).item()


def seed_fidelity(model, inputs: dict, config: DivisionConfig | None = None, seeds=(0, 1, 2), *,
                  select: Callable[[str], bool] | None = None, share: float = 0.01) -> Fidelity:
    """:func:`gradient_fidelity` with one draw per seed, each against the exact gradient of that
    seed (its own dropout masks and rounding noise as the process left it): the whole cosines are
    :func:`gradient_cosine`'s, and per tensor the minimum over the seeds. What the suites measure."""
    found = Fidelity([], {})
    with restored_division(model) as before:
        for seed in seeds:
            remove_division(model)
            exact = named_grads(model, inputs, seed, select=select)
            apply_division(model, config or before or DivisionConfig())
            _add_draw(found, exact, named_grads(model, inputs, seed, select=select), share)
    return found


def added_variance(model, batches: list[dict], config: DivisionConfig | None = None, draws: int = 2, *, seed: int = 0,
                   autocast: torch.dtype | None = None, select: Callable[[str], bool] | None = None) -> float:
    """Division's added variance as a fraction of the minibatch sampling variance at the size of
    ``batches`` (GACT, ICML 2022): ``mean over batches and draws of |g_div - g|^2`` over ``mean over
    batches of |g - mean g|^2``, with ``g`` each batch's exact gradient. Several batches of the
    same size from one dataset are needed (at least 2; 6 or more for a stable figure)."""
    if len(batches) < 2:
        raise ValueError("added_variance: batches needs at least 2 batches of the same size")
    with restored_division(model) as before:
        remove_division(model)
        exact = [flat_grad(model, b, seed, autocast, select=select) for b in batches]
        apply_division(model, config or before or DivisionConfig())
        added = [(flat_grad(model, b, seed, autocast, select=select, noise_seed=1000 + d) - g).pow(2).sum().item()
                 for b, g in zip(batches, exact) for d in range(draws)]
    mean = torch.stack(exact).mean(0)
    sampling = [(g - mean).pow(2).sum().item() for g in exact]
    # the sample variance about the batches' own mean: n - 1 degrees of freedom
    return statistics.fmean(added) / (sum(sampling) / (len(exact) - 1))
