"""The process's memory as the kernel reports it, and :class:`StepLog`, the Trainer callback that
logs each step's time and peak (what ``hf-division run`` installs under ``HF_DIVISION_STEP_LOG``).
"""
from __future__ import annotations

import gc
import json
import os
import resource
import time
import torch
import transformers


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
