"""Generic fallback for model types without a patcher (``DivisionConfig(generic_fallback=True)``).

Finds what the dedicated patchers state by hand: norm classes (a leaf module whose class name
contains "Norm"), gated MLPs (``gate_proj``/``up_proj``/``down_proj`` + ``act_fn``), GPT-2 style
``Conv1D``, and uses the attention interface only if the model's modeling file dispatches through
it. Token axis: the second-to-last dim, as for every patcher.
"""
import sys

from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_division.patching import patch_gated_mlp, patch_modules, use_attention_interface
from hf_division.registry import register_fallback

from .common import ACTIVATIONS


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__ and not any(True for _ in module.children())


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _uses_attention_interface(model: nn.Module) -> bool:
    return any(hasattr(sys.modules[type(m).__module__], "ALL_ATTENTION_FUNCTIONS") for m in model.modules())


@register_fallback
def apply_division_generic(model, state):
    for module in model.modules():
        if _is_gated_mlp(module):
            patch_gated_mlp(state, module)
    norms = tuple({type(m) for m in model.modules() if _is_norm(m)} | {nn.LayerNorm})
    patch_modules(state, model, norm_types=norms, activation_types=ACTIVATIONS, conv1d_types=(Conv1D,))
    if _uses_attention_interface(model):  # otherwise the model's own attention keeps its tensors
        use_attention_interface(state, model)
