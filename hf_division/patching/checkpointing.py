"""Recomputation primitives: a layer Transformers checkpoints, and a module division recomputes in
backward on its own account, each run as one :class:`~hf_division.autograd.ops.CheckpointFn` whose
tensor inputs are kept compressed (docs/DESIGN.md, "Mechanism: custom autograd Functions at module level").
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_division.autograd.ops import CheckpointFn
from hf_division.autograd.saved_hooks import compressed_saves
from hf_division.patching.wrappers import PatchState, config_for, in_training, wrap_forward


def patch_checkpointing(state: PatchState, model: nn.Module) -> None:
    """Layers Transformers checkpoints (``GradientCheckpointingLayer`` with checkpointing on, e.g.
    ``activation_checkpointing_enable(every_n_layers=...)``) run through :class:`CheckpointFn`:
    the boundary input is kept compressed instead of whole, and the recomputation in backward
    saves nothing compressed. Checked at call time, so enabling checkpointing later works too.
    The first forward runs without autograd, or, where ``state.recorded_checkpoint`` and the
    layer's checkpointing function is non-reentrant, under it as that function runs it
    (:class:`~hf_division.registry.CheckpointForward`)."""

    def make(orig, config):
        def forward(self, *args, **kwargs):
            if getattr(self, "gradient_checkpointing", False) and in_training(self):
                inner = type(self).forward.__wrapped__  # the layer's forward without checkpointing
                recorded = state.recorded_checkpoint and not _reentrant(self)
                return _checkpointed(state, config, inner, self, recorded, args, kwargs)
            return orig(*args, **kwargs)

        return forward

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            wrap_forward(state, module, functools.partial(make, config=config_for(state, module)))


def patch_recomputed(state: PatchState, module: nn.Module, kind: str = "attention") -> None:
    """``module``'s forward, in training with ``kind`` compressed, runs as one :class:`CheckpointFn`
    of its own: it saves nothing but its tensor inputs (compressed as a checkpoint's, the family's
    ``checkpoint_exact`` held as they are) and the RNG state, and backward runs it again under
    autograd. For code computed inline whose saves outweigh its inputs many times over, where memory
    matters more than its forward run twice: the long-input families' sparse attentions under
    ``recompute_inline_attention`` (``model_patches.common.patch_inline_attention``; their figures:
    ``scripts/sparse_attention.py``, docs/RESULTS.md, "Long-input attentions"). Submodules keep their
    own patches for the first forward; the recomputation runs them unpatched, as every checkpoint's."""
    config = config_for(state, module)

    def make(orig):
        def forward(self, *args, **kwargs):
            if not (in_training(self) and config.bits(kind)):
                return orig(*args, **kwargs)
            anchored = _anchored(self, args, kwargs)
            if anchored is None:  # no input to carry the parameters' gradients: keep its saves instead
                with compressed_saves(config, kind):
                    return orig(*args, **kwargs)
            return _checkpointed(state, config, type(self).forward, self, False, *anchored)

        return forward

    wrap_forward(state, module, make)


def _anchored(module: nn.Module, args: tuple, kwargs: dict):
    """``(args, kwargs)``, where no tensor input needs a gradient but a parameter of ``module`` does,
    with the hidden states (the first floating positional tensor, else ``hidden_states=``) made a
    leaf that needs one; None where there is none to make. Why: :class:`CheckpointFn`, as reentrant
    checkpointing, is recorded only for inputs that need a gradient, and its backward is what gives
    the parameters theirs. A first layer's input, a frozen embedding's output, needs none (LoRA),
    and without this its adapters got no gradient at all."""
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values())):
        return args, kwargs
    if not any(p.requires_grad for p in module.parameters()):
        return args, kwargs
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return (*args[:i], a.detach().requires_grad_(), *args[i + 1:]), kwargs
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor) and hidden.is_floating_point():
        return args, {**kwargs, "hidden_states": hidden.detach().requires_grad_()}
    return None


def _checkpointed(state: PatchState, config, inner, module: nn.Module, recorded: bool, args: tuple, kwargs: dict):
    """``inner(module, *args, **kwargs)`` through :class:`CheckpointFn`."""
    # keyword tensors that need a gradient (DeBERTa's ``rel_embeddings``, one LayerNorm output
    # shared by every layer) become inputs: captured, each layer's backward would run through
    # their graph again and find it freed
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    run = functools.partial(_call_split, inner, module, len(args), names,
                            {k: v for k, v in kwargs.items() if k not in names})
    exact = (_exact_positions(inner, len(args), tuple(names), state.checkpoint_exact)
             if state.checkpoint_exact else frozenset())
    return CheckpointFn.apply(run, config, recorded, exact, *args, *(kwargs[k] for k in names))


@functools.lru_cache(maxsize=256)
def _exact_positions(forward, n_args: int, names: tuple, exact: frozenset) -> frozenset:
    """Which of :class:`CheckpointFn`'s inputs (``n_args`` positional, then keyword ``names``) a
    layer's ``forward`` takes under a name in ``exact`` (the family's ``checkpoint_exact``;
    T5's blocks take their position biases positionally)."""
    params = list(inspect.signature(forward).parameters)[1:n_args + 1]
    return frozenset(i for i, name in enumerate(params + list(names)) if name in exact)


def _reentrant(layer: nn.Module) -> bool:
    """Whether ``layer``'s checkpointing function is reentrant (runs the first forward without
    autograd), by the keywords Transformers bound it with (``activation_checkpointing_kwargs``,
    whose default is ``{"use_reentrant": False}``); where they do not say, by
    ``torch.utils.checkpoint.checkpoint``'s own default, reentrant."""
    reentrant = getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", {}).get("use_reentrant")
    return True if reentrant is None else bool(reentrant)


def _call_split(fn, module, n_args: int, names: list, kwargs: dict, *inputs):
    """``fn(module, *inputs[:n_args], **kwargs, **{names: the rest of inputs})``."""
    return fn(module, *inputs[:n_args], **kwargs, **dict(zip(names, inputs[n_args:])))
