"""glibc's allocator settings for a peak measurement, importable before torch.

glibc reads ``MALLOC_*`` at start-up only, so a script that needs them re-executes itself; doing
that before importing torch and Transformers saves the re-executed process's imports being paid
twice (docs/RESULTS.md, How it is measured).
"""
from __future__ import annotations

import os
import sys

#: glibc: allocations over 64 KiB mmap-served and returned to the system when freed
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def reexec_under_malloc_env() -> None:
    """Replace this process by itself with :data:`MALLOC_ENV` set, unless it is set already."""
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, **MALLOC_ENV))
