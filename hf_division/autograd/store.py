"""Saved-activation entries: one compressed copy per tensor, shared by every op that keeps it.

An :class:`Entry` is either a :class:`~hf_division.quant.packed.Packed` tensor or a recipe
``fn(parent)`` (e.g. a LayerNorm output is rebuilt from its compressed input). The registry maps a
*live* tensor to its entry so that the next op saving the same tensor reuses it. It is keyed on
``id(t)`` and validated through a weak reference to ``t``: keying on ``data_ptr`` is unsafe because
memory freed during the forward is reused at the same address for another tensor (docs/DESIGN.md,
"One copy per tensor, keyed on a live reference"). Rounding noise comes from :mod:`hf_division.compress.noise`, byte accounting is
:mod:`hf_division.autograd.accounting`.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable

import torch

from hf_division.autograd.accounting import account
from hf_division.autograd.padding import zero_padding_tokens, zero_tokens
from hf_division.quant.packed import Packed
from hf_division.compress.pipeline import cast_finite, compress, compress_row_scaled, decompress
from hf_division.config import DivisionConfig
from hf_division.compress.noise import generator
from hf_division.kernels.native import pack_mask
from hf_division.kernels.triton_codec import device_path
from hf_division.quant.packing import unpack_mask

#: names of the store's work in a ``torch.profiler`` trace: compressing a saved activation (the
#: outlier search, the row scales and the encode) and rebuilding it in backward (docs/GUIDE.md,
#: "Profiling a step")
COMPRESS_LABEL, REBUILD_LABEL = "hf_division::compress", "hf_division::rebuild"
#: :meth:`Entry.bits` of a tensor held exact: more than any compressed width
EXACT = 64


def _traced(label: str):
    """A profiler range named ``label`` while a profiler runs, else nothing: opening a range costs
    an op dispatch, and this runs for every saved tensor of every step (docs/GUIDE.md, "Profiling
    a step")."""
    return torch.profiler.record_function(label) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class Entry:
    """A saved activation held for backward. ``take()`` rebuilds it for one consumer."""

    __slots__ = ("packed", "parents", "fn", "whole", "kind", "extra", "sign", "zeros", "uses", "users", "_cache",
                 "_cast", "freed", "__weakref__")

    def __init__(self, kind: str, packed=None, parents: tuple = (), fn: Callable | None = None, extra=(), sign=None,
                 whole: Callable | None = None):
        self.packed, self.parents, self.fn, self.kind = packed, tuple(parents), fn, kind
        self.whole = whole  # ``whole(*parents)``: the recipe from the parent entries themselves, or None
        self.sign = sign  # (bits, n) of ``x > 0``, exact, for activations with a kink at 0
        self.zeros = None  # (batch index, token index, token dim) of padding tokens that were all zero
        self.extra = tuple(extra)  # tensors a recipe needs (e.g. a dropout mask), for accounting
        self.uses = 0  # consumers that have not run their backward yet (in this backward)
        self.users = 0  # consumers in all
        self._cache = self._cast = None
        self.freed = False
        account([self])

    def take(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rebuilt tensor for one consumer's backward (which then counts as done with it), cast
        to ``dtype`` if given: one cast shared by the consumers that ask for it (the q, k and v
        projections of one normalized input under autocast, which each cast it before)."""
        value = self.get()
        if dtype is not None and value.dtype != dtype:
            cast = self._cast
            if cast is None or cast.dtype != dtype:
                cast = value.to(dtype)
                self._cast = cast if self.uses > 1 else None
            value = cast
        self.done()
        return value

    def get(self) -> torch.Tensor:
        """The rebuilt tensor; kept until its last consumer is done so it is decompressed once."""
        if self._cache is not None:
            return self._cache
        if self.freed:
            raise RuntimeError(
                "hf-division: this saved activation was freed after its last use in backward (as PyTorch "
                "frees saved tensors); call backward(retain_graph=True) to backpropagate through it twice"
            )
        if self.packed is not None:
            with _traced(REBUILD_LABEL):
                value = decompress(self.packed)
                if self.sign is not None:
                    value = _with_sign(value, unpack_mask(*self.sign, value.shape))
                if self.zeros is not None:
                    value = zero_tokens(value, *self.zeros)
        else:
            value = self._from_parents()
        if self.uses > 1:
            self._cache = value
        return value

    def _from_parents(self) -> torch.Tensor:
        value = self.whole(*self.parents) if self.whole is not None else None
        if value is None:
            return self.fn(*(p.take() for p in self.parents))
        for parent in self.parents:
            parent.done()
        return value

    def compressed(self) -> Packed | None:
        """The compressed tensor itself, for a kernel that reads it in place of :meth:`take` (the
        caller then calls :meth:`done`); None where the entry is a recipe, carries an exact sign,
        or is already rebuilt (then taking it costs nothing)."""
        if (self.packed is None or self.sign is not None or self.zeros is not None or self._cache is not None
                or self.freed):
            return None
        return self.packed

    def done(self) -> None:
        """One consumer's backward has used it. After the last one the compressed copy is freed
        too, unless this backward retains the graph: autograd keeps the Functions' contexts (and so
        these entries) until the whole backward ends, so without this memory grew layer by layer
        during backward (docs/DESIGN.md, "One copy per tensor, keyed on a live reference")."""
        self.uses -= 1
        if self.uses <= 0:
            self._cache = self._cast = None
            keep = _backward_keeps_graph()
            if keep:  # a retained graph: the next backward goes through every consumer again
                self.uses = self.users
            elif keep is False:
                self.packed = self.sign = self.fn = self.whole = None
                self.parents = self.extra = ()
                self.freed = True

    def add_user(self) -> None:
        self.uses += 1
        self.users += 1

    def bits(self) -> int:
        """The fewest bits per element anything rebuilding it is held at: its own compressed copy's,
        or a recipe's parents' fewest; :data:`EXACT` where all of it is exact."""
        if self.packed is not None:
            return self.packed.bits or EXACT
        return min(map(Entry.bits, self.parents), default=EXACT)

    def tensors(self) -> list[torch.Tensor]:
        p = self.packed
        own = p.storages() if p is not None else []
        own += [self.sign[0]] if self.sign is not None else []
        own += list(self.zeros[:2]) if self.zeros is not None else []
        return own + list(self.extra)


def _backward_keeps_graph() -> bool | None:
    """Whether the running backward retains the graph; None outside a backward (or if unknown)."""
    try:
        if torch._C._current_graph_task_id() == -1:
            return None
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):
        return None


def _with_sign(value: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Move rebuilt values that crossed 0 back to the side the original was on."""
    tiny = torch.finfo(value.dtype).tiny
    return torch.where(positive.bool(), value.clamp(min=tiny), value.clamp(max=0))


# ----------------------------------------------------------------------------- recomputation
class _Depth(threading.local):
    """Per thread: :func:`exact` in one thread must not switch compression off for a forward
    running in another (a DataParallel replica, an evaluation thread), and a recomputation runs in
    the thread of the backward that needs it."""
    value = 0


_recomputing = _Depth()


def active() -> bool:
    """Whether ops should compress what they save: training with grad, and not inside a
    checkpoint's backward recomputation (whose saved tensors are consumed at once)."""
    return torch.is_grad_enabled() and not in_recomputation()


def in_recomputation() -> bool:
    """Whether a checkpoint's backward recomputation (or :func:`exact`) is running in this thread."""
    return bool(_recomputing.value)


@contextlib.contextmanager
def recomputing():
    _recomputing.value += 1
    try:
        yield
    finally:
        _recomputing.value -= 1


@contextlib.contextmanager
def exact():
    """Forwards run inside (in this thread) keep what they save for backward uncompressed, as the unpatched model
    does (e.g. for a gradient penalty, which needs second derivatives); the model stays patched."""
    with recomputing():
        yield


# ----------------------------------------------------------------------------- bookkeeping
_DISABLE_TORCH_FUNCTION = getattr(torch._C, "DisableTorchFunction", None)


def bookkeeping(fn: Callable) -> Callable:
    """``fn`` (division's own tensor code: compressing, packing bits, registering) run with
    ``__torch_function__`` handling off. The patched forward runs under a ``TorchFunctionMode``
    (:class:`hf_division.autograd.forward_mode.ForwardMode`), whose Python handler every torch call would otherwise
    go through; it routes nothing here (it routes only dropout and dtype casts, and a Function's
    forward runs with grad off), and a compressed copy does not depend on any other mode (e.g. a default-device
    context: this code places every tensor itself). At small sizes that handler outweighed the
    kernels (docs/DESIGN.md, "Mechanism")."""
    if _DISABLE_TORCH_FUNCTION is None:
        return torch.compiler.disable(fn)

    def run(*args, **kwargs):
        with _DISABLE_TORCH_FUNCTION():
            return fn(*args, **kwargs)

    run.__name__, run.__doc__, run.__wrapped__ = fn.__name__, fn.__doc__, fn
    # never traced by Dynamo: where it inlines an autograd Function's forward, tracing the registry
    # (a dict that weak-reference finalizers change at any collection) fails or guards on it
    return torch.compiler.disable(run)


# ----------------------------------------------------------------------------- registry
_live: dict[int, tuple[weakref.ref, int, Entry]] = {}


def live_count() -> int:
    """How many live tensors the registry maps to entries (a leak check)."""
    return len(_live)


def lookup(t: torch.Tensor) -> Entry | None:
    """The entry holding the live tensor ``t`` (unmodified since), or None."""
    rec = _live.get(id(t))
    if rec is not None and rec[0]() is t and rec[1] == t._version and not rec[2].freed:
        return rec[2]
    return None


def register(t: torch.Tensor, entry: Entry) -> None:
    key = id(t)

    def _drop(ref, key=key):
        if _live.get(key, (None,))[0] is ref:
            del _live[key]

    _live[key] = (weakref.ref(t, _drop), t._version, entry)


@bookkeeping
def keep(t: torch.Tensor, kind: str, config: DivisionConfig, exact_sign: bool = False, precise: bool = False) -> Entry:
    """The entry holding ``t`` for one more consumer: reused if ``t`` is already held (``precise``:
    only if held at no fewer bits than ``config`` gives ``kind``, else a copy of its own, which later
    consumers share). ``exact_sign``: also keep ``t > 0`` as bits, so that the rebuilt tensor has
    the original's sign everywhere (ReLU-like activations: their gradient is the sign)."""
    entry = lookup(t)
    if entry is None or precise and entry.bits() < (config.bits(kind) or EXACT):
        with _traced(COMPRESS_LABEL):
            entry = _keep_new(t, kind, config, exact_sign)
    entry.add_user()
    return entry


def _keep_new(t: torch.Tensor, kind: str, config: DivisionConfig, exact_sign: bool) -> Entry:
    """:func:`keep` of a tensor not held yet: the entry, registered. A parameter fed to a layer as
    its input (DeBERTa normalizes its relative-position embedding weight in every forward) is held
    by reference, as autograd holds it: the model holds it anyway, so a compressed copy cost bytes
    the unpatched model does not hold, and its gradient precision. Only a parameter: another leaf
    that needs a gradient is an activation too (PEFT's ``enable_input_require_grads`` makes the
    embedding's output one, the first checkpointed layer's input), which nothing else holds."""
    entry = None
    if isinstance(t, torch.nn.Parameter):
        entry = _by_reference(t, kind)
        register(t, entry)
        return entry
    if kind == "norm" and config.norm_row_scale and config.bits(kind):
        entry = _keep_row_scaled(t, kind, config)
    if entry is None:
        packed = pack(t, kind, config)
        sign = pack_mask(t > 0) if exact_sign and packed.bits else None
        entry = Entry(kind, packed=packed, sign=sign)
        entry.zeros = zero_padding_tokens(t) if packed.bits else None
        register(t, entry)
    return entry


def _by_reference(t: torch.Tensor, kind: str) -> Entry:
    """An entry holding ``t`` itself (a view sharing its storage and version counter), whose rebuild
    raises where ``t`` was modified in place since, as autograd's check of its own saves does."""
    held, version = t.detach(), t._version

    def rebuild() -> torch.Tensor:
        if held._version != version:
            raise RuntimeError("hf-division: a parameter a layer took as its input was modified by an inplace "
                               "operation between the forward and its backward (one of the variables needed for "
                               "gradient computation)")
        return held

    return Entry(kind, fn=rebuild, extra=[held])


#: the smallest scale a row is kept at (:func:`_keep_row_scaled`); a 0-d CPU tensor combines with any device's
_TINY = torch.tensor(torch.finfo(torch.float32).tiny)


def _keep_row_scaled(t: torch.Tensor, kind: str, config: DivisionConfig) -> Entry | None:
    """``t`` ``(..., T, C)`` kept as its per-row (token) RMS, exact in float32, times the
    compressed rows divided by it. For the residual stream (norm inputs): a norm normalizes each
    token, so each token's error should be relative to its own scale, not to its block's or
    group's. Rows of other scales otherwise lose their value: LLMs' "massive activations" on the
    first tokens set the LFC and group ranges of their neighbours, and ViT's [CLS] or mask-token
    rows, several times smaller than the patches, drown in them (docs/ARCHITECTURES.md, "ViT"; docs/DESIGN.md, "Policy").
    Costs ``4 / (C / 2)`` of the 4-bit codes."""
    if t.numel() < config.min_numel or t.dim() < 2 or not t.is_floating_point():
        return None
    x, dtype = t.detach(), t.dtype  # the recipe must not reference ``t``: that would keep it alive
    rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).mul_(x.shape[-1] ** -0.5)
    # a zero row (a padding token whose embedding is zero, as in Gemma) keeps the smallest scale: its
    # codes then rebuild it as (almost) exactly zero. A norm's Jacobian at a zero row is 1/sqrt(eps),
    # a thousand times its value at a row of a group's quantization noise; with left padding the last
    # padding token predicts the first real one, so that Jacobian carries a gradient (issue 41)
    # (``fmax``: one kernel where ``where`` against a filled tensor took three on a GPU, and as
    # ``where`` it gives a row holding a NaN the smallest scale too, which a clamp would leave NaN)
    rms = torch.fmax(rms, _TINY)
    fused = compress_row_scaled(x, rms, generator=generator(t.device), **config.compressor_args(kind))
    if fused is not None:  # the division and the product inside the kernels' passes
        if not fused.bits:
            return None
        entry = Entry(kind, packed=fused)
        register(t, entry)
        return entry
    packed = pack(x / rms, kind, config)
    if not packed.bits:  # not smaller compressed: ``keep`` holds ``t`` itself, without the scales
        return None
    # clamped to ``dtype``'s range: an fp16 value near 65504 times its rebuilt scale can round to inf
    derive(t, (Entry(kind, packed=packed),), lambda r: cast_finite(r * rms, dtype), extra=[rms])
    return lookup(t)


@bookkeeping
def keep_mask(t: torch.Tensor, kind: str = "attention") -> Entry | None:
    """The entry holding the attention mask ``t`` as 1 bit per element for one more consumer
    (reused if ``t`` is already held: every layer of a forward gets the same mask), or None to hold
    ``t`` as it is.

    Why: the recomputation in backward needs the mask, which the unpatched model never keeps (its
    softmax keeps the probabilities instead); held whole, a float ``(B, 1, T, T)`` mask outweighs a
    layer's compressed q, k, v (docs/DESIGN.md, "Attention masks as bits"). Held as bits: a bool
    mask, and on the CPU (where reading back the check costs nothing) a float mask whose entries
    are 0 and one other value (Transformers' additive "blocked" value); only when the bits are
    smaller than ``t``'s storage (a broadcast view is small already). Rebuilt exactly."""
    entry = lookup(t)
    if entry is None:
        rebuild = _mask_recipe(t)
        if rebuild is None:
            return None
        entry = Entry(kind, fn=rebuild, extra=rebuild.extra)
        register(t, entry)
    entry.add_user()
    return entry


def _mask_recipe(t: torch.Tensor) -> Callable | None:
    """A no-argument function rebuilding ``t`` from its bits (kept as its ``extra`` attribute, with
    the bias below), or None if ``t`` is not such a mask or would not be smaller (:func:`keep_mask`).

    A float mask is "blocked -> its minimum" over a base that does not vary along the query axis
    (-2): zero (Transformers' additive masks) or a per-key bias (ALiBi, which Falcon adds into the
    mask since Transformers 5.25, docs/DESIGN.md "Attention masks as bits"). The blocked pattern is
    held once over the leading axes it does not vary along (ALiBi's heads). Exactness is checked."""
    if t.requires_grad:  # a learned bias, not a mask
        return None
    if t.dtype == torch.bool:
        blocked, fill, base = ~t, None, None
    elif t.is_floating_point() and not device_path(t.device) and t.numel() and t.dim() >= 2:
        fill = t.min().item()
        blocked = t == fill
        base = t.masked_fill(blocked, float("-inf")).amax(-2, keepdim=True)
        base = base.masked_fill_(base.isinf(), 0.0)  # a key no query attends: its base is never read
        base = base if bool(base.any()) else None
    else:
        return None
    blocked = blocked if device_path(t.device) else _fewest_axes(blocked)  # its check reads back
    bias = [] if base is None else [base]
    bits, n = pack_mask(blocked)
    if bits.numel() + sum(b.numel() * b.element_size() for b in bias) >= t.untyped_storage().nbytes():
        return None
    shape, small, dtype, device = t.shape, blocked.shape, t.dtype, t.device

    def rebuild() -> torch.Tensor:
        off = unpack_mask(bits, n, small).bool().expand(shape)
        if fill is None:
            return (~off).contiguous()
        value = torch.zeros((), dtype=dtype, device=device) if base is None else base
        return torch.where(off, torch.full((), fill, dtype=dtype, device=device), value).expand(shape).contiguous()

    if fill is not None and not torch.equal(rebuild(), t):  # a third value, or a bias varying per query
        return None
    rebuild.extra = [bits, *bias]
    return rebuild


def _fewest_axes(blocked: torch.Tensor) -> torch.Tensor:
    """``blocked`` narrowed to size 1 along each leading axis (all but the last two) it does not vary along."""
    for axis in range(blocked.dim() - 2):
        first = blocked.narrow(axis, 0, 1)
        if blocked.size(axis) > 1 and torch.equal(first.expand_as(blocked), blocked):
            blocked = first
    return blocked


@bookkeeping
def derive(t: torch.Tensor, parents: tuple, fn: Callable, extra=(), whole: Callable | None = None) -> None:
    """Declare that ``t == fn(*parents)`` so a later consumer of ``t`` stores nothing new.
    ``whole(*parent_entries)``, where given, is tried first: the same value computed from the
    entries as they are held (:meth:`Entry.compressed`), or None to fall back to ``fn``."""
    entry = Entry(parents[0].kind, parents=parents, fn=fn, extra=extra, whole=whole)
    for parent in parents:
        parent.add_user()
    register(t, entry)
    weakref.finalize(t, _release_unused, weakref.ref(entry))


def _release_unused(ref):
    # ``t`` died; if no consumer took the recipe, give its use of the parents back
    entry = ref()
    if entry is not None and entry.users == 0:
        for parent in entry.parents:
            parent.users -= 1
            parent.done()


def pack(t: torch.Tensor, kind: str, config: DivisionConfig) -> Packed:
    """``t`` compressed as ``config`` says for ``kind`` (kept as it is when too small, not float,
    or a Linear input of at most ``config.narrow_linear`` channels)."""
    args = config.compressor_args(kind)
    narrow = kind == "linear" and t.dim() >= 2 and t.shape[-1] <= config.narrow_linear
    if t.numel() < config.min_numel or not t.is_floating_point() or narrow:
        args["bits"] = 0
    token_dim = -2 if t.dim() >= 2 else None
    return compress(t.detach(), token_dim=token_dim, generator=generator(t.device), **args)
