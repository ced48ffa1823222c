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

Division patches module *instances* of the unwrapped model, so it survives the wrapping
``prepare`` does (DDP and Accelerate's autocast wrapper of ``forward`` are tested; FSDP1/FSDP2
wrappers with ``torch.distributed`` directly). Applying it to an already prepared model works too
(``apply_division`` unwraps ``.module`` / ``_orig_mod``). Do not call ``remove_division`` on a
prepared model: the base model's ``forward`` is then restored to the un-wrapped one, dropping
Accelerate's autocast wrapper if that was installed after division.
"""
from __future__ import annotations

from torch import nn

from .api import apply_division, division_config_of, unwrap
from .config import DivisionConfig
from .noise import reseed, step_seed


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
