"""Qwen3: RMSNorm, gated MLP, rotary attention (grouped-query) through the attention interface."""
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, Qwen3RMSNorm

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, gated_decoder_patcher

apply_division_to_qwen3 = register("qwen3", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    gated_decoder_patcher(Qwen3RMSNorm, Qwen3MLP, attention_type=Qwen3Attention)
)
