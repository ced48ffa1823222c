"""Mixtral: a Mistral decoder whose MLP is a top-k router over experts held as 3-D parameters."""
from transformers.models.mixtral.modeling_mixtral import (
    MixtralAttention,
    MixtralExperts,
    MixtralRMSNorm,
    MixtralTopKRouter,
)

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, moe_patcher

apply_division_to_mixtral = register("mixtral", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    moe_patcher(MixtralRMSNorm, (), MixtralExperts, MixtralTopKRouter, attention_type=MixtralAttention)
)
