"""Llama's RMSNorm in fused Triton kernels (hf_division/kernels/triton_norm.py), on a CPU machine under
Triton's interpreter as tests/test_triton.py runs the compressor's: the module's output and its
gradients no further from the exact ones than the torch formula's (hf_division/autograd/rms_norm.py),
each gradient alone as both together, the weight gradient's split over programs, two launches and no
readback, and where the kernels decline.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_triton_norm.py
"""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hf_division.analysis.launches import KernelCounter
from hf_division.autograd import rms_norm
from hf_division.kernels import configured
from hf_division.kernels import triton_norm

from conftest import TRITON_MARKS, ULP

pytestmark = TRITON_MARKS
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def _inputs(tokens, channels, scale, dtype, wdtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, tokens, channels, generator=g) * scale).to(dtype).to(DEV)
    w = (torch.rand(channels, generator=g) + 0.5).to(wdtype).to(DEV)
    grad = torch.randn(2, tokens, channels, generator=g).to(torch.promote_types(dtype, wdtype)).to(DEV)
    return x, w, grad


def _norm(x, w, grad, need_x=True, need_w=True):
    """``(y, dx, dw, fused)`` through rms_norm's functions as its backward calls them."""
    stats = {}
    y = rms_norm.normalize(x, w, EPS, stats)
    fused = stats["rebuilt"][0]
    return (y, *rms_norm.gradients(grad, stats["rebuilt"], w, x.dtype, need_x, need_w), fused)


def _exact(x, w, grad):
    """The output (without the module's rounding of ``x_n``) and the gradients in float64."""
    x64, w64, g64 = x.double().requires_grad_(), w.double().requires_grad_(), grad.double()
    y = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS))
    dx, dw = torch.autograd.grad(y, (x64, w64), g64)
    return y.detach(), dx, dw


def _check_against_formula(x, w, grad):
    """The output within one unit of the input dtype (the module rounds ``x_n`` to it, where an rstd
    one float32 unit off can flip it), the gradients' error against the float64 ones at most twice
    the torch formula's plus a rounding of their terms to the gradient's dtype (each element rounds
    its own way: on a few elements either may round luckily)."""
    dtype = x.dtype
    y, dx, dw, fused = _norm(x, w, grad)
    with configured(triton_rms_norm=False):
        y_ref, dx_ref, dw_ref, ref_fused = _norm(x, w, grad)
    assert fused and not ref_fused
    assert (y.dtype, dx.dtype, dw.dtype) == (y_ref.dtype, dx_ref.dtype, dw_ref.dtype)
    y64, dx64, dw64 = _exact(x, w, grad)
    # a unit of x's dtype (x_n rounded to it; below its normal range, a unit of its subnormals), one
    # of y's (stored), a few float32 units (a GPU's rsqrt)
    subnormal = torch.finfo(dtype).smallest_normal * ULP[dtype] * w.double().abs()
    assert ((y.double() - y64).abs() <= (ULP[dtype] + ULP[y.dtype] + 2.0**-20) * y64.abs() + subnormal + 1e-30).all()
    rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS)
    g64, x64, w64 = grad.double().abs(), x.double().abs(), w.double().abs()
    terms = {"x": (g64 * w64 * rstd).norm(), "w": (g64 * x64 * rstd).sum((0, 1)).norm()}
    for name, ours, torch_formula, exact in (("x", dx, dx_ref, dx64), ("w", dw, dw_ref, dw64)):
        err, ref_err = ((t.double() - exact).norm() for t in (ours, torch_formula))
        assert err <= 2 * ref_err + (ULP[ours.dtype] + 1e-5) * terms[name], name


@settings(max_examples=30, deadline=None)
# x_n of about 2e-5 in fp16, below its normal range (found by this test in CI: the bound lacked the
# subnormals' unit; the kernel's output equals the torch formula's there)
@example(tokens=7, channels=46, log_scale=1.9375, dtype=torch.float16, own_weight=False, seed=575)
@given(tokens=st.integers(1, 9), channels=st.integers(1, 70), log_scale=st.floats(-4, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), own_weight=st.booleans(),
       seed=st.integers(0, 2**16))
def test_output_and_gradients_no_further_than_the_torch_formulas(tokens, channels, log_scale, dtype, own_weight, seed):
    """Scales from where eps dominates mean(x^2) to large, every input dtype, a float32 weight or
    one in the input's dtype, widths 1 to 70 (each a compile of its own on a GPU: the next test is
    the one scripts/gpu_session.sh runs there)."""
    _check_against_formula(*_inputs(tokens, channels, 10**log_scale, dtype, dtype if own_weight else torch.float32, seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [64, 576])
def test_the_stand_in_and_smollm2_widths_against_the_torch_formula(dtype, channels):
    _check_against_formula(*_inputs(40, channels, 2.0, dtype, torch.float32, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_either_gradient_alone_equals_both(dtype):
    x, w, grad = _inputs(37, 96, 2.0, dtype, torch.float32, 0)
    _, dx, dw, _ = _norm(x, w, grad)
    _, dx_only, none_w, _ = _norm(x, w, grad, need_w=False)
    _, none_x, dw_only, _ = _norm(x, w, grad, need_x=False)
    assert none_w is None and none_x is None
    assert torch.equal(dx, dx_only) and torch.equal(dw, dw_only)


def test_weight_gradient_split_over_programs(monkeypatch):
    """Rows spread over fewer programs, each summing several blocks of rows (ITERS > 1, a ragged last
    block): the input gradient is the same to the bit, the weight gradient the same sums in another
    order (float32 rounding)."""
    x, w, grad = _inputs(150, 64, 1.0, torch.bfloat16, torch.float32, 1)  # 300 rows: 5 blocks of 64
    _, dx, dw, _ = _norm(x, w, grad)
    monkeypatch.setattr(triton_norm, "PROGRAMS", 2)
    _, dx_split, dw_split, _ = _norm(x, w, grad)
    assert torch.equal(dx, dx_split)
    torch.testing.assert_close(dw_split, dw, rtol=1e-5, atol=1e-6)


def test_two_launches_and_no_readback():
    """The rebuild is one Triton launch and no torch kernel; the gradient one launch and the sum of
    the weight gradient's partial rows; neither reads a value back on the host."""
    x, w, grad = _inputs(33, 80, 1.0, torch.bfloat16, torch.float32, 2)
    stats = {}
    with KernelCounter() as rebuild:
        rms_norm.normalize(x, w, EPS, stats)
    with KernelCounter() as backward:
        rms_norm.gradients(grad, stats["rebuilt"], w, x.dtype, True, True)
    assert (rebuild.triton, dict(rebuild.ops), rebuild.readbacks) == (1, {}, [])
    assert (backward.triton, dict(backward.ops), backward.readbacks) == (1, {"sum": 1}, [])


def test_where_the_kernels_decline():
    """The torch formula where the switch is off, where the compressor's Triton kernels do not run
    (their switch off), for a row wider than the kernels take, and for a weight that is not one
    contiguous row."""
    x, w, _ = _inputs(3, 16, 1.0, torch.float32, torch.float32, 3)
    assert triton_norm.applies(x, w)
    with configured(triton_rms_norm=False):
        assert not triton_norm.applies(x, w)
    with configured(triton=False):
        assert not triton_norm.applies(x, w)
        assert not _norm(x, w, x)[3]
    wide = torch.zeros(1, triton_norm.MAX_WIDTH + 1, device=DEV)
    assert not triton_norm.applies(wide, torch.ones(wide.shape[-1], device=DEV))
    assert not triton_norm.applies(x, torch.ones(32, device=DEV)[::2])
