"""The three fidelity measures (hf_division/analysis/fidelity.py; docs/GUIDE.md, "Gradient fidelity")."""
import pytest
import torch

import hf_division as hd
from hf_division.analysis.fidelity import added_variance, cosine, gradient_fidelity, named_grads, precision_reference
from hf_division.api import division_config_of

from conftest import tiny_batch, tiny_model

EXACT = hd.DivisionConfig(linear_bits=0, attention_bits=0, activation_bits=0, norm_bits=0)


def test_fidelity_over_draws_and_per_tensor():
    model = tiny_model("llama", "sdpa")
    batch = tiny_batch(batch=4, seq=64, pad_from=[64, 40, 64, 20])
    f = gradient_fidelity(model, batch, draws=4)
    assert len(f.whole) == 4 and len(set(f.whole)) > 1  # the draws differ
    assert 0.98 <= f.worst <= f.median < 1 and not f.missing
    # per tensor, from the gradients themselves: the carrying tensors and their worst cosine
    exact = named_grads(model, batch, 0)
    norm = torch.cat(list(exact.values())).norm()
    assert set(f.per_tensor) == {n for n, g in exact.items() if g.norm() >= 0.01 * norm}
    name, worst = f.worst_tensor
    assert worst == min(f.per_tensor.values()) < f.worst  # a tensor sits below the whole gradient
    assert division_config_of(model) is None  # left as found
    # every kind exact: the same gradient (up to summation order) in every draw
    same = gradient_fidelity(model, batch, EXACT, draws=2)
    assert same.worst > 1 - 1e-9 and min(same.per_tensor.values()) > 1 - 1e-9
    # 1-bit linear inputs: a visibly worse gradient, which the per-tensor minimum shows first
    coarse = gradient_fidelity(model, batch, hd.DivisionConfig(linear_bits=1), draws=2)
    assert coarse.worst_tensor[1] < worst


def test_added_variance_against_the_sampling_variance():
    model = tiny_model("bert", "eager", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batches = [tiny_batch(batch=4, seq=32, seed=s) for s in range(4)]
    ratio = added_variance(model, batches, draws=2)
    assert 0 < ratio < 0.1
    assert added_variance(model, batches, EXACT, draws=1) < 1e-9
    # the definition, computed here: mean |g_div - g|^2 over mean-corrected |g - mean g|^2
    exact = [torch.cat(list(named_grads(model, b, 0).values())) for b in batches]
    hd.apply_division(model, hd.DivisionConfig(linear_bits=1))
    div = [torch.cat(list(named_grads(model, b, 0, noise_seed=1000).values())) for b in batches]
    hd.remove_division(model)
    mean = torch.stack(exact).mean(0)
    want = sum((d - g).pow(2).sum() for d, g in zip(div, exact)).item() / len(batches) / (
        sum((g - mean).pow(2).sum() for g in exact).item() / (len(batches) - 1))
    got = added_variance(model, batches, hd.DivisionConfig(linear_bits=1), draws=1)
    assert got == pytest.approx(want, rel=1e-9) and got > ratio
    assert cosine(exact[0], div[0]) < 1
    with pytest.raises(ValueError, match="batches"):
        added_variance(model, batches[:1])


def test_precision_reference_is_the_unpatched_autocast_gradient_against_float32():
    model = tiny_model("llama", "sdpa")
    batch = tiny_batch(batch=2, seq=40, pad_from=[40, 25])
    hd.apply_division(model)
    ref = precision_reference(model, batch, torch.bfloat16)
    assert division_config_of(model) is not None  # left patched, as found
    hd.remove_division(model)
    exact, half = named_grads(model, batch, 0), named_grads(model, batch, 0, torch.bfloat16)
    flat = torch.cat(list(exact.values()))
    # the same float64 cosine, summed tensor by tensor instead of over one flat copy
    assert ref.whole == pytest.approx([cosine(torch.cat([half[n] for n in exact]), flat)], abs=1e-12)
    assert 0.9 < ref.worst < 1  # bf16 moves the gradient, a little
    flat_half = torch.cat(list(half.values()))  # the carrying tensors: the autocast gradient's
    carrying = {n for n, g in half.items() if g.norm() >= 0.01 * flat_half.norm()}
    assert ref.per_tensor == pytest.approx({n: cosine(half[n], exact[n]) for n in carrying}, abs=1e-12)


def test_gradients_held_in_float32_give_the_float64_figures():
    """A float32 model's gradient is float32: holding it so between passes (half the memory, for a
    1B model on the CPU) changes no figure, since the sums still run in float64."""
    model = tiny_model("llama", "sdpa")
    batch = tiny_batch(batch=2, seq=40, pad_from=[40, 25])
    wide = gradient_fidelity(model, batch, hd.DivisionConfig(), draws=2)
    held = gradient_fidelity(model, batch, hd.DivisionConfig(), draws=2, dtype=torch.float32)
    assert held.whole == wide.whole and held.per_tensor == wide.per_tensor
    assert all(g.dtype == torch.float32 for g in named_grads(model, batch, 0, dtype=torch.float32).values())
