"""LongT5: T5's layers (``LongT5LayerNorm``, gated-GELU or ReLU feed-forward, relative position
bias) with a sparse encoder attention, local (``LongT5LocalAttention``: each block of
``local_radius + 1`` tokens attends its own and its two neighbour blocks) or transient-global
(``LongT5TransientGlobalAttention``: also one aggregate token per ``global_block_size`` tokens).

The decoder's self- and cross-attention go through Transformers' attention interface as T5's do
(``AttentionFn``, the position bias a differentiated keyword tensor). The encoder's attention is
computed inline, in blocks, with no interface to dispatch to. Unpatched it saves the q blocks, the
three-block keys and values, and the float32 probabilities and dropped-out weights, each
``(batch, blocks, heads, block, 3 * block [+ globals])``: the encoder's largest saves, growing with
``local_radius``. Division recomputes it instead
(:func:`~hf_division.patching.checkpointing.patch_recomputed`): it keeps its input (the norm's
output, at ``checkpoint_bits``), the position bias that carries the mask as it is (one per stack,
as T5's) and the RNG state, and runs the attention again in backward, its projections included.
Checkpointing as T5's (``model_patches/t5.py``): the same block signature, and position biases
passed from layer to layer.
"""
from transformers.models.longt5.modeling_longt5 import (
    LongT5DenseGatedActDense, LongT5LayerNorm, LongT5LocalAttention, LongT5TransientGlobalAttention,
)

from hf_division.patching.checkpointing import patch_recomputed
from hf_division.registry import CheckpointForward, TrainingCache, register

from .common import DECODER_DEFAULTS, encoder_patcher, patch_t5_gated_ff, with_patches

apply_division_to_longt5 = register("longt5", defaults=DECODER_DEFAULTS, training_cache=TrainingCache.ENCODER_DECODER,
                                    checkpoint_forward=CheckpointForward.AS_CHECKPOINTED,
                                    checkpoint_exact=("position_bias", "encoder_decoder_position_bias"))(
    with_patches(encoder_patcher(norm_types=(LongT5LayerNorm,)),
                 (LongT5DenseGatedActDense, patch_t5_gated_ff),
                 ((LongT5LocalAttention, LongT5TransientGlobalAttention), patch_recomputed))
)
