"""Attention masks held as bits for the recomputation in backward (hf_division.store.keep_mask)."""
import pytest
import torch

import hf_division as hd
from hf_division import attention
from hf_division.config import DivisionConfig
from hf_division.store import keep_mask

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
    assert sum(t.numel() * t.element_size() for t in entry.tensors()) == -(-mask.numel() // 8)
    assert keep_mask(mask) is entry  # a second layer reuses the first one's bits
    rebuilt = entry.take()
    assert rebuilt.dtype == mask.dtype and rebuilt.shape == mask.shape
    assert torch.equal(rebuilt.view(torch.uint8) if rebuilt.dtype != torch.bool else rebuilt,
                       mask.view(torch.uint8) if mask.dtype != torch.bool else mask)


def test_other_masks_held_as_they_are():
    bias = torch.randn(2, 1, 16, 16)  # a position bias, not a mask: more than two values
    broadcast = torch.zeros(2, 1, 1, 16).masked_fill_(torch.rand(2, 1, 1, 16) > 0.5, -1e9).expand(2, 1, 64, 16)
    assert keep_mask(bias) is None
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
