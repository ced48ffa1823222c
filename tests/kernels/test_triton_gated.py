"""A SiLU-gated MLP's product and gradients in Triton kernels (hf_division/kernels/triton_gated.py), on a
CPU machine under Triton's interpreter: torch's ops' values to one unit of the dtype (each intermediate
rounded where torch rounds it), either gradient alone as both, one launch each and no readback, where
the kernels decline, and GatedFn taking them in a step on the GPU's path.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_triton_gated.py
"""
import pytest
import torch
import torch.nn.functional as F

from hf_division.analysis.fidelity import cosine
from hf_division.analysis.launches import KernelCounter
from hf_division.kernels import configured
from hf_division.kernels import triton_gated

from conftest import TRITON_MARKS, ULP, switched_steps

pytestmark = TRITON_MARKS
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(dtype, shape=(3, 37, 50), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * s).to(dtype).to(DEV) for s in (3.0, 1.0, 1.0)]


def _torch_ops(d, gate, up):
    a = F.silu(gate)
    return a * up, torch.ops.aten.silu_backward(d * up, gate), d * a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_ops_values_to_one_unit(dtype):
    """5550 elements: a ragged last block of the 1024 a program takes. Every value within one unit of
    the dtype of torch's (the exponential's own rounding can move a rounding) plus a few float32 units
    of the tensor's largest (``silu_backward`` cancels near its zero), and most equal."""
    gate, up, d = _tensors(dtype)
    h = triton_gated.product(gate, up)
    dg, du = triton_gated.gradients(d, gate, up, True, True)
    for ours, theirs in zip((h, dg, du), _torch_ops(d, gate, up)):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        diff = (ours.double() - theirs.double()).abs()
        assert (diff <= 2 * ULP[dtype] * theirs.double().abs() + 8 * ULP[torch.float32] * theirs.abs().max()).all()
        assert (diff == 0).double().mean() > (0.6 if dtype == torch.float32 else 0.99)


def test_either_gradient_alone_equals_both():
    gate, up, d = _tensors(torch.bfloat16, (5, 300))
    dg, du = triton_gated.gradients(d, gate, up, True, True)
    dg_only, none_u = triton_gated.gradients(d, gate, up, True, False)
    none_g, du_only = triton_gated.gradients(d, gate, up, False, True)
    assert none_u is None and none_g is None
    assert torch.equal(dg, dg_only) and torch.equal(du, du_only)


def test_one_launch_each_and_no_readback():
    gate, up, d = _tensors(torch.bfloat16)
    with KernelCounter() as product:
        triton_gated.product(gate, up)
    with KernelCounter() as backward:
        triton_gated.gradients(d, gate, up, True, True)
    for counted in (product, backward):
        assert (counted.triton, dict(counted.ops), counted.readbacks) == (1, {}, [])


def test_where_the_kernels_decline():
    """Torch's ops where the switch is off, where the compressor's Triton kernels do not run, and for
    tensors of two dtypes, two shapes, or a dtype the kernels do not round to."""
    gate, up, d = _tensors(torch.float32)
    assert triton_gated.applies(d, gate, up)
    with configured(triton_gated=False):
        assert not triton_gated.applies(gate, up)
    with configured(triton=False):
        assert not triton_gated.applies(gate, up)
    assert not triton_gated.applies(gate, up.bfloat16())
    assert not triton_gated.applies(gate, up[:, :5])
    assert not triton_gated.applies(gate.double(), up.double())


def test_gated_fn_takes_them_on_the_gpus_path():
    """A Llama step on the GPU's path under bf16 autocast: each layer's product and gradients through
    the kernels (two launches a layer more with them than without), the gradient that of torch's ops
    to their rounding (float32 without autocast: tests/kernels/test_triton_steps.py)."""
    layers, steps = switched_steps("triton_gated", DEV)
    (grads_on, on), (grads_off, off) = steps[True], steps[False]
    assert on.triton - off.triton == 2 * layers
    assert cosine(grads_on, grads_off) > 1 - 1e-6
