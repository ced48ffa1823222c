"""Vision-text models with both towers training (the conformance suite runs their vision tower with
a classification head): CLIP and SigLIP contrastive loss over token and patch batches."""
import pytest
import torch
from transformers import AutoConfig, AutoModel

import hf_division as hd
from hf_division.analysis.fidelity import gradient_cosine
from hf_division.bench.tiny_models import TEXT_TOWER, VIT, pixel_batch, token_batch


def _towers(model_type: str, impl: str):
    cfg = AutoConfig.for_model(model_type, text_config=dict(TEXT_TOWER, pad_token_id=1), vision_config=VIT)
    torch.manual_seed(0)
    return AutoModel.from_config(cfg, attn_implementation=impl).train()


def _batch(n=4, seq=128):
    ids = token_batch(batch=n, seq=seq)["input_ids"]
    return {"input_ids": ids, "pixel_values": pixel_batch(batch=n)["pixel_values"], "return_loss": True}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["clip", "siglip"])
def test_both_towers(model_type, impl):
    model = _towers(model_type, impl)
    batch = _batch()
    torch.manual_seed(0)
    ref = model(**batch).logits_per_image
    hd.apply_division(model)
    torch.manual_seed(0)
    assert torch.equal(model(**batch).logits_per_image, ref)
    hd.remove_division(model)
    assert min(gradient_cosine(model, batch, seeds=(0,))) >= 0.98
    mem = hd.measure_activation_memory(model, batch)
    assert mem.ratio >= 4, mem.table()
