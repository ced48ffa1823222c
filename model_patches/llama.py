"""Llama: RMSNorm, gated MLP, rotary attention (grouped-query) through the attention interface."""
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from .common import gated_decoder_patcher

apply_division_to_llama = gated_decoder_patcher(LlamaRMSNorm, LlamaMLP)
