"""LongT5: T5's layers (``LongT5LayerNorm``, gated-GELU or ReLU feed-forward, relative position
bias) with a sparse encoder attention, local (``LongT5LocalAttention``: each block of
``local_radius + 1`` tokens attends its own and its two neighbour blocks) or transient-global
(``LongT5TransientGlobalAttention``: also one aggregate token per ``global_block_size`` tokens).

The decoder's self- and cross-attention go through Transformers' attention interface as T5's do
(``AttentionFn``, the position bias a differentiated keyword tensor). The encoder's attention is
computed inline, in blocks, with no interface to dispatch to, so what autograd saves inside it is
kept compressed where it is saved (:func:`~hf_division.patching.primitives.patch_saved`, the
``attention`` kind): the q blocks, the three-block keys and values, and the float32 probabilities
and dropped-out weights, each ``(batch, blocks, heads, block, 3 * block [+ globals])``, the
encoder's largest saves. With ``recompute_inline_attention`` it runs again in backward from its
input instead (:func:`~model_patches.common.patch_inline_attention`): fewer bytes still, for about a
quarter more step time (docs/RESULTS.md, "Long-input attentions"). Checkpointing as T5's (``model_patches/t5.py``):
the same block signature, and position biases passed from layer to layer.
"""
from transformers.models.longt5.modeling_longt5 import (
    LongT5DenseGatedActDense, LongT5LayerNorm, LongT5LocalAttention, LongT5TransientGlobalAttention,
)

from hf_division.registry import CheckpointForward, TrainingCache, register

from .common import DECODER_DEFAULTS, encoder_patcher, patch_inline_attention, patch_t5_gated_ff, with_patches

#: the encoder's attention classes, computed inline
SPARSE_ATTENTION = (LongT5LocalAttention, LongT5TransientGlobalAttention)

apply_division_to_longt5 = register("longt5", defaults=DECODER_DEFAULTS, training_cache=TrainingCache.ENCODER_DECODER,
                                    checkpoint_forward=CheckpointForward.AS_CHECKPOINTED,
                                    checkpoint_exact=("position_bias", "encoder_decoder_position_bias"))(
    with_patches(encoder_patcher(norm_types=(LongT5LayerNorm,)),
                 (LongT5DenseGatedActDense, patch_t5_gated_ff),
                 (SPARSE_ATTENTION, patch_inline_attention))
)
