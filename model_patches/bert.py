"""BERT family (bert, roberta, xlm-roberta, electra): post-LN encoder, GELU MLP, all heads."""
from .common import encoder_patcher

apply_division_to_bert = encoder_patcher()
