"""Replacing the ``forward`` of one module instance, and keeping that reversible: the record of what
was replaced (:class:`PatchState`), the wrappers' own copies in ``DataParallel`` replicas, wrappers
another library removed since (:func:`forget_lost`), and the undo (docs/DESIGN.md, "Patching,
registry and families"). The primitives in :mod:`.primitives` are built on :func:`wrap_forward`.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_division.config import DivisionConfig
from hf_division.autograd.store import active


@dataclass
class PatchState:
    """What division changed on one model: its config and every replaced ``forward``."""

    config: DivisionConfig
    modules: list = field(default_factory=list)  # (module, previous instance forward or None)
    n_modules: int = 0  # size of the module tree when last patched
    attn: list = field(default_factory=list)  # config objects switched to division attention
    names: dict = field(default_factory=dict)  # id(module) -> name in the model (for module_bits)
    losses: list = field(default_factory=list)  # models whose ``loss_function`` was set
    rotary: dict = field(default_factory=dict)  # modeling module name -> finalizer that uninstalls its wrapper
    declined: set = field(default_factory=set)  # Linear subclasses left exact, warned about once each
    modes: dict = field(default_factory=dict)  # a training forward's signature -> whether ForwardMode routed in it
    forwards: int = 0  # training forwards run by the root
    recorded_checkpoint: bool = False  # the family's ``CheckpointForward`` is ``AS_CHECKPOINTED``
    checkpoint_exact: frozenset = frozenset()  # the family's ``checkpoint_exact``


def layer_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s layers (Transformers' checkpointable layers), input first."""
    return [name for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]


def config_for(state: PatchState, module: nn.Module) -> DivisionConfig:
    """The config ``module`` uses: ``state.config`` with its ``module_bits`` overrides resolved."""
    if not state.config.override_names():
        return state.config
    return state.config.for_module(state.names.get(id(module), ""))


def in_training(module: nn.Module) -> bool:
    """Whether ``module`` runs a forward whose saved tensors should be compressed now."""
    return module.training and active()


def unpatched_forward(module: nn.Module):
    """``module``'s class forward bound to it: what a recomputation in backward calls (never a
    patched instance forward, which would compress again)."""
    return types.MethodType(type(module).forward, module)


def _wrapped(module: nn.Module) -> bool:
    """Whether ``module``'s instance forward is one of ours."""
    return getattr(getattr(module.__dict__.get("forward"), "__func__", None), "_division", False)


def wrap_forward(state: PatchState, module: nn.Module, make_forward) -> None:
    """Replace ``module.forward`` by ``make_forward(original forward)`` (bound to ``module``), once:
    a module reached twice (shared) keeps the first wrapper. A replica made by ``DataParallel``
    (``_replicate_for_data_parallel``, which copies the instance dict) gets a wrapper of its own
    around its own original forward (:func:`_replicate`)."""
    previous = module.__dict__.get("forward")
    if _wrapped(module):
        return  # already ours (a shared module reached twice)
    _install(module, module.forward, make_forward)
    module.__dict__[REPLICATE] = types.MethodType(_replicate, module)
    state.modules.append((module, previous))


#: the ``nn.Module`` method ``DataParallel``'s ``replicate`` calls on every module
REPLICATE = "_replicate_for_data_parallel"


def _install(module: nn.Module, orig, make_forward) -> None:
    new = make_forward(orig)
    new._division = True
    new._division_make, new._division_orig = make_forward, orig
    # keep the original signature visible (the Trainer picks dataset columns from it)
    new.__wrapped__ = getattr(orig, "__func__", orig)
    module.__dict__["forward"] = types.MethodType(new, module)


def _replicate(self: nn.Module) -> nn.Module:
    """``nn.Module._replicate_for_data_parallel`` for a patched module: the replica shares this
    module's instance dict, so its forward would be this module's wrapper, running this module's
    original forward on this module's parameters; it gets its own, around its own forward."""
    replica = type(self)._replicate_for_data_parallel(self)
    if not _wrapped(self):  # another library removed our forward since: nothing of ours to carry over
        replica.__dict__.pop(REPLICATE, None)
        return replica
    wrapper = self.__dict__["forward"].__func__
    orig = wrapper._division_orig
    if isinstance(orig, types.MethodType) and orig.__self__ is self:
        orig = types.MethodType(orig.__func__, replica)
    _install(replica, orig, wrapper._division_make)
    replica.__dict__[REPLICATE] = types.MethodType(_replicate, replica)
    return replica


def forget_lost(state: PatchState) -> bool:
    """Drop the records of modules whose forward is no longer ours, so that patching again wraps
    what they run now; whether there were any.

    Why: Transformers' hub-kernel support (``use_kernels``, on for models from ``from_pretrained``
    where the ``kernels`` package is installed) re-kernelizes the layers it marks (activations,
    RMSNorm) at every train/eval switch and removes their instance forward where no kernel applies,
    ours included: a model patched in eval mode lost them at the Trainer's first ``model.train()``."""
    if all(_wrapped(m) for m, _ in state.modules):  # every training forward asks: no list built
        return False
    state.modules[:] = [(m, previous) for m, previous in state.modules if _wrapped(m)]
    return True


def restore_forward(module: nn.Module, previous) -> None:
    """Undo one :func:`wrap_forward`: ``previous`` is the instance forward it replaced (None: none)."""
    module.__dict__.pop(REPLICATE, None)
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous


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
