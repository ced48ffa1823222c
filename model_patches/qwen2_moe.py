"""Qwen2-MoE (Qwen1.5-MoE): routed experts plus a shared expert scaled by a sigmoid gate. The
whole sparse block is caught where autograd saves (the shared expert's product with its gate is
computed inline, outside any module); its dense gated MLPs keep their own op."""
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeAttention,
    Qwen2MoeMLP,
    Qwen2MoeRMSNorm,
    Qwen2MoeSparseMoeBlock,
    Qwen2MoeTopKRouter,
)

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, moe_patcher

apply_division_to_qwen2_moe = register("qwen2_moe", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    moe_patcher(Qwen2MoeRMSNorm, Qwen2MoeMLP, Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter,
                attention_type=Qwen2MoeAttention)
)
