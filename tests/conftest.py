import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

torch.set_num_threads(2)

ENCODER_TYPES = ["bert", "roberta", "xlm-roberta", "electra", "distilbert"]


def tiny_config(model_type: str, attn: str = "eager", **kw):
    common = dict(vocab_size=128, max_position_embeddings=160, num_labels=3)
    if model_type == "distilbert":
        sizes = dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128)
    else:
        sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
        if model_type == "electra":
            sizes["embedding_size"] = 32
    cfg = AutoConfig.for_model(model_type, **common, **sizes, **kw)
    cfg._attn_implementation = attn
    return cfg


def tiny_model(model_type: str, attn: str = "eager", seed: int = 0, **kw):
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(tiny_config(model_type, attn, **kw), attn_implementation=attn)


def tiny_batch(batch=4, seq=64, seed=0, pad_from=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 128, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if pad_from is not None:
        for i, start in enumerate(pad_from):
            mask[i, start:] = 0
            ids[i, start:] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (batch,), generator=g)}


@pytest.fixture
def batch():
    return tiny_batch()
