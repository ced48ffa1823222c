"""The compressor's native CPU kernels: ``csrc/division_cpu.c``, built with the C compiler on first use.

The token-group compressor compiled by ``torch.compile`` spent most of a division step's extra
time on the CPU: inductor's loops ran at about 1.5 ns per element and each call paid about 0.1 ms
of guards and wrappers, several calls per saved tensor (docs/DESIGN.md, "Native CPU kernels").
The C file is the same math element by element and gives the same bytes (tested against
:mod:`hf_division.quant.codecs`); one call per tensor, parallel over PyTorch's threads.

It is built once per machine into a cache folder (``HF_DIVISION_CACHE``, else
``$XDG_CACHE_HOME/hf_division`` or ``~/.cache/hf_division``), keyed on the source, the flags, the
compiler and the CPU, like inductor's own C++ cache. Where no compiler works, or with
the ``native`` switch off (:func:`hf_division.kernels.configure`, ``HF_DIVISION_NATIVE=0``),
:func:`kernels` returns None and the compressor uses the
``torch.compile`` kernels (:mod:`hf_division.kernels.compiled`), with one warning.
"""
from __future__ import annotations

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
    """The loaded library, built on first use; None if switched off (``native``) or it cannot be built here."""
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


def _load() -> ctypes.CDLL | None:
    try:
        return build()
    except (OSError, subprocess.SubprocessError) as err:
        warnings.warn(f"hf-division: the native CPU kernels could not be built, so the compressor runs its "
                      f"torch.compile kernels (slower): {err}", RuntimeWarning, stacklevel=3)
        return None


def build(cc: str | None = None, cache: Path | None = None) -> ctypes.CDLL:
    """Compile ``csrc/division_cpu.c`` with ``cc`` (default: ``$CC``, else ``cc``) into ``cache``
    (default: the cache folder above) unless it is there already, and load it. Tries
    ``-march=native`` first, then without it (some compilers or CPUs lack it). Raises ``OSError``
    or ``subprocess.SubprocessError`` naming each command that failed."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    errors = []
    for arch in (["-march=native"], []):
        flags = FLAGS + arch
        try:
            return _declare(ctypes.CDLL(str(_compiled(cc, flags, cache or _cache_dir()))))
        except (OSError, subprocess.SubprocessError) as err:
            errors.append(f"{' '.join([cc] + flags)}: {err}")
    raise subprocess.SubprocessError(" | ".join(errors))


def _compiled(cc: str, flags: list[str], cache: Path) -> Path:
    source = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_id().encode()]))
    target = cache / f"division_cpu_{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([cc, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise subprocess.SubprocessError(f"exit status {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: processes building at once each install a whole file
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    shape = [i64, i64, i64, i64, i64, i32, i32]  # m, t, c, block, group, bits, lfc kind
    lib.hfd_encode_tokens.argtypes = [p, *shape, p, p, p, p, i32, ctypes.c_uint32, p, p, i32]
    lib.hfd_encode_tokens.restype = None
    lib.hfd_encode_tile.argtypes = []
    lib.hfd_encode_tile.restype = i64
    lib.hfd_decode_tokens.argtypes = [p, *shape, p, p, p, p, p, i32]
    lib.hfd_decode_tokens.restype = None
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
    return lib


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= GRAIN else 1


def encode_tokens(x3: torch.Tensor, codes, lfc, lo, scale, seed: int | None, bits: int, block: int, group: int,
                  row_scale: torch.Tensor | None = None, score: bool = False) -> torch.Tensor | None:
    """Fill ``codes``, ``lfc`` (None: no LFC), ``lo`` and ``scale`` from ``x3`` ``(M, T, C)`` float32,
    each sequence padded to whole blocks by repeating its last token (the layout of
    :func:`hf_division.compress.pipeline.compress`), divided by ``row_scale`` (``M*T`` float32, one per
    token) where given. ``seed``: the rounding noise's seed, None for round-to-nearest.
    ``score``: also return :func:`token_absmax` of ``x3`` (not divided), read in the encode's first pass."""
    m, t, c = x3.shape
    x = x3.contiguous()
    kind = LFC_KIND[None if lfc is None else lfc.dtype]
    parts = None
    if score:
        tile = kernels().hfd_encode_tile()
        parts = torch.empty(m * t, -(-c // tile), dtype=torch.float32)
    kernels().hfd_encode_tokens(_ptr(x), m, t, c, block, group, bits, kind, _ptr(lfc), _ptr(lo), _ptr(scale),
                                _ptr(codes), seed is not None, (seed or 0) & 0xFFFFFFFF, _ptr(_rows(row_scale, m * t)),
                                _ptr(parts), _threads(m * t * c))
    return None if parts is None else parts.amax(dim=1)  # NaN where a part is NaN, as the one-pass score


def _rows(row_scale: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if row_scale is None:
        return None
    if row_scale.dtype != torch.float32 or row_scale.numel() != n or not row_scale.is_contiguous():
        raise ValueError(f"hf-division: row_scale must be {n} contiguous float32 values, got {tuple(row_scale.shape)} "
                         f"{row_scale.dtype}")
    return row_scale


def decode_tokens(out: torch.Tensor, codes, lfc, lo, scale, bits: int, block: int, group: int,
                  row_scale: torch.Tensor | None = None) -> None:
    """Rebuild into ``out`` ``(M, T, C)`` float32 (contiguous) what :func:`encode_tokens` encoded,
    multiplied back by ``row_scale`` where given."""
    m, t, c = out.shape
    kind = LFC_KIND[None if lfc is None else lfc.dtype]
    kernels().hfd_decode_tokens(_ptr(out), m, t, c, block, group, bits, kind, _ptr(lfc), _ptr(lo), _ptr(scale),
                                _ptr(codes), _ptr(_rows(row_scale, m * t)), _threads(m * t * c))


def silu_gated(n: int, c: int, group: int, gate: tuple, up: tuple, grad: torch.Tensor | None,
               out: tuple[torch.Tensor, ...]) -> None:
    """``silu(gate) * up`` (``grad`` None) into ``out = (h,)``, else its gradients for ``grad`` into
    ``out = (d_gate, d_up)``, all ``(n, c)`` contiguous float32, from ``gate`` and ``up`` as
    compressed: each ``(codes, lo, scale, bits, slot, rows)`` of tokens in groups of ``group``
    without LFC (``slot``: ``(n,)`` int32, the row of ``rows`` ``(k, c)`` float32 holding a token
    exactly, -1 for none; both None without outliers)."""
    h, dg, du = (out[0], None, None) if grad is None else (None, *out)
    args = [_ptr(v) if isinstance(v, torch.Tensor) or v is None else v for v in (*gate, *up, grad, h, dg, du)]
    status = kernels().hfd_silu_gated(n, c, group, *args, _threads(n * c))
    if status:
        raise MemoryError("hf-division: the SiLU-gated kernel could not allocate its tile buffers")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``, Transformers' rotary embedding of one ``(b, h, t, e)``
    float32 tensor, or with ``backward`` its gradient when ``x`` is the output's gradient; ``cos`` and
    ``sin``: ``(b or 1, t, e)`` float32 with equal strides and a unit last stride (what
    :func:`hf_division.autograd.rotary.takes` checks). The result has ``x``'s layout where ``empty_like`` keeps it."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    b, h, t, e = x.shape
    batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    kernels().hfd_rotary(_ptr(x), *x.stride()[:3], _ptr(cos), _ptr(sin), batch_stride, cos.stride(1), _ptr(out),
                         *out.stride()[:3], b, h, t, e, int(backward), _threads(x.numel()))
    return out


def token_absmax(x3: torch.Tensor) -> torch.Tensor | None:
    """Per token of ``x3`` ``(M, T, C)``, max |x| as ``(M*T,)`` float32 (NaN where a token has a NaN):
    the score :func:`hf_division.quant.exact_tokens.outlier_candidates` ranks, in one pass. None where the
    kernels do not take ``x3`` (not a contiguous float32 CPU tensor): the caller computes it."""
    if not (x3.device.type == "cpu" and x3.dtype == torch.float32 and x3.is_contiguous() and x3.dim() == 3
            and x3.shape[2] > 0 and kernels() is not None):
        return None
    out = torch.empty(x3.shape[0] * x3.shape[1], dtype=torch.float32)
    kernels().hfd_token_absmax(_ptr(x3), out.numel(), x3.shape[2], _ptr(out), _threads(x3.numel()))
    return out


def pack_mask(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`hf_division.quant.packing.pack_mask` (the same bits), in one pass where the native kernels
    take ``mask`` (a contiguous CPU tensor), else by the tensor code."""
    if not (mask.device.type == "cpu" and mask.is_contiguous() and mask.element_size() in (1, 2, 4, 8)
            and kernels() is not None):
        return quant_pack_mask(mask)
    n = mask.numel()
    bits = torch.empty(-(-n // 8), dtype=torch.uint8)
    kernels().hfd_pack_nonzero(_ptr(mask), n, mask.element_size(), _ptr(bits), _threads(n))
    return bits, n


def masked_scale(grad: torch.Tensor, bits: torch.Tensor, n: int, shape, dtype: torch.dtype, divisor: float) -> torch.Tensor:
    """``grad * unpack_mask(bits, n, shape, dtype, divisor).to(grad.dtype)`` (dropout's backward:
    the gradient times the forward's noise), in one pass for contiguous float32 CPU gradients."""
    if not (grad.device.type == "cpu" and grad.dtype == dtype == torch.float32 and grad.is_contiguous()
            and kernels() is not None):
        return grad * unpack_mask(bits, n, shape, dtype, divisor).to(grad.dtype)
    value = bit_table(grad.device, dtype, float(divisor))[1, 0].item()  # the tensor code's kept value, to the bit
    out = torch.empty_like(grad)
    kernels().hfd_masked_scale(_ptr(grad), _ptr(bits), value, _ptr(out), n, _threads(n))
    return out


# ----------------------------------------------------------------------------- dropout draws
#: byte offsets in the CPU generator's serialized state (``torch.Generator.get_state``, ATen's
#: CPUGeneratorImplStateLegacy): mt19937's ``left`` (int32), ``next`` (uint64), 624 state words (uint64)
_LEFT, _NEXT, _WORDS = slice(8, 12), slice(16, 24), slice(24, 24 + 624 * 8)
_STATE_BYTES = 5056


def draw_bits(state: torch.Tensor, p: float, n: int) -> torch.Tensor:
    """``n`` Bernoulli(``p``) draws as bits, from a CPU generator's serialized state ``state`` (what
    ``torch.Generator.get_state`` returns), which is updated in place to the state after them."""
    bits = torch.empty(-(-n // 8), dtype=torch.uint8)
    kernels().hfd_bernoulli_bits(_ptr(state[_WORDS]), _ptr(state[_LEFT]), _ptr(state[_NEXT]), float(p), n, _ptr(bits))
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
