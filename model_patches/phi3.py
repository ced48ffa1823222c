"""Phi-3: like Llama, but one fused ``gate_up_proj`` and ``up * act(gate)`` in that order."""
from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3MLP, Phi3RMSNorm

from hf_division.registry import TrainingCache, register

from .common import GATED_DECODER_DEFAULTS, gated_by_shape, gated_decoder_patcher

apply_division_to_phi3 = register("phi3", defaults=GATED_DECODER_DEFAULTS, by_shape=gated_by_shape, training_cache=TrainingCache.DECODER)(
    gated_decoder_patcher(Phi3RMSNorm, Phi3MLP, up_first=True, attention_type=Phi3Attention)
)
