import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

torch.set_num_threads(2)

ENCODER_TYPES = ["bert", "roberta", "xlm-roberta", "electra", "distilbert"]


DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, head_dim=16)
SIZES = {
    "distilbert": dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128),
    "electra": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, embedding_size=32),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=160),
    "opt": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64),
    **{t: DECODER for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")},
}


def tiny_config(model_type: str, attn: str = "eager", **kw):
    common = dict(vocab_size=128, max_position_embeddings=160, num_labels=3, pad_token_id=1)
    sizes = SIZES.get(model_type, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))
    cfg = AutoConfig.for_model(model_type, **common, **sizes, **kw)
    cfg._attn_implementation = attn
    return cfg


def tiny_model(model_type: str, attn: str = "eager", seed: int = 0, **kw):
    """A random-init sequence classifier; skips the test where Transformers lacks ``attn``."""
    torch.manual_seed(seed)
    try:
        return AutoModelForSequenceClassification.from_config(tiny_config(model_type, attn, **kw), attn_implementation=attn)
    except ValueError as err:
        if "does not support an attention implementation" in str(err):
            pytest.skip(f"{model_type} has no {attn} attention in Transformers")
        raise


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
