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

import ctypes
import functools
import threading
import warnings

import torch

from hf_division.kernels.library import FLAGS, SOURCE, Refused, build  # noqa: F401 (public here too)
from hf_division.kernels.switches import switches
from hf_division.quant.packing import bit_table, unpack_mask
from hf_division.quant.packing import pack_mask as quant_pack_mask

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


def _load() -> ctypes.CDLL | None:
    # any failure falls back (and is remembered by kernels()): the kernels are only a faster path
    try:
        return build()
    except Exception as err:  # noqa: BLE001
        warnings.warn(f"hf-division: the native CPU kernels could not be built or loaded, so the compressor runs "
                      f"its torch.compile kernels (slower): {err}", RuntimeWarning, stacklevel=3)
        return None


def applies(device: torch.device, lfc_dtype: torch.dtype | None) -> bool:
    """Whether the native kernels take a token-grouped tensor on ``device`` with this LFC dtype
    (None: no LFC): on the CPU, with an LFC of bf16 or float32 or none."""
    return device.type == "cpu" and lfc_dtype in LFC_KIND and kernels() is not None


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
