"""Backward shortcuts: the written-out sdpa backward (AttentionFn on CPU) and the direct derivative of GELU/SiLU (RecomputeFn)."""
import pytest
import torch
import torch.nn.functional as F

import hf_division as hd
from hf_division.autograd.ops import elementwise_grad
from hf_division.kernels import configure, configured
from hf_division.analysis.fidelity import flat_grad
from hf_division.autograd.sdpa_backward import sdpa_grads

from conftest import tiny_batch, tiny_model


def _set_blocks(monkeypatch, query_block: int, skip_block: int) -> None:
    from hf_division.autograd import sdpa_backward

    monkeypatch.setattr(sdpa_backward, "QUERY_BLOCK", query_block)
    monkeypatch.setattr(sdpa_backward, "SKIP_BLOCK", skip_block)


def _inputs(h=4, hk=4, tq=24, tk=24, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, tq, e, generator=g, requires_grad=True)
    k = torch.randn(2, hk, tk, e, generator=g, requires_grad=True)
    v = torch.randn(2, hk, tk, e + 2, generator=g, requires_grad=True)
    dout = torch.randn(2, h, tq, e + 2, generator=g)
    return q, k, v, dout


def _mask(kind, tq=24, tk=24):
    g = torch.Generator().manual_seed(1)
    if kind == "bool":
        m = torch.rand(2, 1, tq, tk, generator=g) > 0.3
        m[0, 0, 3] = False  # a row with every key masked
        return m
    if kind == "float":
        return torch.randn(2, 1, tq, tk, generator=g)
    if kind == "per_head":  # a different float bias per query head
        return torch.randn(2, 4, tq, tk, generator=g)
    if kind == "per_head_row":  # per head, one row for every query
        return torch.randn(2, 4, 1, tk, generator=g)
    if kind == "key_padding":  # (B, 1, 1, Tk) bool
        m = torch.rand(2, 1, 1, tk, generator=g) > 0.3
        m[..., 0] = True
        return m
    if kind == "2d":
        return torch.randn(tq, tk, generator=g)
    if kind == "causal_padded":  # what Transformers builds for a padded causal batch: item 1 has 5 padding keys
        m = torch.ones(tq, tk, dtype=torch.bool).tril().expand(2, 1, tq, tk).clone()
        m[1, ..., tk - 5 :] = False
        return m
    return None


_MASKS = [None, "bool", "float", "per_head", "per_head_row", "key_padding", "2d", "causal_padded"]


# sdpa takes a mask or is_causal, never both: the causal flag only with no mask
@pytest.mark.parametrize("mask,causal", [(m, False) for m in _MASKS] + [(None, True)])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("tq", [24, 9])
@pytest.mark.parametrize("blocks", [(128, 32), (8, 8), (5, 5), (8, 4)])
def test_matches_autograd_of_sdpa(mask, causal, gqa, tq, blocks, monkeypatch):
    """Every mask layout sdpa broadcasts, with grouped-query heads folded into taller matrices
    (hf_division.autograd.sdpa_backward._fold_heads), queries shorter than keys, and the queries in one
    block or several (``QUERY_BLOCK``, ``SKIP_BLOCK``; causal blocks leave out their masked keys)."""
    _set_blocks(monkeypatch, *blocks)
    q, k, v, dout = _inputs(hk=2 if gqa else 4, tq=tq)
    m = _mask(mask, tq=tq)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=0.3, enable_gqa=gqa)
    ref = torch.autograd.grad(out, (q, k, v), dout)
    got = sdpa_grads(q.detach(), k.detach(), v.detach(), dout, m, None, 0.0, causal, 0.3, gqa)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def testquery_blocks_leave_out_the_keys_every_query_of_the_block_has_masked(monkeypatch):
    """Which keys each block of queries computes: all of them, but for those that every query of
    the block (in every batch item and head) has masked: after the block under a causal mask,
    padding keys, and at least one key. Blocks that attend the same keys are joined."""
    from hf_division.autograd.sdpa_backward import query_blocks

    _set_blocks(monkeypatch, 8, 8)
    causal = [(0, 8, 8), (8, 16, 16), (16, 24, 24)]
    assert query_blocks(None, True, 24, 24) == causal
    assert query_blocks(None, False, 24, 24) == [(0, 8, 24), (8, 16, 24), (16, 24, 24)]
    assert query_blocks(None, True, 9, 24) == [(0, 8, 8), (8, 9, 9)]
    padded = _mask("causal_padded")  # item 0 attends every key: nothing more is left out
    assert query_blocks(padded, False, 24, 24) == causal
    padded[0, ..., 19:] = False  # now every item has 5 padding keys
    assert query_blocks(padded, False, 24, 24) == [(0, 8, 8), (8, 16, 16), (16, 24, 19)]
    bias = torch.zeros(24, 24).masked_fill_(~padded[0, 0], float("-inf"))  # the same as a float bias
    assert query_blocks(bias, False, 24, 24) == [(0, 8, 8), (8, 16, 16), (16, 24, 19)]
    assert query_blocks(torch.randn(2, 1, 24, 24), False, 24, 24)[0] == (0, 8, 24)  # finite: every key
    keys = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    keys[..., 20:] = False
    assert query_blocks(keys, False, 24, 24) == [(0, 8, 20), (8, 16, 20), (16, 24, 20)]
    assert query_blocks(torch.zeros(2, 1, 24, 24, dtype=torch.bool), False, 24, 24)[0] == (0, 8, 1)
    _set_blocks(monkeypatch, 8, 4)
    assert query_blocks(None, True, 12, 12) == [(0, 4, 4), (4, 8, 8), (8, 12, 12)]
    assert query_blocks(None, False, 20, 20) == [(0, 8, 20), (8, 16, 20), (16, 20, 20)]
    assert query_blocks(keys[..., :12], True, 12, 12) == [(0, 4, 4), (4, 8, 8), (8, 12, 12)]
    assert query_blocks(padded, False, 24, 24)[-2:] == [(12, 16, 16), (16, 24, 19)]


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("query_block", [128, 7])
def test_dropout_keep_mask(gqa, query_block, monkeypatch):
    _set_blocks(monkeypatch, query_block, min(query_block, 32))
    q, k, v, dout = _inputs(hk=2 if gqa else 4)
    m = _mask("bool")
    keep = (torch.rand(2, 4, 24, 24, generator=torch.Generator().manual_seed(2)) > 0.25).to(torch.uint8)
    kr, vr = (t.repeat_interleave(2, dim=1) if gqa else t for t in (k, v))
    s = (q @ kr.transpose(-2, -1)) * 0.3
    s = s.masked_fill(~m, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = (p * keep / 0.75) @ vr
    ref = torch.autograd.grad(out, (q, k, v), dout)
    got = sdpa_grads(q.detach(), k.detach(), v.detach(), dout, m, keep, 0.25, False, 0.3, gqa)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
@pytest.mark.parametrize("query_block", [128, 16])
def test_attention_fn_fast_path_matches_recomputation(model_type, query_block, monkeypatch):
    from hf_division.autograd import sdpa_backward

    _set_blocks(monkeypatch, query_block, min(query_block, 32))
    calls = []
    real = sdpa_backward.sdpa_grads
    monkeypatch.setattr(sdpa_backward, "sdpa_grads", lambda *a: calls.append(a[5] is not None) or real(*a))
    # bert: attention dropout 0.1 (sdpa's math path, recorded masks); llama: causal + GQA, no dropout
    model = tiny_model(model_type, "sdpa", **({"attention_probs_dropout_prob": 0.1} if model_type == "bert" else {}))
    batch = tiny_batch(pad_from=[64, 50, 64, 33])
    cfg = hd.DivisionConfig(rounding="nearest", min_numel=0)  # deterministic compression
    hd.apply_division(model, cfg)
    fast = flat_grad(model, batch, 0)
    # the fast path ran once per layer, with the recorded dropout bits where there is dropout
    assert calls == [model_type == "bert"] * model.config.num_hidden_layers
    with configured(sdpa_backward=False):
        slow = flat_grad(model, batch, 0)
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-6)
    assert not torch.equal(fast, torch.zeros_like(fast))


def test_activation_direct_backward_matches_autograd():
    from torch import nn
    from transformers.activations import GELUActivation, NewGELUActivation, SiLUActivation

    x = torch.randn(4, 16, 32, requires_grad=True)
    g = torch.randn(4, 16, 32)
    for module in (nn.GELU(), nn.GELU(approximate="tanh"), GELUActivation(), nn.SiLU(), SiLUActivation()):
        direct = elementwise_grad(module.forward)
        assert direct is not None, module
        (ref,) = torch.autograd.grad(module(x), x, g)
        torch.testing.assert_close(direct(g, x.detach()), ref)
    for module in (NewGELUActivation(), nn.ReLU(), nn.LayerNorm(32), GELUActivation(use_gelu_python=True)):
        assert elementwise_grad(module.forward) is None, module


@pytest.mark.parametrize("mask", [None, "bool", "float", "broadcast"])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skip_block", [32, 5])
def test_chunked_over_batch_matches_one_pass(monkeypatch, mask, gqa, dtype, skip_block):
    """sdpa_grads runs over chunks of the batch (cache-sized); per-item slices of q, k, v, dout,
    mask and dropout bits must give the one-pass result (masks of batch 1 are broadcast), in
    the input dtype (float32 chunks are written by the products, others copied), in one block
    of queries or several."""
    from hf_division.autograd import sdpa_backward

    _set_blocks(monkeypatch, 128 if skip_block == 32 else skip_block, skip_block)

    q, k, v, dout = (t.detach().to(dtype) for t in _inputs(hk=2 if gqa else 4))
    m = _mask("float")[:1] if mask == "broadcast" else _mask(mask)
    keep = (torch.rand(2, 4, 24, 24, generator=torch.Generator().manual_seed(2)) > 0.25).to(torch.uint8)
    args = (q, k, v, dout, m, keep, 0.25, False, 0.3, gqa)
    whole = sdpa_grads(*args)
    monkeypatch.setattr(sdpa_backward, "CHUNK_BYTES", 1)  # one item per chunk
    chunked = sdpa_grads(*args)
    for a, b, t in zip(chunked, whole, (q, k, v)):
        assert a.dtype == t.dtype and a.shape == t.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("frozen_linears", [False, True])
def test_layer_norm_direct_backward_is_the_recomputation_to_the_bit(frozen_linears, monkeypatch):
    """nn.LayerNorm runs one normalization in backward (hf_division.autograd.layer_norm) where the generic
    path ran two; with the Linears frozen no later layer rebuilds its output and the backward
    normalizes on its own. The gradients equal the generic path's to the bit."""
    from hf_division.autograd import layer_norm
    from hf_division.patching import primitives as patching

    batch = tiny_batch(pad_from=[64, 50, 64, 33])
    grads, calls = {}, []
    real = layer_norm.LayerNormFn.backward
    monkeypatch.setattr(layer_norm.LayerNormFn, "backward", lambda *a: calls.append(1) or real(*a))
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(patching, "layer_norm_takes", lambda module: False)
        model = tiny_model("bert", "sdpa")
        for m in model.modules():
            if frozen_linears and isinstance(m, torch.nn.Linear):
                m.weight.requires_grad_(False)
        hd.apply_division(model, hd.DivisionConfig(rounding="nearest", min_numel=0))
        grads[fast] = flat_grad(model, batch, 0)
    assert len(calls) == 2 * model.config.num_hidden_layers + 1  # every LayerNorm, embeddings' included
    assert torch.equal(grads[True], grads[False]) and grads[True].abs().sum() > 0


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_norm_and_gated_mlp_run_once_in_backward_with_the_same_gradient(monkeypatch, amp):
    """A norm with parameters on the generic path (RecomputeFn; Llama's RMSNorm switched to it
    here, hf_division.autograd.rms_norm being tested in tests/autograd/test_rms_norm.py): the rebuild of its output
    for the next layer records the recomputation and the norm's backward reuses it; the gated
    MLP's product rebuild (with the fused kernel off, tested in tests/autograd/test_gated.py) leaves act(gate)
    and SiLU's gradient comes from silu_backward. Each runs
    once per backward where it ran twice, and the gradient is the same to the bit; under bf16
    autocast too (the GPU's usual step), where SiLU is on no autocast list."""
    from transformers.models.llama import modeling_llama

    calls = {"norm": 0, "silu": 0}
    norm, silu = modeling_llama.LlamaRMSNorm.forward, F.silu  # counted where they are looked up at call time
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", lambda self, x: calls.__setitem__("norm", calls["norm"] + 1) or norm(self, x))
    monkeypatch.setattr(F, "silu", lambda x, inplace=False: calls.__setitem__("silu", calls["silu"] + 1) or silu(x, inplace))
    batch = tiny_batch(pad_from=[64, 50, 64, 33])
    grads, counts = {}, {}
    with configured(rms_norm_backward=False, gated_from_codes=False, shared_recomputation=True):
        for shared in (True, False):
            configure(shared_recomputation=shared)  # off: recompute without a graph, SiLU's gradient through autograd
            model = tiny_model("llama", "sdpa")
            hd.apply_division(model, hd.DivisionConfig(rounding="nearest", min_numel=0))
            model.zero_grad()
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                out = model(**batch)
            before = dict(calls)
            out.loss.backward()
            counts[shared] = (calls["norm"] - before["norm"], calls["silu"] - before["silu"])
            grads[shared] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    layers = model.config.num_hidden_layers
    assert counts[True] == (2 * layers + 1, layers)  # two norms a layer + the final one; one MLP a layer
    assert counts[False] == (2 * counts[True][0], 2 * layers)
    assert torch.equal(grads[True], grads[False]) and grads[True].abs().sum() > 0


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_attention_without_dropout_keeps_no_rng_state_nor_watches_for_draws(monkeypatch, dropout):
    """sdpa called without dropout draws nothing: AttentionFn keeps no RNG state and runs it
    without the dispatch mode that records draws (host time per op on a GPU), and the gradient is
    the one with both, to the bit. With dropout both are kept and the draws are replayed."""
    from hf_division.autograd import ops
    from hf_division.patching import attention

    made = {"rng": 0, "modes": 0}
    rng, modes = ops.RngState, ops.DropoutMasks
    monkeypatch.setattr(ops, "RngState", lambda *a: made.__setitem__("rng", made["rng"] + 1) or rng(*a))
    monkeypatch.setattr(ops, "DropoutMasks", lambda **k: made.__setitem__("modes", made["modes"] + 1) or modes(**k))
    batch = tiny_batch(pad_from=[64, 50, 64, 33])
    grads, counts = {}, {}
    for watched in (False, True):  # True: as every implementation outside DRAWS_ONLY_FOR_DROPOUT
        monkeypatch.setattr(attention, "DRAWS_ONLY_FOR_DROPOUT", frozenset() if watched else frozenset({"sdpa"}))
        model = tiny_model("llama", "sdpa", attention_dropout=dropout)
        hd.apply_division(model, hd.DivisionConfig(rounding="nearest", min_numel=0))
        made.update(rng=0, modes=0)
        grads[watched] = flat_grad(model, batch, 0)
        counts[watched] = dict(made)
    layers = model.config.num_hidden_layers
    assert counts[True] == {"rng": layers, "modes": 2 * layers}  # a mode in forward and one in backward
    assert counts[False] == (counts[True] if dropout else {"rng": 0, "modes": 0})
    assert torch.equal(grads[False], grads[True]) and grads[True].abs().sum() > 0
