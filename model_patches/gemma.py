"""Gemma: RMSNorm with a (1 + weight) scale, gated GELU MLP, rotary attention (grouped-query) through the attention interface."""
from transformers.models.gemma.modeling_gemma import GemmaAttention, GemmaMLP, GemmaRMSNorm

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, gated_decoder_patcher

apply_division_to_gemma = register("gemma", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    gated_decoder_patcher(GemmaRMSNorm, GemmaMLP, attention_type=GemmaAttention)
)
