"""`apply_division` / `remove_division`: instance-level, reversible, idempotent patching.

Patching replaces the ``forward`` of individual module *instances* (never classes, never the
module tree), so state dicts, checkpoints and other instances are untouched, and restoring is
deleting the instance attribute again. Which modules get which treatment is decided per
architecture by ``model_patches`` (a ``model_type -> function`` registry, as in Liger-Kernel).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from . import attention
from .config import DivisionConfig
from .functions import DropoutFn, LinearFn, RecomputeFn

STATE_ATTR = "_division_state"


@dataclass
class _State:
    config: DivisionConfig
    modules: list = field(default_factory=list)  # (module, previous instance forward or None)
    attn: list = field(default_factory=list)  # (config object, previous attn implementation)


def _training(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


# ----------------------------------------------------------------------------- module wrappers
def _wrap(state: _State, module: nn.Module, make_forward) -> None:
    previous = module.__dict__.get("forward")
    if getattr(getattr(previous, "__func__", None), "_division", False):
        return  # already ours (a shared module reached twice)
    orig = module.forward
    new = make_forward(orig)
    new._division = True
    module.forward = types.MethodType(new, module)
    state.modules.append((module, previous))


def patch_linear(state: _State, module: nn.Module, kind: str = "linear") -> None:
    """``nn.Linear``-like module: input kept compressed for the weight gradient."""
    config = state.config

    def make(orig):
        def forward(self, x):
            if _training(self) and self.weight.requires_grad and config.bits(kind):
                return LinearFn.apply(x, self.weight, self.bias, config, kind)
            return orig(x)

        return forward

    _wrap(state, module, make)


def patch_recompute(state: _State, module: nn.Module, kind: str) -> None:
    """Norm or activation module ``y = f(x)``: input kept compressed, f recomputed in backward."""
    config = state.config
    params = tuple(module.parameters(recurse=False))

    def make(orig):
        def forward(self, x):
            if _training(self) and config.bits(kind) and (x.requires_grad or any(p.requires_grad for p in params)):
                return RecomputeFn.apply(orig, config, kind, x, *params)
            return orig(x)

        return forward

    _wrap(state, module, make)


def patch_dropout(state: _State, module: nn.Dropout) -> None:
    """Dropout: mask kept as bits instead of a float tensor."""
    config = state.config

    def make(orig):
        def forward(self, x):
            if _training(self) and config.dropout_bits and 0 < self.p < 1 and not self.inplace and x.requires_grad:
                return DropoutFn.apply(x, self.p)
            return orig(x)

        return forward

    _wrap(state, module, make)


def patch_modules(state: _State, root: nn.Module, norm_types=(nn.LayerNorm,), activation_types=()) -> None:
    """The shared wiring: every Linear, norm, activation and Dropout below ``root``."""
    for module in root.modules():
        if isinstance(module, nn.Linear):
            patch_linear(state, module)
        elif isinstance(module, norm_types):
            patch_recompute(state, module, "norm")
        elif isinstance(module, activation_types):
            patch_recompute(state, module, "activation")
        elif isinstance(module, nn.Dropout):
            patch_dropout(state, module)


def use_attention_interface(state: _State, model: nn.Module) -> None:
    """Route the model's attention through ``division_<impl>`` (see hf_division.attention)."""
    for module in model.modules():
        module.__dict__[attention.CONFIG_ATTR] = state.config
    state.attn = attention.switch(model)


# ----------------------------------------------------------------------------- public API
def unwrap(model: nn.Module) -> nn.Module:
    """The ``PreTrainedModel`` inside PEFT, DDP/FSDP-style (``.module``) or compiled wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module) and not hasattr(model, "config"):
            model = model.module
    return model


def supported_model_types() -> list[str]:
    from model_patches import PATCHERS

    return sorted(PATCHERS)


def apply_division(model: nn.Module, config: DivisionConfig | None = None) -> nn.Module:
    """Compress the activations ``model`` keeps for backward during training. In place.

    ``model``: a ``PreTrainedModel`` or a wrapper of one (PEFT, DDP, ``torch.compile``).
    Calling it again with the same config does nothing; with another config, re-patches.
    Raises ``ValueError`` for a model type without a patcher.
    """
    from model_patches import PATCHERS

    config = DivisionConfig() if config is None else config
    if not isinstance(config, DivisionConfig):
        raise TypeError(f"config must be a DivisionConfig, got {type(config).__name__}")
    base = unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in PATCHERS:
        raise ValueError(
            f"hf-division has no patcher for model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    current = base.__dict__.get(STATE_ATTR)
    if current is not None:
        if current.config == config:
            return model
        remove_division(base)
    state = _State(config)
    try:
        PATCHERS[model_type](base, state)
    except BaseException:
        _undo(base, state)
        raise
    base.__dict__[STATE_ATTR] = state
    return model


def remove_division(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_division` exactly; a no-op on an unpatched model."""
    base = unwrap(model)
    state = base.__dict__.pop(STATE_ATTR, None)
    if state is not None:
        _undo(base, state)
    return model


def division_config_of(model: nn.Module) -> DivisionConfig | None:
    state = unwrap(model).__dict__.get(STATE_ATTR)
    return None if state is None else state.config


def _undo(base: nn.Module, state: _State) -> None:
    for module, previous in reversed(state.modules):
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
    attention.restore(state.attn)
    for module in base.modules():
        module.__dict__.pop(attention.CONFIG_ATTR, None)
