"""BERT family (bert, roberta, xlm-roberta, electra): post-LN encoder, GELU MLP, all heads."""
from transformers.activations import ACT2CLS

from hf_division.patching import patch_modules, use_attention_interface

#: activation modules Transformers builds from ``config.hidden_act``
ACTIVATIONS = tuple({cls if isinstance(cls, type) else cls[0] for cls in ACT2CLS.values()})


def apply_division_to_bert(model, state):
    patch_modules(state, model, activation_types=ACTIVATIONS)
    use_attention_interface(state, model)
