"""DistilBERT: same blocks as BERT under other names (q_lin/k_lin/v_lin, sa_layer_norm, ffn)."""
from .bert import apply_division_to_bert

# Nothing differs in what is saved: the shared wiring finds DistilBERT's Linear, LayerNorm,
# activation and Dropout modules by type and its attention goes through the same interface.
apply_division_to_distilbert = apply_division_to_bert
