"""Pieces the architecture patchers share: patcher factories and the measured family defaults."""
import functools

import torch
from torch import nn
from transformers.activations import ACT2CLS

from hf_division.patching.checkpointing import patch_recomputed
from hf_division.patching.primitives import (
    patch_gated_body, patch_gated_mlp, patch_modules, patch_rotary, patch_saved, use_attention_interface,
)
from hf_division.patching.wrappers import config_for

#: activation modules Transformers builds from ``config.hidden_act``
ACTIVATIONS = tuple({cls if isinstance(cls, type) else cls[0] for cls in ACT2CLS.values()})

#: Pretrained decoder LLMs need more bits for what feeds the attention recomputation and the MLP
#: activation: measured on real SmolLM2-135M (docs/ARCHITECTURES.md, "Real pretrained decoder weights"; command:
#: ``python -m hf_division.bench family --smollm2 ...``). Random-init models cannot show it, so the
#: other decoder families take the measured Llama setting by analogy. T5 too: it does not scale q.k
#: by 1/sqrt(d), and gated-GELU T5 (v1.1, Flan) needed 8 bits there as well.
DECODER_DEFAULTS = {"attention_bits": 8, "activation_bits": 8}
#: Gated-MLP decoders (Llama, Mistral, Qwen, Phi-3, Gemma): the gate and up inputs at 4 bits in
#: groups of 32 tokens without an LFC, which on real SmolLM2 cost about the bytes of 4 bits with
#: the LFC and a fraction of its gradient error, 8 bits in the first 40% and the last 5% of the
#: layers; Linear inputs (o_proj's) in groups of 32 tokens without an LFC, likewise; norm inputs
#: (which the q/k/v and gate/up weight gradients read) in groups of 32 tokens with the LFC
#: (docs/DESIGN.md, "Policy"; docs/RESULTS.md, "Real decoder weights: SmolLM2-135M" and "Short
#: padded texts"). T5, GPT-2 and OPT keep ``DECODER_DEFAULTS``.
GATED_DECODER_DEFAULTS = {**DECODER_DEFAULTS, "activation_bits": 4, "activation_group_size": 32,
                          "activation_block_size": 1, "early_layers": 0.4, "late_layers": 0.05,
                          "linear_group_size": 32, "linear_block_size": 1, "norm_group_size": 32}
#: Hidden width from which a gated decoder keeps its gate and up inputs at 8 bits in every layer.
#: Their 4-bit rounding noise reaches every earlier layer's gradient through the MLP's backward, and
#: on random-init models of published shapes that path weighs more the wider the model: from this
#: width the 4-bit middle layers put the whole gradient at the cosine bar, below it they keep it
#: well above, and with 8 bits the wide shapes still save more bytes than the narrow ones
#: (docs/DESIGN.md, "Policy", "Wide gated decoders"; docs/RESULTS.md, "The Llama-1B shape's cosine").
WIDE_GATED_HIDDEN = 1536


def gated_by_shape(model_config) -> dict:
    """The gated decoders' defaults that depend on the model's shape: 8-bit gate and up inputs in
    every layer from :data:`WIDE_GATED_HIDDEN` wide (the text config's ``hidden_size``)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    wide = (getattr(text, "hidden_size", None) or 0) >= WIDE_GATED_HIDDEN
    return {"activation_bits": 8} if wide else {}


#: BERT-family encoders: no token of real MiniLM's activations reaches the outlier ratio (the bytes
#: held are the same with and without the search), and the search is one more pass over every
#: saved tensor: skipped. No LFC: at 4 bits the block means bought no gradient fidelity on real
#: MiniLM and cost one bit per element, a fifth of the bytes (docs/DESIGN.md, "Policy"; docs/RESULTS.md,
#: "Precision policy on MiniLM").
ENCODER_DEFAULTS = {"outlier_ratio": 0.0, "block_size": 1}


def encoder_patcher(norm_types=(nn.LayerNorm,), conv1d_types=()):
    """Patcher for models whose blocks are Linear/Conv1D, norm, activation, Dropout + attention."""

    def apply(model, state):
        patch_modules(state, model, norm_types=norm_types, activation_types=ACTIVATIONS, conv1d_types=conv1d_types)
        use_attention_interface(state, model)

    return apply


def with_patches(base, *pairs):
    """Patcher: ``patch(state, module)`` on every module of each ``(module type, patch)`` pair,
    then ``base`` (the shared wiring: modules a family patches itself keep that patch)."""

    def apply(model, state):
        for module in model.modules():
            for module_type, patch in pairs:
                if isinstance(module, module_type):
                    patch(state, module)
        base(model, state)

    return apply


def gated_decoder_patcher(norm_type, mlp_type, up_first=False, attention_type=()):
    """Patcher for Llama-style decoders: ``norm_type`` (RMSNorm variants), gated ``mlp_type`` and
    ``attention_type``, whose modeling file's rotary embedding runs as one native pass each way in
    training (:func:`~hf_division.patching.primitives.patch_rotary`)."""

    return with_patches(encoder_patcher(norm_types=(nn.LayerNorm, norm_type)),
                        (mlp_type, functools.partial(patch_gated_mlp, up_first=up_first)),
                        (attention_type, patch_rotary))


def moe_patcher(norm_type, mlp_type, experts_type, router_type, attention_type=()):
    """Patcher for mixture-of-experts decoders (Mixtral, Qwen-MoE): a Llama-style decoder whose
    MLP is a router plus experts stored as 3-D parameters. The experts index their weights and
    gather their tokens instead of calling ``nn.Linear``, and Transformers dispatches them to one
    of several kernels (``experts_implementation``), so what they save is caught where autograd
    saves it (:func:`~hf_division.patching.primitives.patch_saved`), kernel-agnostic. Their gate/up/product
    tensors take the gated-MLP policy (``activation``); the router's input is a linear input."""

    return with_patches(gated_decoder_patcher(norm_type, mlp_type, attention_type=attention_type),
                        (experts_type, functools.partial(patch_saved, kind="activation")),
                        (router_type, functools.partial(patch_saved, kind="linear")))


def _t5_gated_ff(ff, x, product):
    """``wo(dropout(act(wi_0(x)) * wi_1(x)))``: gate and up kept compressed once, product derived."""
    h = ff.dropout(product(ff.wi_0(x), ff.wi_1(x)))
    if h.dtype != ff.wo.weight.dtype and ff.wo.weight.dtype != torch.int8:
        h = h.to(ff.wo.weight.dtype)  # T5 keeps ``wo`` in float32 (as the original forward)
    return ff.wo(h)


def patch_t5_gated_ff(state, ff: nn.Module) -> None:
    """T5's gated-GELU feed-forward (``wi_0``, ``wi_1``, ``dropout``, ``wo``, ``act``; T5 v1.1,
    mT5, umT5, LongT5): :func:`~hf_division.patching.primitives.patch_gated_body` around it."""
    patch_gated_body(state, ff, ff.act, _t5_gated_ff)


def patch_inline_attention(state, attention: nn.Module) -> None:
    """An attention computed inline, outside Transformers' attention interface: what autograd saves
    inside it kept compressed where it is saved (``patch_saved``, the ``attention`` kind), or, with
    ``recompute_inline_attention``, the module run again in backward from its input
    (``patch_recomputed``): several times fewer bytes for a quarter more step time
    (docs/RESULTS.md, "Long-input attentions"). Only for a module whose random draws are torch's
    (its dropout): the recomputation replays those and no others."""
    if config_for(state, attention).recompute_inline_attention:
        patch_recomputed(state, attention)
    else:
        patch_saved(state, attention, "attention")
