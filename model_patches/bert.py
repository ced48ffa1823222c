"""BERT family (bert, roberta, xlm-roberta, camembert, electra): post-LN encoder, GELU MLP, all heads."""
from hf_division.registry import register

from .common import ENCODER_DEFAULTS, encoder_patcher

apply_division_to_bert = register("bert", "roberta", "xlm-roberta", "camembert", "electra", defaults=ENCODER_DEFAULTS)(
    encoder_patcher()
)
