"""Division in custom Accelerate training loops (docs/GUIDE.md, "Accelerate loops").

The pattern (``scripts/train_accelerate.py`` is a complete example)::

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model = AutoModelForSequenceClassification.from_pretrained(...)
    prepare_division(model, DivisionConfig())        # before accelerator.prepare
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    step = 0
    for i, batch in enumerate(train_dl):
        if i % 2 == 0:                                # first micro-batch of an optimizer step
            reseed_for_step(step, seed, accelerator)  # optional: noise from (seed, step, rank)
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step(); optimizer.zero_grad()
        step += accelerator.sync_gradients
    keep_process_group_until_exit()                   # then accelerator.end_training()

Division patches module *instances* of the unwrapped model, so it survives the wrapping
``prepare`` does (DDP and Accelerate's autocast wrapper of ``forward`` are tested; FSDP1/FSDP2
wrappers with ``torch.distributed`` directly). Applying it to an already prepared model works too
(``apply_division`` unwraps ``.module`` / ``_orig_mod``). Do not call ``remove_division`` on a
prepared model: the base model's ``forward`` is then restored to the un-wrapped one, dropping
Accelerate's autocast wrapper if that was installed after division.
"""
from __future__ import annotations

import atexit
import gc

import torch
from torch import nn

from hf_division.api import apply_division, division_config_of, unwrap
from hf_division.config import DivisionConfig
from hf_division.compress.noise import reseed, step_seed


def prepare_division(model: nn.Module, config: DivisionConfig | None = None) -> nn.Module:
    """:func:`~hf_division.apply_division` for an Accelerate loop; returns ``model``.

    ``model``: the model before ``accelerator.prepare`` (recommended) or the prepared one.
    ``config``: a :class:`DivisionConfig` (default policy if None).
    """
    return apply_division(model, config if config is not None else DivisionConfig())


def reseed_for_step(step: int, seed: int, accelerator=None) -> int:
    """Restart the rounding noise for optimizer step ``step`` of a run seeded with ``seed``, on this
    process (``accelerator.process_index``); returns the noise seed.

    Call it at the start of each optimizer step (before its first micro-batch), as the Trainer's
    ``DivisionCallback`` does: the noise then depends only on ``(seed, step, rank)``, so a loop
    resumed from ``accelerator.save_state`` at step ``k`` draws the noise of the uninterrupted run.
    """
    rank = getattr(accelerator, "process_index", 0) if accelerator is not None else 0
    noise_seed = step_seed(seed, step, rank)
    reseed(noise_seed)
    return noise_seed


def division_enabled(model: nn.Module) -> bool:
    """Whether ``model`` (prepared or not) has division applied."""
    return division_config_of(unwrap(model)) is not None


#: process groups referenced from Python until the interpreter exits (:func:`keep_process_group_until_exit`)
_KEPT_GROUPS: list = []


def keep_process_group_until_exit() -> None:
    """Hold the default process group from Python until exit, when it is released first thing.

    Why: a 2-process CPU launch once hung after its work was done (docs/GUIDE.md, "Distributed").
    Its stack showed the DDP reducer, freed as the script's ``main`` returned, dropping the last
    reference to the gloo group. The group's destructor waits for gloo's worker threads and the
    reducer's binding runs it holding the GIL, while a worker freeing a finished collective's
    tensors waited for the GIL. The Python process-group object releases the GIL before it
    destroys the group (pytorch/pytorch#56297), so it is made the last reference. Not specific to
    division: any DDP run on gloo can meet it. A no-op without an initialized process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    group = torch.distributed.group.WORLD
    if any(kept is group for kept in _KEPT_GROUPS):
        return
    if not _KEPT_GROUPS:
        atexit.register(release_kept_process_groups)
    _KEPT_GROUPS.append(group)


def kept_process_groups() -> tuple:
    """The process groups :func:`keep_process_group_until_exit` holds now."""
    return tuple(_KEPT_GROUPS)


def release_kept_process_groups() -> None:
    """Drop the kept groups (run at exit; earlier once no DDP wrapper holds them any more)."""
    gc.collect()  # wrappers kept alive only by reference cycles drop their references first
    _KEPT_GROUPS.clear()
