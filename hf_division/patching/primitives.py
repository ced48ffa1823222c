"""The patching primitives ``model_patches`` builds its families from (public, documented).

Patching replaces the ``forward`` of individual module *instances* (never classes, never the
module tree), so state dicts, checkpoints and other instances are untouched, and restoring is
deleting the instance attribute again (:mod:`.wrappers` holds that mechanism). The one module-level function
replaced, the rotary embedding's (:func:`patch_rotary`), is a wrapper that runs the original outside
a patched attention module's training forward, removed with the last model using it. Each primitive records what it
replaced in a :class:`PatchState`; :mod:`hf_division.api` owns that state's life cycle
(docs/DESIGN.md, "Patching, registry and families").
"""
from __future__ import annotations

import contextlib
import sys
import warnings
import weakref

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from hf_division.patching.attention import CONFIG_ATTR, switch
from hf_division.config import DivisionConfig
from hf_division.autograd.layer_norm import layer_norm, takes as layer_norm_takes
from hf_division.autograd.rms_norm import eps_of as rms_norm_eps, rms_norm, takes as rms_norm_takes
from hf_division.autograd.lm_loss import causal_lm_loss, tag_logits
from hf_division.compress.noise import model_stream
from hf_division.kernels.switches import switches
from hf_division.autograd import rotary
from hf_division.autograd.forward_mode import ForwardMode
from hf_division.autograd.ops import GatedFn, LinearFn, RecomputeFn
from hf_division.autograd.saved_hooks import compressed_saves
from hf_division.autograd.padding import padding_of
from hf_division.patching.training_cache import CacheSlot
from hf_division.registry import TrainingCache
from hf_division.patching.wrappers import (
    PatchState, config_for, forget_lost, in_training, unpatched_forward, wrap_forward,
)


def patch_linear(state: PatchState, module: nn.Module, transposed: bool = False, kind: str = "linear") -> None:
    """``nn.Linear`` (or, ``transposed``, GPT-2's ``Conv1D``): input kept compressed for the
    weight gradient."""
    config = config_for(state, module)

    def make(orig):
        def forward(self, x):
            # a frozen layer (LoRA's base) keeps no input, but through LinearFn it keeps its weight by
            # reference where autograd keeps autocast's low-precision copy of it for the input gradient
            if in_training(self) and (config.bits(kind) if self.weight.requires_grad else x.requires_grad):
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


def patch_root(state: PatchState, model: nn.Module, repatch,
               training_cache: TrainingCache = TrainingCache.NONE) -> None:
    """The model's own forward: in training, (1) modules added after patching (PEFT's
    ``get_peft_model`` after ``apply_division`` adds ``lora_A``/``lora_B``) get patched before they
    run, by calling ``repatch`` when the module count changed, and modules whose forward another
    library replaced since (:func:`forget_lost`) get patched again; (2) every dropout, ``nn.Dropout`` or
    functional (OPT calls ``F.dropout`` directly), keeps its mask as bits: the forward runs under a
    ``TorchFunctionMode`` (:class:`~hf_division.autograd.forward_mode.ForwardMode`) that routes ``F.dropout``
    to :class:`DropoutFn`, and lets a dtype cast of a held tensor share its copy; (3) the rounding noise
    comes from the model's own streams (:func:`~hf_division.compress.noise.model_stream`); (4) with
    ``training_cache`` (the family's :attr:`~hf_division.registry.Family.training_cache`), the
    KV cache the forward would build for itself is one that holds nothing
    (:mod:`~hf_division.patching.training_cache`)."""
    state.n_modules = sum(1 for _ in model.modules())
    slot = None if training_cache is TrainingCache.NONE else CacheSlot(model, training_cache)

    def make(orig):
        def forward(self, *args, **kwargs):
            if not in_training(self):
                return orig(*args, **kwargs)
            _refresh(state, self, repatch)
            cache = None if slot is None else slot.unheld(self, args, kwargs)
            if cache is not None:
                kwargs[slot.name] = cache
            signature, mode = _forward_mode(state, args, kwargs)
            passing = contextlib.nullcontext() if cache is None else slot.passing(cache)
            with passing, model_stream(self), padding_of(kwargs.get("attention_mask")), mode:
                out = orig(*args, **kwargs)
            if signature is not None:
                state.modes[signature] = state.modes.get(signature, False) or mode.routed > 0
            return out

        return forward

    wrap_forward(state, model, make)


#: a forward left out of :class:`ForwardMode` runs under it again every this many training forwards
REPROBE_EVERY = 50


def _forward_mode(state: PatchState, args: tuple, kwargs: dict):
    """``(signature, mode)``: the mode a root's training forward runs under, and the signature to
    record whether it routed anything under (None: nothing to record).

    Why: the mode's Python handler costs every torch call of the model's own code host time, where
    most models route nothing (no dropout, no cast of a held tensor) and a GPU's step may wait for its
    host (docs/DESIGN.md, "On a GPU"; the ``dispatch`` suite's ``division-mode`` arm). The first
    forward of each signature (the arguments given, autocast's and grad mode's state), and every
    :data:`REPROBE_EVERY`-th, runs under the mode; a signature under which it routed something
    always does. A forward left out keeps what autograd keeps for a dropout mask or
    a cast copy: never more than the unpatched model holds."""
    mode = ForwardMode(state.config.dropout_bits)
    if not isinstance(mode, ForwardMode):  # under torch.compile: a null context, nothing counted or guarded on
        return None, mode
    state.forwards += 1
    signature = (len(args), tuple(k for k, v in kwargs.items() if v is not None), torch.is_grad_enabled(),
                 *[(torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")])
    if (state.modes.get(signature) is False and state.forwards % REPROBE_EVERY
            and switches().lazy_forward_mode):
        return None, contextlib.nullcontext()
    return signature, mode


@torch.compiler.disable
def _refresh(state: PatchState, model: nn.Module, repatch) -> None:
    """Patch what was added or lost since (:func:`patch_root`). Run eagerly under ``torch.compile``:
    traced by Dynamo (PyTorch 2.11), the wrappers' marks read through ``module.__dict__`` came out
    missing, every record was dropped and re-made over our own wrappers, and ``remove_division``
    then left them in place (``tests/test_compile.py``)."""
    if sum(1 for _ in model.modules()) != state.n_modules or forget_lost(state):
        repatch()
        state.modes.clear()  # new modules (PEFT's adapters) may cast what the mode would route


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
    """The shared wiring: every Linear (and Conv1D), norm and activation below ``root``. A Linear
    subclass with a forward of its own is left exact (:func:`plain_linear`)."""
    for module in root.modules():
        if isinstance(module, nn.Linear):
            if plain_linear(state, module):
                patch_linear(state, module)
        elif isinstance(module, conv1d_types):
            patch_linear(state, module, transposed=True)
        elif isinstance(module, norm_types):
            patch_recompute(state, module, "norm")
        elif isinstance(module, activation_types):
            patch_recompute(state, module, "activation")


#: Linear subclasses whose own forward computes ``x @ weight.T + bias`` from the raw weight (the
#: forward stays theirs, bit for bit; the gradient is LinearFn's): checked by reading their source
PLAIN_LINEAR_SUBCLASSES = {"transformers.models.falcon.modeling_falcon.FalconLinear"}


#: Linear subclasses whose backward keeps no input (bitsandbytes' ``MatMul4Bit`` saves only its packed,
#: frozen weight and computes the input gradient from it): left exact, they cost no activation bytes
NO_SAVED_INPUT = frozenset(f"bitsandbytes.nn.modules.{name}" for name in ("Linear4bit", "LinearNF4", "LinearFP4"))


def plain_linear(state: PatchState, module: nn.Linear) -> bool:
    """Whether ``module`` computes ``F.linear(x, self.weight, self.bias)``: its class does not
    override ``nn.Linear.forward``, or is one of :data:`PLAIN_LINEAR_SUBCLASSES`. :class:`~hf_division.autograd.ops.LinearFn`'s backward assumes
    that; a subclass that scales or quantizes its weight in its forward (fake-quantized QAT
    linears, bitsandbytes' ``Linear4bit`` / ``Linear8bitLt``) would train with no gradient for what
    its forward adds and an input gradient from the wrong weight. Those keep what autograd saves,
    exact, with one warning per class (issue 42, item 2)."""
    kind = f"{type(module).__module__}.{type(module).__qualname__}"
    if type(module).forward is nn.Linear.forward or kind in PLAIN_LINEAR_SUBCLASSES:
        return True
    if kind not in state.declined:
        state.declined.add(kind)
        cost = ("; its frozen 4-bit matmul keeps no input for backward, so this costs no activation memory"
                if kind in NO_SAVED_INPUT else "")
        warnings.warn(f"hf-division: {kind} (e.g. {state.names.get(id(module), type(module).__name__)}) overrides "
                      f"nn.Linear.forward; division leaves its layers exact (their inputs kept as autograd keeps them){cost}")
    return False


def use_attention_interface(state: PatchState, model: nn.Module) -> None:
    """Route the model's attention through ``division_<impl>`` (see hf_division.patching.attention)."""
    for module in model.modules():
        module.__dict__[CONFIG_ATTR] = config_for(state, module)
    if not state.attn:  # switched once; re-patching (new modules) must not switch again
        state.attn = switch(model)
