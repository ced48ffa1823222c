"""Division through Transformers' attention interface.

For a model using attention implementation ``impl`` ("eager", "sdpa", ...), we register
``division_<impl>`` in ``ALL_ATTENTION_FUNCTIONS`` (and the same mask function in
``ALL_MASK_ATTENTION_FUNCTIONS``) and point the model's config at it. The registered function calls
the original one, so the forward is bit-identical, but keeps only compressed q/k/v for backward.
"""
from __future__ import annotations

import sys
import weakref

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from hf_division.autograd.accounting import account_tensors
from hf_division.autograd.ops import AttentionFn
from hf_division.autograd.store import active, keep_mask

PREFIX = "division_"
CONFIG_ATTR = "_division_config"  # set on each module of a patched model
#: Transformers' attention functions that draw random numbers only for their ``dropout``
#: argument (default 0): called without dropout, they draw none (a model's own eager function
#: may draw anywhere, so it is not here)
DRAWS_ONLY_FOR_DROPOUT = frozenset({"sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4"})


def original_attention(impl: str, module: torch.nn.Module):
    """The attention function the unpatched model would call for ``module``."""
    if impl == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise TypeError(f"{type(module).__name__} has no eager_attention_forward in its modeling file")
        return fn
    return ALL_ATTENTION_FUNCTIONS[impl]


def _make(impl: str):
    def division_attention(module, query, key, value, attention_mask, **kwargs):
        orig = original_attention(impl, module)
        config = getattr(module, CONFIG_ATTR, None)
        # tensor arguments that need a gradient (T5's relative position bias) become inputs of
        # AttentionFn: captured in ``call`` only, their gradient would be lost
        names = [n for n, t in kwargs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        extra = [kwargs[n] for n in names]
        if (
            config is None
            or config.bits("attention") == 0
            or not (active() and module.training)
            or not any(t.requires_grad for t in (query, key, value, *extra))
            or kwargs.get("output_attentions")
        ):
            return orig(module, query, key, value, attention_mask, **kwargs)
        bits = keep_mask(attention_mask) if isinstance(attention_mask, torch.Tensor) else None
        mask = [attention_mask]  # the forward reads the mask itself; backward its bits, if held so
        held = ([] if bits is not None else mask) + [t for t in kwargs.values() if isinstance(t, torch.Tensor) and not t.requires_grad]
        account_tensors([t for t in held if isinstance(t, torch.Tensor)], "attention")

        def call(q, k, v, *ex):
            m = mask[0] if mask else bits.take()
            return orig(module, q, k, v, m, **{**kwargs, **dict(zip(names, ex))})[0]

        draws = impl not in DRAWS_ONLY_FOR_DROPOUT or kwargs.get("dropout", 0.0) != 0
        out = AttentionFn.apply(query, key, value, call, config, draws, *extra)
        if bits is not None:
            mask.clear()
        return out, None

    division_attention.__name__ = f"{PREFIX}{impl}"
    return division_attention


def register(impl: str) -> str:
    """Register ``division_<impl>`` once; return its name."""
    if impl.startswith(PREFIX):
        return impl
    name = PREFIX + impl
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make(impl))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS and impl in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


def text_configs(config) -> list:
    """The config and its sub-configs that carry an attention implementation."""
    found = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            found.append(sub)
    return found


def configs_of(model) -> list:
    """``text_configs`` plus any other config object a submodule reads its attention
    implementation from (T5's encoder and decoder stacks each hold a copy of the model config)."""
    found = text_configs(model.config)
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if hasattr(cfg, "_attn_implementation_internal") and all(cfg is not f for f in found):
            found.append(cfg)
    return found


#: id(config) -> [weak reference to the config, its implementation before the first switch, patched models using it]:
#: models built from one config object (``type(m)(m.config)``) share it, so the config goes back
#: to its own implementation only when the last of them is unpatched
_switched: dict[int, list] = {}


def switch(model) -> list:
    """Point every config of ``model`` at its division twin; return the configs to :func:`restore`."""
    saved = []
    for cfg in configs_of(model):
        record = _switched.get(id(cfg))
        if record is None or record[0]() is not cfg:
            record = _switched[id(cfg)] = [weakref.ref(cfg), cfg._attn_implementation_internal, 0]
            cfg._attn_implementation_internal = register(cfg._attn_implementation or "eager")
        record[2] += 1
        saved.append(cfg)
    return saved


def restore(saved: list) -> None:
    """Undo one :func:`switch`: each config returns to its implementation once no model uses it."""
    for cfg in saved:
        record = _switched.get(id(cfg))
        if record is None or record[0]() is not cfg:
            continue
        record[2] -= 1
        if record[2] <= 0:
            cfg._attn_implementation_internal = record[1]
            del _switched[id(cfg)]
