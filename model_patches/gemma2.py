"""Gemma2: (1 + weight) RMSNorm before and after each block, gated MLP, rotary attention with soft-capping through the attention interface."""
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2MLP, Gemma2RMSNorm

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, gated_decoder_patcher

apply_division_to_gemma2 = register("gemma2", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    gated_decoder_patcher(Gemma2RMSNorm, Gemma2MLP, attention_type=Gemma2Attention)
)
