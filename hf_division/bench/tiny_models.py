"""The tiny random-init model of every registered type, at the conformance shape: one table of
config sizes, task head and batch per model type (docs/ARCHITECTURES.md, "Conformance").

Used by the tests (tests/conftest.py) and by ``python -m hf_division.bench architectures``, which
prints the architecture table's bytes ratios and cosines from these same models.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import (AutoConfig, AutoModelForImageClassification, AutoModelForSeq2SeqLM,
                          AutoModelForSequenceClassification, AutoModelForSpeechSeq2Seq)

EOS = 1  # T5's eos id


DEFAULT_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, head_dim=16)
SIZES = {
    "distilbert": dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128),
    "electra": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, embedding_size=32),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=160),
    "opt": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64),
    **{t: DECODER for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")},
    "mixtral": dict(DECODER, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "qwen2_moe": dict(DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64),
    #: windows of 16 tokens, off the compressor's block size (64- and 37-token rows are padded to a
    #: multiple of the window by the model)
    "longformer": dict(DEFAULT_SIZES, attention_window=16),
    #: DeBERTa-v3's settings (relative attention, c2p and p2c, log buckets active at 128 tokens)
    "deberta-v2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       relative_attention=True, pos_att_type="p2c|c2p", position_buckets=32, max_relative_positions=-1,
                       share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0),
}


T5 = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
          relative_attention_num_buckets=16, pad_token_id=0, eos_token_id=EOS, decoder_start_token_id=0)
#: LongT5: T5's sizes, transient-global encoder attention (its local attention's blocks plus the
#: global aggregates) in blocks of 9 tokens, off the compressor's block size, and 16 aggregates at 64
#: tokens; LongT5 has no sequence-classification head: conditional generation on 16 label tokens
LONGT5 = dict(T5, local_radius=8, global_block_size=4, encoder_attention_type="transient-global",
              feed_forward_proj="gated-gelu")
BART = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, eos_token_id=2, bos_token_id=0)
#: LED: BART's sizes, Longformer windows of 16 tokens in the encoder; no sequence-classification head
#: in Transformers' auto classes: conditional generation on 16 label tokens
LED = dict(BART, attention_window=16, max_encoder_position_embeddings=256, max_decoder_position_embeddings=256)
#: Whisper: 128 encoder tokens (from 256 mel frames; Whisper accepts exactly 2 x max_source_positions)
WHISPER = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=128, max_target_positions=160,
               num_mel_bins=80, decoder_start_token_id=0, bos_token_id=0, eos_token_id=2)
#: the text tower of CLIP/SigLIP (built, unused by their image-classification head)
TEXT_TOWER = dict(DEFAULT_SIZES, max_position_embeddings=160, vocab_size=128, bos_token_id=0, eos_token_id=2)
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


def seq2seq_batch(batch=4, seq=64, seed=0, pad_from=None, pad_id=0, eos_id=EOS, targets=16):
    """:func:`token_batch`'s inputs with ``targets`` label tokens per row in [5, 128) instead of a class."""
    out = token_batch(batch, seq, seed, pad_from, pad_id, eos_id)
    g = torch.Generator().manual_seed(seed + 1)
    out["labels"] = torch.randint(5, 128, (batch, targets), generator=g)
    return out


def pixel_batch(batch=4, seq=None, seed=0, pad_from=None, image_size=VIT["image_size"]):
    """Random ``(batch, 3, image_size, image_size)`` pixels + labels; ``seq``/``pad_from`` unused."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, image_size, image_size, generator=g)
    return {"pixel_values": pixels, "labels": torch.randint(0, 3, (batch,), generator=g)}


def audio_batch(batch=4, seq=None, seed=0, pad_from=None, frames=2 * WHISPER["max_source_positions"]):
    """Random mel features ``(batch, 80, frames)`` + 32 decoder label tokens; ``seq``/``pad_from``
    unused (Whisper's input length is fixed by its config)."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, WHISPER["num_mel_bins"], frames, generator=g)
    return {"input_features": features, "labels": torch.randint(5, 128, (batch, 32), generator=g)}


@dataclass(frozen=True)
class Case:
    """How to build a tiny model of one type: config sizes, task head, and a batch it accepts."""

    sizes: dict
    auto: type = AutoModelForSequenceClassification
    batch: Callable = token_batch


#: one row per model type that differs from the default (BERT-sized sequence classifier on tokens)
CASES = {
    **{t: Case(s) for t, s in SIZES.items()},
    **{t: Case(T5, batch=functools.partial(token_batch, pad_id=0, eos_id=EOS)) for t in ("t5", "mt5", "umt5")},
    "longt5": Case(LONGT5, auto=AutoModelForSeq2SeqLM, batch=seq2seq_batch),
    "led": Case(LED, auto=AutoModelForSeq2SeqLM, batch=functools.partial(seq2seq_batch, pad_id=1,
                                                                         eos_id=BART["eos_token_id"])),
    "vit": Case(VIT, auto=AutoModelForImageClassification, batch=pixel_batch),
    **{t: Case(BART, batch=functools.partial(token_batch, eos_id=BART["eos_token_id"])) for t in ("bart", "mbart")},
    "whisper": Case(WHISPER, auto=AutoModelForSpeechSeq2Seq, batch=audio_batch),
    #: CLIP and SigLIP: the vision tower with a classification head (the text tower: tests/model_patches/test_breadth.py)
    **{t: Case(dict(vision_config=VIT, text_config=TEXT_TOWER), auto=AutoModelForImageClassification,
               batch=pixel_batch) for t in ("clip", "siglip")},
}
DEFAULT = Case(DEFAULT_SIZES)


def case(model_type: str) -> Case:
    return CASES.get(model_type, DEFAULT)


def tiny_config(model_type: str, attn: str = "eager", **kw):
    common = dict(vocab_size=128, max_position_embeddings=160, num_labels=3, pad_token_id=1)
    cfg = AutoConfig.for_model(model_type, **{**common, **case(model_type).sizes, **kw})
    cfg._attn_implementation = attn
    return cfg


def tiny_model(model_type: str, attn: str = "eager", seed: int = 0, **kw):
    """A random-init model with the type's task head (``case(t).auto``). Raises ``ValueError`` where
    Transformers lacks ``attn`` for the type (see :func:`has_impl`)."""
    torch.manual_seed(seed)
    return case(model_type).auto.from_config(tiny_config(model_type, attn, **kw), attn_implementation=attn)


def has_impl(err: ValueError) -> bool:
    """False if ``err`` is Transformers refusing an attention implementation for a model type."""
    return "does not support an attention implementation" not in str(err)


def tiny_batch(batch=4, seq=64, seed=0, pad_from=None, model_type=None):
    """A batch ``model_type``'s tiny model accepts (token ids by default)."""
    return case(model_type).batch(batch=batch, seq=seq, seed=seed, pad_from=pad_from)
