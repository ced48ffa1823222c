"""Generic fallback for model types without a patcher (``DivisionConfig(generic_fallback=True)``).

Finds what the dedicated patchers state by hand: norm classes (a leaf module whose class name
contains "Norm"), gated MLPs (``gate_proj``/``up_proj``/``down_proj`` + ``act_fn``, and a forward
that computes ``down(act(gate(x)) * up(x))`` on a probe: a module that does more keeps its own
forward and its saves compressed where autograd makes them), GPT-2 style
``Conv1D``, and uses the attention interface only if the model's modeling file dispatches through
it. Token axis: the second-to-last dim, as for every patcher.

What those cannot reach keeps its saved tensors compressed where autograd saves them
(:func:`~hf_division.patching.primitives.patch_saved`): attention modules of a model that computes attention
inline (DeBERTa; Falcon before Transformers 5.25), mixture-of-experts blocks (experts held as 3-D
parameters), MLPs that are not the standard gated one (ModernBERT's fused ``Wi``), and modules that run a convolution
front inline (Whisper's encoder). Dedicated patchers do better where they know the op (docs/ARCHITECTURES.md,
"Generic fallback").

``recompute_inline_attention`` does not apply here: a recomputation replays torch's random draws
only, and an unknown attention may draw from elsewhere (BigBird's block-sparse attention picks its
random blocks with NumPy in training), so that backward would differentiate another function.
"""
import sys

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_division.patching.primitives import patch_gated_mlp, patch_modules, patch_saved, use_attention_interface
from hf_division.registry import register_fallback

from .common import ACTIVATIONS

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__ and not any(True for _ in module.children())


def _is_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` has a gated MLP's parts and its own forward is ``down(act(gate(x)) * up(x))``,
    to the bit, on random probes (patching replaces that forward: one that also clamps, scales or
    drops would train another function; issue 42, item 4)."""
    if not all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    gate, up, down, act = module.gate_proj, module.up_proj, module.down_proj, module.act_fn
    if not all(isinstance(m, nn.Linear) for m in (gate, up, down)):
        return False
    weight, g = gate.weight, torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for scale in (1.0, 1e3):  # a small and a large probe: a clamp or a saturation shows in one
                x = (torch.randn(1, 3, gate.in_features, generator=g) * scale).to(weight.device, weight.dtype)
                if not _same(type(module).forward(module, x), down(act(gate(x)) * up(x))):
                    return False
    except Exception:  # noqa: BLE001 - a forward that cannot run the probe (meta tensors, ...) is not proven plain
        return False
    return True


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, NaN where the other is NaN (a large probe may overflow a 16-bit model)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _uses_attention_interface(model: nn.Module) -> bool:
    return any(hasattr(sys.modules[type(m).__module__], "ALL_ATTENTION_FUNCTIONS") for m in model.modules())


def _saved_kind(module: nn.Module, inline_attention: bool) -> str | None:
    """The kind to keep ``module``'s own saves as, or None where the shared wiring covers it."""
    name = type(module).__name__
    if "Moe" in name or "MoE" in name or "Experts" in name:
        return "activation"
    if name.endswith("Attention") and inline_attention:
        return "attention"
    if "MLP" in name and not _is_gated_mlp(module):
        return "activation"
    if any(isinstance(child, _CONVS) for child in module.children()) and not isinstance(module, _CONVS):
        return "activation"  # a convolution front run inline (Whisper's encoder)
    return None


@register_fallback
def apply_division_generic(model, state):
    inline_attention = not _uses_attention_interface(model)
    for module in model.modules():
        if _is_gated_mlp(module):
            patch_gated_mlp(state, module)
    for module in model.modules():
        kind = _saved_kind(module, inline_attention)
        if kind is not None:  # never recomputed here (recompute_inline_attention): see the module doc
            patch_saved(state, module, kind)
    norms = tuple({type(m) for m in model.modules() if _is_norm(m)} | {nn.LayerNorm})
    patch_modules(state, model, norm_types=norms, activation_types=ACTIVATIONS, conv1d_types=(Conv1D,))
    if not inline_attention:
        use_attention_interface(state, model)
