"""Triton's launch path on a machine without a GPU: a stand-in CUDA driver under which the
compressor's kernels compile for an H100/H200 (sm_90) and go through Triton's dispatch and
``CompiledKernel``'s launch, all but the driver's own call, which records its arguments instead of
running (docs/DESIGN.md, "On a GPU": host time).

What it is for: timing the host's share of a launch (``python -m hf_division.bench dispatch``) and
checking that :mod:`hf_division.kernels.launcher` hands the launcher what Triton's dispatch hands
it (``tests/kernels/test_launcher.py``). Nothing runs, so outputs stay unwritten. CPU tensors stand
for CUDA tensors (the pipeline takes the GPU's path inside it). The first launch of each
specialization compiles (seconds; Triton caches the result on disk). It runs in a process started
without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import contextlib
import dataclasses

from hf_division.kernels import triton_codec

#: an H100's or H200's: sm_90, 32-thread warps, 227 KiB of shared memory per block, 1024 threads
_ARCH, _WARP, _SHARED, _THREADS = 90, 32, 232448, 1024


class Launches(list):
    """The launches the stand-in driver received, in order (``keep=False``: counted in ``n``
    only): each ``(kernel name, grid, stream, function, metadata, launch metadata, enter hook,
    exit hook, arguments)``, ``function`` the compiled kernel's :class:`Binary`. ``binaries``:
    each kernel compiled (or found in Triton's cache) on the way, as Triton loads it (the kernels a
    step specializes: ``python -m hf_division.bench kernels --step``); ``grids`` (``grids=True``):
    each launch's ``(Binary, grid)``, without its arguments."""

    def __init__(self, keep: bool = True, grids: bool = False):
        super().__init__()
        self.keep, self.n = keep, 0
        self.binaries: list[Binary] = []
        self.grids: list | None = [] if grids else None


@dataclasses.dataclass(frozen=True, eq=False)
class Binary:
    """One compiled kernel as the driver is handed it: its name, constexprs by name, warps, the
    cubin."""
    name: str
    constants: dict
    num_warps: int
    cubin: bytes


class _Utils:
    def __init__(self, record: Launches):
        self.record, self.pending = record, None

    def load_binary(self, name, kernel, shared, device):
        # Triton hands the launcher its source and metadata (launcher_cls) just before the binary
        src, metadata = self.pending or (None, None)
        constants = {} if src is None else {src.fn.arg_names[k[0]]: v for k, v in src.constants.items() if len(k) == 1}
        binary = Binary(name, constants, getattr(metadata, "num_warps", 0), bytes(kernel))
        self.record.binaries.append(binary)
        return object(), binary, 32, 0, _THREADS  # module, function, registers, spills, threads

    def get_device_properties(self, device):
        return {"max_shared_mem": _SHARED, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": _WARP, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}


class _Driver:
    """What Triton asks of the active driver on the way to a launch."""

    def __init__(self, record: Launches):
        self.record = record
        self.utils = _Utils(record)

    def is_active(self) -> bool:
        return True

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device) -> int:
        return 7  # a stream handle the records show

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", _ARCH, _WARP)

    def launcher_cls(self, src, metadata):
        record, name = self.record, src.fn.__name__
        self.utils.pending = (src, metadata)

        def run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
            if enter is not None:
                enter(launch_metadata)
            record.n += 1
            if record.grids is not None:
                record.grids.append((function, (gx, gy, gz)))
            if record.keep:
                record.append((name, (gx, gy, gz), stream, function, packed_metadata, launch_metadata, enter, exit_, args))
            if exit_ is not None:
                exit_(launch_metadata)

        return run


@contextlib.contextmanager
def simulated_cuda(keep: bool = True, grids: bool = False):
    """Inside, the compressor's Triton launches compile for sm_90 and reach a recording stand-in
    of the CUDA launcher (the :class:`Launches` are yielded; ``keep=False``: counted only;
    ``grids``: each launch's kernel and grid kept), with CPU tensors taking the GPU's path."""
    import triton
    from triton.runtime.driver import driver

    if triton.knobs.runtime.interpret:
        raise RuntimeError("hf-division: simulated_cuda() compiles the kernels, which Triton cannot do in a process "
                           "started with TRITON_INTERPRET=1 (its own jit helpers are interpreted there): run it in one "
                           "without")
    from hf_division.kernels import triton_kernels

    record = Launches(keep, grids)
    previous = getattr(driver, "_active", None)  # None where no driver was asked for yet (reset_active would probe)
    driver.set_active(_Driver(record))
    try:
        with triton_codec.on_cpu(), triton_codec.kernels_from(triton_kernels):
            yield record
    finally:
        driver.set_active(previous)
