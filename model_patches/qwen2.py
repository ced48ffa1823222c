"""Qwen2: RMSNorm, gated MLP, rotary attention (grouped-query) through the attention interface."""
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, gated_decoder_patcher

apply_division_to_qwen2 = register("qwen2", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    gated_decoder_patcher(Qwen2RMSNorm, Qwen2MLP, attention_type=Qwen2Attention)
)
