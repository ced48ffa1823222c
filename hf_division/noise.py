"""Rounding-noise streams for stochastic rounding.

Noise comes from generators of our own (one per device), so the model's RNG stream (dropout) is
untouched and the training forward stays bit-identical. They follow torch's seed: a new
``torch.initial_seed()`` (``torch.manual_seed`` / ``set_seed`` with another seed) restarts them.
Re-seeding torch with the *same* seed is invisible from here, so training loops restart the noise
explicitly with ``reseed(step_seed(seed, step, rank))`` at every optimizer step (the Trainer's
``DivisionCallback``, ``hf_division.accelerate.reseed_for_step``): a run resumed from a checkpoint
then draws, from the resumed step on, the noise of the uninterrupted run (docs/GUIDE.md,
"Reproducibility and resume").
"""
from __future__ import annotations

import hashlib

import torch

_stream = {"base": None, "seed": 0}  # base: torch.initial_seed() when last (re)seeded
_generators: dict[torch.device, torch.Generator] = {}


def reseed(seed: int) -> None:
    """Restart the rounding noise of every device from ``seed`` (an int; 48 bits are used)."""
    _stream.update(base=torch.initial_seed(), seed=int(seed))
    _generators.clear()


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The noise seed of optimizer step ``step`` on process ``rank`` of a run seeded with ``seed``
    (a hash: neighbouring steps and ranks get unrelated streams)."""
    digest = hashlib.blake2b(f"{int(seed)}/{int(step)}/{int(rank)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def generator(device: torch.device) -> torch.Generator:
    """The rounding-noise generator for ``device`` (see the module doc)."""
    base = torch.initial_seed()
    if _stream["base"] != base:
        reseed(base)
    gen = _generators.get(device)
    if gen is None:
        gen = _generators[device] = torch.Generator(device=device)
        gen.manual_seed((_stream["seed"] ^ 0x5EED_D1F1) & 0xFFFF_FFFF_FFFF)
    return gen
