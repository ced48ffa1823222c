"""The patching primitives ``model_patches`` builds its families from (public, documented).

Patching replaces the ``forward`` of individual module *instances* (never classes, never the
module tree), so state dicts, checkpoints and other instances are untouched, and restoring is
deleting the instance attribute again (:func:`restore_forward`). The one module-level function
replaced, the rotary embedding's (:func:`patch_rotary`), is a wrapper that runs the original outside
a patched attention module's training forward, removed with the last model using it. Each primitive records what it
replaced in a :class:`PatchState`; :mod:`hf_division.api` owns that state's life cycle
(docs/DESIGN.md, "Patching, registry and families").
"""
from __future__ import annotations

import contextlib
import functools
import sys
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_division.patching.attention import CONFIG_ATTR, switch
from hf_division.config import DivisionConfig
from hf_division.autograd.layer_norm import layer_norm, takes as layer_norm_takes
from hf_division.autograd.rms_norm import eps_of as rms_norm_eps, rms_norm, takes as rms_norm_takes
from hf_division.autograd.lm_loss import causal_lm_loss, tag_logits
from hf_division.compress.noise import model_stream
from hf_division.autograd import rotary
from hf_division.autograd.dropout import BitDropout
from hf_division.autograd.ops import CheckpointFn, GatedFn, LinearFn, RecomputeFn
from hf_division.autograd.saved_hooks import compressed_saves
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


# ----------------------------------------------------------------------------- module wrappers
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


def patch_linear(state: PatchState, module: nn.Module, transposed: bool = False, kind: str = "linear") -> None:
    """``nn.Linear`` (or, ``transposed``, GPT-2's ``Conv1D``): input kept compressed for the
    weight gradient."""
    config = config_for(state, module)

    def make(orig):
        def forward(self, x):
            if in_training(self) and self.weight.requires_grad and config.bits(kind):
                return LinearFn.apply(x, self.weight, self.bias, orig, transposed, config, kind)
            return orig(x)

        return forward

    wrap_forward(state, module, make)


#: activations whose gradient is the sign of the input: keep that sign exactly
KINKED = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh)


def patch_recompute(state: PatchState, module: nn.Module, kind: str) -> None:
    """Norm or activation module ``y = f(x)``: input kept compressed, f recomputed in backward
    (``nn.LayerNorm`` through :func:`~hf_division.autograd.layer_norm.layer_norm`: one normalization in backward;
    Llama's RMSNorm, as :func:`~hf_division.autograd.rms_norm.eps_of` finds it, through
    :func:`~hf_division.autograd.rms_norm.rms_norm`: its gradient written out)."""
    config = config_for(state, module)
    exact_sign = isinstance(module, KINKED) or type(module).__name__ == "ReLUSquaredActivation"
    eps = rms_norm_eps(module) if kind == "norm" else None
    names = [name for name, _ in module.named_parameters(recurse=False)]

    def make(orig):
        def forward(self, x):
            # the parameters as they are now, by name: loading with assign=True, to_empty() and FSDP2
            # put new parameter objects in place after patching, and a DataParallel replica holds its
            # own as plain tensors; the gradient must reach those
            params = tuple(p for p in (getattr(self, name) for name in names) if p is not None)
            if in_training(self) and config.bits(kind) and (x.requires_grad or any(p.requires_grad for p in params)):
                if kind == "norm" and layer_norm_takes(self):
                    return layer_norm(self, orig, config, x)
                if kind == "norm" and rms_norm_takes(eps):
                    return rms_norm(self, orig, eps, config, x)
                return RecomputeFn.apply(orig, config, kind, exact_sign, x, *params)
            return orig(x)

        return forward

    wrap_forward(state, module, make)


def patch_gated_mlp(state: PatchState, mlp: nn.Module, up_first: bool = False) -> None:
    """Gated MLP ``down(act(gate(x)) * up(x))`` (Llama, Mistral, Qwen, Gemma): gate and up kept
    compressed once, their product derived. ``mlp`` has ``gate_proj``, ``up_proj``, ``down_proj``
    and ``act_fn``; Phi-3's fused ``gate_up_proj`` is handled with ``up_first`` by its patcher."""
    config = config_for(state, mlp)
    act_forward = unpatched_forward(mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn)

    def make(orig):
        def forward(self, x):
            if not (in_training(self) and config.bits("activation")):
                return orig(x)
            if hasattr(self, "gate_up_proj"):
                gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            return self.down_proj(gated_product(act_forward, up_first, config, gate, up))

        return forward

    wrap_forward(state, mlp, make)


def patch_rotary(state: PatchState, attention: nn.Module) -> None:
    """An attention module whose modeling file rotates q and k with ``apply_rotary_pos_emb``: in
    a training forward that function runs as :class:`~hf_division.autograd.rotary.RotaryFn` (the same values,
    one native pass forward and one backward), where :func:`hf_division.autograd.rotary.matches` found it
    computing what the kernel computes; elsewhere, and in every other model, it is the original."""
    modeling = sys.modules[type(attention).__module__]
    if modeling.__name__ not in state.rotary:
        if not rotary.install(modeling):
            return
        # a model dropped without remove_division releases its use when its state is collected
        state.rotary[modeling.__name__] = weakref.finalize(state, rotary.uninstall, modeling)

    def make(orig):
        def forward(self, *args, **kwargs):
            if not (self.training and torch.is_grad_enabled()) or torch.compiler.is_compiling():
                return orig(*args, **kwargs)
            with rotary.enabled():
                return orig(*args, **kwargs)

        return forward

    wrap_forward(state, attention, make)


def restore_rotary(state: PatchState) -> None:
    """Undo :func:`patch_rotary`'s wrappers of module functions (the instance forwards are in
    ``state.modules``)."""
    for release in state.rotary.values():
        release()  # a finalizer runs once
    state.rotary.clear()


def patch_saved(state: PatchState, module: nn.Module, kind: str) -> None:
    """``module``'s forward, in training, keeps what autograd saves inside it compressed as
    ``kind`` (:func:`~hf_division.autograd.saved_hooks.compressed_saves`): for code the dedicated ops do not
    cover, e.g. mixture-of-experts blocks whose experts are 3-D parameters, whatever
    ``experts_implementation`` dispatches to, or attention computed inline. Submodules patched
    by the other primitives keep their own ops."""
    config = config_for(state, module)

    def make(orig):
        def forward(self, *args, **kwargs):
            if not (in_training(self) and config.bits(kind)):
                return orig(*args, **kwargs)
            with compressed_saves(config, kind):
                return orig(*args, **kwargs)

        return forward

    wrap_forward(state, module, make)


def gated_product(act, up_first: bool, config: DivisionConfig, gate, up):
    """``act(gate) * up`` (``up * act(gate)`` with ``up_first``) keeping only ``gate`` and ``up``,
    compressed, for backward; the product (what the down projection saves) is derived from them.
    ``act``: the activation's :func:`unpatched_forward`. For gated feed-forwards wired differently
    from :func:`patch_gated_mlp` (T5's ``wi_0``/``wi_1``)."""
    return GatedFn.apply(act, up_first, config, gate, up)


def patch_gated_body(state: PatchState, mlp: nn.Module, act: nn.Module, body) -> None:
    """A gated feed-forward wired differently from :func:`patch_gated_mlp` (T5's ``wi_0``/``wi_1``,
    ModernBERT's fused ``Wi``): in a training forward with activation inputs compressed, ``mlp``
    runs ``body(mlp, x, product)``, where ``product(gate, up)`` is :func:`gated_product` with
    ``act``'s unpatched forward (recomputed in backward); otherwise its own forward."""
    config = config_for(state, mlp)
    act_forward = unpatched_forward(act)

    def product(gate, up):
        return gated_product(act_forward, False, config, gate, up)

    def make(orig):
        def forward(self, x):
            if not (in_training(self) and config.bits("activation")):
                return orig(x)
            return body(self, x, product)

        return forward

    wrap_forward(state, mlp, make)


def forget_lost(state: PatchState) -> bool:
    """Drop the records of modules whose forward is no longer ours, so that patching again wraps
    what they run now; whether there were any.

    Why: Transformers' hub-kernel support (``use_kernels``, on for models from ``from_pretrained``
    where the ``kernels`` package is installed) re-kernelizes the layers it marks (activations,
    RMSNorm) at every train/eval switch and removes their instance forward where no kernel applies,
    ours included: a model patched in eval mode lost them at the Trainer's first ``model.train()``."""
    kept = [(m, previous) for m, previous in state.modules if _wrapped(m)]
    lost = len(kept) != len(state.modules)
    state.modules[:] = kept
    return lost


def patch_root(state: PatchState, model: nn.Module, repatch) -> None:
    """The model's own forward: in training, (1) modules added after patching (PEFT's
    ``get_peft_model`` after ``apply_division`` adds ``lora_A``/``lora_B``) get patched before they
    run, by calling ``repatch`` when the module count changed, and modules whose forward another
    library replaced since (:func:`forget_lost`) get patched again; (2) every dropout, ``nn.Dropout`` or
    functional (OPT calls ``F.dropout`` directly), keeps its mask as bits: the forward runs under a
    ``TorchFunctionMode`` that routes ``F.dropout`` to :class:`DropoutFn`; (3) the rounding noise
    comes from the model's own streams (:func:`~hf_division.compress.noise.model_stream`)."""
    config = state.config
    state.n_modules = sum(1 for _ in model.modules())

    def make(orig):
        def forward(self, *args, **kwargs):
            if not in_training(self):
                return orig(*args, **kwargs)
            if sum(1 for _ in self.modules()) != state.n_modules or forget_lost(state):
                repatch()
            with model_stream(self), BitDropout() if config.dropout_bits else contextlib.nullcontext():
                return orig(*args, **kwargs)

        return forward

    wrap_forward(state, model, make)


def patch_checkpointing(state: PatchState, model: nn.Module) -> None:
    """Layers Transformers checkpoints (``GradientCheckpointingLayer`` with checkpointing on, e.g.
    ``activation_checkpointing_enable(every_n_layers=...)``) run through :class:`CheckpointFn`:
    the boundary input is kept compressed instead of whole, and the recomputation in backward
    saves nothing compressed. Checked at call time, so enabling checkpointing later works too."""

    def make(orig, config):
        def forward(self, *args, **kwargs):
            if getattr(self, "gradient_checkpointing", False) and in_training(self):
                inner = type(self).forward.__wrapped__  # the layer's forward without checkpointing
                # keyword tensors that need a gradient (DeBERTa's ``rel_embeddings``, one LayerNorm
                # output shared by every layer) become inputs: captured, each layer's backward would
                # run through their graph again and find it freed
                names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
                run = functools.partial(_call_split, inner, self, len(args), names,
                                        {k: v for k, v in kwargs.items() if k not in names})
                return CheckpointFn.apply(run, config, *args, *(kwargs[k] for k in names))
            return orig(*args, **kwargs)

        return forward

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            wrap_forward(state, module, functools.partial(make, config=config_for(state, module)))


def _call_split(fn, module, n_args: int, names: list, kwargs: dict, *inputs):
    """``fn(module, *inputs[:n_args], **kwargs, **{names: the rest of inputs})``."""
    return fn(module, *inputs[:n_args], **kwargs, **dict(zip(names, inputs[n_args:])))


#: the LM head's input is kept exact: the fused loss recomputes the logits from it
_EXACT_HEAD = DivisionConfig(linear_bits=0)


def patch_causal_lm_loss(state: PatchState, model: nn.Module) -> None:
    """A causal LM whose loss is Transformers' ``ForCausalLMLoss`` and whose output embedding is
    an ``nn.Linear``: in training, the head tags the logits it returns with its input, and the
    model's ``loss_function`` computes the loss from that input through
    :class:`~hf_division.autograd.lm_loss.CausalLMLossFn`, so no vocabulary-sized tensor is held for
    backward. The logits returned are the head's own (bit-identical); logits changed after the
    head (soft-capping, scaling) or a custom loss function fall back to the model's loss."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if state.losses or not isinstance(head, nn.Linear) or "_loss_function" in model.__dict__:
        return
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return

    def make(orig):
        def forward(self, x):
            if not in_training(self) or not (x.requires_grad or self.weight.requires_grad):
                return orig(x)
            # the head's own graph lives as long as callers hold ``outputs.logits``: through
            # LinearFn it keeps the parameter, not autocast's vocabulary-sized low-precision copy
            # (docs/DESIGN.md, "Causal-LM loss"); the input stays exact (the loss keeps it anyway)
            out = LinearFn.apply(x, self.weight, self.bias, orig, False, _EXACT_HEAD, "linear")
            tag_logits(out, x, self)
            return out

        return forward

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        fused = causal_lm_loss(logits, labels, ignore_index, shift_labels, num_items_in_batch)
        if fused is not None:
            return fused
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)

    wrap_forward(state, head, make)
    state.losses.append(model)
    model.loss_function = loss_function  # Transformers' setter: an instance ``_loss_function``


def restore_loss_functions(state: PatchState) -> None:
    """Undo :func:`patch_causal_lm_loss`."""
    for model in state.losses:
        model.__dict__.pop("_loss_function", None)
    state.losses.clear()


def patch_modules(
    state: PatchState, root: nn.Module, norm_types=(nn.LayerNorm,), activation_types=(), conv1d_types=()
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


def use_attention_interface(state: PatchState, model: nn.Module) -> None:
    """Route the model's attention through ``division_<impl>`` (see hf_division.patching.attention)."""
    for module in model.modules():
        module.__dict__[CONFIG_ATTR] = config_for(state, module)
    if not state.attn:  # switched once; re-patching (new modules) must not switch again
        state.attn = switch(model)


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


