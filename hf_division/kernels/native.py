"""The compressor's native CPU kernels: ``csrc/division_cpu.c``, built with the C compiler on first use.

The token-group compressor compiled by ``torch.compile`` spent most of a division step's extra
time on the CPU: inductor's loops ran at about 1.5 ns per element and each call paid about 0.1 ms
of guards and wrappers, several calls per saved tensor (docs/DESIGN.md, "Native CPU kernels").
The C file is the same math element by element and gives the same bytes (tested against
:mod:`hf_division.quant.codecs`); one call per tensor, parallel over PyTorch's threads.

It is built once per machine into a cache folder (``HF_DIVISION_CACHE``, else
``$XDG_CACHE_HOME/hf_division`` or ``~/.cache/hf_division``), keyed on the source, the flags, the
compiler and the CPU, like inductor's own C++ cache. The folder is made private (0o700), and a
folder or library not owned by this user or writable by others is refused: loading a library runs
its code, so one planted in a shared cache would run in every process. Ranks building at once take
a file lock: one builds, the others wait and load its library. Where no compiler works, the
cache is refused, or a library lacks a symbol even rebuilt, or with
the ``native`` switch off (:func:`hf_division.kernels.configure`, ``HF_DIVISION_NATIVE=0``),
:func:`kernels` returns None and the compressor uses the
``torch.compile`` kernels (:mod:`hf_division.kernels.compiled`), with one warning (once per process).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from hf_division.kernels.switches import switches
from hf_division.quant.packing import bit_table, unpack_mask
from hf_division.quant.packing import pack_mask as quant_pack_mask

SOURCE = Path(__file__).with_name("csrc") / "division_cpu.c"
#: -ffp-contract=off: each product and sum rounded on its own, as in the tensor code (same bytes).
#: -fno-trapping-math: without it GCC keeps a float comparison (the clamps of the SiLU kernel's e^x)
#: as a branch, which leaves the gated loops scalar on AVX2 CPUs; it changes no value, only whether
#: a comparison may be computed for every lane (docs/DESIGN.md, "Gated MLP").
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared", "-std=gnu11"]
#: LFC kinds of the C side (``enum`` in the source)
LFC_KIND = {None: 0, torch.bfloat16: 1, torch.float32: 2}

#: elements below which a kernel runs on one thread, as ATen's parallel loops do below their grain
#: size: waking the other threads costs more than the work (and far more on a busy machine)
GRAIN = 32768

_state: dict = {"lib": None, "tried": False}
_lock = threading.Lock()


def kernels() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None if switched off (``native``) or it cannot be built or
    loaded here (tried once per process: a failure warns once, and is not retried on every call)."""
    if not switches().native:
        return None
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                _state["lib"] = _load()
                _state["tried"] = True
    return _state["lib"]


def applies(device: torch.device, lfc_dtype: torch.dtype | None) -> bool:
    """Whether the native kernels take a token-grouped tensor on ``device`` with this LFC dtype
    (None: no LFC): on the CPU, with an LFC of bf16 or float32 or none."""
    return device.type == "cpu" and lfc_dtype in LFC_KIND and kernels() is not None


def _cache_dir() -> Path:
    root = os.environ.get("HF_DIVISION_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_division")
    return Path(root)


def _cpu_id() -> str:
    """What the build depends on beyond the source: the CPU's features (``-march=native``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


class Refused(OSError):
    """The cache or a library in it is not safe to load from, or a library lacks symbols even rebuilt:
    no other build flags are tried."""


def _load() -> ctypes.CDLL | None:
    # any failure falls back (and is remembered by kernels()): the kernels are only a faster path
    try:
        return build()
    except Exception as err:  # noqa: BLE001
        warnings.warn(f"hf-division: the native CPU kernels could not be built or loaded, so the compressor runs "
                      f"its torch.compile kernels (slower): {err}", RuntimeWarning, stacklevel=3)
        return None


def build(cc: str | None = None, cache: Path | None = None) -> ctypes.CDLL:
    """Compile ``csrc/division_cpu.c`` with ``cc`` (default: ``$CC``, else ``cc``) into ``cache``
    (default: the cache folder above) unless it is there already, and load it. Tries
    ``-march=native`` first, then without it (some compilers or CPUs lack it). A cached library
    that lacks a symbol is stale: it is rebuilt once. Raises ``OSError`` or
    ``subprocess.SubprocessError`` naming each command that failed, :class:`Refused` (an
    ``OSError``) naming the folder or file that is not private to this user, or the missing symbol."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    cache = cache or _cache_dir()
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)  # mode: the folder only, not its parents
    _check_private(cache, "folder")
    errors = []
    for arch in (["-march=native"], []):
        flags = FLAGS + arch
        try:
            return _loaded(cc, flags, cache)
        except Refused:
            raise
        except (OSError, subprocess.SubprocessError) as err:
            errors.append(f"{' '.join([cc] + flags)}: {err}")
    raise subprocess.SubprocessError(" | ".join(errors))


def _check_private(path: Path, what: str) -> os.stat_result:
    """``path``'s status, or :class:`Refused` where another user owns it or may write it."""
    st = os.stat(path)
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if st.st_uid != uid:
        reason = f"owned by uid {st.st_uid}, not by this user (uid {uid})"
    elif st.st_mode & 0o022:
        reason = f"writable by {'group' if st.st_mode & 0o020 else 'others'} (mode {st.st_mode & 0o777:o})"
    else:
        return st
    raise Refused(f"the native kernels' cache {what} {path} is {reason}; not loading from it")


def _loaded(cc: str, flags: list[str], cache: Path) -> ctypes.CDLL:
    target = _target(cc, flags, cache)
    seen, missing = None, None
    for attempt in range(2):  # a library missing a symbol is stale: rebuilt once
        if attempt or not target.exists():
            _install(cc, flags, target, seen)
        seen = _check_private(target, "library")
        lib = ctypes.CDLL(str(target))
        try:
            return _declare(lib)
        except AttributeError as err:
            missing = err
            _unload(lib)  # else dlopen of the same path returns this library again
    raise Refused(f"{target} lacks a symbol even rebuilt: {missing}")


def _target(cc: str, flags: list[str], cache: Path) -> Path:
    source = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_id().encode()]))
    return cache / f"division_cpu_{key.hexdigest()[:20]}.so"


def _install(cc: str, flags: list[str], target: Path, stale: os.stat_result | None) -> None:
    """Build ``target`` unless another process did while this one waited for the lock (``stale``:
    the status of the stale library to replace, None where there was none)."""
    with _build_lock(target.parent):
        if target.exists() and (stale is None or not os.path.samestat(stale, os.stat(target))):
            return
        fd, name = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        built = Path(name)
        try:
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode:
                raise subprocess.SubprocessError(f"exit status {done.returncode}: {done.stderr.strip()[-2000:]}")
            os.chmod(built, 0o755)  # the linker's mode follows the umask, which may let the group write
            os.replace(built, target)  # atomic: a reader sees the old file or the whole new one
        finally:
            built.unlink(missing_ok=True)


@contextlib.contextmanager
def _build_lock(cache: Path):
    """Held while building into ``cache``: ranks starting together build once."""
    fd = os.open(cache / ".build.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass  # no locks here: builds may overlap, and each install is still atomic
        yield
    finally:
        os.close(fd)  # releases the lock


def _unload(lib: ctypes.CDLL) -> None:
    import _ctypes

    close = getattr(_ctypes, "dlclose", None)
    if close is not None:
        close(lib._handle)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    shape = [i64, i64, i64, i64, i64, i32, i32]  # m, t, c, block, group, bits, lfc kind
    lib.hfd_encode_tokens.argtypes = [p, *shape, p, p, p, p, i32, ctypes.c_uint32, p, p, i32]
    lib.hfd_encode_tokens.restype = i32
    lib.hfd_encode_tile.argtypes = []
    lib.hfd_encode_tile.restype = i64
    lib.hfd_decode_tokens.argtypes = [p, *shape, p, p, p, p, p, i32]
    lib.hfd_decode_tokens.restype = i32
    operand = [p, p, p, i32, p, p]  # codes, lo, scale, bits, outlier slots, outlier rows
    lib.hfd_silu_gated.argtypes = [i64, i64, i64, *operand, *operand, p, p, p, p, i32]
    lib.hfd_silu_gated.restype = i32
    lib.hfd_token_absmax.argtypes = [p, i64, i64, p, i32]
    lib.hfd_token_absmax.restype = None
    lib.hfd_pack_nonzero.argtypes = [p, i64, i32, p, i32]
    lib.hfd_pack_nonzero.restype = None
    lib.hfd_masked_scale.argtypes = [p, p, ctypes.c_float, p, i64, i32]
    lib.hfd_masked_scale.restype = None
    lib.hfd_bernoulli_bits.argtypes = [p, p, p, ctypes.c_double, i64, p]
    lib.hfd_bernoulli_bits.restype = None
    lib.hfd_rotary.argtypes = [p, i64, i64, i64, p, p, i64, i64, p, i64, i64, i64, i64, i64, i64, i64, i32, i32]
    lib.hfd_rotary.restype = None
    lib.hfd_fail_next_allocs.argtypes = [i32]
    lib.hfd_fail_next_allocs.restype = None
    return lib


def _arg(fn: str, name: str, t, dtype: torch.dtype, numel: int) -> int:
    """``t``'s address once it is a contiguous CPU tensor of ``dtype`` with at least ``numel`` elements,
    what the C function ``fn`` reads or writes there; else TypeError or ValueError naming ``name``.
    A few attribute reads: it runs per saved tensor."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"hf-division: {fn}: argument '{name}' must be a {dtype} tensor, got {got}")
    if not t.is_cpu or not t.is_contiguous() or t.numel() < numel:  # is_cpu: device.type costs 5x
        raise ValueError(f"hf-division: {fn}: argument '{name}' must be a contiguous CPU tensor of at least {numel} "
                         f"elements, got {t.numel()} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")
    return t.data_ptr()


def _opt(fn: str, name: str, t, dtype: torch.dtype, numel: int) -> int | None:
    return None if t is None else _arg(fn, name, t, dtype, numel)


def _params(fn: str, bits: int, block: int, group: int) -> None:
    # bits 0 divides by zero in the C code's layout, block or group 0 in its loops
    if not (1 <= bits <= 8 and block >= 1 and group >= 1):
        raise ValueError(f"hf-division: {fn}: arguments 'bits' (1 to 8), 'block' and 'group' (at least 1) got "
                         f"{bits}, {block}, {group}")


def _code_bytes(n: int, group: int, bits: int, c: int) -> int:
    """Bytes of the codes of ``n`` tokens in groups of ``group`` (quant.packed.code_bytes of the full
    groups and the last): a group of ``g`` tokens takes ``ceil(g * bits / 8)`` bytes per channel."""
    full, rest = divmod(n, group)
    return c * (full * -(-group * bits // 8) + -(-rest * bits // 8))


def _lfc(fn: str, lfc, n: int) -> tuple[int, int | None]:
    kind = LFC_KIND.get(None if lfc is None else lfc.dtype)
    if kind is None:
        raise TypeError(f"hf-division: {fn}: argument 'lfc' must be bfloat16, float32 or None, got {lfc.dtype}")
    return kind, None if lfc is None else _arg(fn, "lfc", lfc, lfc.dtype, n)


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= GRAIN else 1


def encode_tokens(x3: torch.Tensor, codes, lfc, lo, scale, seed: int | None, bits: int, block: int, group: int,
                  row_scale: torch.Tensor | None = None, score: bool = False) -> torch.Tensor | None:
    """Fill ``codes``, ``lfc`` (None: no LFC), ``lo`` and ``scale`` from ``x3`` ``(M, T, C)`` float32,
    each sequence padded to whole blocks by repeating its last token (the layout of
    :func:`hf_division.compress.pipeline.compress`), divided by ``row_scale`` (``M*T`` float32, one per
    token) where given. ``seed``: the rounding noise's seed, None for round-to-nearest.
    ``score``: also return :func:`token_absmax` of ``x3`` (not divided), read in the encode's first pass.
    Buffers of another dtype, device or size than the C code reads and writes raise naming them."""
    fn = "hfd_encode_tokens"
    m, t, c = x3.shape
    _params(fn, bits, block, group)
    n = m * (-(-t // block) * block)  # tokens, padded
    groups = -(-n // group)
    x = x3.contiguous()
    kind, lfc_at = _lfc(fn, lfc, n // block * c)
    at = (_arg(fn, "x3", x, torch.float32, m * t * c), lfc_at, _arg(fn, "lo", lo, torch.bfloat16, groups * c),
          _arg(fn, "scale", scale, torch.bfloat16, groups * c),
          _arg(fn, "codes", codes, torch.uint8, _code_bytes(n, group, bits, c)))
    parts = None
    if score:
        tile = kernels().hfd_encode_tile()
        parts = torch.empty(m * t, -(-c // tile), dtype=torch.float32)
    status = kernels().hfd_encode_tokens(at[0], m, t, c, block, group, bits, kind, *at[1:], seed is not None,
                                         (seed or 0) & 0xFFFFFFFF, _rows(fn, row_scale, m * t),
                                         None if parts is None else parts.data_ptr(), _threads(m * t * c))
    if status:
        raise MemoryError(f"hf-division: {fn} could not allocate its row map ({8 * n} bytes)")
    return None if parts is None else parts.amax(dim=1)  # NaN where a part is NaN, as the one-pass score


def _rows(fn: str, row_scale: torch.Tensor | None, n: int) -> int | None:
    if row_scale is not None and row_scale.numel() != n:
        raise ValueError(f"hf-division: {fn}: argument 'row_scale' must be {n} contiguous float32 values, got "
                         f"{tuple(row_scale.shape)} {row_scale.dtype}")
    return _opt(fn, "row_scale", row_scale, torch.float32, n)


def decode_tokens(out: torch.Tensor, codes, lfc, lo, scale, bits: int, block: int, group: int,
                  row_scale: torch.Tensor | None = None) -> None:
    """Rebuild into ``out`` ``(M, T, C)`` float32 (contiguous) what :func:`encode_tokens` encoded,
    multiplied back by ``row_scale`` where given."""
    fn = "hfd_decode_tokens"
    m, t, c = out.shape
    _params(fn, bits, block, group)
    n = m * (-(-t // block) * block)
    groups = -(-n // group)
    kind, lfc_at = _lfc(fn, lfc, n // block * c)
    status = kernels().hfd_decode_tokens(
        _arg(fn, "out", out, torch.float32, m * t * c), m, t, c, block, group, bits, kind, lfc_at,
        _arg(fn, "lo", lo, torch.bfloat16, groups * c), _arg(fn, "scale", scale, torch.bfloat16, groups * c),
        _arg(fn, "codes", codes, torch.uint8, _code_bytes(n, group, bits, c)), _rows(fn, row_scale, m * t),
        _threads(m * t * c))
    if status:
        raise MemoryError(f"hf-division: {fn} could not allocate its row map ({8 * n} bytes)")


def silu_gated(n: int, c: int, group: int, gate: tuple, up: tuple, grad: torch.Tensor | None,
               out: tuple[torch.Tensor, ...]) -> None:
    """``silu(gate) * up`` (``grad`` None) into ``out = (h,)``, else its gradients for ``grad`` into
    ``out = (d_gate, d_up)``, all ``(n, c)`` contiguous float32, from ``gate`` and ``up`` as
    compressed: each ``(codes, lo, scale, bits, slot, rows)`` of tokens in groups of ``group``
    without LFC (``slot``: ``(n,)`` int32, the row of ``rows`` ``(k, c)`` float32 holding a token
    exactly, -1 for none; both None without outliers)."""
    fn = "hfd_silu_gated"
    if len(out) != (1 if grad is None else 2):
        raise ValueError(f"hf-division: {fn}: argument 'out' must hold {1 if grad is None else 2} tensors, "
                         f"got {len(out)}")
    h, dg, du = (out[0], None, None) if grad is None else (None, *out)
    args = [*_operand(fn, "gate", gate, n, c, group), *_operand(fn, "up", up, n, c, group)]
    args += [_opt(fn, name, v, torch.float32, n * c) for name, v in (("grad", grad), ("out", h), ("out", dg),
                                                                       ("out", du))]
    status = kernels().hfd_silu_gated(n, c, group, *args, _threads(n * c))
    if status:
        raise MemoryError(f"hf-division: {fn} could not allocate its tile buffers")


def _operand(fn: str, name: str, operand: tuple, n: int, c: int, group: int) -> list:
    codes, lo, scale, bits, slot, rows = operand
    _params(fn, bits, 1, group)
    if (slot is None) != (rows is None):
        raise ValueError(f"hf-division: {fn}: arguments '{name}.slot' and '{name}.rows' go together")
    groups = -(-n // group)
    # the slots' values (rows of `rows`) are the caller's: checking them would read the whole tensor
    return [_arg(fn, f"{name}.codes", codes, torch.uint8, _code_bytes(n, group, bits, c)),
            _arg(fn, f"{name}.lo", lo, torch.bfloat16, groups * c), _arg(fn, f"{name}.scale", scale, torch.bfloat16,
                                                                          groups * c),
            bits, _opt(fn, f"{name}.slot", slot, torch.int32, n), _opt(fn, f"{name}.rows", rows, torch.float32, c)]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``, Transformers' rotary embedding of one ``(b, h, t, e)``
    float32 tensor, or with ``backward`` its gradient when ``x`` is the output's gradient; ``cos`` and
    ``sin``: ``(b or 1, t, e)`` float32 with equal strides and a unit last stride (what
    :func:`hf_division.autograd.rotary.takes` checks). The result has ``x``'s layout where ``empty_like`` keeps it."""
    fn = "hfd_rotary"
    for name, v in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            raise TypeError(f"hf-division: {fn}: argument '{name}' must be a float32 tensor, got "
                            f"{getattr(v, 'dtype', type(v).__name__)}")
        if not v.is_cpu or v.dim() != (4 if v is x else 3):
            raise ValueError(f"hf-division: {fn}: argument '{name}' must be a {4 if v is x else 3}-d CPU tensor, "
                             f"got {tuple(v.shape)} on {v.device}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    b, h, t, e = x.shape
    if e % 2:
        raise ValueError(f"hf-division: {fn}: argument 'x' must have an even last size, got {tuple(x.shape)}")
    if cos.shape[0] not in (1, b) or cos.shape[1:] != (t, e) or cos.stride(-1) != 1:
        raise ValueError(f"hf-division: {fn}: argument 'cos' must be (1 or {b}, {t}, {e}) with a unit last stride, "
                         f"got {tuple(cos.shape)} strided {cos.stride()}")
    if sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(f"hf-division: {fn}: argument 'sin' must be shaped and strided as cos {tuple(cos.shape)} "
                         f"{cos.stride()}, got {tuple(sin.shape)} {sin.stride()}")
    out = torch.empty_like(x)
    batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    kernels().hfd_rotary(x.data_ptr(), *x.stride()[:3], cos.data_ptr(), sin.data_ptr(), batch_stride, cos.stride(1),
                         out.data_ptr(), *out.stride()[:3], b, h, t, e, int(backward), _threads(x.numel()))
    return out


def token_absmax(x3: torch.Tensor) -> torch.Tensor | None:
    """Per token of ``x3`` ``(M, T, C)``, max |x| as ``(M*T,)`` float32 (NaN where a token has a NaN):
    the score :func:`hf_division.quant.exact_tokens.outlier_candidates` ranks, in one pass. None where the
    kernels do not take ``x3`` (not a contiguous float32 CPU tensor): the caller computes it."""
    if not (x3.device.type == "cpu" and x3.dtype == torch.float32 and x3.is_contiguous() and x3.dim() == 3
            and x3.shape[2] > 0 and kernels() is not None):
        return None
    out = torch.empty(x3.shape[0] * x3.shape[1], dtype=torch.float32)
    kernels().hfd_token_absmax(x3.data_ptr(), out.numel(), x3.shape[2], out.data_ptr(), _threads(x3.numel()))
    return out


def pack_mask(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`hf_division.quant.packing.pack_mask` (the same bits), in one pass where the native kernels
    take ``mask`` (a contiguous CPU tensor), else by the tensor code."""
    if not (mask.device.type == "cpu" and mask.is_contiguous() and mask.element_size() in (1, 2, 4, 8)
            and kernels() is not None):
        return quant_pack_mask(mask)
    n = mask.numel()
    bits = torch.empty(-(-n // 8), dtype=torch.uint8)
    kernels().hfd_pack_nonzero(mask.data_ptr(), n, mask.element_size(), bits.data_ptr(), _threads(n))
    return bits, n


def masked_scale(grad: torch.Tensor, bits: torch.Tensor, n: int, shape, dtype: torch.dtype, divisor: float) -> torch.Tensor:
    """``grad * unpack_mask(bits, n, shape, dtype, divisor).to(grad.dtype)`` (dropout's backward:
    the gradient times the forward's noise), in one pass for contiguous float32 CPU gradients."""
    if not (grad.device.type == "cpu" and grad.dtype == dtype == torch.float32 and grad.is_contiguous()
            and kernels() is not None):
        return grad * unpack_mask(bits, n, shape, dtype, divisor).to(grad.dtype)
    if grad.numel() != n:
        raise ValueError(f"hf-division: hfd_masked_scale: argument 'n' must be grad's {grad.numel()} elements, got {n}")
    at = _arg("hfd_masked_scale", "bits", bits, torch.uint8, -(-n // 8))
    value = bit_table(grad.device, dtype, float(divisor))[1, 0].item()  # the tensor code's kept value, to the bit
    out = torch.empty_like(grad)
    kernels().hfd_masked_scale(grad.data_ptr(), at, value, out.data_ptr(), n, _threads(n))
    return out


# ----------------------------------------------------------------------------- dropout draws
#: byte offsets in the CPU generator's serialized state (``torch.Generator.get_state``, ATen's
#: CPUGeneratorImplStateLegacy): mt19937's ``left`` (int32), ``next`` (uint64), 624 state words (uint64)
_LEFT, _NEXT, _WORDS = slice(8, 12), slice(16, 24), slice(24, 24 + 624 * 8)
_STATE_BYTES = 5056


def draw_bits(state: torch.Tensor, p: float, n: int) -> torch.Tensor:
    """``n`` Bernoulli(``p``) draws as bits, from a CPU generator's serialized state ``state`` (what
    ``torch.Generator.get_state`` returns), which is updated in place to the state after them."""
    _arg("hfd_bernoulli_bits", "state", state, torch.uint8, _STATE_BYTES)
    if state.numel() != _STATE_BYTES or n < 0:
        raise ValueError(f"hf-division: hfd_bernoulli_bits: argument 'state' must be a generator state of "
                         f"{_STATE_BYTES} bytes and 'n' at least 0, got {state.numel()} and {n}")
    bits = torch.empty(-(-n // 8), dtype=torch.uint8)
    kernels().hfd_bernoulli_bits(state[_WORDS].data_ptr(), state[_LEFT].data_ptr(), state[_NEXT].data_ptr(), float(p),
                                 n, bits.data_ptr())
    return bits


def draws_match_aten() -> bool:
    """Whether :func:`bernoulli_bits` gives ATen's draws and stream in this process: False without
    the native kernels (the ``native`` switch off, no compiler), else :func:`checked_draws`."""
    lib = kernels()
    return lib is not None and checked_draws(lib)


@functools.lru_cache(maxsize=2)
def checked_draws(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s draws are ATen's, draws and generator state after them: checked once per
    library on a private generator (the default one is not touched). False where ATen draws
    otherwise (e.g. a build whose ``bernoulli_`` uses MKL's generator) or the state layout differs."""
    g = torch.Generator().manual_seed(20261202)
    for n, p in ((1000, 0.9), (2000, 0.5), (777, 1 / 3)):
        state = g.get_state()
        if state.numel() != _STATE_BYTES:
            return False
        bits = draw_bits(state, p, n)
        ours = unpack_mask(bits, n, (n,))
        theirs = torch.empty(n).bernoulli_(p, generator=g).to(torch.uint8)
        if not (torch.equal(ours, theirs) and torch.equal(state, g.get_state())):
            return False
    return True


def draws_apply(target: torch.Tensor, p, generator=None) -> bool:
    """Whether :func:`bernoulli_bits` can stand for ``target.bernoulli_(p, generator=generator)``:
    a contiguous CPU tensor, a float ``p`` in [0, 1], the default generator, and the native draws
    checked equal to ATen's here, and the ``native_draws`` switch on."""
    plain = generator is None and isinstance(p, float) and 0.0 <= p <= 1.0
    on_cpu = target.device.type == "cpu" and target.is_contiguous() and target.numel() > 0
    return switches().native_draws and plain and on_cpu and draws_match_aten()


def bernoulli_bits(n: int, p: float) -> torch.Tensor:
    """The bits (:func:`hf_division.quant.packing.pack_mask`'s layout) of ``torch.empty(n).bernoulli_(p)``
    drawn from the default CPU generator, which advances as ATen's draw would advance it: the same
    mask and the same stream after it (:func:`draws_match_aten` must hold), in one pass instead of
    a draw and a pack."""
    state = torch.get_rng_state()
    bits = draw_bits(state, p, n)
    torch.set_rng_state(state)
    return bits


def fill_draws(target: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``target`` filled with the 0/1 values of ``bits``, as ``bernoulli_`` fills it."""
    return target.copy_(unpack_mask(bits, target.numel(), target.shape))
