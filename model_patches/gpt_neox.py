"""GPT-NeoX (Pythia): LayerNorm, GELU MLP, fused qkv projection with partial rotary, through the
attention interface; parallel residual changes nothing about what is saved."""
from hf_division.registry import register

from .common import DECODER_DEFAULTS, encoder_patcher

apply_division_to_gpt_neox = register("gpt_neox", defaults=DECODER_DEFAULTS, dynamic_cache=True)(encoder_patcher())
