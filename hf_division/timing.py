"""Median step times of several methods, measured interleaved.

Each round times one step of every method in turn, the first method rotated from round to round,
so machine noise and warm caches hit all methods alike; round 0 warms up (compilation, allocator
pools) and is discarded (docs/RESULTS.md, How it is measured).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def timed(step: Callable[[], object], device: str = "cpu") -> float:
    """Seconds ``step()`` takes, CUDA work included."""
    sync = _sync(device)
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - t0


def _sync(device: str) -> Callable[[], None]:
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def interleaved_medians(names: list[str], seconds: Callable[[str], float], rounds: int,
                        before_round: Callable[[int], None] | None = None) -> dict[str, float]:
    """``{name: median seconds}`` over ``rounds`` rounds; ``seconds(name)`` times one step of ``name``.
    ``before_round(r)``, if given, runs before round ``r`` (0: the warm-up), e.g. to give every
    method of that round the same new batch."""
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        if before_round is not None:
            before_round(r)
        start = r % len(names)
        for name in names[start:] + names[:start]:
            dt = seconds(name)
            if r:
                times[name].append(dt)
    return {n: statistics.median(v) for n, v in times.items()}
