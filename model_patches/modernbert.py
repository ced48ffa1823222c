"""ModernBERT: pre-LN encoder with rotary attention through the attention interface (global and
local layers) and a GLU MLP whose gate and input come from one fused projection ``Wi``.

The fused MLP is ``Wo(drop(act(a) * g))`` with ``a, g = Wi(x).chunk(2)``: as a plain module tree
it would keep ``a``, ``act(a)`` and ``g`` whole (the multiply saves both operands). Here the two
halves are kept compressed once and the product derived from them, as for Llama's gated MLP.
"""
from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

from hf_division.patching.primitives import patch_gated_body
from hf_division.registry import register

from .common import ENCODER_DEFAULTS, encoder_patcher, with_patches


def _glu(mlp, hidden_states, product):
    gate, up = mlp.Wi(hidden_states).chunk(2, dim=-1)
    return mlp.Wo(mlp.drop(product(gate, up)))


def _patch_glu(state, mlp: ModernBertMLP) -> None:
    patch_gated_body(state, mlp, mlp.act, _glu)


apply_division_to_modernbert = register("modernbert", defaults=ENCODER_DEFAULTS)(
    with_patches(encoder_patcher(), (ModernBertMLP, _patch_glu))
)
