"""Triton's interpreter without its per-call re-patching of ``triton.language`` (tests only).

Why: under ``TRITON_INTERPRET=1`` every call of a ``@triton.jit`` device function from inside a
kernel (Triton 3.9's ``InterpretedFunction.__call__``) patches ``triton.language`` again, walking
five modules with ``inspect.getmembers``, although the launch (``GridExecutor.__call__``) has
patched the same module objects already and keeps them patched until it ends. The kernels here
call small device functions in their loops, so in an interpreted training step that re-patching
took a quarter of the interpreter's time under cProfile (``_patch_lang`` 38 s of 148 in
``test_a_training_step_through_the_kernels_matches_the_torch_path[None]``, now in
tests/kernels/test_triton_steps.py); without the profiler, tests/test_triton.py (those steps
then in it), tests/kernels and tests/analysis/test_gpu_resources.py took 272 s with it spared
against 333 s on 2 workers (``HF_DIVISION_TEST_REPATCH=1`` for the latter). Nothing a
kernel computes changes: :func:`install` leaves to Triton a call outside a launch and the first
call in a launch of a device function whose module sees a language module the launch has not
patched yet (``triton.language.core`` for ``tl.max``; Triton leaves that patch in place to the
launch's end, as it leaves every device call's), and does nothing where Triton's function is not
the one described (another version).
"""
from __future__ import annotations

import contextlib
import inspect
import threading

_launching = threading.local()


def install() -> bool:
    """Patch Triton's interpreter as the module doc says; whether it was (False: Triton missing or
    its interpreter not as described)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    call = getattr(getattr(interpreter, "InterpretedFunction", None), "__call__", None)
    grid = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    names = getattr(getattr(call, "__code__", None), "co_names", ())
    if ORIGINAL or grid is None or not {"_patch_lang", "rewrite"} <= set(names):  # installed, or not as described
        return False
    langs_of: dict[int, frozenset] = {}  # id(function) -> the language modules its module sees

    def langs(fn) -> frozenset:
        found = langs_of.get(id(fn))
        if found is None:
            found = langs_of[id(fn)] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return found

    def device_call(self, *args, **kwargs):
        patched = getattr(_launching, "langs", None)  # what the running launch has patched
        if not patched:
            return call(self, *args, **kwargs)
        if not langs(self.fn) <= patched[-1]:  # Triton's call patches them, never undone in the launch
            patched[-1] |= langs(self.fn)
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own call reports it
            raise interpreter.InterpreterError(repr(e)) from e

    def launch(self, *args, **kwargs):
        stack = _launching.__dict__.setdefault("langs", [])
        stack.append(set(langs(self.fn)))
        try:
            return grid(self, *args, **kwargs)
        finally:
            stack.pop()

    ORIGINAL.update({interpreter.InterpretedFunction: call, interpreter.GridExecutor: grid})
    interpreter.InterpretedFunction.__call__ = device_call
    interpreter.GridExecutor.__call__ = launch
    return True


#: Triton's own ``__call__`` of each class :func:`install` patched
ORIGINAL: dict = {}


@contextlib.contextmanager
def as_triton_has_it():
    """Triton's interpreter as it is, inside (what :func:`install` changed undone meanwhile)."""
    patched = {cls: cls.__call__ for cls in ORIGINAL}
    for cls, call in ORIGINAL.items():
        cls.__call__ = call
    try:
        yield
    finally:
        for cls, call in patched.items():
            cls.__call__ = call
