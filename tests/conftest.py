import functools
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageClassification, AutoModelForSequenceClassification

torch.set_num_threads(2)

ENCODER_TYPES = ["bert", "roberta", "xlm-roberta", "electra", "distilbert"]
EOS = 1  # T5's eos id


DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, head_dim=16)
SIZES = {
    "distilbert": dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128),
    "electra": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, embedding_size=32),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=160),
    "opt": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64),
    **{t: DECODER for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")},
}


T5 = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
          relative_attention_num_buckets=16, pad_token_id=0, eos_token_id=EOS, decoder_start_token_id=0)
#: ViT: 48x48 images in 4x4 patches -> 144 patch tokens + [CLS]; 3*4*4 = 48 pixel values per token for
#: hidden 64, about the ratio of ViT-B/16 (768 for 768), so the pixel input weighs as in real models.
#: The token count is fixed by the config, so ViT batches ignore ``seq``.
VIT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=48,
           patch_size=4, num_channels=3)


def token_batch(batch=4, seq=64, seed=0, pad_from=None, pad_id=1, eos_id=None):
    """Random token ids in [5, 128) + mask + one label in [0, 3) per row. ``pad_from[i]``: row i is
    padded from there. ``eos_id``: the last real token of each row (T5 classifies its eos token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 128, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    ends = list(pad_from) if pad_from is not None else [seq] * batch
    for i, end in enumerate(ends):
        mask[i, end:] = 0
        ids[i, end:] = pad_id
        if eos_id is not None:
            ids[i, end - 1] = eos_id
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (batch,), generator=g)}


def pixel_batch(batch=4, seq=None, seed=0, pad_from=None, image_size=VIT["image_size"]):
    """Random ``(batch, 3, image_size, image_size)`` pixels + labels; ``seq``/``pad_from`` unused."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, image_size, image_size, generator=g)
    return {"pixel_values": pixels, "labels": torch.randint(0, 3, (batch,), generator=g)}


@dataclass(frozen=True)
class Case:
    """How to build a tiny model of one type: config sizes, task head, and a batch it accepts."""

    sizes: dict
    auto: type = AutoModelForSequenceClassification
    batch: Callable = token_batch


#: one row per model type that differs from the default (BERT-sized sequence classifier on tokens)
CASES = {
    **{t: Case(s) for t, s in SIZES.items()},
    "t5": Case(T5, batch=functools.partial(token_batch, pad_id=0, eos_id=EOS)),
    "vit": Case(VIT, auto=AutoModelForImageClassification, batch=pixel_batch),
}
DEFAULT = Case(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))


def case(model_type: str) -> Case:
    return CASES.get(model_type, DEFAULT)


def tiny_config(model_type: str, attn: str = "eager", **kw):
    common = dict(vocab_size=128, max_position_embeddings=160, num_labels=3, pad_token_id=1)
    cfg = AutoConfig.for_model(model_type, **{**common, **case(model_type).sizes, **kw})
    cfg._attn_implementation = attn
    return cfg


def tiny_model(model_type: str, attn: str = "eager", seed: int = 0, **kw):
    """A random-init model with the type's task head (``case(t).auto``); skips the test where
    Transformers lacks ``attn``."""
    torch.manual_seed(seed)
    try:
        return case(model_type).auto.from_config(tiny_config(model_type, attn, **kw), attn_implementation=attn)
    except ValueError as err:
        if "does not support an attention implementation" in str(err):
            pytest.skip(f"{model_type} has no {attn} attention in Transformers")
        raise


def tiny_batch(batch=4, seq=64, seed=0, pad_from=None, model_type=None):
    """A batch ``model_type``'s tiny model accepts (token ids by default)."""
    return case(model_type).batch(batch=batch, seq=seq, seed=seed, pad_from=pad_from)


@pytest.fixture
def batch():
    return tiny_batch()
