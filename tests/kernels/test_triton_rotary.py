"""The rotary embedding of q and k in one Triton launch each way (hf_division/kernels/triton_rotary.py), on a
CPU machine under Triton's interpreter: Transformers' values and autograd's gradients to the bit in every
mix of dtypes type promotion gives, q and k in one launch and no torch kernel, where the kernel declines,
and a patched Llama step on the GPU's path taking it with the same gradients as Transformers' function.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_triton_rotary.py
"""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.models.llama import modeling_llama

from hf_division.analysis.launches import KernelCounter
from hf_division.autograd import rotary
from hf_division.kernels import configured
from hf_division.kernels import triton_codec as tc
from hf_division.kernels import triton_rotary

from conftest import TRITON_MARKS, switched_steps

pytestmark = [*TRITON_MARKS, pytest.mark.heavy]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(gen, b, heads, kv, t, e, batch_cos, transposed, q_dtype, cos_dtype, special=False):
    """q as Llama's attention makes it (a transposed view of the projection) or contiguous, scaled so
    that products round in every dtype; ``special``: zeros of both signs and an infinity in q, a NaN
    in cos, a zero in sin."""
    q = torch.randn(b, t, heads, e, generator=gen) if transposed else torch.randn(b, heads, t, e, generator=gen)
    k = torch.randn(b, kv, t, e, generator=gen) * 30
    cos, sin = (torch.randn(batch_cos, t, e, generator=gen) for _ in range(2))
    if special:
        q.view(-1)[: min(3, q.numel())] = torch.tensor([0.0, -0.0, float("inf")])[: min(3, q.numel())]
        cos.view(-1)[0], sin.view(-1)[-1] = float("nan"), 0.0
    q = q.transpose(1, 2) if transposed else q
    q, k = (x.to(q_dtype).to(DEV).requires_grad_() for x in (q, k))
    return q, k, cos.to(cos_dtype).to(DEV), sin.to(cos_dtype).to(DEV)


def _layout(t):
    """The strides that place elements (a size-1 axis's stride places none)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def _same(a, b):
    return a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), heads=st.integers(1, 4), kv=st.integers(1, 2), t=st.integers(1, 40),
       half=st.integers(1, 40), shared_cos=st.booleans(), transposed=st.booleans(),
       q_dtype=st.sampled_from(DTYPES), cos_dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
@example(b=2, heads=9, kv=3, t=33, half=32, shared_cos=True, transposed=True, q_dtype=torch.bfloat16,
         cos_dtype=torch.float32, seed=0)  # SmolLM2's heads under autocast, a ragged last tile
def test_values_and_gradients_are_transformers_to_the_bit(b, heads, kv, t, half, shared_cos, transposed, q_dtype,
                                                          cos_dtype, seed):
    """Forward and backward against ``apply_rotary_pos_emb`` under autograd, in the promoted dtype
    (under autocast: bf16 q and k, float32 cos), with zeros, infinities and a NaN planted, and an
    output gradient that is a transposed view (as sdpa's backward gives it)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, cos, sin = _inputs(gen, b, heads, kv, t, 2 * half, 1 if shared_cos else b, transposed, q_dtype, cos_dtype,
                             special=True)
    assert rotary.takes(q, k, cos, sin)
    theirs = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    ours = rotary.RotaryFn.apply(q, k, cos, sin)
    for a, c in zip(theirs, ours):
        assert _same(a, c) and _layout(a) == _layout(c)
    out = theirs[0].dtype
    grads = (torch.randn(b, t, heads, 2 * half, generator=gen).to(out).to(DEV).transpose(1, 2),
             torch.randn(b, kv, t, 2 * half, generator=gen).to(out).to(DEV))
    expected = torch.autograd.grad(theirs, (q, k), grads)
    got = torch.autograd.grad(ours, (q, k), grads)
    for a, c in zip(expected, got):
        assert _same(a, c)


@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize("cos_dtype", DTYPES)
def test_each_dtype_mix_to_the_bit_at_smollm2s_heads(q_dtype, cos_dtype):
    """The property above at one shape per dtype mix (SmolLM2's 9 and 3 heads of 64, a ragged last
    tile): the check scripts/gpu_session.sh runs on a GPU, where a fused multiply-add would show."""
    test_values_and_gradients_are_transformers_to_the_bit.hypothesis.inner_test(
        b=2, heads=9, kv=3, t=33, half=32, shared_cos=True, transposed=True, q_dtype=q_dtype, cos_dtype=cos_dtype,
        seed=5)


def test_one_launch_each_way_and_no_torch_kernel():
    gen = torch.Generator().manual_seed(1)
    q, k, cos, sin = _inputs(gen, 2, 9, 3, 50, 64, 1, True, torch.bfloat16, torch.float32)
    with KernelCounter() as forward:
        out_q, out_k = rotary.RotaryFn.apply(q, k, cos, sin)
    grads = torch.ones_like(out_q), torch.ones_like(out_k)
    with KernelCounter() as backward:
        torch.autograd.grad((out_q, out_k), (q, k), grads)
    for counted in (forward, backward):
        assert (counted.triton, dict(counted.ops), counted.readbacks) == (1, {}, [])


def test_one_input_needing_a_gradient_gets_one():
    """k frozen (its projection's weight and input need no gradient): q's gradient alone, in one
    launch over q only, equal to Transformers'."""
    gen = torch.Generator().manual_seed(2)
    q, k, cos, sin = _inputs(gen, 2, 4, 2, 20, 16, 2, True, torch.bfloat16, torch.float32)
    k = k.detach()
    ours = rotary.RotaryFn.apply(q, k, cos, sin)
    theirs = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    g = torch.randn(ours[0].shape, generator=gen).to(DEV)
    before = tc.launches()
    (got,) = torch.autograd.grad(ours[0], q, g)
    assert tc.launches() - before == 1
    assert _same(got, torch.autograd.grad(theirs[0], q, g)[0])


def test_where_the_kernel_declines():
    """Transformers' function where either switch is off, where the compressor's Triton kernels do not
    run, and for a dtype the kernel does not round to; the native CPU pass is never taken instead
    on the GPU's path."""
    gen = torch.Generator().manual_seed(3)
    q, k, cos, sin = _inputs(gen, 1, 2, 1, 6, 8, 1, True, torch.float32, torch.float32)
    assert rotary.takes(q, k, cos, sin) and triton_rotary.applies(q, k, cos)
    for off in ({"triton_rotary": False}, {"rotary": False}):
        with configured(**off):
            assert not rotary.takes(q, k, cos, sin)
    with configured(triton=False):
        assert not triton_rotary.applies(q, k, cos)
    assert not rotary.takes(q.double(), k.double(), cos.double(), sin.double())
    assert not rotary.takes(q, k, cos, sin.bfloat16())


def test_a_patched_llama_step_takes_it_on_the_gpus_path():
    """A Llama step on the GPU's path under bf16 autocast: one launch a layer each way, 30 torch
    kernels a layer fewer, and the same gradients as Transformers' function under autograd (the
    forward and the backward are its values to the bit)."""
    layers, steps = switched_steps("triton_rotary", DEV)
    (grads_on, on), (grads_off, off) = steps[True], steps[False]
    assert on.triton - off.triton == 2 * layers
    assert sum(off.ops.values()) - sum(on.ops.values()) == 30 * layers
    assert torch.equal(grads_on, grads_off)


def test_a_gradient_broadcast_from_a_sum_is_read_as_its_values():
    """``out.sum().backward()`` hands the embedding an expanded gradient (every stride 0, the last
    too): the kernel reads rows with a unit last stride, so such a gradient is made contiguous first."""
    gen = torch.Generator().manual_seed(4)
    q, k, cos, sin = _inputs(gen, 2, 3, 1, 9, 16, 1, True, torch.bfloat16, torch.float32)
    ours = rotary.RotaryFn.apply(q, k, cos, sin)
    theirs = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for a, c in zip(torch.autograd.grad(theirs[0].sum() + theirs[1].sum(), (q, k)),
                    torch.autograd.grad(ours[0].sum() + ours[1].sum(), (q, k))):
        assert _same(a, c)
