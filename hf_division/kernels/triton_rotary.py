"""The rotary position embedding of q and k in one Triton launch each way, where the compressor's
Triton kernels run (the ``triton_rotary`` switch; docs/DESIGN.md, "On a GPU").

Why: Transformers' ``apply_rotary_pos_emb`` is ``x * cos + rotate_half(x) * sin`` for q and for k.
On a GPU each op is a kernel launch: five a tensor forward (two products, the negation, the
concatenation, the sum), ten backward (two products, the negation, the concatenation's two slices
written into zero-filled tensors, the sums, and under autocast the casts of the bf16 inputs'
gradients): 30 launches a layer under autocast (docs/RESULTS.md, "Kernel launches"), each a pass
over ``(batch, heads, tokens, head_dim)``. Here q and k take one launch forward and one backward,
each element read and written once.

The values are autograd's to the bit: each product and sum rounded where torch's ops round them,
with no fused multiply-add (:func:`hf_division.kernels.triton_layers.rotary_rows`), in any mix of
float32, bf16 and fp16 that type promotion gives (under autocast q and k are bf16 and ``cos``
float32: the embedding comes out in float32, as torch's does).
"""
from __future__ import annotations

import functools

import torch

from hf_division.kernels import triton_codec
from hf_division.kernels.triton_codec import ROUNDED, pow2
from hf_division.kernels.switches import switches

#: values per program's tile: rows of a head's two halves, at least one row
TILE = 2048


def applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the kernel takes this call (shapes and strides are checked by
    :func:`hf_division.autograd.rotary.takes`): the switch on, the compressor's Triton kernels
    running on the tensors' one device, every dtype one the kernel rounds to."""
    return (switches().triton_rotary and triton_codec.applies(q.device) and k.device == q.device
            and cos.device == q.device and q.dtype in ROUNDED and k.dtype in ROUNDED and cos.dtype in ROUNDED)


@functools.lru_cache(maxsize=None)
def _promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.promote_types(a, b)


def _rows(x: torch.Tensor, rows: int) -> tuple[int, int]:
    """``(rows of x, programs over them)``."""
    n = x.shape[0] * x.shape[1] * x.shape[2]
    return n, -(-n // rows)


def rotate(pairs: list, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> list:
    """Forward (``backward`` False): ``[(x, None), ...]`` (q and k, or one of them) -> their
    embeddings, each in ``x``'s dtype promoted with ``cos``'s and laid out as ``x``. Backward:
    ``[(grad, dtype), ...]`` -> the inputs' gradients, each in its input's ``dtype``, laid out as
    the gradient. One launch for up to two tensors; ``cos``, ``sin`` ``(b or 1, t, e)``."""
    # rows are read with a unit last stride: a gradient broadcast from a sum (every stride 0) is not
    ins = [x if x.stride(-1) == 1 else x.contiguous() for x, _ in pairs]
    outs = [torch.empty_like(x, dtype=dtype if backward else _promoted(x.dtype, cos.dtype))
            for x, (_, dtype) in zip(ins, pairs)]
    half = ins[0].shape[-1] // 2
    bh = pow2(half)
    rows = max(1, TILE // (2 * bh))
    q, qo = ins[0], outs[0]
    k, ko = (ins[1], outs[1]) if len(ins) > 1 else (q, qo)  # one tensor: k's share of the programs is none
    rq, pq = _rows(q, rows)
    rk, pk = _rows(k, rows) if len(ins) > 1 else (0, 0)
    if pq + pk:
        # forward-sense dtypes: the input's, then the output's (backward reads the output's gradient)
        qd, qod = (qo, q) if backward else (q, qo)
        kd, kod = (ko, k) if backward else (k, ko)
        cb = cos.stride(0) if cos.shape[0] > 1 else 0
        key = ("rotary", backward, len(ins), q.shape, q.stride(), qo.stride(), k.shape, k.stride(), ko.stride(),
               cos.shape, cos.stride(), q.dtype, qo.dtype, k.dtype, ko.dtype, cos.dtype, sin.dtype)
        launch = triton_codec.planned(key, lambda: triton_codec.Launch("rotary", (pq + pk,), dict(
            BACKWARD=backward, QD=ROUNDED[qd.dtype], QOD=ROUNDED[qod.dtype], KD=ROUNDED[kd.dtype],
            KOD=ROUNDED[kod.dtype], ROWS=rows, BH=bh)))
        launch(q, qo, k, ko, cos, sin, rq, rk, q.shape[1], k.shape[1], q.shape[2], half, pq, *q.stride()[:3],
               *qo.stride()[:3], *k.stride()[:3], *ko.stride()[:3], cb, cos.stride(1))
    return outs
