"""Byte accounting: what a training forward holds for backward, exactly (docs/DESIGN.md, Accounting).

Between :func:`start_accounting` and :func:`stop_accounting`, every store entry created and every
tensor an op reports (:func:`account_tensors`: dropout bits, RNG states, masks it keeps outside any
entry) is recorded by weak reference, so that the accounting itself keeps nothing alive.
What autograd saves itself and what checkpointed layers keep are added by
:func:`hf_division.autograd.held.held_by_forward`.
"""
from __future__ import annotations

import weakref

import torch

_records: list | None = None


def account(objects, kind: str | None = None) -> None:
    """Record ``objects`` (tensors of ``kind``, or objects with ``kind`` and ``tensors()``, whose
    kind is their own) if an accounting is running."""
    if _records is not None:
        _records.extend((weakref.ref(o), kind) for o in objects)


def account_tensors(tensors, kind: str) -> None:
    """Report tensors an op holds for backward outside any store entry."""
    account(tensors, kind)


def start_accounting() -> None:
    global _records
    _records = []


def recorded() -> list:
    """The recorded objects still alive (tensors and store entries), while an accounting runs."""
    return [obj for obj in (ref() for ref, _ in _records or []) if obj is not None]


def stop_accounting() -> list[tuple[torch.Tensor, str]]:
    """``(tensor, kind)`` for what was recorded since :func:`start_accounting` and is still held."""
    global _records
    refs, _records = _records or [], None
    held = []
    for ref, kind in refs:
        obj = ref()
        if obj is None:
            continue
        if isinstance(obj, torch.Tensor):
            held.append((obj, kind))
        else:
            held.extend((t, obj.kind) for t in obj.tensors())
    return held
