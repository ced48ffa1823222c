"""`apply_division` / `remove_division`: instance-level, reversible, idempotent patching.

Which modules get which treatment is decided per architecture by ``model_patches`` (each family
registers itself in :mod:`hf_division.registry`, as in Liger-Kernel's registry of apply functions);
the patching itself is the primitives of :mod:`hf_division.patching.primitives` (docs/DESIGN.md, "Patching, registry and families").
"""
from __future__ import annotations

import contextlib
import copy
import types
import warnings

from torch import nn
from transformers import PretrainedConfig

from hf_division.patching.attention import CONFIG_ATTR, restore
from hf_division.config import DivisionConfig
from hf_division.patching.checkpointing import patch_checkpointing
from hf_division.patching.primitives import (
    patch_causal_lm_loss, patch_root, restore_loss_functions, restore_rotary,
)
from hf_division.patching.wrappers import PatchState, layer_names, restore_forward, unwrap
from hf_division.registry import CheckpointForward, TrainingCache, fallback, family, supported_model_types

__all__ = ["apply_division", "remove_division", "restored_division", "division_config_of", "patched_modules",
           "supported_model_types", "unwrap", "patched_again"]

#: instance attribute of the unwrapped model holding its :class:`~hf_division.patching.primitives.PatchState`
STATE_ATTR = "_division_state"
#: instance hooks that make ``copy.deepcopy`` and pickle copy the model unpatched, then patch the copy
COPY_HOOKS = ("__deepcopy__", "__reduce_ex__")


def apply_division(model: nn.Module, config: DivisionConfig | None = None) -> nn.Module:
    """Compress the activations ``model`` keeps for backward during training. In place.

    ``model``: a ``PreTrainedModel`` or a wrapper of one (PEFT, DDP, ``torch.compile``).
    Calling it again with the same config does nothing; with another config, re-patches.
    Raises ``ValueError`` for a model type without a patcher.
    """
    config = DivisionConfig() if config is None else config
    if not isinstance(config, DivisionConfig):
        raise TypeError(f"config must be a DivisionConfig, got {type(config).__name__}")
    base = unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    patcher = _patcher(base, model_type, config)
    config = config.resolved(model_type, getattr(base, "config", None)).with_edge_layers(layer_names(base))
    current = base.__dict__.get(STATE_ATTR)
    if current is not None:
        if current.config == config:
            _patch_new_modules(base, current, patcher)  # e.g. adapters added since
            return model
        remove_division(base)
    found = family(model_type)
    state = PatchState(config, names={id(m): name for name, m in base.named_modules()},
                       recorded_checkpoint=found is not None and found.checkpoint_forward is CheckpointForward.AS_CHECKPOINTED,
                       checkpoint_exact=frozenset(found.checkpoint_exact if found is not None else ()))
    unknown = [n for n in config.override_names() if n not in state.names.values()]
    if unknown:
        raise ValueError(
            f"DivisionConfig.module_bits names modules that {type(base).__name__} does not have: {unknown[:5]}"
        )
    try:
        _patch_all(base, state, patcher)
        patch_root(state, base, lambda: _patch_new_modules(base, state, patcher),
                   training_cache=TrainingCache.NONE if found is None else found.training_cache)
    except BaseException:
        _undo(base, state)
        raise
    base.__dict__[STATE_ATTR] = state
    base.__dict__["__deepcopy__"] = types.MethodType(_deepcopy_patched, base)
    base.__dict__["__reduce_ex__"] = types.MethodType(_reduce_patched, base)
    return model


def _plain_copy(base: nn.Module, memo: dict | None = None):
    """``(deep copy of base as if unpatched, base's config)``; ``base`` is patched again after.

    Why: the patched forwards are closures over the modules they replaced, so a copy of them
    would run the original's modules (docs/GUIDE.md, "Limits and guarantees")."""
    config = division_config_of(base)
    remove_division(base)
    try:
        return copy.deepcopy(base, memo), config
    finally:
        apply_division(base, config)


def _deepcopy_patched(base: nn.Module, memo: dict):
    clone, config = _plain_copy(base, memo)
    return apply_division(clone, config)


def _reduce_patched(base: nn.Module, protocol: int):
    # pickled as "an unpatched copy, patched again on load": the copy holds a second set of
    # weights until pickling ends
    return patched_again, _plain_copy(base)


def patched_again(model: nn.Module, config: DivisionConfig) -> nn.Module:
    """What unpickling a patched model calls: ``apply_division(model, config)``."""
    return apply_division(model, config)


def _patcher(base: nn.Module, model_type: str | None, config: DivisionConfig):
    """The registered patcher of ``model_type``, or the generic one if the config allows it."""
    found = family(model_type)
    if found is not None:
        return found.apply
    generic = fallback()
    if generic is None or not (config.generic_fallback and isinstance(getattr(base, "config", None), PretrainedConfig)):
        raise ValueError(
            f"hf-division has no patcher for model_type {model_type!r}; supported: "
            f"{', '.join(supported_model_types())} (or DivisionConfig(generic_fallback=True) to try the generic one)"
        )
    warnings.warn(
        f"hf-division: no patcher for model_type {model_type!r}; using the generic fallback "
        "(Linear/Conv1D, norm and activation inputs, attention if it uses the attention interface)"
    )
    return generic


def _patch_all(base: nn.Module, state: PatchState, patcher) -> None:
    patch_causal_lm_loss(state, base)  # first: its LM head is not an ordinary Linear
    patcher(base, state)
    patch_checkpointing(state, base)


def _patch_new_modules(base: nn.Module, state: PatchState, patcher) -> None:
    """Patch modules added after :func:`apply_division` (already patched ones are skipped)."""
    done = len(state.modules)
    try:
        _patch_all(base, state, patcher)
    except BaseException:  # leave the model as it was before this call
        for module, previous in reversed(state.modules[done:]):
            restore_forward(module, previous)
        del state.modules[done:]
        raise
    state.n_modules = sum(1 for _ in base.modules())


def remove_division(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_division` exactly; a no-op on an unpatched model."""
    base = unwrap(model)
    state = base.__dict__.pop(STATE_ATTR, None)
    if state is not None:
        _undo(base, state)
    return model


def _undo(base: nn.Module, state: PatchState) -> None:
    for name in COPY_HOOKS:
        base.__dict__.pop(name, None)
    for module, previous in reversed(state.modules):
        restore_forward(module, previous)
    restore(state.attn)
    restore_loss_functions(state)
    restore_rotary(state)
    for module in base.modules():
        module.__dict__.pop(CONFIG_ATTR, None)


@contextlib.contextmanager
def restored_division(model: nn.Module):
    """Run a measurement that patches and unpatches ``model`` freely: afterwards it is patched as
    before (same config, or not at all) and in the train/eval mode it had."""
    before, was_training = division_config_of(model), unwrap(model).training
    try:
        yield before
    finally:
        remove_division(model)
        if before is not None:
            apply_division(model, before)
        model.train(was_training)


def division_config_of(model: nn.Module) -> DivisionConfig | None:
    """The (resolved) config ``model`` is patched with, or None if it is not."""
    state = unwrap(model).__dict__.get(STATE_ATTR)
    return None if state is None else state.config


def patched_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose ``forward`` division replaced (empty if ``model`` is not patched)."""
    state = unwrap(model).__dict__.get(STATE_ATTR)
    return [] if state is None else [module for module, _ in state.modules]
