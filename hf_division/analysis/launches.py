"""What a training step would launch on a GPU, counted on any machine: the torch ops that run a
kernel, the Triton kernels, and the ops that read a value back on the host (docs/DESIGN.md, "On a
GPU"). A GPU runs a small kernel in about the time the host takes to launch it, so the count is
the CPU-side measure of what the host must keep up with; a readback stalls the device and breaks
CUDA-graph capture.

On a CPU machine the GPU's path runs on CPU tensors inside :func:`gpu_path` (the Triton kernels
under ``TRITON_INTERPRET=1``, the CPU-only fast paths off).
"""
from __future__ import annotations

import collections
import contextlib
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_division.kernels import configured, triton_codec

#: ops that allocate, view or alias: no kernel
NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "_unsafe_view", "as_strided",
    "alias", "detach", "permute", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "reshape",
    "_reshape_alias", "view_as", "lift_fresh", "resolve_conj", "resolve_neg", "unbind", "split", "chunk",
    "split_with_sizes", "is_same_size", "_has_compatible_shallow_copy_type", "set_", "promote_types"})
#: ops that read a device value back on the host, or size their output by one
READBACKS = frozenset({"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal",
                       "is_nonzero", "repeat_interleave", "masked_scatter", "bincount", "tolist"})
#: the CPU-only fast paths, off as on a GPU
GPU_SWITCHES = dict(native=False, native_draws=False, gated_from_codes=False, sdpa_backward=False)


class KernelCounter(TorchDispatchMode):
    """Counts, while active, the torch ops that would launch a kernel (``ops``, a Counter by op
    name) and those that would read back on the host (``readbacks``, in order), leaving out what
    runs inside a Triton launch (the interpreter's own copies)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.readbacks: list[str] = []
        self._triton = 0

    def __enter__(self):
        self._triton = triton_codec.launches()
        return super().__enter__()

    def __exit__(self, *exc):
        self._triton = triton_codec.launches() - self._triton
        return super().__exit__(*exc)

    @property
    def triton(self) -> int:
        """Triton kernels launched while active (after exit)."""
        return self._triton

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not triton_codec.launching():
            if name in READBACKS or _bool_index(func, args):
                self.readbacks.append(name)
            elif name not in NO_KERNEL:
                self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _bool_index(func, args) -> bool:
    """Indexing by a boolean mask: a nonzero, then a readback of its count."""
    return func is torch.ops.aten.index.Tensor and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))


@contextlib.contextmanager
def gpu_path():
    """Inside, CPU tensors take the GPU's path: the Triton kernels (interpreted), no CPU-only fast path."""
    with configured(**GPU_SWITCHES), triton_codec.on_cpu():
        yield


def train_step(model: torch.nn.Module, batch: dict, autocast: torch.dtype | None = None) -> float:
    """One training step: forward under ``autocast`` on the model's device, backward, ``zero_grad``;
    the host's seconds until the forward returned its loss (on a GPU, not synchronized)."""
    device = next(model.parameters()).device.type
    start = time.perf_counter()
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = model(**batch).loss
    forward = time.perf_counter() - start
    loss.backward()
    model.zero_grad(set_to_none=True)
    return forward


def step_counts(model: torch.nn.Module, batch: dict, autocast: torch.dtype | None = None) -> KernelCounter:
    """One training step (:func:`train_step`) counted, after one uncounted step (set-up,
    compilation, seed blocks)."""
    train_step(model, batch, autocast)
    counter = KernelCounter()
    with counter:
        train_step(model, batch, autocast)
    return counter
