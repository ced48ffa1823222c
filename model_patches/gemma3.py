"""Gemma 3 (text): Gemma 2's sandwich RMSNorms and gated GELU MLP, plus RMSNorm on q and k
(patched as norms like the others), sliding and global attention layers through the attention
interface."""
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3MLP, Gemma3RMSNorm

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, gated_decoder_patcher

apply_division_to_gemma3 = register("gemma3_text", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    gated_decoder_patcher(Gemma3RMSNorm, Gemma3MLP, attention_type=Gemma3Attention)
)
