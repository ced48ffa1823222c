"""The architecture registry: ``model_type -> Family`` (patcher + its default policy). A leaf module.

Each module of ``model_patches`` registers its family here when imported::

    register("llama", defaults=GATED_DECODER_DEFAULTS)(gated_decoder_patcher(LlamaRMSNorm, LlamaMLP))

and :mod:`hf_division.api` looks the family up when patching. A family's ``defaults`` are the
:class:`~hf_division.config.DivisionConfig` fields whose measured default differs for it
(docs/DESIGN.md, "Policy"); :meth:`DivisionConfig.resolved` reads them through :func:`family_defaults`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping


@dataclass(frozen=True)
class Family:
    """How to patch one architecture: ``apply(model, state)`` and its default config fields."""

    apply: Callable
    defaults: Mapping = field(default_factory=dict)


_FAMILIES: dict[str, Family] = {}
_FALLBACK: list[Callable] = []


def register(*model_types: str, defaults: Mapping | None = None):
    """Decorator: register a patcher ``apply(model, state)`` for ``model_types``; returns it."""
    if not model_types:
        raise ValueError("register: name at least one model_type")

    def decorate(apply: Callable) -> Callable:
        family = Family(apply, MappingProxyType(dict(defaults or {})))
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
    """The registered family of ``model_type``, or None."""
    return _FAMILIES.get(model_type)


def fallback() -> Callable | None:
    """The generic patcher, if one is registered."""
    return _FALLBACK[0] if _FALLBACK else None


def family_defaults(model_type: str | None) -> Mapping:
    """The config fields whose default differs for ``model_type`` (empty if none or unknown)."""
    found = _FAMILIES.get(model_type)
    return found.defaults if found is not None else {}


def supported_model_types() -> list[str]:
    """Model types with a registered patcher, sorted."""
    return sorted(_FAMILIES)


@contextlib.contextmanager
def unregistered(*model_types: str):
    """Hide the families of ``model_types`` inside the block, e.g. to measure what the generic
    fallback does on a type that has its own patcher."""
    hidden = {t: _FAMILIES.pop(t) for t in model_types if t in _FAMILIES}
    try:
        yield
    finally:
        _FAMILIES.update(hidden)
