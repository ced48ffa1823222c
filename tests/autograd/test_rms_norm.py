"""Llama's RMSNorm with its gradient written out (hf_division.autograd.rms_norm): which modules take it,
and that its gradients are autograd's through the module (to float32 rounding)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

import hf_division as hd
from hf_division.autograd import rms_norm
from hf_division.kernels import configure, configured
from hf_division.analysis.fidelity import flat_grad

from conftest import tiny_batch, tiny_model


class _OtherEps(LlamaRMSNorm):
    """Reads a constant instead of its ``variance_epsilon``: the small-scale probe tells them apart."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2))


def test_the_formula_is_found_where_it_holds():
    for module, eps in [(LlamaRMSNorm(64, 1e-6), 1e-6), (MistralRMSNorm(64, 1e-5), 1e-5), (Qwen3RMSNorm(64, 1e-6), 1e-6),
                        (T5LayerNorm(64, 1e-6), 1e-6), (torch.nn.RMSNorm(64, eps=1e-5), 1e-5)]:
        assert rms_norm.eps_of(module) == eps, type(module).__name__
    for module in (GemmaRMSNorm(64, 1e-6), torch.nn.LayerNorm(64), torch.nn.RMSNorm(64), _OtherEps(64, 1e-6),
                   torch.nn.Linear(64, 64)):
        assert rms_norm.eps_of(module) is None, type(module).__name__


def _autograd(x, w, g, eps):
    module = LlamaRMSNorm(x.shape[-1], eps).to(w.dtype)
    module.weight.data.copy_(w)
    xx = x.detach().requires_grad_()
    y = module(xx)
    gx, gw = torch.autograd.grad(y, (xx, module.weight), g)
    return y.detach(), gx, gw


def _exact(x, w, g, eps):
    """The formula's gradients in float64 (the module itself computes in float32 whatever its input)."""
    xx, ww = x.double().requires_grad_(), w.double().requires_grad_()
    y = ww * (xx * torch.rsqrt(xx.pow(2).mean(-1, keepdim=True) + eps))
    return torch.autograd.grad(y, (xx, ww), g.double())


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 9), channels=st.integers(1, 70), log_scale=st.floats(-4, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_output_and_gradients_are_autograds(tokens, channels, log_scale, dtype, seed):
    """Scales from where eps dominates mean(x^2) to large; float32 and bf16 inputs (the module
    computes in float32 and casts back). The gradients are held against the float64 ones
    of the same inputs: their error is at most twice autograd's in the input dtype, plus a float
    rounding of the terms they are summed from (a single channel cancels almost to 0)."""
    g = torch.Generator().manual_seed(seed)
    eps = 1e-5
    x = (torch.randn(2, tokens, channels, generator=g) * 10**log_scale).to(dtype)
    w = (torch.rand(channels, generator=g) + 0.5).to(dtype)
    grad = torch.randn(2, tokens, channels, generator=g).to(dtype)
    y_ref, gx_ref, gw_ref = _autograd(x, w, grad, eps)
    stats = {}
    y = rms_norm.normalize(x, w, eps, stats)
    gx, gw = rms_norm.gradients(grad, stats["rebuilt"], w, x.dtype, True, True)
    assert y.dtype == y_ref.dtype and gx.dtype == gx_ref.dtype and gw.dtype == gw_ref.dtype
    rel = {torch.bfloat16: 1e-2, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(y, y_ref, rtol=rel, atol=rel)
    x64, w64, g64 = x.double(), w.double(), grad.double()
    gx64, gw64 = _exact(x64, w64, g64, eps)
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    terms = {"x": (g64.abs() * w64.abs() * rstd).norm(), "w": (g64.abs() * x64.abs() * rstd).sum((0, 1)).norm()}
    for name, ours, theirs, exact in (("x", gx, gx_ref, gx64), ("w", gw, gw_ref, gw64)):
        err, autograd_err = ((t.double() - exact).norm() for t in (ours, theirs))
        assert err <= 2 * autograd_err + rel * terms[name], name


@pytest.fixture(autouse=True)
def _restore_the_switch():
    with configured(rms_norm_backward=True):
        yield


def _patched(fast: bool, frozen_linears=False, dtype=torch.float32):
    configure(rms_norm_backward=fast)  # read when the forward runs
    model = tiny_model("llama", "sdpa").to(dtype)
    for m in model.modules():
        if frozen_linears and isinstance(m, torch.nn.Linear):
            m.weight.requires_grad_(False)
    return hd.apply_division(model, hd.DivisionConfig(rounding="nearest", min_numel=0))


def _grads(model):
    return flat_grad(model, tiny_batch(pad_from=[64, 50, 64, 33]), 0).double()


@pytest.mark.parametrize("frozen_linears", [False, True])
def test_llama_gradients_match_the_generic_recomputation(frozen_linears, monkeypatch):
    """Every RMSNorm of a tiny Llama takes the path (two a layer and the final one), the module's
    forward is not run again in backward, and the gradients are the generic path's (which runs it
    under autograd on the same rebuilt input) to float32 rounding. With the Linears frozen no
    later layer rebuilds the output and the backward normalizes on its own."""
    calls, forwards = [], []
    real, norm = rms_norm.RMSNormFn.backward, LlamaRMSNorm.forward
    monkeypatch.setattr(rms_norm.RMSNormFn, "backward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", lambda self, x: forwards.append(1) or norm(self, x))
    model = _patched(True, frozen_linears)
    forwards.clear()  # the probes of rms_norm.eps_of ran the forward when the model was patched
    fast = _grads(model)
    layers = model.config.num_hidden_layers
    assert len(calls) == 2 * layers + 1
    assert len(forwards) == 2 * layers + 1  # the forward's own calls: none again in backward
    generic = _grads(_patched(False, frozen_linears))
    assert len(calls) == 2 * layers + 1  # not taken when switched off
    assert (fast - generic).norm() <= 1e-5 * generic.norm() and generic.abs().sum() > 0


def test_bf16_llama_gradients_match_the_generic_recomputation():
    fast = _grads(_patched(True, dtype=torch.bfloat16))
    generic = _grads(_patched(False, dtype=torch.bfloat16))
    cos = torch.nn.functional.cosine_similarity(fast, generic, dim=0)
    assert cos > 0.999 and generic.abs().sum() > 0


def test_gemma_keeps_the_generic_path(monkeypatch):
    calls = []
    real = rms_norm.RMSNormFn.backward
    monkeypatch.setattr(rms_norm.RMSNormFn, "backward", lambda *a: calls.append(1) or real(*a))
    model = tiny_model("gemma", "sdpa")
    hd.apply_division(model, hd.DivisionConfig(rounding="nearest", min_numel=0))
    assert flat_grad(model, tiny_batch(), 0).abs().sum() > 0 and calls == []


def test_bf16_autocast_takes_the_path_with_the_generic_gradient(monkeypatch):
    """Under bf16 autocast (the GPU's usual step) every RMSNorm takes the written-out gradient too
    (its formula runs in float32, which autocast leaves alone), and the gradients are the generic
    recomputation's to bf16 rounding: a float32 rounding apart in a norm's gradient flips the
    rounding of a few bf16 products downstream (8e-5 of the norm apart here; bf16's unit roundoff
    is 3.9e-3)."""
    calls = []
    real = rms_norm.RMSNormFn.backward
    monkeypatch.setattr(rms_norm.RMSNormFn, "backward", lambda *a: calls.append(1) or real(*a))
    batch = tiny_batch(pad_from=[64, 50, 64, 33])
    fast = flat_grad(_patched(True), batch, 0, torch.bfloat16).double()
    layers = _patched(True).config.num_hidden_layers
    assert len(calls) == 2 * layers + 1
    generic = flat_grad(_patched(False), batch, 0, torch.bfloat16).double()
    assert len(calls) == 2 * layers + 1  # not taken when switched off
    assert (fast - generic).norm() <= 1e-3 * generic.norm() and generic.abs().sum() > 0
