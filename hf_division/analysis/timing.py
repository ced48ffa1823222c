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
    return timed_host(step, device)[1]


def timed_host(step: Callable[[], object], device: str = "cpu") -> tuple[float, float]:
    """``(host seconds, seconds)`` of ``step()``: until it returned, and with its CUDA work done.
    On a GPU the first is what the host spends sending the step (where the launch queue is full,
    the host waits in it too); the step takes about the larger of that and the GPU's own time
    (docs/DESIGN.md, "On a GPU": host time)."""
    sync = _sync(device)
    sync()
    t0 = time.perf_counter()
    step()
    host = time.perf_counter() - t0
    sync()
    return host, time.perf_counter() - t0


def median_time(fn: Callable[[], object], rounds: int = 7) -> float:
    """Median seconds of ``rounds`` calls of ``fn`` (CPU), after one untimed warm-up call: for
    kernels timed alone, where one method at a time is enough."""
    fn()
    return statistics.median(timed(fn) for _ in range(rounds))


def _sync(device: str) -> Callable[[], None]:
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def interleaved_times(names: list[str], seconds: Callable[[str], float], rounds: int,
                      before_round: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """``{name: [seconds of each round]}`` over ``rounds`` rounds (the warm-up round dropped);
    ``seconds(name)`` times one step of ``name``. ``before_round(r)``, if given, runs before round
    ``r`` (0: the warm-up), e.g. to give every method of that round the same new batch."""
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        if before_round is not None:
            before_round(r)
        start = r % len(names)
        for name in names[start:] + names[:start]:
            dt = seconds(name)
            if r:
                times[name].append(dt)
    return times


def interleaved_medians(names: list[str], seconds: Callable[[str], float], rounds: int,
                        before_round: Callable[[int], None] | None = None) -> dict[str, float]:
    """``{name: median seconds}`` of :func:`interleaved_times`."""
    times = interleaved_times(names, seconds, rounds, before_round)
    return {n: statistics.median(v) for n, v in times.items()}


def round_ratios(times: dict[str, list[float]], ref: str) -> dict[str, tuple[float, float, float]]:
    """``{name: (median, first quartile, third quartile)}`` of each round's ratio to ``ref``'s time
    in the same round. Machine load that drifts over minutes moves both steps of a round alike,
    so these ratios spread less than the ratio of two medians taken over all rounds."""
    out = {}
    for name, ts in times.items():
        ratios = sorted(t / r for t, r in zip(ts, times[ref]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out[name] = (statistics.median(ratios), q[0], q[2])
    return out


def quartile_ratios(times: dict[str, list[float]], ref: str) -> dict[str, float]:
    """``{name: first quartile of its times / first quartile of ref's}``. Another process or a
    neighbour on the machine only ever adds time to a step, so the faster steps of each arm are
    the ones least touched by it; the first quartile takes them without resting on one extreme
    round as the minimum would (docs/RESULTS.md, How it is measured)."""
    def q1(ts):
        return statistics.quantiles(ts, n=4)[0] if len(ts) > 1 else ts[0]

    base = q1(times[ref])
    return {name: q1(ts) / base for name, ts in times.items()}
