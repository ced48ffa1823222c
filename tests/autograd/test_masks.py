"""Attention masks held as bits for the recomputation in backward (hf_division.autograd.store.keep_mask)."""
import pytest
import torch

import hf_division as hd
from hf_division.patching import attention
from hf_division.config import DivisionConfig
from hf_division.autograd.store import keep_mask

from conftest import tiny_batch, tiny_model


def _masks():
    attend = torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(0)) > 0.3
    low = torch.finfo(torch.float32).min
    return {
        "bool": attend,
        "additive min": torch.zeros(attend.shape).masked_fill_(~attend, low),
        "additive -inf": torch.zeros(attend.shape).masked_fill_(~attend, float("-inf")),
        "bf16 min": torch.zeros(attend.shape, dtype=torch.bfloat16).masked_fill_(~attend, torch.finfo(torch.bfloat16).min),
        "all attend": torch.zeros(attend.shape),
    }


@pytest.mark.parametrize("name", list(_masks()))
def test_mask_rebuilt_exactly_from_bits(name):
    mask = _masks()[name]
    entry = keep_mask(mask)
    assert entry is not None
    # the blocked pattern is held once along an axis it does not vary along (every row attends all)
    per_bit = mask[:1].numel() if name == "all attend" else mask.numel()
    assert sum(t.numel() * t.element_size() for t in entry.tensors()) == -(-per_bit // 8)
    assert keep_mask(mask) is entry  # a second layer reuses the first one's bits
    rebuilt = entry.take()
    assert rebuilt.dtype == mask.dtype and rebuilt.shape == mask.shape
    assert torch.equal(rebuilt.view(torch.uint8) if rebuilt.dtype != torch.bool else rebuilt,
                       mask.view(torch.uint8) if mask.dtype != torch.bool else mask)


def _alibi_mask(heads=4, t=32, dtype=torch.float32):
    """Falcon's mask since Transformers 5.25: ``alibi / sqrt(d)`` per head and key, "blocked" (causal
    or left padding) set to the dtype's minimum."""
    g = torch.Generator().manual_seed(1)
    keys = torch.ones(3, t, dtype=torch.long)
    keys[1, :5] = 0
    keys[2, :17] = 0
    slopes = torch.rand(heads, generator=g) + 0.1
    bias = (slopes[:, None] * ((keys.cumsum(-1) - 1) * keys)[:, None, :]).to(dtype)[:, :, None, :] / 4
    blocked = torch.ones(t, t, dtype=torch.bool).triu(1) | (keys == 0)[:, None, None, :]
    return bias.expand(3, heads, t, t).masked_fill(blocked, torch.finfo(dtype).min), bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_with_a_per_key_bias_held_as_bits_and_the_bias(dtype):
    mask, bias = _alibi_mask(dtype=dtype)
    entry = keep_mask(mask)
    assert entry is not None
    held = sum(t.numel() * t.element_size() for t in entry.tensors())
    # the pattern once for all heads, (3, 1, 32, 32) bits, plus the (3, heads, 1, 32) bias
    assert held == 3 * 32 * 32 // 8 + bias.numel() * bias.element_size()
    assert torch.equal(entry.take().view(torch.uint8), mask.view(torch.uint8))


def test_mask_with_a_pattern_per_head_keeps_every_head():
    mask, _ = _alibi_mask()
    mask[:, 1, :, 0] = torch.finfo(mask.dtype).min  # head 1 blocks key 0 as well
    entry = keep_mask(mask)
    assert torch.equal(entry.take(), mask)
    assert entry.tensors()[0].numel() == mask.numel() // 8


def test_other_masks_held_as_they_are():
    bias = torch.randn(2, 1, 16, 16)  # a position bias, not a mask: more than two values
    broadcast = torch.zeros(2, 1, 1, 16).masked_fill_(torch.rand(2, 1, 1, 16) > 0.5, -1e9).expand(2, 1, 64, 16)
    assert keep_mask(bias) is None
    per_query = _alibi_mask()[0]
    per_query[0, 0, 5, 2] += 1.0  # the bias of one key differs between two queries
    assert keep_mask(per_query) is None
    assert keep_mask(broadcast) is None  # its storage (2 x 16 floats) is no larger than the bits
    assert keep_mask(torch.full((2, 1, 16, 16), float("nan"))) is None
    assert keep_mask(torch.zeros(2, 1, 16, 16, requires_grad=True)) is None


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model(**batch).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gradient_same_as_with_the_mask_held_whole(attn, monkeypatch):
    """Padded rows make a real mask; round-to-nearest makes the compressed rest deterministic."""
    batch = tiny_batch(pad_from=[64, 40, 17, 52])
    config = DivisionConfig(rounding="nearest")
    model = hd.apply_division(tiny_model("bert", attn), config)
    bits = hd.measure_activation_memory(model, batch, config).division_bytes
    with_bits = _grads(model, batch)
    monkeypatch.setattr(attention, "keep_mask", lambda mask: None)
    whole = hd.measure_activation_memory(model, batch, config).division_bytes
    held_whole = _grads(model, batch)
    assert all(torch.equal(a, b) for a, b in zip(with_bits, held_whole))
    assert len(with_bits) == len(held_whole) > 0
    assert bits < whole


@pytest.mark.parametrize("attn,amp", [("eager", None), ("sdpa", None), ("sdpa", torch.bfloat16),
                                      ("eager", torch.float16)])
def test_padding_free_packed_batch_gradient(attn, amp):
    """A padding-free packed batch, as TRL's padding-free collator trains one: three sequences per
    row of 96 tokens (37, 45 and 14, off the 16-token block), position ids restarting at each, no
    attention mask, ``use_cache=False`` (Transformers builds the packing mask from the position ids
    only without a cache); float32 and under bf16 and fp16 autocast. The gradient against the
    unpatched model's at the same precision, over 3 draws, whole and per tensor (those with at
    least 1% of the norm). The mask decides it: the unpatched gradient with the packing left out (a
    cache present) reads 0.77 whole and 0.49 per tensor against it."""
    from hf_division.analysis.fidelity import cosine, named_grads
    from hf_division.bench.suites import cuda as cuda_suite

    model = cuda_suite.build("tiny", "cpu").train()
    model.set_attn_implementation(attn)
    ids = torch.randint(1, 512, (2, 96), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(37), torch.arange(45), torch.arange(14)]).expand(2, -1)
    batch = {"input_ids": ids, "position_ids": position_ids, "labels": ids, "use_cache": False}
    exact = named_grads(model, batch, 0, amp)
    whole = torch.cat(list(exact.values()))
    large = [k for k in exact if exact[k].norm() >= 0.01 * whole.norm()]
    hd.apply_division(model)
    for seed in range(3):
        grads = named_grads(model, batch, seed, amp)
        assert cosine(whole, torch.cat(list(grads.values()))) > 0.995
        assert min(cosine(exact[k], grads[k]) for k in large) > 0.99
