"""The compressor's GPU kernels in Triton: token groups encoded and rebuilt in one launch each, the
exact (outlier) tokens scored and chosen in two more, no host synchronisation (docs/DESIGN.md,
"On a GPU").

The math is :mod:`hf_division.quant.codecs`' element by element: the same block sums in token order,
the same bf16 rounding on the bits, the same counter-based noise (:func:`~hf_division.quant.rounding.hash_uniform`
of each element's index in the padded ``(M*Tp, C)`` tokens), the same word layout
(:func:`~hf_division.quant.packing.code_layout`), each product rounded on its own (no fused
multiply-add: :data:`_OPTIONS`). The codes, block means and group ranges equal the reference's to
the bit, under Triton's interpreter in CI (``tests/test_triton.py``) and on a GPU
(``tests/test_cuda.py``).

Each launcher takes the tensor as it is held (any float dtype, any strides of its ``(M, T, C)``
view): no float32 copy, no padding copy. What the pipeline does around them is in
:class:`hf_division.compress.backends.TritonBackend`.

Without a CUDA device they run on CPU tensors under Triton's interpreter only (``TRITON_INTERPRET=1``
set before Triton is first imported; tests/conftest.py does) and inside :func:`on_cpu`;
:func:`available` says whether Triton is importable.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from hf_division.kernels import launcher
from hf_division.kernels.switches import switches
from hf_division.quant.packed import TokenBuffers, code_bytes
from hf_division.quant.packing import code_layout
from hf_division.quant.rounding import SCALE_DTYPE

try:  # Triton ships with CUDA builds of torch; a CPU build may lack it (then the torch kernels run)
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

#: LFC kinds of the kernels: none, then the stored dtype
LFC_KIND = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
#: the float dtypes the kernels round to (``triton_kernels.round_lfc``), by their code: what the
#: RMSNorm's and gated MLP's kernels take (:mod:`.triton_norm`, :mod:`.triton_gated`)
ROUNDED = {dtype: code for dtype, code in LFC_KIND.items() if dtype is not None}
#: tokens of the exact-token search's median sample (docs/DESIGN.md, "On a GPU")
SAMPLE = 1024
_counts = {"launches": 0}
_cpu = {"on": False}


def available() -> bool:
    """Whether the kernels can run here (Triton importable)."""
    return triton is not None


def applies(device: torch.device) -> bool:
    """Whether the compressor uses these kernels for token groups on ``device`` (the ``triton``
    switch on): a CUDA device, or the CPU inside :func:`on_cpu`."""
    if not (triton is not None and switches().triton):
        return False
    return device.type == "cuda" or (device.type == "cpu" and _cpu["on"])


def device_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the GPU's path, where reading a value back on the host
    stalls the device and breaks CUDA-graph capture: any device but the CPU, and the CPU inside
    :func:`on_cpu`. Elsewhere a readback costs nothing and the CPU's data-dependent paths run."""
    return device.type != "cpu" or _cpu["on"]


@contextlib.contextmanager
def on_cpu():
    """Inside, CPU tensors go through these kernels (under Triton's interpreter, ``TRITON_INTERPRET=1``)
    as CUDA tensors do: how the tests run the GPU path on a CPU machine."""
    if triton is None:
        raise RuntimeError("hf-division: on_cpu() needs Triton (pip install triton)")
    before, _cpu["on"] = _cpu["on"], True
    try:
        yield
    finally:
        _cpu["on"] = before


def launches() -> int:
    """Kernel launches so far in this process (the launch-budget test reads it)."""
    return _counts["launches"]


def _kernels(compile_only: bool = False):
    """The jit kernels' module, imported once (``compile_only``: to compile, not to run)."""
    global _KERNELS
    if _KERNELS is None:
        if not (compile_only or torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
            raise RuntimeError("hf-division: without a CUDA device the Triton kernels run only under Triton's "
                               "interpreter: set TRITON_INTERPRET=1 in the environment before Python starts")
        from hf_division.kernels import triton_kernels

        _KERNELS = triton_kernels
    return _KERNELS


_KERNELS = None


@contextlib.contextmanager
def kernels_from(module):
    """Inside, launches go to ``module``'s jit functions (:mod:`.triton_kernels` imported without the
    interpreter, compiled for a simulated device: :mod:`hf_division.analysis.simulated_cuda`)."""
    global _KERNELS
    before, _KERNELS = _KERNELS, module
    _resolved.clear()
    _planned.clear()
    try:
        yield
    finally:
        _KERNELS = before
        _resolved.clear()
        _planned.clear()


#: kernel name -> (its jit function, its launch options, whether compiled: not interpreted), per launch
_resolved: dict = {}


def jit_function(name: str, compile_only: bool = False):
    """The jit function ``<name>_kernel``: the compressor's (:mod:`.triton_kernels`, or the module
    :func:`kernels_from` gives), else a layer op's (:mod:`.triton_layers`)."""
    fn = getattr(_kernels(compile_only), name + "_kernel", None)
    if fn is None:
        from hf_division.kernels import triton_layers

        fn = getattr(triton_layers, name + "_kernel")
    return fn


def _resolve(name: str) -> tuple:
    fn = jit_function(name)
    got = _resolved[name] = (fn, options(name), isinstance(fn, triton.runtime.jit.JITFunction))
    return got


# ----------------------------------------------------------------------------- launchers
_launching = {"depth": 0, "skip": False}


def launching() -> bool:
    """Whether a kernel launch is under way (the interpreter's own tensor copies then run)."""
    return _launching["depth"] > 0


@contextlib.contextmanager
def not_run():
    """Inside, launches are counted but not run: what the host spends around the kernels, timed
    alone (the ``launches`` suite), each launch's key included where :mod:`.launcher` would launch
    it (a :class:`Launch` whose kernel is kept: what it reads instead). Triton's launch path itself
    is timed by the ``dispatch`` suite. The outputs are left unwritten."""
    before, _launching["skip"] = _launching["skip"], True
    try:
        yield
    finally:
        _launching["skip"] = before


def launch_kernel(name: str, grid: tuple, *args, **meta) -> None:
    """``<name>_kernel[grid](*args, **meta)`` from the jit module (:mod:`.triton_kernels`), counted
    (:func:`launches`), through :mod:`.launcher` where the ``triton_launch`` switch is on and the
    kernel compiled; under :func:`not_run`, counted only. How every Triton kernel of the package is
    launched (:mod:`.triton_norm`'s too)."""
    _counts["launches"] += 1
    fn, options, compiled = _resolved.get(name) or _resolve(name)
    direct = switches().triton_launch
    if _launching["skip"]:
        if direct:  # the host's share of a kept kernel's launch: its key (the driver's call aside)
            launcher.key(fn, args, meta, options)
        return
    _launching["depth"] += 1
    try:
        switch = device_switch(args[0])
        if switch is not None:
            with switch:
                _run(fn, grid, args, meta, options, direct and compiled)
        else:
            _run(fn, grid, args, meta, options, direct and compiled)
    finally:
        _launching["depth"] -= 1


class Launch:
    """One call site's launch of kernel ``name`` for one shape: its grid and constexprs, fixed, and
    the compiled kernels the launcher kept for it, by device and pointer alignment. The caller keys
    it (:func:`planned`) on everything that decides the scalar arguments and the pointers' dtypes,
    so that a launch after the first goes straight to the kept kernel without :func:`launch_kernel`
    rebuilding the launcher's key from every argument (docs/DESIGN.md, "On a GPU": host time)."""

    __slots__ = ("name", "grid", "meta", "kept", "options", "ptrs")

    def __init__(self, name: str, grid: tuple, meta: dict):
        self.name, self.grid, self.meta, self.kept = name, grid, meta, {}
        self.options = self.ptrs = None

    def __call__(self, *args) -> None:
        ptrs = self.ptrs  # None until a first launch found the kernel compiled (not interpreted)
        on = switches()
        if ptrs is None or not (on.triton_launch and on.planned_launch):
            self._first(args)
            return
        device = args[0].device
        if device.type == "cuda" and device_switch(args[0]) is not None:  # launch_kernel switches device
            launch_kernel(self.name, self.grid, *args, **self.meta)
            return
        variant = (device, *[t.data_ptr() & 15 for t in ptrs(args)])
        if _launching["skip"]:  # the host's share of a planned launch (the driver's call aside)
            _counts["launches"] += 1
            return
        entry = self.kept.get(variant)
        if entry is None:  # the first of its variant: the launcher's way, then kept
            launch_kernel(self.name, self.grid, *args, **self.meta)
            entry = launcher.kept(_resolved[self.name][0], args, self.meta, self.options)
            if entry is not None:
                self.kept[variant] = entry
            return
        _counts["launches"] += 1
        launcher.run_kept(entry, self.grid, args, self.meta, self.options)

    def _first(self, args: tuple) -> None:
        launch_kernel(self.name, self.grid, *args, **self.meta)
        fn, self.options, compiled = _resolved.get(self.name) or _resolve(self.name)
        if compiled:
            self.ptrs = launcher.pointers(fn, len(args))


_planned: dict = {}


def planned(key: tuple, make) -> Launch:
    """The :class:`Launch` kept for ``key`` (``make()`` builds it the first time): ``key`` names the
    kernel and fixes every scalar argument, every pointer's dtype, the grid and the constexprs of
    its launches (with whatever module constant they are derived from)."""
    got = _planned.get(key)
    if got is None:
        if len(_planned) >= launcher.MAX_KEYS:
            _planned.clear()
        got = _planned[key] = make()
    return got


def _run(fn, grid, args, meta, options, kept: bool) -> None:
    if kept:
        launcher.launch(fn, grid, args, meta, options)
    else:  # Triton's dispatch (and the interpreter's)
        fn[grid](*args, **meta, **options)


def device_switch(t: torch.Tensor):
    """``torch.cuda.device(t.device)`` where ``t`` is on a CUDA device other than the current one,
    else None. Triton launches on the current device and refuses another device's pointers
    (triton-lang/triton#5205): a model spread over the GPUs of one process (``device_map="auto"``)
    has layers on devices that are not current."""
    device = t.device
    if device.type != "cuda" or torch.cuda.device_count() < 2 or device.index == torch.cuda.current_device():
        return None
    return torch.cuda.device(device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The power of 2 at or above ``n`` (>= 1), in plain Python: it runs per launch."""
    return 1 << (max(1, int(n)) - 1).bit_length()


#: values of one tile of the encode and decode kernels (rows of words x channels): 8 a thread of
#: their 4 warps, with which no variant spills registers under Triton 3.6 or 3.9
#: (docs/DESIGN.md, "On a GPU": registers)
TILE = 1024


def _channel_tile(c: int, rows: int) -> int:
    """Channels per program: a tile of at most :data:`TILE` values, at least 16 channels (32 bytes
    of a bf16 row, a whole memory sector)."""
    return max(16, min(pow2(c), TILE // pow2(rows)))


def _layouts(group: int, rest: int, bits: int, c: int) -> tuple:
    """The word layout of a full group and of the last, partial one (``code_layout``'s), as
    ``(r_last, launch constants)``, the channel tile ``BC`` and the rows of words a tile takes
    (``RCH_*``, the rest in a loop) among them (cached with the rest of a launch's, :func:`group_launch`)."""
    full_dtype, r_full = code_layout(group, bits)
    last_dtype, r_last = code_layout(rest, bits) if rest else (torch.uint8, 0)
    bc = _channel_tile(c, r_full)
    rt_full, rt_last = pow2(r_full), pow2(r_last)
    return r_last, dict(R_FULL=r_full, FULL32=full_dtype == torch.int32, LAST32=last_dtype == torch.int32, BC=bc,
                        RT_FULL=rt_full, RT_LAST=rt_last, RCH_FULL=min(rt_full, max(1, TILE // bc)),
                        RCH_LAST=min(rt_last, max(1, TILE // bc)))


def encode_tokens(x3: torch.Tensor, seed, bits: int, block: int, group: int, lfc_dtype, exact=None,
                  row_scale: torch.Tensor | None = None):
    """``(M, T, C)`` tokens (any float dtype and strides) -> ``TokenBuffers`` filled as
    :func:`hf_division.quant.codecs.encode_tokens` fills them, rows padded to whole blocks by
    repeating the last token; one launch. ``seed``: 0-d int64 tensor on the device (None: round
    to nearest). ``exact``: :func:`exact_tokens`' result, whose tokens are zeroed in what is
    encoded and copied into its ``rows``. ``row_scale``: float32, one per token in ``x3``'s
    order (contiguous): ``x3 / row_scale`` is encoded, in the kernel's pass, and an exact token's
    row is held as dividing then multiplying rebuilds it, in ``x3``'s dtype."""
    m, t, c = x3.shape
    out = TokenBuffers.empty(m, t, c, bits, block, group, lfc_dtype, SCALE_DTYPE, x3.device)
    r_last, split, grid, meta = group_launch(c, out.n_full, out.rest, group, bits, block)
    slot, rows = (out.lo, out.lo) if exact is None else (exact["slot"], exact["rows"])
    key = ("encode", x3.shape, x3.stride(), x3.dtype, bits, block, group, lfc_dtype, _dtype(seed), exact is None,
           _dtype(row_scale))
    launch = planned(key, lambda: Launch("encode", grid, dict(
        HAS_SEED=seed is not None, HAS_SLOT=exact is not None, NBT=pow2(group // block),
        LFC=LFC_KIND[lfc_dtype if block > 1 else None], ROW_SCALE=row_scale is not None,
        ROWS_BF16=x3.dtype == torch.bfloat16, **meta)))
    launch(x3, *x3.stride(), t, out.tokens // m, c, out.n_full, out.rest, r_last, out.lo if seed is None else seed,
           slot, rows, out.lo if row_scale is None else row_scale, _top(x3.dtype), out.codes, split,
           out.lo if out.lfc is None else out.lfc, out.lo, out.scale)
    return out


def _dtype(t: torch.Tensor | None):
    """``t``'s dtype, None for no tensor (a launch's key: a placeholder's dtype is fixed)."""
    return None if t is None else t.dtype


@functools.lru_cache(maxsize=1024)
def group_launch(c: int, n_full: int, rest: int, group: int, bits: int, block: int) -> tuple:
    """``(r_last, split, grid, constants)`` of an encode or decode launch over ``n_full`` groups and
    a last one of ``rest`` tokens, ``c`` channels (``split``: the byte where the last group's words
    start in the codes); cached: it runs for every saved tensor, with the few shapes of one model
    (docs/DESIGN.md, "On a GPU": host time)."""
    r_last, lay = _layouts(group, rest, bits, c)
    return (r_last, code_bytes(n_full, group, bits, c), (n_full + (rest > 0), _cdiv(c, lay["BC"])),
            dict(BITS=bits, BLOCK=block, GROUP=group, **lay))


@functools.lru_cache(maxsize=None)
def _top(dtype: torch.dtype) -> float:
    """The largest finite value a rebuilt ``dtype`` is clamped to (0: float32, not clamped)."""
    return torch.finfo(dtype).max if dtype != torch.float32 else 0.0


def decode_tokens(p) -> torch.Tensor:
    """A token-grouped ``Packed`` -> ``(M, T, C)`` in ``p.dtype`` (clamped to its finite range),
    times its ``row_scale`` where it has one, its exact rows in their places; one launch, two with
    exact rows."""
    m, t, c = p.layout.rows
    block, group = p.block_size, p.group_size
    tp = -(-t // block) * block
    n_full, rest = divmod(m * tp, group)
    out = torch.empty(m * t, c, dtype=p.dtype, device=p.packed.device)
    r_last, split, grid, meta = group_launch(c, n_full, rest, group, p.bits, block)
    rs = p.row_scale
    key = ("decode", m, t, c, p.bits, block, group, p.dtype, p.packed.dtype, _dtype(p.lfc), p.lo.dtype,
           p.scale.dtype, _dtype(rs))
    launch = planned(key, lambda: Launch("decode", grid, dict(
        HAS_LFC=p.lfc is not None, CLAMP=p.dtype != torch.float32, OUT_BF16=p.dtype == torch.bfloat16,
        ROW_SCALE=rs is not None, **meta)))
    launch(out, t, tp, c, n_full, rest, r_last, p.packed, split, p.lo if p.lfc is None else p.lfc, p.lo, p.scale,
           p.lo if rs is None else rs, _top(p.dtype))
    if p.rows is not None and p.rows.numel():
        keep = p.row_keep
        k = p.rows.shape[0]
        key = ("put_rows", k, c, p.dtype, p.rows.dtype, p.row_index.dtype, keep is None)
        launch = planned(key, lambda: _put_rows_launch(k, c, keep is not None))
        launch(out, p.rows, p.row_index, p.row_index if keep is None else keep.view(torch.int8), c)
    return out.view(m, t, c)


def _put_rows_launch(k: int, c: int, has_keep: bool) -> Launch:
    bc = max(16, min(pow2(c), 1024))
    return Launch("put_rows", (k, _cdiv(c, bc)), dict(HAS_KEEP=has_keep, BC=bc))


def exact_tokens(x3: torch.Tensor, ratio: float, row_scale: torch.Tensor | None = None) -> dict:
    """The outlier tokens of ``(M, T, C)`` (any dtype and strides; divided by ``row_scale``, as
    :func:`encode_tokens` takes it) at a fixed capacity, with no host synchronisation; two
    launches. Returns ``slot`` (int32, its first ``M*T``: ``2 * slot + 1`` for a token held exact,
    -1 otherwise; the search's scratch after them), ``rows`` (``(k, C)`` in ``x3``'s dtype, filled
    by :func:`encode_tokens`), ``row_index`` (int64) and ``row_keep`` (bool), ``k = max(1, M*T // 64)``
    as :func:`hf_division.quant.exact_tokens.outlier_candidates`.

    The criterion is that function's, max |x| of a token above ``ratio`` times the median token's,
    with the median of every ``ceil(n / SAMPLE)``-th token's (all up to :data:`SAMPLE` tokens) and, past
    ``k`` such tokens, whichever took a slot first instead of the largest (docs/DESIGN.md, "On a GPU")."""
    m, t, c = x3.shape
    n = m * t
    k = min(max(1, n // 64), n)
    dev = x3.device
    work = torch.empty(2 * n + 1, dtype=torch.int32, device=dev)  # the slots, then the scores and a counter
    row_index = torch.empty(k, dtype=torch.int64, device=dev)
    keep = torch.empty(k, dtype=torch.int8, device=dev)
    key = ("score", x3.shape, x3.stride(), x3.dtype, _dtype(row_scale))
    score = planned(key, lambda: Launch("score", *score_launch(n, c, row_scale is not None)))
    score(x3, *x3.stride(), t, c, n, work, row_index, keep, k, work if row_scale is None else row_scale)
    ratio = float(ratio)
    select = planned(("select", n, ratio), lambda: Launch("select", (_cdiv(n, 1024),), dict(SAMPLE=SAMPLE, BT=1024)))
    select(work, n, _cdiv(n, SAMPLE), k, ratio, row_index, keep)
    rows = torch.empty(k, c, dtype=x3.dtype, device=dev)
    return dict(slot=work, rows=rows, row_index=row_index, row_keep=keep.view(torch.bool))


def score_launch(n: int, c: int, row_scale: bool = False) -> tuple:
    """``(grid, {"BT": tokens, "BC": channels, "ROW_SCALE": row_scale})`` of the score kernel over
    ``n`` tokens of ``c`` channels (its programs also clear the ``k <= n`` exact rows'
    bookkeeping); kept with its :class:`Launch`. A program takes 4 tokens of 256 channels or more, so that a tensor of
    8192 tokens spreads over 2048 programs, more than an H200's 132 multiprocessors hold at once
    (``python -m hf_division.bench kernels --step``: its waves); narrower rows, more tokens, so that
    a tile still holds :data:`TILE` values (8 a thread: 16-byte loads of bf16)."""
    bc = max(16, min(pow2(c), TILE // 4))
    bt = max(4, TILE // bc)
    return (_cdiv(n, bt),), dict(BT=bt, BC=bc, ROW_SCALE=row_scale)


#: per kernel launch options: no multiply-add fusion where the reference rounds each product (the
#: rotary embedding: torch's products and sums are separate kernels); eight
#: warps for the RMSNorm's tiles of 4,096 values and more (kernels/triton_norm.py)
_OPTIONS = {"encode": {"enable_fp_fusion": False}, "decode": {"enable_fp_fusion": False},
            "rms_rebuild": {"num_warps": 8}, "rms_grad": {"num_warps": 8}, "rotary": {"enable_fp_fusion": False}}
_NO_OPTIONS: dict = {}


def options(name: str) -> dict:
    """The launch options of kernel ``name`` (:data:`_OPTIONS`; what it is compiled with ahead too)."""
    return _OPTIONS.get(name, _NO_OPTIONS)
