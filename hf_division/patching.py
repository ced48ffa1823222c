"""`apply_division` / `remove_division`: instance-level, reversible, idempotent patching.

Patching replaces the ``forward`` of individual module *instances* (never classes, never the
module tree), so state dicts, checkpoints and other instances are untouched, and restoring is
deleting the instance attribute again. Which modules get which treatment is decided per
architecture by ``model_patches`` (a ``model_type -> function`` registry, as in Liger-Kernel).
"""
from __future__ import annotations

import contextlib
import functools
import types
import warnings
from dataclasses import dataclass, field

from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_layers import GradientCheckpointingLayer

from . import attention, store
from .config import DivisionConfig
from .functions import BitDropout, CheckpointFn, GatedFn, LinearFn, RecomputeFn

STATE_ATTR = "_division_state"


@dataclass
class _State:
    config: DivisionConfig
    modules: list = field(default_factory=list)  # (module, previous instance forward or None)
    n_modules: int = 0  # size of the module tree when last patched
    attn: list = field(default_factory=list)  # (config object, previous attn implementation)
    names: dict = field(default_factory=dict)  # id(module) -> name in the model (for module_bits)


def config_for(state: _State, module: nn.Module) -> DivisionConfig:
    """The config ``module`` uses: ``state.config`` with its ``module_bits`` overrides resolved."""
    if not state.config.override_names():
        return state.config
    return state.config.for_module(state.names.get(id(module), ""))


def _training(module: nn.Module) -> bool:
    return module.training and store.active()


# ----------------------------------------------------------------------------- module wrappers
def _wrap(state: _State, module: nn.Module, make_forward) -> None:
    previous = module.__dict__.get("forward")
    if getattr(getattr(previous, "__func__", None), "_division", False):
        return  # already ours (a shared module reached twice)
    orig = module.forward
    new = make_forward(orig)
    new._division = True
    # keep the original signature visible (the Trainer picks dataset columns from it)
    new.__wrapped__ = getattr(orig, "__func__", orig)
    module.forward = types.MethodType(new, module)
    state.modules.append((module, previous))


def patch_linear(state: _State, module: nn.Module, transposed: bool = False, kind: str = "linear") -> None:
    """``nn.Linear`` (or, ``transposed``, GPT-2's ``Conv1D``): input kept compressed for the
    weight gradient."""
    config = config_for(state, module)

    def make(orig):
        def forward(self, x):
            if _training(self) and self.weight.requires_grad and config.bits(kind):
                return LinearFn.apply(x, self.weight, self.bias, orig, transposed, config, kind)
            return orig(x)

        return forward

    _wrap(state, module, make)


#: activations whose gradient is the sign of the input: keep that sign exactly
KINKED = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh)


def patch_recompute(state: _State, module: nn.Module, kind: str) -> None:
    """Norm or activation module ``y = f(x)``: input kept compressed, f recomputed in backward."""
    config = config_for(state, module)
    params = tuple(module.parameters(recurse=False))
    exact_sign = isinstance(module, KINKED) or type(module).__name__ == "ReLUSquaredActivation"

    def make(orig):
        def forward(self, x):
            if _training(self) and config.bits(kind) and (x.requires_grad or any(p.requires_grad for p in params)):
                return RecomputeFn.apply(orig, config, kind, exact_sign, x, *params)
            return orig(x)

        return forward

    _wrap(state, module, make)


def patch_gated_mlp(state: _State, mlp: nn.Module, up_first: bool = False) -> None:
    """Gated MLP ``down(act(gate(x)) * up(x))`` (Llama, Mistral, Qwen, Gemma): gate and up kept
    compressed once, their product derived. ``mlp`` has ``gate_proj``, ``up_proj``, ``down_proj``
    and ``act_fn``; Phi-3's fused ``gate_up_proj`` is handled with ``up_first`` by its patcher."""
    config = config_for(state, mlp)
    act = mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn
    act_forward = types.MethodType(type(act).forward, act)  # unpatched: recomputed under autograd

    def make(orig):
        def forward(self, x):
            if not (_training(self) and config.bits("activation")):
                return orig(x)
            if hasattr(self, "gate_up_proj"):
                gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            return self.down_proj(GatedFn.apply(act_forward, up_first, config, gate, up))

        return forward

    _wrap(state, mlp, make)


def patch_root(state: _State, model: nn.Module, repatch) -> None:
    """The model's own forward: in training, (1) modules added after patching (PEFT's
    ``get_peft_model`` after ``apply_division`` adds ``lora_A``/``lora_B``) get patched before they
    run, by calling ``repatch`` when the module count changed; (2) every dropout, ``nn.Dropout`` or
    functional (OPT calls ``F.dropout`` directly), keeps its mask as bits: the forward runs under a
    ``TorchFunctionMode`` that routes ``F.dropout`` to :class:`DropoutFn`."""
    config = state.config
    state.n_modules = sum(1 for _ in model.modules())

    def make(orig):
        def forward(self, *args, **kwargs):
            if not _training(self):
                return orig(*args, **kwargs)
            if sum(1 for _ in self.modules()) != state.n_modules:
                repatch()
            if not config.dropout_bits:
                return orig(*args, **kwargs)
            with BitDropout():
                return orig(*args, **kwargs)

        return forward

    _wrap(state, model, make)


def patch_checkpointing(state: _State, model: nn.Module) -> None:
    """Layers Transformers checkpoints (``GradientCheckpointingLayer`` with checkpointing on, e.g.
    ``activation_checkpointing_enable(every_n_layers=...)``) run through :class:`CheckpointFn`:
    the boundary input is kept compressed instead of whole, and the recomputation in backward
    saves nothing compressed. Checked at call time, so enabling checkpointing later works too."""

    def make(orig, config):
        def forward(self, *args, **kwargs):
            if getattr(self, "gradient_checkpointing", False) and _training(self):
                inner = type(self).forward.__wrapped__  # the layer's forward without checkpointing
                return CheckpointFn.apply(functools.partial(inner, self, **kwargs), config, *args)
            return orig(*args, **kwargs)

        return forward

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            _wrap(state, module, functools.partial(make, config=config_for(state, module)))


def patch_modules(
    state: _State, root: nn.Module, norm_types=(nn.LayerNorm,), activation_types=(), conv1d_types=()
) -> None:
    """The shared wiring: every Linear (and Conv1D), norm and activation below ``root``."""
    for module in root.modules():
        if isinstance(module, nn.Linear):
            patch_linear(state, module)
        elif isinstance(module, conv1d_types):
            patch_linear(state, module, transposed=True)
        elif isinstance(module, norm_types):
            patch_recompute(state, module, "norm")
        elif isinstance(module, activation_types):
            patch_recompute(state, module, "activation")


def use_attention_interface(state: _State, model: nn.Module) -> None:
    """Route the model's attention through ``division_<impl>`` (see hf_division.attention)."""
    for module in model.modules():
        module.__dict__[attention.CONFIG_ATTR] = config_for(state, module)
    if not state.attn:  # switched once; re-patching (new modules) must not switch again
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
    from model_patches.generic import apply_division_generic

    config = DivisionConfig() if config is None else config
    if not isinstance(config, DivisionConfig):
        raise TypeError(f"config must be a DivisionConfig, got {type(config).__name__}")
    base = unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    patcher = PATCHERS.get(model_type)
    if patcher is None:
        if not (config.generic_fallback and isinstance(getattr(base, "config", None), PretrainedConfig)):
            raise ValueError(
                f"hf-division has no patcher for model_type {model_type!r}; supported: "
                f"{', '.join(supported_model_types())} (or DivisionConfig(generic_fallback=True) to try the generic one)"
            )
        warnings.warn(
            f"hf-division: no patcher for model_type {model_type!r}; using the generic fallback "
            "(Linear/Conv1D, norm and activation inputs, attention if it uses the attention interface)"
        )
        patcher = apply_division_generic
    config = config.resolved(model_type)
    current = base.__dict__.get(STATE_ATTR)
    if current is not None:
        if current.config == config:
            _patch_new_modules(base, current, patcher)  # e.g. adapters added since
            return model
        remove_division(base)
    state = _State(config, names={id(m): name for name, m in base.named_modules()})
    unknown = [n for n in config.override_names() if n not in state.names.values()]
    if unknown:
        raise ValueError(
            f"DivisionConfig.module_bits names modules that {type(base).__name__} does not have: {unknown[:5]}"
        )
    try:
        _patch_all(base, state, patcher)
        patch_root(state, base, lambda: _patch_new_modules(base, state, patcher))
    except BaseException:
        _undo(base, state)
        raise
    base.__dict__[STATE_ATTR] = state
    return model


def _patch_all(base: nn.Module, state: _State, patcher) -> None:
    patcher(base, state)
    patch_checkpointing(state, base)


def _patch_new_modules(base: nn.Module, state: _State, patcher) -> None:
    """Patch modules added after :func:`apply_division` (already patched ones are skipped)."""
    done = len(state.modules)
    try:
        _patch_all(base, state, patcher)
    except BaseException:  # leave the model as it was before this call
        for module, previous in reversed(state.modules[done:]):
            _restore(module, previous)
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
    state = unwrap(model).__dict__.get(STATE_ATTR)
    return None if state is None else state.config


def _undo(base: nn.Module, state: _State) -> None:
    for module, previous in reversed(state.modules):
        _restore(module, previous)
    attention.restore(state.attn)
    for module in base.modules():
        module.__dict__.pop(attention.CONFIG_ATTR, None)


def _restore(module: nn.Module, previous) -> None:
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous
