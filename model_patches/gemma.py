"""Gemma: RMSNorm with a (1 + weight) scale, gated GELU MLP, rotary attention (grouped-query) through the attention interface."""
from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm

from .common import gated_decoder_patcher

apply_division_to_gemma = gated_decoder_patcher(GemmaRMSNorm, GemmaMLP)
