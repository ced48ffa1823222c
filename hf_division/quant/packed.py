"""What a compressed tensor is: :class:`Packed` (codes, group ranges, block means, exact rows) and
the :class:`Layout` of its tokens in memory (docs/DESIGN.md, "Compressor").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
import torch


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

    def inverse(self) -> list[int]:
        out = [0] * len(self.perm)
        for i, d in enumerate(self.perm):
            out[d] = i
        return out


@dataclass
class Packed:
    """A compressed tensor: one bundle of what it holds. ``nbytes`` is exact (the storages held)."""

    packed: torch.Tensor  # uint8 codes, about N * bits / 8 bytes (quant.code_layout); raw tensor when ``bits == 0``
    lo: torch.Tensor | None  # bf16 group minimum: (n_groups,) flat, (ceil(M*Tp / group), C) tokens
    scale: torch.Tensor | None  # bf16 group step, shaped as ``lo``
    lfc: torch.Tensor | None  # (M * ceil(T / block), C) in the LFC dtype
    shape: torch.Size  # original shape
    dtype: torch.dtype  # original dtype
    layout: Layout | None  # None: flat, no token axis
    bits: int
    block_size: int
    group_size: int
    rows: torch.Tensor | None = None  # (k, C) outlier tokens kept exact, in the original dtype
    row_index: torch.Tensor | None = None  # (k,) int64 their index among the M*T tokens
    grouping: str = "flat"  # "tokens": groups of tokens within one channel; "flat": consecutive elements
    row_keep: torch.Tensor | None = None  # (k,) bool: which of ``rows`` are exact (None: all); see ``static_rows``
    row_scale: torch.Tensor | None = None  # (..., T, 1) float32: x / row_scale was compressed (compress_row_scaled)

    def storages(self) -> list[torch.Tensor]:
        """The tensors this object holds."""
        own = (self.packed, self.lo, self.scale, self.lfc, self.rows, self.row_index, self.row_keep, self.row_scale)
        return [t for t in own if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.storages())
