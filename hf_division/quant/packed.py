"""What a compressed tensor is: :class:`Packed` (codes, group ranges, block means, exact rows), the
:class:`Layout` of its tokens in memory, and how the codes of token groups lie in bytes
(docs/DESIGN.md, "Compressor").
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from hf_division.quant.packing import code_layout

#: how a compressed tensor groups its values for one min/scale pair
TOKENS, FLAT = "tokens", "flat"
GROUPINGS = (TOKENS, FLAT)


@dataclass(frozen=True)
class Layout:
    """Where the tokens of a compressed tensor lie in its memory.

    The tensor, permuted by ``perm`` (dims by decreasing stride), has shape ``shape`` and is dense;
    its token axis is ``token_dim`` of that permuted shape. Compression works on it viewed as
    ``(M, T, C)``: ``M`` the product of the dims before the token axis, ``C`` of those after it.
    """

    perm: tuple
    shape: tuple
    token_dim: int

    @property
    def channels(self) -> int:
        """``C``; a token axis that is innermost makes each token one channel."""
        if self.token_dim == len(self.shape) - 1:
            return 1
        return math.prod(self.shape[self.token_dim + 1 :])

    @functools.cached_property  # read per launch; a frozen Layout's fields never change
    def rows(self) -> tuple[int, int, int]:
        """``(M, T, C)``."""
        return math.prod(self.shape[: self.token_dim]), self.shape[self.token_dim], self.channels

    def inverse(self) -> list[int]:
        out = [0] * len(self.perm)
        for i, d in enumerate(self.perm):
            out[d] = i
        return out


@dataclass(kw_only=True)
class Packed:
    """A compressed tensor: one bundle of what it holds, built and read by name. ``nbytes`` is
    exact (the storages held)."""

    packed: torch.Tensor  # uint8 codes, about N * bits / 8 bytes (code_bytes); the tensor itself when ``bits == 0``
    lo: torch.Tensor | None = None  # bf16 group minimum: (n_groups,) flat, (ceil(M*Tp / group), C) tokens
    scale: torch.Tensor | None = None  # bf16 group step, shaped as ``lo``
    lfc: torch.Tensor | None = None  # (M * ceil(T / block), C) in the LFC dtype
    shape: torch.Size  # original shape
    dtype: torch.dtype  # original dtype
    layout: Layout | None = None  # None: flat, no token axis
    bits: int
    block_size: int
    group_size: int
    grouping: str = FLAT  # TOKENS: groups of tokens within one channel; FLAT: consecutive elements
    rows: torch.Tensor | None = None  # (k, C) tokens kept exact (outliers, leading), in the original dtype
    row_index: torch.Tensor | None = None  # (k,) int64 their index among the M*T tokens
    row_keep: torch.Tensor | None = None  # (k,) bool: which of ``rows`` are exact (None: all); see ``static_rows``
    row_scale: torch.Tensor | None = None  # (..., T, 1) float32: x / row_scale was compressed (compress_row_scaled)

    @classmethod
    def kept(cls, x: torch.Tensor, block_size: int, group_size: int) -> "Packed":
        """``x`` held as it is (``bits == 0``)."""
        return cls(packed=x, shape=x.shape, dtype=x.dtype, bits=0, block_size=block_size, group_size=group_size)

    def storages(self) -> list[torch.Tensor]:
        """The tensors this object holds."""
        own = (self.packed, self.lo, self.scale, self.lfc, self.rows, self.row_index, self.row_keep, self.row_scale)
        return [t for t in own if t is not None]

    @property
    def own_bytes(self) -> int:
        """The bytes of the tensors held, as numel x item size: :attr:`nbytes` where each tensor
        owns its storage, as everything :func:`~hf_division.compress.pipeline.compress` makes does
        (a test holds them equal). Read without a Python storage object per tensor, which PyTorch
        keeps alive with the tensor: about a quarter of the objects a forward left to the garbage
        collector (docs/DESIGN.md, "On a GPU")."""
        return sum(t.numel() * t.element_size() for t in self.storages())

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.storages())


def token_group(group_size: int, block: int, bits: int) -> int:
    """Tokens per group: ``group_size`` rounded down to whole LFC blocks (at least one), then up
    to a multiple of ``8 / bits`` so that every group's codes fill whole bytes."""
    group = max(block, group_size // block * block)
    while group * bits % 8:
        group += block
    return group


def code_bytes(n_groups: int, group: int, bits: int, c: int) -> int:
    """Bytes of the codes of ``n_groups`` groups of ``group`` tokens x ``c`` channels
    (:func:`~hf_division.quant.packing.code_layout`; 0 for ``group == 0``)."""
    dtype, rows = code_layout(group, bits)
    return n_groups * rows * c * dtype.itemsize


def code_views(codes: torch.Tensor, n_full: int, rest: int, group: int, bits: int, c: int):
    """``codes`` (uint8, flat) as ``(the full groups' words (n_full, rows, C), the partial group's
    (1, rows, C) or None)``, each in its :func:`~hf_division.quant.packing.code_layout` dtype."""
    split, full_dtype, full_shape, last_dtype, last_shape = _code_split(n_full, rest, group, bits, c)
    full = codes[:split].view(full_dtype).view(full_shape)
    if not rest:
        return full, None
    return full, codes[split:].view(last_dtype).view(last_shape)


@functools.lru_cache(maxsize=1024)
def _code_split(n_full: int, rest: int, group: int, bits: int, c: int) -> tuple:
    """Where :func:`code_views` splits the codes and how it views each part; cached: it runs for
    every saved tensor, with the few shapes of one model (docs/DESIGN.md, "On a GPU": host time)."""
    full_dtype, rows = code_layout(group, bits)
    last_dtype, last_rows = code_layout(rest, bits) if rest else (torch.uint8, 0)
    return code_bytes(n_full, group, bits, c), full_dtype, (n_full, rows, c), last_dtype, (1, last_rows, c)


@functools.lru_cache(maxsize=1024)
def _buffer_sizes(m: int, t: int, c: int, bits: int, block: int, group: int) -> tuple:
    """:meth:`TokenBuffers.empty`'s sizes: ``(tokens, n_full, rest, code bytes)``; cached as
    :func:`_code_split`."""
    n = m * (-(-t // block) * block)
    n_full, rest = divmod(n, group)
    return n, n_full, rest, code_bytes(n_full, group, bits, c) + code_bytes(1, rest, bits, c)


@dataclass
class TokenBuffers:
    """The storages of token-grouped codes for an ``(M, T, C)`` tensor, its rows padded to whole
    blocks (``tokens`` in all): ``n_full`` groups of ``group`` tokens and a last one of ``rest``
    (0: none)."""

    codes: torch.Tensor
    lfc: torch.Tensor | None
    lo: torch.Tensor
    scale: torch.Tensor
    tokens: int
    n_full: int
    rest: int

    @classmethod
    def empty(cls, m: int, t: int, c: int, bits: int, block: int, group: int, lfc_dtype: torch.dtype,
              scale_dtype: torch.dtype, device) -> "TokenBuffers":
        n, n_full, rest, nbytes = _buffer_sizes(m, t, c, bits, block, group)
        codes = torch.empty(nbytes, dtype=torch.uint8, device=device)
        lo = torch.empty(n_full + (rest > 0), c, dtype=scale_dtype, device=device)
        lfc = torch.empty(n // block, c, dtype=lfc_dtype, device=device) if block > 1 else None
        return cls(codes, lfc, lo, torch.empty_like(lo), n, n_full, rest)
