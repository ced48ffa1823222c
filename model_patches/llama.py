"""Llama: RMSNorm, gated MLP, rotary attention (grouped-query) through the attention interface."""
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, gated_decoder_patcher

apply_division_to_llama = register("llama", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    gated_decoder_patcher(LlamaRMSNorm, LlamaMLP, attention_type=LlamaAttention)
)
