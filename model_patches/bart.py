"""BART family (bart, mbart): encoder-decoder with LayerNorm (post-LN in BART, pre-LN in mBART),
GELU MLP, self- and cross-attention through the attention interface. The cross-attention keys
and values are projections of the encoder output, which is kept compressed once and shared by
every decoder layer's k and v projections (hf_division/autograd/store.py)."""
from hf_division.registry import TrainingCache, register

from .common import encoder_patcher

apply_division_to_bart = register("bart", "mbart", training_cache=TrainingCache.ENCODER_DECODER)(encoder_patcher())
