"""DistilBERT: BERT's blocks under other names (q_lin/k_lin/v_lin, sa_layer_norm, ffn)."""
from hf_division.registry import register

from .common import ENCODER_DEFAULTS, encoder_patcher

apply_division_to_distilbert = register("distilbert", defaults=ENCODER_DEFAULTS)(encoder_patcher())
