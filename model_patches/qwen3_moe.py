"""Qwen3-MoE: Qwen3 with a top-k router over experts (3-D parameters); layers listed in
``mlp_only_layers`` keep a dense gated MLP."""
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeExperts,
    Qwen3MoeMLP,
    Qwen3MoeRMSNorm,
    Qwen3MoeTopKRouter,
)

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, moe_patcher

apply_division_to_qwen3_moe = register("qwen3_moe", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    moe_patcher(Qwen3MoeRMSNorm, Qwen3MoeMLP, Qwen3MoeExperts, Qwen3MoeTopKRouter, attention_type=Qwen3MoeAttention)
)
