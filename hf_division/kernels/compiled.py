"""How the compressor's kernels run: compiled with ``torch.compile`` over fixed-size chunks.

torch.compile fuses each kernel of :mod:`hf_division.quant.codecs` into one loop nest, several times faster
than eager on CPU, but only with static shapes: dynamic-shape code was many times *slower* here
(``python -m hf_division.bench compressor`` times both; docs/DESIGN.md, "Compressor"). So the
kernels run compiled over fixed-size chunks and eagerly on the remainder: the flat (ActNN) path over
``CHUNKS`` groups, the token path over ``TOKEN_CHUNK``-sized pieces. Without a working compiler
(no C++ toolchain, an unsupported device) everything falls back to eager, with a warning.
"""
from __future__ import annotations

import functools
import itertools
import types
import warnings

import torch

from hf_division.kernels.switches import configure, switches

#: groups per compiled call of the flat path (few calls: each pays its guards)
CHUNKS = (4096, 1024, 256)
#: elements per compiled call of the token kernels: a chunk stays in cache across the kernel's
#: passes (block sums, group ranges, codes); chunks 4x smaller take what is left, then one eager call.
#: The results do not depend on it; 4x larger chunks (4x fewer guarded calls) were no faster
#: (``step-time --token-chunks``; docs/RESULTS.md, "Where the time goes")
TOKEN_CHUNK = 1 << 20

_variant_ids = itertools.count()
_options: dict = {}  # kernel -> inductor options of its own (:func:`tune`)


def tune(kernel, **options) -> None:
    """Compile ``kernel`` with these inductor options too (``torch.compile(options=...)``), for
    every variant compiled from now on."""
    _options[kernel] = {**_options.get(kernel, {}), **options}


def fused() -> bool:
    """Whether the kernels are to run compiled (the ``compile`` switch: :func:`hf_division.kernels.configure`)."""
    return switches().compile


@functools.lru_cache(maxsize=None)
def compiled(kernel, variant: tuple):
    """``kernel`` compiled for one ``variant`` (static arguments and the chunk's shapes, or which
    inputs are None).

    Each variant gets a copy of the function with a code object of its own: dynamo keeps at most
    ``recompile_limit`` versions per code object and runs the rest eagerly, and bit widths x chunk
    sizes x rounding modes exceed that (decoders use 4 and 8 bits, auto-precision 2, 4, 8)."""
    code = kernel.__code__.replace(co_name=f"{kernel.__name__}_v{next(_variant_ids)}")
    fn = types.FunctionType(code, kernel.__globals__, code.co_name, kernel.__defaults__, kernel.__closure__)
    # emulated casts: the LFC must be rounded to its dtype before the HFC is taken from it
    return torch.compile(fn, dynamic=False, options={"emulate_precision_casts": True, **_options.get(kernel, {})})


def _fall_back(kernel, err: Exception) -> None:
    warnings.warn(f"hf-division: torch.compile of {kernel.__name__} failed ({err!r}); using eager kernels")
    configure(compile=False)


def token_chunks(n_groups: int, c: int, group: int, compile: bool = True):
    """``(first group, groups)`` pieces covering ``n_groups`` groups of ``group`` tokens x ``c``
    channels: compiled sizes, largest first, then an eager remainder (``groups`` negative); one
    eager piece without ``compile``."""
    size = 1 << max(0, (TOKEN_CHUNK // (group * c)).bit_length() - 1)
    start = 0
    while size >= 1 and compile:
        while n_groups - start >= size:
            yield start, size
            start += size
        if size == 1:
            break
        size = max(1, size // 4)
    if start < n_groups:
        yield start, -(n_groups - start)


def run_tokens(kernel, static: tuple, pieces, args_of) -> None:
    """``kernel(*args_of(start, groups), *static)`` for each ``(start, groups)`` piece: compiled
    for the positive sizes, eager for the remainder. The kernels write into output slices that
    ``args_of`` passes (one compiled graph serves every offset), so no concatenation follows."""
    for start, groups in pieces:
        args = args_of(start, abs(groups))
        if groups > 0 and fused():  # not switched off by a failed compile since the pieces were cut
            shapes = tuple(None if a is None else (tuple(a.shape), a.dtype) for a in args)
            try:
                compiled(kernel, (static, shapes))(*args, *static)
                continue
            except Exception as err:  # no C++ compiler, unsupported device, ...: stay correct, go eager
                _fall_back(kernel, err)
        kernel(*args, *static)


def run_groups(kernel, n_groups: int, args: tuple, per_group: tuple, static: tuple, compile: bool = True):
    """``kernel(*args, *static)`` over all groups, sliced into fixed-size compiled chunks with
    ``compile`` (else one eager call).

    ``per_group[i]``: elements of ``args[i]`` per group (None: pass ``args[i]`` as it is).
    Each output is concatenated in group order.
    """
    if not compile or not fused() or n_groups < CHUNKS[-1]:
        return kernel(*args, *static)
    pieces, start = [], 0
    absent = tuple(a is None for a in args)
    for size in CHUNKS:
        fn = compiled(kernel, (static, size, absent))
        while n_groups - start >= size:
            sliced = [a if k is None or a is None else a[start * k : (start + size) * k] for a, k in zip(args, per_group)]
            try:
                pieces.append(fn(*sliced, *static))
            except Exception as err:  # no C++ compiler, unsupported device, ...: stay correct, go eager
                _fall_back(kernel, err)
                return kernel(*args, *static)
            start += size
    if start < n_groups:
        sliced = [a if k is None or a is None else a[start * k :] for a, k in zip(args, per_group)]
        pieces.append(kernel(*sliced, *static))
    return tuple(torch.cat(parts) for parts in zip(*pieces))
