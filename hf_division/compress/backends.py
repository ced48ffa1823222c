"""The compressor's backends: one small interface, picked once per tensor (docs/DESIGN.md,
"Compressor").

* ``native``: the C kernels (:mod:`hf_division.kernels.native`), on the CPU, for token groups with no
  LFC or a bf16 or float32 one: the encode, the decode and the outlier score, one pass each.
* ``compiled``: the torch kernels of :mod:`hf_division.quant.codecs` through ``torch.compile`` over
  fixed-size chunks (:mod:`hf_division.kernels.compiled`); any device, every layout.
* ``eager``: the same torch kernels called as they are, the reference the others are tested
  against (``tests/compress/test_backends.py``).
* ``triton``: the Triton kernels (:mod:`hf_division.kernels.triton_codec`), on CUDA devices, for
  token groups: the tensor read as it is held (any dtype and strides), the exact tokens chosen
  and the whole encode in three launches, the rebuild in one or two, no host synchronisation.

A backend turns ``(M, T, C)`` float32 tokens, or a flat float32 run, into codes and back; which
tokens are held exact, the layout and the bundle are the pipeline's (:mod:`.pipeline`). All give
the same codes for the same seed (the compiled kernels may round a product differently at a
last-bit tie, a code in 10^4 or fewer, tested).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_division.kernels import compiled as runner
from hf_division.kernels import native
from hf_division.kernels import triton_codec
from hf_division.kernels.switches import switches
from hf_division.quant.codecs import decode_into, dequantize_tuple, encode_groups, encode_into, minmax_groups
from hf_division.quant.exact_tokens import token_absmax
from hf_division.quant.packed import FLAT, Packed, TokenBuffers, code_views
from hf_division.quant.rounding import SCALE_DTYPE, bf16_directed, wrap_int32

# The codes are read once per code of a word (8 times at 4 bits), above inductor's default of 4
# reads, beyond which it writes them out as int32 and packs them in a second loop (docs/DESIGN.md,
# "Compressor"). The flat kernels are slower with it: only this one gets it.
runner.tune(encode_into, realize_reads_threshold=64)


@dataclass
class Encoded:
    """What an encode returns: the codes and their group ranges, the block means (None: no LFC),
    and, where asked for and read in the encode's own pass, max |x| per token."""

    codes: torch.Tensor
    lfc: torch.Tensor | None
    lo: torch.Tensor
    scale: torch.Tensor
    absmax: torch.Tensor | None = None


class Backend:
    """The interface: encode and decode token groups and flat groups, and score tokens."""

    name = ""
    #: reads max |x| per token in the encode's first pass (``encode_tokens(score=True)``)
    scores_in_encode = False
    #: divides each token by a given scale inside its passes (``encode_tokens(row_scale=...)``)
    scales_rows = False
    #: reads the tokens in any float dtype and strides (else the pipeline hands it float32)
    any_dtype = False
    #: chooses outlier tokens at a fixed capacity itself (``exact_tokens``) and rebuilds whole
    #: tensors, exact rows included (``rebuild_tokens``)
    whole = False

    def token_absmax(self, x3: torch.Tensor) -> torch.Tensor:
        """Max |x| per token of ``(M, T, C)`` as ``(M*T,)``: the outlier search's score."""
        return token_absmax(x3)

    def encode_tokens(self, x3: torch.Tensor, seed, bits: int, block: int, group: int, lfc_dtype: torch.dtype,
                      row_scale: torch.Tensor | None = None, score: bool = False) -> Encoded:
        """``(M, T, C)`` float32 -> codes in groups of ``group`` tokens of one channel, rows padded
        to whole blocks of ``block`` by repeating the last token; ``seed`` (0-d int64, None: round
        to nearest) seeds the rounding noise."""
        raise NotImplementedError

    def decode_tokens(self, p: Packed) -> torch.Tensor:
        """A token-grouped ``p`` -> float32 ``(M, T, C)`` in memory order, times ``p.row_scale``."""
        raise NotImplementedError

    def encode_flat(self, flat: torch.Tensor, seed, bits: int, group: int) -> Encoded:
        """Float32 (a multiple of ``group``) -> codes with one min/scale pair per ``group`` elements."""
        raise NotImplementedError

    def decode_flat(self, p: Packed) -> torch.Tensor:
        """A flat-grouped ``p`` -> its values, float32, padding included."""
        raise NotImplementedError


class TorchBackend(Backend):
    """The torch kernels, compiled over chunks or eager."""

    def __init__(self, compile: bool):
        self.compile, self.name = compile, "compiled" if compile else "eager"

    def encode_tokens(self, x3, seed, bits, block, group, lfc_dtype, row_scale=None, score=False) -> Encoded:
        if row_scale is not None or score:
            raise ValueError(f"the {self.name} backend neither scales rows nor scores tokens in its encode")
        m, t, c = x3.shape
        out = TokenBuffers.empty(m, t, c, bits, block, group, lfc_dtype, SCALE_DTYPE, x3.device)
        n = out.tokens
        if n != m * t:  # repeat the last token: the padded block's mean moves, but no group range widens
            x3 = torch.cat([x3, x3[:, -1:].expand(m, n // m - t, c)], dim=1)
        tokens = x3.reshape(-1, c)
        full, last = code_views(out.codes, out.n_full, out.rest, group, bits, c)

        def args_of(start, groups, words=None):
            stop = start + groups
            return (full[start:stop] if words is None else words,
                    None if out.lfc is None else out.lfc[start * group // block : stop * group // block],
                    out.lo[start:stop], out.scale[start:stop], tokens[start * group : stop * group],
                    None if seed is None else seed + start * group * c)

        pieces = runner.token_chunks(out.n_full, c, group, self.compile)
        runner.run_tokens(encode_into, (bits, block, group, lfc_dtype), pieces, args_of)
        if out.rest:  # a last, partial group: its own length
            encode_into(*args_of(out.n_full, 1, last), bits, block, out.rest, lfc_dtype)
        return Encoded(out.codes, out.lfc, out.lo, out.scale)

    def decode_tokens(self, p: Packed) -> torch.Tensor:
        m, t, c = p.layout.rows
        block, group = p.block_size, p.group_size
        tp = -(-t // block) * block
        n_full, rest = divmod(m * tp, group)
        lo, scale = p.lo.float(), p.scale.float()
        lfc = p.lfc.float() if p.lfc is not None else None
        full, last = code_views(p.packed, n_full, rest, group, p.bits, c)
        out = torch.empty(m * tp, c, dtype=torch.float32, device=p.packed.device)

        def args_of(start, groups, words=None):
            stop = start + groups
            return (out[start * group : stop * group], full[start:stop] if words is None else words,
                    None if lfc is None else lfc[start * group // block : stop * group // block], lo[start:stop],
                    scale[start:stop])

        runner.run_tokens(decode_into, (p.bits, block, group), runner.token_chunks(n_full, c, group, self.compile),
                          args_of)
        if rest:
            decode_into(*args_of(n_full, 1, last), p.bits, block, rest)
        x = out.view(m, tp, c)
        x = x[:, :t].contiguous() if tp != t else x
        return x if p.row_scale is None else x * p.row_scale.view(m, t, 1)

    def encode_flat(self, flat, seed, bits, group) -> Encoded:
        """``lo`` rounded down and ``scale`` up to bf16 (:func:`~hf_division.quant.rounding.bf16_directed`),
        so every value of the group lies inside ``[lo, lo + levels * scale]`` and clamping never
        biases the rounding; element ``i`` gets ``hash_uniform(i, seed)``."""
        n_groups = flat.numel() // group
        lo, hi = runner.run_groups(minmax_groups, n_groups, (flat,), (group,), (group,), self.compile)
        levels = (1 << bits) - 1
        lo32 = bf16_directed(lo, down=True)
        s32 = bf16_directed((hi - lo32) * (1.0 / levels), down=False)
        inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
        base = None if seed is None else wrap_int32(torch.arange(n_groups, dtype=torch.int64, device=flat.device) * group)
        (codes,) = runner.run_groups(encode_groups, n_groups, (flat, base, seed, lo32, inv), (group, 1, None, 1, 1),
                                     (bits, group), self.compile)
        return Encoded(codes, None, lo32.to(SCALE_DTYPE), s32.to(SCALE_DTYPE))

    def decode_flat(self, p: Packed) -> torch.Tensor:
        per_code = p.group_size * p.bits // 8
        (flat,) = runner.run_groups(dequantize_tuple, p.lo.numel(), (p.packed, p.lo, p.scale), (per_code, 1, 1),
                                    (p.bits, p.group_size), self.compile)
        return flat


class NativeBackend(Backend):
    """The C kernels: token groups on the CPU, padding and all in one call."""

    name, scores_in_encode, scales_rows = "native", True, True

    def token_absmax(self, x3: torch.Tensor) -> torch.Tensor:
        absmax = native.token_absmax(x3)  # None where the kernel does not take x3 (a strided view, ...)
        return token_absmax(x3) if absmax is None else absmax

    def encode_tokens(self, x3, seed, bits, block, group, lfc_dtype, row_scale=None, score=False) -> Encoded:
        m, t, c = x3.shape
        out = TokenBuffers.empty(m, t, c, bits, block, group, lfc_dtype, SCALE_DTYPE, x3.device)
        absmax = native.encode_tokens(x3, out.codes, out.lfc, out.lo, out.scale, None if seed is None else int(seed),
                                      bits, block, group, row_scale, score)
        return Encoded(out.codes, out.lfc, out.lo, out.scale, absmax)

    def decode_tokens(self, p: Packed) -> torch.Tensor:
        out = torch.empty(*p.layout.rows, dtype=torch.float32)
        native.decode_tokens(out, p.packed, p.lfc, p.lo, p.scale, p.bits, p.block_size, p.group_size, p.row_scale)
        return out


class TritonBackend(TorchBackend):
    """The Triton kernels for token groups; flat groups through the torch kernels."""

    any_dtype, whole, scales_rows = True, True, True

    def __init__(self):
        super().__init__(compile=True)  # flat groups: the compiled torch kernels
        self.name = "triton"

    def exact_tokens(self, x3: torch.Tensor, ratio: float, row_scale: torch.Tensor | None = None) -> dict:
        """The outlier tokens at a fixed capacity (:func:`~hf_division.kernels.triton_codec.exact_tokens`),
        of ``x3 / row_scale`` where given."""
        return triton_codec.exact_tokens(x3, ratio, row_scale)

    def encode_tokens(self, x3, seed, bits, block, group, lfc_dtype, row_scale=None, score=False,
                      exact=None) -> Encoded:
        """``row_scale``: one per token of ``x3`` in its order; the exact rows (``exact``) are then
        held as dividing and multiplying rebuilds them, in ``x3``'s dtype."""
        if score:
            raise ValueError("the triton backend does not score tokens in its encode")
        out = triton_codec.encode_tokens(x3, seed, bits, block, group, lfc_dtype, exact, row_scale)
        return Encoded(out.codes, out.lfc, out.lo, out.scale)

    def rebuild_tokens(self, p: Packed) -> torch.Tensor:
        """``p`` -> ``(M, T, C)`` in ``p.dtype``, times its row scale, its exact rows in their places."""
        return triton_codec.decode_tokens(p)


NATIVE, COMPILED, EAGER = NativeBackend(), TorchBackend(compile=True), TorchBackend(compile=False)
TRITON = TritonBackend()


def pick(device: torch.device, grouping: str, lfc_dtype: torch.dtype | None) -> Backend:
    """The backend for one tensor: the native kernels where they take it (CPU, token groups, the
    ``native`` switch on, no LFC or a bf16/float32 one), the Triton kernels for token groups on a
    CUDA device (the ``triton`` switch on, Triton importable), else the torch kernels, compiled
    unless the ``compile`` switch is off (:func:`hf_division.kernels.configure`)."""
    if grouping != FLAT and triton_codec.applies(device):
        return TRITON
    if grouping != FLAT and native.applies(device, lfc_dtype):
        return NATIVE
    return COMPILED if switches().compile else EAGER
