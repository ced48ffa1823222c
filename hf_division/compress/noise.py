"""Rounding-noise streams for stochastic rounding.

Noise comes from generators of our own (one per device), so the model's RNG stream (dropout) is
untouched and the training forward stays bit-identical. They follow torch's seed: a new
``torch.initial_seed()`` (``torch.manual_seed`` / ``set_seed`` with another seed) restarts them.
Re-seeding torch with the *same* seed is invisible from here, so training loops restart the noise
explicitly with ``reseed(step_seed(seed, step, rank))`` at every optimizer step (the Trainer's
``DivisionCallback``, ``hf_division.integrations.accelerate.reseed_for_step``): a run resumed from a checkpoint
then draws, from the resumed step on, the noise of the uninterrupted run (docs/GUIDE.md,
"Reproducibility and resume").

Each patched model draws from generators of its own (:func:`model_stream`, entered by its
forward), so one model's noise does not depend on what another drew in between (an EMA or teacher
copy, a second model in one script). After each (re)seed, models are numbered in the order their
first training forward runs: the first gets the stream a lone model always had (so every existing
guarantee holds for it), the k-th one mixed with k.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref

import torch

from hf_division.quant.rounding import noise_seed

_stream = {"base": None, "seed": 0, "next": 0}  # base: torch.initial_seed() when last (re)seeded
_numbering = threading.Lock()  # models forwarding in several threads at once get distinct numbers


class _Running(threading.local):
    """The model whose forward runs in this thread (its number): replicas forwarding in threads
    (DataParallel) or a second model in another thread must not draw from each other's stream."""
    salt = 0


_running = _Running()
_generators: dict[tuple, torch.Generator] = {}  # (device, salt) -> generator
_salts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its number since the last seed


def reseed(seed: int) -> None:
    """Restart the rounding noise of every device and model from ``seed`` (an int; 48 bits are used)."""
    _stream.update(base=torch.initial_seed(), seed=int(seed), next=0)
    _generators.clear()
    _salts.clear()


def _follow_torch_seed() -> None:
    base = torch.initial_seed()
    if _stream["base"] != base:
        reseed(base)


@contextlib.contextmanager
def model_stream(model):
    """Draw rounding noise from ``model``'s own streams inside (see the module doc)."""
    _follow_torch_seed()
    salt = _salts.get(model)
    if salt is None:
        with _numbering:
            salt = _salts.get(model)
            if salt is None:
                salt = _salts[model] = _stream["next"]
                _stream["next"] += 1
    before = _running.salt
    _running.salt = salt
    try:
        yield
    finally:
        _running.salt = before


@contextlib.contextmanager
def untouched():
    """Draws inside leave every stream as it was: a measuring forward before a step (the
    Trainer's choice of ``division_checkpointing``) must not shift the noise that step draws."""
    before = {key: gen.get_state() for key, gen in _generators.items()}
    try:
        yield
    finally:
        for key in list(_generators):
            if key in before:
                _generators[key].set_state(before[key])
            else:
                del _generators[key]


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The noise seed of optimizer step ``step`` on process ``rank`` of a run seeded with ``seed``
    (a hash: neighbouring steps and ranks get unrelated streams)."""
    digest = hashlib.blake2b(f"{int(seed)}/{int(step)}/{int(rank)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def generators(device) -> list[torch.Generator]:
    """The rounding-noise generators made so far for ``device``: what a CUDA graph capturing a
    division step registers (``CUDAGraph.register_generator_state``) so that each replay draws new
    noise (docs/GUIDE.md, "On a GPU")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return [gen for (dev, _), gen in _generators.items() if dev == device]


def generator(device: torch.device) -> torch.Generator:
    """The rounding-noise generator for ``device`` and the model running (see the module doc)."""
    _follow_torch_seed()
    salt = _running.salt
    gen = _generators.get((device, salt))
    if gen is None:
        gen = _generators[(device, salt)] = torch.Generator(device=device)
        seed = _stream["seed"] if salt == 0 else step_seed(_stream["seed"], 0, -salt)
        gen.manual_seed((seed ^ 0x5EED_D1F1) & 0xFFFF_FFFF_FFFF)
    return gen


#: seeds drawn at once for a tensor off the CPU (docs/DESIGN.md, "On a GPU")
SEED_BLOCK = 256
#: generators whose seed blocks are kept (the oldest is dropped past this; it draws a new block
#: when it is next used)
KEPT_BLOCKS = 64
# id(generator) -> (generator, its block). Not a WeakKeyDictionary: torch.Generator takes weak
# references from PyTorch 2.13 on, and the lent GPU machines run 2.11 (docs/GUIDE.md, "On a GPU").
# The generator is held with its block, so that an id is never read for another generator.
_blocks: dict[int, tuple[torch.Generator, dict]] = {}


def tensor_seed(device: torch.device, gen: torch.Generator | None, blocks: bool) -> torch.Tensor:
    """A 0-d int64 seed in ``[0, 2**32)`` on ``device`` for one tensor's rounding noise, drawn from
    ``gen`` (:func:`~hf_division.quant.rounding.noise_seed`).

    With ``blocks`` (the GPU's path), seeds are drawn :data:`SEED_BLOCK` at a time and handed out as
    views, one each: a draw is a kernel launch, and a saved tensor's whole compression is one to
    three (docs/DESIGN.md, "On a GPU"). The block is drawn again where ``gen`` was reseeded or
    moved since (its seed and offset differ from what the draw left), and where a CUDA graph is
    being captured and the block was not drawn inside it, so that every replay draws its own noise."""
    if not blocks or gen is None:
        return noise_seed(device, gen)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    held, block = _blocks.get(id(gen), (None, None))
    if held is not gen or block["next"] >= SEED_BLOCK or block["mark"] != _mark(gen) or block["captured"] != capturing:
        seeds = torch.randint(0, 2**32, (SEED_BLOCK,), dtype=torch.int64, generator=gen, device=gen.device).to(device)
        # handed out as views made at once: one indexing op per tensor cost more host time
        block = {"seeds": seeds.unbind(0), "next": 0, "mark": _mark(gen), "captured": capturing}
        _blocks.pop(id(gen), None)
        while len(_blocks) >= KEPT_BLOCKS:
            _blocks.pop(next(iter(_blocks)), None)
        _blocks[id(gen)] = (gen, block)
    seed = block["seeds"][block["next"]]
    block["next"] += 1
    return seed


def _mark(gen: torch.Generator) -> tuple:
    """Where ``gen`` stands: its seed and its offset (a counter-based CUDA generator) or state."""
    if gen.device.type == "cuda":
        return gen.initial_seed(), gen.get_offset()
    return gen.initial_seed(), bytes(gen.get_state().numpy())
