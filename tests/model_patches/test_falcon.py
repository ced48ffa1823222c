"""Falcon's variants the conformance suite's default config does not reach: ALiBi positions (whose
bias Transformers 5.25 adds into the attention mask), grouped keys/values
(``new_decoder_architecture``) and per-head keys/values (``multi_query=False``), with padding.
Run under whichever Transformers is installed (model_patches/falcon.py picks the path)."""
import pytest
import torch

import hf_division as hd
from hf_division.analysis.fidelity import gradient_cosine

from conftest import tiny_batch, tiny_model

VARIANTS = {
    "alibi": dict(alibi=True),
    "alibi, per-head kv": dict(alibi=True, multi_query=False),
    "grouped kv": dict(new_decoder_architecture=True, num_kv_heads=2),
    "rotary, per-head kv": dict(multi_query=False),
}
PADDED = [128, 100, 77, 128]


def _logits(model, batch, seed=3):
    torch.manual_seed(seed)
    return model(**batch).logits


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_bit_identical_gradient_close_bytes_fewer(variant, impl):
    model = tiny_model("falcon", impl, **VARIANTS[variant]).train()
    batch = tiny_batch(batch=4, seq=128, pad_from=PADDED)
    ref = _logits(model, batch)
    model.eval()
    ref_eval = model(**batch).logits
    mem = hd.measure_activation_memory(model, batch)
    cos = gradient_cosine(model, batch, seeds=(0, 1))
    hd.apply_division(model)
    assert torch.equal(_logits(model.train(), batch), ref)
    assert torch.equal(model.eval()(**batch).logits, ref_eval)
    assert min(cos) >= 0.98, cos
    assert mem.ratio >= 4, mem.table()
    hd.remove_division(model)


def test_alibi_mask_held_as_bits_not_whole():
    """The ALiBi mask is ``(batch, heads, T, T)`` floats, a layer's attention probabilities' worth:
    what the attention holds besides q, k, v must be far smaller than it."""
    model = tiny_model("falcon", "eager", alibi=True)
    batch = tiny_batch(batch=4, seq=128, pad_from=PADDED)
    mem = hd.measure_activation_memory(model, batch)
    heads = model.config.num_attention_heads
    mask_bytes = 4 * heads * 128 * 128 * 4
    baseline, held = mem.by_kind["attention"]
    assert held < mask_bytes / 4, mem.table()
    assert held < baseline / 4, mem.table()
