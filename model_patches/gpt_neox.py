"""GPT-NeoX (Pythia): LayerNorm, GELU MLP, fused qkv projection with partial rotary, through the
attention interface; parallel residual changes nothing about what is saved."""
from hf_division.registry import TrainingCache, register

from .common import DECODER_DEFAULTS, encoder_patcher

apply_division_to_gpt_neox = register("gpt_neox", defaults=DECODER_DEFAULTS, training_cache=TrainingCache.DECODER)(encoder_patcher())
