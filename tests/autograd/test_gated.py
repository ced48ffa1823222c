"""The SiLU-gated product and its gradients computed from the compressed operands (hf_division.autograd.gated_product):
the same values as rebuilding both tensors and running ATen's ops on them, and GatedFn's use of it."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_division as hd
from hf_division.compress import pipeline as compressor
from hf_division.autograd import gated_product as gated, store
from hf_division.kernels import configured, native
from hf_division.analysis.fidelity import flat_grad

from conftest import tiny_batch, tiny_model

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no C compiler: the fused kernel is native")


def _pair(shape, bits=(8, 4), group=32, seed=0, outliers=False, special=False):
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(*shape, generator=g) * 3 for _ in range(2))
    if outliers:  # a few tokens far above the median: kept exact, out of the groups
        gate.view(-1, shape[-1])[1] *= 400
        up.view(-1, shape[-1])[-1] *= 400
    if special:
        gate.view(-1)[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 95.0, -120.0])
    kw = dict(token_dim=-2, block_size=1, group_size=group, generator=torch.Generator().manual_seed(seed),
              outlier_ratio=16.0 if outliers else 0.0)
    return compressor.compress(gate, bits=bits[0], **kw), compressor.compress(up, bits=bits[1], **kw)


def _reference(pg, pu, grad=None):
    """What GatedFn computes without the kernel: both rebuilt, then ATen's ops."""
    x, u = compressor.decompress(pg), compressor.decompress(pu)
    if grad is None:
        return (F.silu(x) * u,)
    return torch.ops.aten.silu_backward(grad * u, x), grad * F.silu(x)


def _exact(pg, pu, grad=None):
    """The same in float64 on the rebuilt float32 values, each with the size of its terms: a bound
    for float32 rounding (silu'(x) cancels near x = -1.28 and takes 1 - sigmoid(x) to within
    eps * sigmoid(x), so relative to the result it has none)."""
    x, u = (compressor.decompress(p).double() for p in (pg, pu))
    s = torch.sigmoid(x)
    if grad is None:
        h = x * s * u
        return ((h, h.abs()),)
    dy = grad.double()
    d_gate = dy * u * s * (1 + x * (1 - s))
    d_up = dy * x * s
    return (d_gate, (dy * u * s).abs() * (1 + x.abs())), (d_up, d_up.abs())  # 1 - s: absolute error eps * s


def _check(got, pg, pu, grad=None):
    """Within 8 float32 roundings of its terms' size of the exact value, as ATen's own ops are;
    NaN and infinities where ATen has them."""
    eps = torch.finfo(torch.float32).eps
    for g, aten, (exact, size) in zip(got, _reference(pg, pu, grad), _exact(pg, pu, grad)):
        assert g.shape == aten.shape and g.dtype == torch.float32
        finite = torch.isfinite(aten)
        assert torch.equal(torch.isfinite(g), finite) and torch.equal(g[~finite].isnan(), aten[~finite].isnan())
        assert torch.equal(g[~finite & ~aten.isnan()], aten[~finite & ~aten.isnan()])
        bound = 8 * eps * size[finite] + 1e-30  # below 1e-30 (sigmoid near underflow) every result counts as 0
        assert ((aten[finite].double() - exact[finite]).abs() <= bound).all()  # the bound is fair to ATen
        assert ((g[finite].double() - exact[finite]).abs() <= bound).all()


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 3), t=st.integers(1, 70), c=st.integers(1, 300), bits=st.sampled_from([(8, 4), (4, 4), (2, 8)]),
       group=st.sampled_from([8, 32, 64]), outliers=st.booleans(), seed=st.integers(0, 1000))
def test_matches_rebuilt_tensors(m, t, c, bits, group, outliers, seed):
    """Any token count (a short last group), channels across several tiles, outlier tokens of
    either operand put back exactly."""
    pg, pu = _pair((m, t, c), bits, group, seed, outliers and t * m > 2 and c > 1)
    if not gated.applies(pg, pu):  # e.g. too small to be smaller compressed: kept as it is
        assert pg.bits == 0 or pu.bits == 0
        return
    grad = torch.randn(m, t, c, generator=torch.Generator().manual_seed(seed + 1))
    _check((gated.silu_gated(pg, pu),), pg, pu)
    _check(gated.silu_gated(pg, pu, grad), pg, pu, grad)


@pytest.mark.parametrize("outliers, special", [(True, False), (False, True)])
def test_outliers_and_special_values(outliers, special):
    """Exact tokens in both operands; NaN, infinities and values where e^-x over- or underflows
    (a NaN token leaves the outlier search out, so the two cases are apart)."""
    pg, pu = _pair((2, 64, 300), outliers=outliers, special=special)
    assert (pg.rows is not None and pu.rows is not None) == outliers
    grad = torch.randn(2, 64, 300)
    _check((gated.silu_gated(pg, pu),), pg, pu)
    _check(gated.silu_gated(pg, pu, grad), pg, pu, grad)


def test_strided_operands_keep_their_layout():
    """Operands compressed from a transposed view come back with that view's shape and grads match."""
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(40, 2, 96, generator=g).transpose(0, 1) for _ in range(2))  # (2, 40, 96) strided
    kw = dict(token_dim=-2, block_size=1, group_size=32, stochastic=False)
    pg, pu = compressor.compress(gate, bits=8, **kw), compressor.compress(up, bits=4, **kw)
    assert gated.applies(pg, pu)
    grad = torch.randn(2, 40, 96)
    _check((gated.silu_gated(pg, pu),), pg, pu)
    _check(gated.silu_gated(pg, pu, grad), pg, pu, grad)


def test_declines_what_it_does_not_take():
    x = torch.randn(2, 64, 128)
    kw = dict(token_dim=-2, group_size=32)
    plain = compressor.compress(x, bits=4, block_size=1, **kw)
    assert gated.applies(plain, plain)
    lfc = compressor.compress(x, bits=4, block_size=8, **kw)
    bf16 = compressor.compress(x.bfloat16(), bits=4, block_size=1, **kw)
    other = compressor.compress(torch.randn(2, 64, 64), bits=4, block_size=1, **kw)
    for a, b in ((plain, lfc), (bf16, bf16), (plain, other), (plain, None)):
        assert not gated.applies(a, b)
        assert gated.silu_gated(a, b) is None
    assert gated.silu_gated(plain, plain, torch.randn(2, 64, 128).double()) is None  # grad dtype
    with configured(gated_from_codes=False):
        assert not gated.applies(plain, plain)
    with configured(native=False):
        assert not gated.applies(plain, plain)


@pytest.mark.parametrize("model_type", ["llama", "phi3", "qwen2"])
def test_gated_fn_uses_it_and_matches_the_rebuild(model_type, monkeypatch):
    """Tiny SiLU-gated decoders (Phi-3: ``up * act(gate)`` on the two halves of one projection):
    the kernel computes each layer's product (for the down projection) and its gradients; the
    gradient equals GatedFn's rebuild of gate and up to float32 rounding, and gate's and up's
    entries count both uses as taken (freed after backward)."""
    calls, held = [], []
    real, compressed = native.silu_gated, store.Entry.compressed
    monkeypatch.setattr(native, "silu_gated", lambda *a: calls.append(a[5] is None) or real(*a))
    monkeypatch.setattr(store.Entry, "compressed", lambda self: held.append(self) or compressed(self))
    model = tiny_model(model_type, "sdpa")
    batch = tiny_batch(pad_from=[64, 50, 64, 33], model_type=model_type)
    hd.apply_division(model, hd.DivisionConfig(rounding="nearest", min_numel=0))
    fused = flat_grad(model, batch, 0)
    assert calls == [True, False] * model.config.num_hidden_layers  # product, then gradients, per layer
    assert len(held) == 4 * model.config.num_hidden_layers and all(e.freed for e in held)  # taken, then freed
    with configured(gated_from_codes=False):
        rebuilt = flat_grad(model, batch, 0)
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert torch.isfinite(fused).all() and not torch.equal(fused, torch.zeros_like(fused))
    torch.testing.assert_close(fused, rebuilt, rtol=1e-5, atol=1e-7)


def test_gated_fn_falls_back_where_the_kernel_declines():
    """bf16 (the kernel takes float32) runs GatedFn's rebuild; still trains."""
    calls = []
    model = tiny_model("llama", "sdpa").to(torch.bfloat16)
    hd.apply_division(model, hd.DivisionConfig(min_numel=0))
    real = native.silu_gated
    native.silu_gated = lambda *a: calls.append(1) or real(*a)
    try:
        g = flat_grad(model, tiny_batch(), 0)
    finally:
        native.silu_gated = real
    assert calls == [] and torch.isfinite(g).all()
