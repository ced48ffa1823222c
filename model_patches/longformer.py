"""Longformer: RoBERTa's post-LN encoder (LayerNorm, GELU MLP) whose self-attention is a sliding window
of ``attention_window`` tokens plus the tokens marked global, computed inline in chunks (no
attention interface to dispatch to).

What autograd saves inside that attention (the chunked queries and keys, the banded scores'
probabilities, the global tokens' own) is kept compressed where it is saved
(:func:`~hf_division.patching.primitives.patch_saved`, the ``attention`` kind), or
with ``recompute_inline_attention`` run again in backward from its input
(:func:`~model_patches.common.patch_inline_attention`); its q/k/v projections,
global ones included, keep their own ops. The encoder policy (every kind at 4 bits, no LFC, no
outlier-token search) by analogy with BERT's, measured on tiny random-init models only.
"""
from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

from hf_division.registry import register

from .common import ENCODER_DEFAULTS, encoder_patcher, patch_inline_attention, with_patches

#: the self-attention class, computed inline
SPARSE_ATTENTION = (LongformerSelfAttention,)

apply_division_to_longformer = register("longformer", defaults=ENCODER_DEFAULTS)(
    with_patches(encoder_patcher(), (SPARSE_ATTENTION, patch_inline_attention))
)
