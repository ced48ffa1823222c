"""Peak memory of a training step, measured in a process where nothing else ran.

CPU: the resident-set high-water mark (``VmHWM``, what ``getrusage`` reports as ``ru_maxrss``),
reset to the current resident set through ``/proc/self/clear_refs`` before the step, with glibc
told to serve allocations over 64 KiB by mmap (:data:`MALLOC_ENV`) so that freed memory leaves the
process and the mark follows the live bytes. CUDA: ``torch.cuda.max_memory_allocated``.

A measurement wants a clean process: :func:`run_clean` starts a fresh interpreter with
:data:`MALLOC_ENV` (glibc reads it at start-up only) and :func:`forked` runs each job in a child
forked from the caller, which has imported the libraries but run nothing, so the fork is cheap
and every job starts from the same memory (docs/RESULTS.md, How it is measured).
"""
from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import time
from typing import Callable

import torch
import transformers

#: glibc: allocations over 64 KiB mmap-served and returned to the system when freed
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_high_water() -> bool:
    """Reset the resident high-water mark to the current resident set (Linux >= 4.0); False where
    the kernel refuses, and the mark then only grows (measure sizes in increasing order)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def high_water() -> int:
    """Resident high-water mark of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def malloc_trim() -> None:
    """Hand glibc's free heap back to the system, so the next step starts from live bytes only."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def step_peak(step: Callable[[], object], device: str = "cpu") -> tuple[int, str]:
    """``(bytes, how)``: peak memory while ``step()`` runs, above the memory just before it."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, "torch.cuda.max_memory_allocated"
    malloc_trim()
    reset = reset_high_water()
    before = rss()
    step()
    how = "RSS high-water (clear_refs reset)" if reset else "ru_maxrss (no reset; sizes ascending)"
    return high_water() - before, how


def process_peak_bytes() -> tuple[int, str]:
    """``(bytes, kind)``: the peak memory of this whole process so far (weights included)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_rss_high_water"


def forked(job: Callable[[object], object], items: list) -> list:
    """``[job(item) for item in items]``, each call in a child forked from this process; results
    travel back as JSON. A failing child is reported, never continued in the caller's loop."""
    results = []
    for item in items:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            code = 0
            try:
                result = job(item)
            except BaseException as err:
                result, code = {"error": f"{type(err).__name__}: {err}"}, 1
            with os.fdopen(write, "w") as f:
                json.dump(result, f)
            os._exit(code)
        os.close(write)
        with os.fdopen(read) as f:
            text = f.read()
        os.waitpid(pid, 0)
        results.append(json.loads(text) if text else {"error": "child died"})
    failed = {str(item): r["error"] for item, r in zip(items, results) if isinstance(r, dict) and "error" in r}
    if failed:
        raise RuntimeError(f"measurement failed: {failed}")
    return results


def run_clean(argv: list[str], what: str):
    """Run ``python ARGV`` in a fresh interpreter with :data:`MALLOC_ENV`; its last line of
    output is JSON, returned parsed. ``what`` names the run in the error."""
    res = subprocess.run([sys.executable, *argv], env=dict(os.environ, **MALLOC_ENV), capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{what} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


class StepLog(transformers.TrainerCallback):
    """Writes one JSON line per optimizer step of a ``Trainer``: wall seconds, the process's peak
    memory during the step (absolute: CPU resident high-water reset at the step's start; CUDA
    ``max_memory_allocated``), and the logged loss. How ``hf-division run`` measures an unmodified
    script (``HF_DIVISION_STEP_LOG=PATH``); the garbage collection and trim before each step are
    outside the timed window."""

    def __init__(self, path: str):
        self.path, self.start, self.loss = path, 0.0, {}

    def on_step_begin(self, args, state, control, **kwargs):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            malloc_trim()
            reset_high_water()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.start
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else high_water()
        self.write({"step": state.global_step, "seconds": seconds, "peak_bytes": peak})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.write({"step": state.global_step, "loss": logs["loss"]})

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
