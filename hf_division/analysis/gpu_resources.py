"""What each Triton kernel of the package takes of an H100's or H200's multiprocessor, read without a
GPU from the cubin Triton compiles for sm_90: registers per thread, the stack (registers spilled to
local memory, which a GPU reads and writes like global memory), the machine instructions, and how
many of its programs a multiprocessor holds at once (docs/DESIGN.md, "On a GPU": registers).

Why: the compressor's kernels move data and compute little, so a GPU runs them as fast as it keeps
loads in flight, which is what resident warps and unspilled registers decide. Those are fixed when
the kernel compiles, so a CPU machine can check them (``tests/analysis/test_gpu_resources.py``);
the time itself only a GPU measures.

The tools are the ones Triton ships for its own use (``cuobjdump`` and ``nvdisasm``, found through
``triton.knobs.nvidia``); run it in a process without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass

#: an sm_90 multiprocessor's limits (CUDA C++ Programming Guide, "Compute Capabilities", the table
#: of technical specifications, 9.0): 32-bit registers, resident warps, resident blocks, shared
#: memory (bytes, the 1 KiB the driver reserves per block included below), and the register
#: allocation unit (per warp)
SM90 = dict(registers=65536, warps=64, blocks=32, shared=233472, shared_reserved=1024, register_unit=256)
#: an H200's (and an H100 SXM's) multiprocessors
H200_SMS = 132


@dataclass(frozen=True)
class Usage:
    """One compiled kernel's resources."""
    warps: int
    registers: int
    stack: int
    shared: int
    instructions: int
    loads: int = 0  # global loads in the code (LDG)
    wide_loads: int = 0  # of them, 16 bytes wide (LDG.E.128): aligned, vectorized

    def resident(self, sm: dict = SM90) -> int:
        """Programs (thread blocks) of this kernel a multiprocessor holds at once."""
        return resident(self.registers, self.warps, self.shared, sm)

    def row(self) -> dict:
        return {**asdict(self), "resident": self.resident(), "resident_warps": self.resident() * self.warps}


def resident(registers: int, warps: int, shared: int, sm: dict = SM90) -> int:
    """Blocks of ``warps`` warps, ``registers`` per thread and ``shared`` bytes a multiprocessor
    holds at once: the least of what its registers (allocated per warp in units of
    ``register_unit``), its warps, its blocks and its shared memory allow."""
    unit = sm["register_unit"]
    per_warp = -(-registers * 32 // unit) * unit
    by_registers = sm["registers"] // (per_warp * warps) if per_warp else sm["blocks"]
    by_shared = sm["shared"] // (shared + sm["shared_reserved"])
    return min(by_registers, sm["warps"] // warps, sm["blocks"], by_shared)


def _tool(name: str) -> str:
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def resource_line(text: str) -> dict:
    """``cuobjdump -res-usage``'s line of a function (``REG:n STACK:n SHARED:n LOCAL:n ...``) as
    integers; ValueError where the text has none."""
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if m is None:
        raise ValueError(f"hf-division: no resource usage in cuobjdump's output: {text[-300:]!r}")
    return dict(zip(("registers", "stack", "shared", "local"), map(int, m.groups())))


def count_instructions(sass: str) -> int:
    """Machine instructions in ``nvdisasm``'s listing (one ``/*address*/`` per instruction)."""
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.M))


def count_loads(sass: str) -> tuple[int, int]:
    """Global loads in ``nvdisasm``'s listing, and those of them 16 bytes wide."""
    loads = re.findall(r"\bLDG(\.[\w.]+)?", sass)
    return len(loads), sum(".128" in suffix for suffix in loads)


def usage(kernel) -> Usage:
    """A Triton ``CompiledKernel``'s :class:`Usage`, from its cubin."""
    return usage_of(kernel.asm["cubin"], kernel.metadata.num_warps)


def usage_of(cubin: bytes, warps: int) -> Usage:
    """The :class:`Usage` of a kernel compiled to ``cubin`` to run with ``warps`` warps a program."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True)
        sass = subprocess.run([_tool("nvdisasm"), path], capture_output=True, text=True, check=True)
    r = resource_line(res.stdout)
    loads, wide = count_loads(sass.stdout)
    return Usage(warps=warps, registers=r["registers"], stack=r["stack"] + r["local"], shared=r["shared"],
                 instructions=count_instructions(sass.stdout), loads=loads, wide_loads=wide)


def report(arch: int = 90) -> dict:
    """``{variant: Usage}`` for every kernel variant :func:`hf_division.kernels.triton_variants.compile_variants`
    compiles."""
    from hf_division.kernels import triton_variants

    return {variant: usage(kernel) for variant, kernel in triton_variants.compile_variants(arch).items()}
