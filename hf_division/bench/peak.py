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
from typing import Callable
import torch
from hf_division.bench.malloc_env import MALLOC_ENV
from hf_division.integrations.step_log import high_water, malloc_trim, reset_high_water, rss


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
