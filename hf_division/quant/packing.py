"""Bit layouts: codes packed into bytes or int32 words along tokens, and boolean masks as bits.

Pure tensor functions (docs/DESIGN.md, "Compressor"), on any device and ``torch.compile``-able.
"""
from __future__ import annotations

import functools
import torch


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of values < 2**bits (length divisible by 8 // bits) into bytes."""
    if bits == 8:
        return q
    per = 8 // bits
    q = q.view(-1, per)
    out = q[:, 0].clone()
    for i in range(1, per):
        out |= q[:, i] << (bits * i)
    return out


def unpack_bits(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``(n,)`` uint8 -> ``(n * 8 // bits,)`` uint8."""
    if bits == 8:
        return p
    shifts = torch.arange(0, 8, bits, device=p.device, dtype=torch.uint8)
    return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(-1)


#: multiplying 8 bytes of 0/1 (one int64, little-endian) by this gathers them into the top byte,
#: byte i -> bit i: the same order as ``pack_bits(., 1)``, in one multiply instead of 8 shift/or passes
_GATHER_BITS = 0x0102040810204080


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_mask(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Any-shape bool/0-1 tensor -> (``ceil(n / 8)`` uint8 bytes, ``n``). A float element counts as
    set if any of its bits is (a 0/1 tensor has no -0.0): an integer view's ``bool()`` is one pass,
    cheaper than comparing floats with 0 (``python -m hf_division.bench compressor`` times it)."""
    # a bool mask is already 0/1 bytes (dropout's); an offset view is copied for the int64 view below
    ready = mask.dtype == torch.bool and mask.is_contiguous() and mask.storage_offset() % 8 == 0
    if not ready and mask.is_floating_point() and mask.is_contiguous():
        mask = mask.view(_SAME_SIZE_INT[mask.element_size()])
    flat = (mask if ready else mask.bool()).reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n % 8:
        flat = torch.nn.functional.pad(flat, (0, -n % 8))
    words = flat.contiguous().view(torch.int64)  # int64 overflow wraps; only the top byte is kept
    return ((words * _GATHER_BITS) >> 56).to(torch.uint8), n


@functools.lru_cache(maxsize=64)
def bit_table(device: torch.device, dtype: torch.dtype = torch.uint8, divisor: float = 1.0) -> torch.Tensor:
    """``(256, 8)``: row ``b`` holds the bits of byte ``b`` (bit ``i`` in column ``i``, the order of
    ``pack_bits(., 1)``) as ``dtype``, divided by ``divisor``. Read only: it is shared."""
    table = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    table = table.to(dtype)
    return table if divisor == 1.0 else table.div_(divisor)


def unpack_mask(bits: torch.Tensor, n: int, shape, dtype: torch.dtype = torch.uint8, divisor: float = 1.0) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: 0/1 values of ``shape`` as ``dtype`` (``uint8``), divided by
    ``divisor`` (a dropout mask's ``1 - p``: the same values as dividing the 0/1 tensor).

    One gather of a table row per byte (:func:`bit_table`) instead of a shift and a mask per bit
    plane, several times faster on CPU (``python -m hf_division.bench compressor`` times both)."""
    index = bits.int()  # index_select, not advanced indexing: several times faster on CPU
    if dtype == torch.uint8 and divisor == 1.0:
        out = bit_table(bits.device).view(torch.int64).view(-1).index_select(0, index).view(torch.uint8)  # a row: one int64
    else:
        out = bit_table(bits.device, dtype, float(divisor)).index_select(0, index).view(-1)
    return out[:n].view(shape)


def code_layout(group: int, bits: int) -> tuple[torch.dtype, int]:
    """How one group's codes are stored: ``(word dtype, rows of words)``, each row ``C`` words.

    int32 words where the group fills whole words, uint8 bytes otherwise (short or partial
    groups; the last row then holds fewer codes). Words, because inductor's CPU code shifts and
    converts 8-bit lanes slowly (docs/DESIGN.md, "Compressor", why int32 words along tokens)."""
    if group * bits % 32 == 0:
        return torch.int32, group * bits // 32
    return torch.uint8, -(-group * bits // 8)


def pack_tokens(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``(s, G, C)`` (values < 2**bits) in a uint8 or int32 tensor -> ``(s, R, C)`` of that
    dtype, ``per`` codes per word (``per`` = word bits / ``bits``, ``R = ceil(G / per)``): word
    ``(k, u, j)`` holds the codes of tokens ``u + i * R`` of channel ``j`` at bits ``i * bits``
    (``i < per``; tokens past ``G`` are 0). Packed along tokens, not neighbouring channels, so
    packing and unpacking are vector loops over contiguous channels (docs/DESIGN.md, "Compressor")."""
    per = q.element_size() * 8 // bits
    if per == 1:
        return q
    s, g, c = q.shape
    if g % per:
        q = torch.nn.functional.pad(q, (0, 0, 0, -g % per))
    q = q.view(s, per, -1, c)
    out = q[:, 0]
    for i in range(1, per):  # int32: the top code's shift may reach the sign bit; unpacking masks it off
        out = out | (q[:, i] << (bits * i))
    return out


def unpack_tokens(codes: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Inverse of :func:`pack_tokens`: ``(s, R, C)`` words -> ``(s, G, C)`` codes (same dtype)."""
    per = codes.element_size() * 8 // bits
    if per == 1:
        return codes
    s, rows, c = codes.shape
    shifts = torch.arange(0, per * bits, bits, dtype=codes.dtype, device=codes.device)
    q = (codes.view(s, 1, rows, c) >> shifts.view(1, per, 1, 1)) & ((1 << bits) - 1)
    return q.view(s, per * rows, c)[:, :group]
