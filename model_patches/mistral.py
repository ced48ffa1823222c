"""Mistral: RMSNorm, gated MLP, rotary attention (grouped-query) through the attention interface."""
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralMLP, MistralRMSNorm

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, gated_decoder_patcher

apply_division_to_mistral = register("mistral", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    gated_decoder_patcher(MistralRMSNorm, MistralMLP, attention_type=MistralAttention)
)
