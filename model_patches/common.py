"""Pieces the architecture patchers share."""
from torch import nn
from transformers.activations import ACT2CLS

from hf_division.patching import patch_gated_mlp, patch_modules, use_attention_interface

#: activation modules Transformers builds from ``config.hidden_act``
ACTIVATIONS = tuple({cls if isinstance(cls, type) else cls[0] for cls in ACT2CLS.values()})


def encoder_patcher(norm_types=(nn.LayerNorm,), conv1d_types=()):
    """Patcher for models whose blocks are Linear/Conv1D, norm, activation, Dropout + attention."""

    def apply(model, state):
        patch_modules(state, model, norm_types=norm_types, activation_types=ACTIVATIONS, conv1d_types=conv1d_types)
        use_attention_interface(state, model)

    return apply


def gated_decoder_patcher(norm_type, mlp_type, up_first=False):
    """Patcher for Llama-style decoders: ``norm_type`` (RMSNorm variants) and gated ``mlp_type``."""

    def apply(model, state):
        for module in model.modules():
            if isinstance(module, mlp_type):
                patch_gated_mlp(state, module, up_first)
        encoder_patcher(norm_types=(nn.LayerNorm, norm_type))(model, state)

    return apply
