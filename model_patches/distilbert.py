"""DistilBERT: BERT's blocks under other names (q_lin/k_lin/v_lin, sa_layer_norm, ffn)."""
from .common import encoder_patcher

apply_division_to_distilbert = encoder_patcher()
