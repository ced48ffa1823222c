"""Mistral: RMSNorm, gated MLP, rotary attention (grouped-query) through the attention interface."""
from transformers.models.mistral.modeling_mistral import MistralMLP, MistralRMSNorm

from .common import gated_decoder_patcher

apply_division_to_mistral = gated_decoder_patcher(MistralRMSNorm, MistralMLP)
