"""Phi (Phi-1/1.5/2): one LayerNorm per block feeding attention and MLP in parallel, GELU MLP,
optional q/k LayerNorms, partial rotary, through the attention interface."""
from hf_division.registry import TrainingCache, register

from .common import DECODER_DEFAULTS, encoder_patcher

apply_division_to_phi = register("phi", defaults=DECODER_DEFAULTS, training_cache=TrainingCache.DECODER)(encoder_patcher())
