"""Qwen3: RMSNorm, gated MLP, rotary attention (grouped-query) through the attention interface."""
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from .common import gated_decoder_patcher

apply_division_to_qwen3 = gated_decoder_patcher(Qwen3RMSNorm, Qwen3MLP)
