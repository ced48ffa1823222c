"""A compiled Triton kernel launched again without Triton's per-call dispatch (the ``triton_launch``
switch; docs/DESIGN.md, "On a GPU": host time).

Why: ``kernel[grid](*args)`` binds the arguments, specializes each one, builds a cache key and
looks the compiled kernel up on every call, then builds launch metadata for the launch hooks.
Division launches three to five kernels per saved tensor, each running a few microseconds on a
GPU, so that dispatch is a share of the host's step that a GPU may wait for (docs/RESULTS.md,
"Kernel launches": the ``dispatch`` suite times both ways).

Here the first call with a given key goes through Triton (which compiles or finds the kernel and
launches it) and keeps the compiled kernel that Triton returns. Later calls with that key launch it
as Triton's dispatch ends, through ``CompiledKernel.run``, with no metadata built while no launch
hook is installed. The key determines Triton's specialization, or is finer: each tensor's dtype and
address modulo 16 (Triton: whether 16 divides it), each scalar's type and value, the constexprs and
options by name and value, the device. ``tests/kernels/test_launcher.py`` checks, through a
simulated CUDA driver, that both ways hand the launcher the same kernels and arguments.
"""
from __future__ import annotations

import operator
import warnings

import torch

from hf_division.kernels.switches import configure

#: entries per kernel before its keys are dropped (scalars are keyed by value: a run whose
#: sequence lengths vary adds keys; each new key costs one dispatch through Triton)
MAX_KEYS = 4096


class _Kernel:
    """One jit function's launches: which arguments are pointers, and the compiled kernels by key."""

    __slots__ = ("fn", "names", "layouts", "compiled")

    def __init__(self, fn):
        self.fn = fn
        self.names = tuple(fn.arg_names)
        self.layouts = {}  # number of positional arguments -> (pointers' getter, scalars' getter)
        self.compiled = {}

    def layout(self, n: int):
        """Getters of the pointer and of the scalar arguments among the first ``n`` (pointers:
        the parameters named ``*_ptr``, as every kernel of :mod:`.triton_kernels` names them)."""
        got = self.layouts.get(n)
        if got is None:
            ptrs = [i for i, name in enumerate(self.names[:n]) if name.endswith("_ptr")]
            rest = [i for i in range(n) if i not in ptrs]
            got = self.layouts[n] = (_getter(ptrs), _getter(rest))
        return got


def _getter(idx: list):
    """``args -> tuple(args[i] for i in idx)`` at C speed."""
    if not idx:
        return lambda args: ()
    get = operator.itemgetter(*idx)
    return get if len(idx) > 1 else (lambda args: (get(args),))


_DTYPE = operator.attrgetter("dtype")
_kernels: dict = {}  # id(jit function) -> _Kernel (the kernels live as long as their module)
_triton: list = []  # Triton's runtime knobs and driver, imported at the first launch


def key(fn, args: tuple, meta: dict, options: dict):
    """``(the kernel's launches, what determines Triton's specialization of fn for this call, the
    device aside)``; the second None where a pointer argument is not a tensor."""
    k = _kernel(fn)
    n = len(args)
    ptrs, scalars = k.layout(n)
    s, p = scalars(args), ptrs(args)
    try:
        # one flat tuple (hashed faster than nested ones): for one kernel and n, the number of pointers
        # and scalars is fixed, and so is the number of constexprs (keep_first keeps no other)
        return k, (n, *map(_DTYPE, p), *[t.data_ptr() & 15 for t in p], *s, *map(type, s), *meta.items(),
                   *options.items())
    except AttributeError:  # a pointer argument that is not a tensor: never kept
        return k, None


def launch(fn, grid: tuple, args: tuple, meta: dict, options: dict) -> None:
    """``fn[grid](*args, **meta, **options)`` on the current CUDA device and stream, through the
    compiled kernel kept for this key after its first launch."""
    k, spec = key(fn, args, meta, options)
    if spec is None:
        fn[grid](*args, **meta, **options)
        return
    full = (current_device(), spec)
    entry = k.compiled.get(full)
    if entry is None:
        keep_first(k, full, grid, args, meta, options)
        return
    run_kept((fn, *entry), grid, args, meta, options)


def current_device() -> int:
    """The current CUDA device's index, as Triton's driver gives it (imported at the first call)."""
    if not _triton:
        from triton import knobs
        from triton.runtime.driver import driver

        _triton.extend((knobs.runtime, driver))
    return _triton[1].active.get_current_device()


def kept(fn, args: tuple, meta: dict, options: dict):
    """What :func:`launch` keeps for this call's key on the current device, once it has launched
    it: ``(fn, compiled kernel, constexprs in parameter order)``, for :func:`run_kept`; None where
    nothing is kept (a pointer argument that is not a tensor, a kernel Triton's dispatch returned
    no compiled kernel for)."""
    k, spec = key(fn, args, meta, options)
    entry = None if spec is None else k.compiled.get((current_device(), spec))
    return None if entry is None else (fn, *entry)


def run_kept(entry: tuple, grid: tuple, args: tuple, meta: dict, options: dict) -> None:
    """Launch :func:`kept`'s ``entry`` with ``args`` on the current stream, as Triton's dispatch
    ends: the caller vouches that ``args`` have the key ``entry`` was kept under (``meta`` and
    ``options``: the launch's, for Triton's dispatch where the launcher refuses the arguments)."""
    fn, kernel, tail = entry
    runtime, driver = _triton
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    values = args + tail
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    if getattr(enter, "calls", True) or getattr(exit_, "calls", True):  # hooks to call: their metadata
        metadata = kernel.launch_metadata(grid, stream, *values)
    else:  # chains with no hook in them (Triton's default): no metadata built, no chain called
        metadata = enter = exit_ = None
    # the end of Triton's JITFunction.run (3.6 to 3.9)
    n = len(grid)
    try:
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
                   kernel.packed_metadata, metadata, enter, exit_, *values)
    except (TypeError, AttributeError) as err:  # a Triton whose launcher takes other arguments: raised before launching
        _give_up(err)
        fn[grid](*args, **meta, **options)


def pointers(fn, n: int):
    """``args -> the pointer arguments among them`` for ``n`` positional arguments of ``fn`` (the
    parameters named ``*_ptr``)."""
    return _kernel(fn).layout(n)[0]


def _kernel(fn) -> _Kernel:
    """``fn``'s :class:`_Kernel`, made at its first launch."""
    k = _kernels.get(id(fn))
    if k is None:
        k = _kernels[id(fn)] = _Kernel(fn)
    return k


def _give_up(err: Exception) -> None:
    """Turn the ``triton_launch`` switch off for the process, saying why (Triton's dispatch then
    launches every kernel, as with the switch off)."""
    warnings.warn(f"hf-division: launching kept Triton kernels failed ({type(err).__name__}: {err}); every launch goes "
                  "through Triton's dispatch from now on (the triton_launch switch is off)", RuntimeWarning, stacklevel=3)
    configure(triton_launch=False)


def keep_first(k: _Kernel, full: tuple, grid: tuple, args: tuple, meta: dict, options: dict) -> None:
    """Launch through Triton and keep what it returns, where every pointer argument is a tensor
    and every tensor a pointer argument (else nothing is kept: each call takes Triton's way)."""
    kernel = k.fn[grid](*args, **meta, **options)
    ptrs, scalars = k.layout(len(args))
    if (kernel is None or not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))
            or not all(isinstance(t, torch.Tensor) for t in ptrs(args))
            or any(isinstance(v, torch.Tensor) for v in scalars(args))
            or set(k.names[len(args):]) != set(meta)):
        return
    if len(k.compiled) >= MAX_KEYS:
        k.compiled.clear()
    k.compiled[full] = (kernel, tuple(meta[name] for name in k.names[len(args):]))


def forget() -> None:
    """Drop every kept kernel (the next launch of each goes through Triton again)."""
    _kernels.clear()
