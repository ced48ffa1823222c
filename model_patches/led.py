"""LED (Longformer-Encoder-Decoder): BART's layers (LayerNorm, GELU MLP, post-LN) with Longformer's
sliding-window self-attention in the encoder, every attention computed inline (no attention
interface to dispatch to).

What autograd saves inside the encoder's self-attention (the chunked queries and keys, the banded
probabilities) and inside the decoder's self- and cross-attention (the ``T x T`` and ``T x S``
probabilities) is kept compressed where it is saved
(:func:`~hf_division.patching.primitives.patch_saved`, the ``attention`` kind), or
with ``recompute_inline_attention`` run again in backward from its input
(:func:`~model_patches.common.patch_inline_attention`); the projections keep
their own ops. The generic policy, as BART's (``model_patches/bart.py``), measured on tiny
random-init models only.
"""
from transformers.models.led.modeling_led import LEDDecoderAttention, LEDEncoderSelfAttention

from hf_division.registry import TrainingCache, register

from .common import encoder_patcher, patch_inline_attention, with_patches

apply_division_to_led = register("led", training_cache=TrainingCache.ENCODER_DECODER)(
    with_patches(encoder_patcher(), ((LEDEncoderSelfAttention, LEDDecoderAttention), patch_inline_attention))
)
