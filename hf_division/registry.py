"""The architecture registry: ``model_type -> Family`` (patcher + its default policy). A leaf module.

Each module of ``model_patches`` registers its family here when imported::

    register("llama", defaults=GATED_DECODER_DEFAULTS)(gated_decoder_patcher(LlamaRMSNorm, LlamaMLP))

and :mod:`hf_division.api` looks the family up when patching. A family's ``defaults`` are the
:class:`~hf_division.config.DivisionConfig` fields whose measured default differs for it
(docs/DESIGN.md, "Policy"); :meth:`DivisionConfig.resolved` reads them through :func:`family_defaults`.

Families are found lazily: the ``model_patches`` package declares which of its modules registers
which model types (its ``FAMILIES`` table), and the first lookup of a model type imports that one
module, by name. A family module imports its architecture's modeling file, so importing every
family up front would load some thirty modeling files that a run patching one model never uses
(docs/DESIGN.md, "Patching, registry and families").
"""
from __future__ import annotations

import contextlib
import enum
import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping


class TrainingCache(enum.Enum):
    """The KV cache a family's training forward builds for itself where ``config.use_cache`` is on;
    division gives the forward one of the same kind that holds nothing
    (:mod:`hf_division.patching.training_cache`)."""

    #: none (encoders), or one division leaves as it is
    NONE = "none"
    #: a decoder's ``DynamicCache``
    DECODER = "decoder"
    #: an encoder-decoder's ``EncoderDecoderCache``, two caches of the decoder's depth, built by its
    #: decoder where the head leaves ``use_cache`` on: T5's and Whisper's conditional generation
    #: always, BART's without labels (its heads, and T5's classification heads, turn it off when
    #: given labels)
    ENCODER_DECODER = "encoder-decoder"


class CheckpointForward(enum.Enum):
    """How division runs the first forward of a layer Transformers checkpoints, whose inputs
    alone it keeps (docs/DESIGN.md, "Bit-identical forward")."""

    #: without autograd, which records nothing (the least host time)
    BARE = "bare"
    #: as the model's checkpointing function runs it: where that is non-reentrant (Transformers'
    #: default), under autograd with every saved tensor dropped; for families whose forward reads
    #: gradient flags (T5's sdpa picks its kernel by whether its additive mask needs a gradient)
    AS_CHECKPOINTED = "as-checkpointed"


@dataclass(frozen=True)
class Family:
    """How to patch one architecture: ``apply(model, state)``, its default config fields,
    ``by_shape(model_config)``: the fields whose default differs again for a model of that shape,
    ``training_cache``: the KV cache its models build in a training forward,
    ``checkpoint_forward``: how a checkpointed layer's first forward runs, and ``checkpoint_exact``:
    the inputs of a checkpointed layer it holds as they are."""

    apply: Callable
    defaults: Mapping = field(default_factory=dict)
    by_shape: Callable[[object], Mapping] | None = None
    training_cache: TrainingCache = TrainingCache.NONE
    checkpoint_forward: CheckpointForward = CheckpointForward.BARE
    #: the parameter names of a checkpointed layer's inputs held as they are, not compressed, passed
    #: positionally or by keyword: attention biases that need a gradient and carry the mask's
    #: extreme values (T5's position biases), which a group's range would lose
    checkpoint_exact: tuple[str, ...] = ()


_FAMILIES: dict[str, Family] = {}
_FALLBACK: list[Callable] = []
_HIDDEN: set[str] = set()  # model types :func:`unregistered` hides

#: the package whose modules register the families; imported by name, never statically, so the
#: registry stays a leaf and a family's module loads only when its model type is asked for
FAMILY_PACKAGE = "model_patches"
#: its module that registers the generic fallback
FALLBACK_MODULE = "generic"


def declared() -> dict[str, str]:
    """``model_type -> module`` of :data:`FAMILY_PACKAGE` that registers it (the package's
    ``FAMILIES`` table, read without importing any family module)."""
    table = importlib.import_module(FAMILY_PACKAGE).FAMILIES
    return {t: module for module, types in table.items() for t in types}


def _load(model_type: str | None) -> None:
    """Import the module that registers ``model_type``, if one is declared and it is not loaded."""
    if model_type is None or model_type in _FAMILIES or model_type in _HIDDEN:
        return
    module = declared().get(model_type)
    if module is not None:
        importlib.import_module(f"{FAMILY_PACKAGE}.{module}")


def register(*model_types: str, defaults: Mapping | None = None, by_shape: Callable[[object], Mapping] | None = None,
             training_cache: TrainingCache = TrainingCache.NONE,
             checkpoint_forward: CheckpointForward = CheckpointForward.BARE, checkpoint_exact: tuple[str, ...] = ()):
    """Decorator: register a patcher ``apply(model, state)`` for ``model_types``; returns it.
    ``defaults``: the config fields whose measured default differs for them; ``by_shape``: given a
    model's ``config``, the fields whose default differs again for that model (e.g. by width);
    ``training_cache``, ``checkpoint_forward`` and ``checkpoint_exact``: :class:`Family`'s."""
    if not model_types:
        raise ValueError("register: name at least one model_type")
    if not isinstance(training_cache, TrainingCache):
        raise TypeError(f"register: training_cache must be a TrainingCache, got {training_cache!r}")
    if not isinstance(checkpoint_forward, CheckpointForward):
        raise TypeError(f"register: checkpoint_forward must be a CheckpointForward, got {checkpoint_forward!r}")
    if not (isinstance(checkpoint_exact, tuple) and all(isinstance(n, str) for n in checkpoint_exact)):
        raise TypeError(f"register: checkpoint_exact must be a tuple of parameter names, got {checkpoint_exact!r}")

    def decorate(apply: Callable) -> Callable:
        family = Family(apply, MappingProxyType(dict(defaults or {})), by_shape, training_cache, checkpoint_forward,
                        checkpoint_exact)
        for model_type in model_types:
            if model_type in _FAMILIES and _FAMILIES[model_type].apply is not apply:
                raise ValueError(f"hf-division: model_type {model_type!r} is registered twice")
            _FAMILIES[model_type] = family
        return apply

    return decorate


def register_fallback(apply: Callable) -> Callable:
    """Decorator: the generic patcher for unregistered types (``DivisionConfig.generic_fallback``)."""
    _FALLBACK[:] = [apply]
    return apply


def family(model_type: str | None) -> Family | None:
    """The family of ``model_type`` (its module imported on first use), or None."""
    _load(model_type)
    return None if model_type in _HIDDEN else _FAMILIES.get(model_type)


def fallback() -> Callable | None:
    """The generic patcher, if one is registered (its module imported on first use)."""
    if not _FALLBACK:
        importlib.import_module(f"{FAMILY_PACKAGE}.{FALLBACK_MODULE}")
    return _FALLBACK[0] if _FALLBACK else None


def family_defaults(model_type: str | None, model_config=None) -> Mapping:
    """The config fields whose default differs for ``model_type`` (empty if none or unknown); with
    ``model_config`` (a model's ``config``), also those its family sets for that model's shape."""
    found = family(model_type)
    if found is None:
        return {}
    if model_config is None or found.by_shape is None:
        return found.defaults
    return MappingProxyType({**found.defaults, **found.by_shape(model_config)})


def supported_model_types() -> list[str]:
    """Model types with a patcher, declared or registered, sorted; imports no family module."""
    return sorted((set(declared()) | set(_FAMILIES)) - _HIDDEN)


def registered() -> list[str]:
    """Model types whose family module has been imported so far, sorted."""
    return sorted(_FAMILIES)


@contextlib.contextmanager
def unregistered(*model_types: str):
    """Hide the families of ``model_types`` inside the block, e.g. to measure what the generic
    fallback does on a type that has its own patcher."""
    fresh = set(model_types) - _HIDDEN
    _HIDDEN.update(fresh)
    try:
        yield
    finally:
        _HIDDEN.difference_update(fresh)
