"""Trainer integration: ``TrainingArguments(division=True, division_<field>=...)`` and ``Trainer``.

``TrainingArguments`` (and ``Seq2SeqTrainingArguments``) gain ``division`` plus one
``division_<field>`` argument per :class:`DivisionConfig` field (same types and defaults), so
``HfArgumentParser`` exposes ``--division --division_block_size 8 ...``. ``Trainer`` applies
division when training starts, as Transformers does for ``use_liger_kernel``; evaluation and
prediction run the original forward (division only acts in train mode with grad enabled), and
checkpoints are plain Transformers ones. :class:`DivisionCallback` does the same for any
``transformers.Trainer`` (``hf-division run`` installs it for unmodified scripts).
"""
from __future__ import annotations

import dataclasses
import typing

import transformers

from .api import apply_division
from .config import DivisionConfig
from .noise import reseed, step_seed

PREFIX = "division_"


def _division_fields():
    """``division`` plus one ``division_<field>`` per config field, with its type, default and help."""
    out = [("division", bool, dataclasses.field(default=False, metadata={
        "help": "hf-division: keep the activations saved for backward compressed (DIVISION)."}))]
    types = typing.get_type_hints(DivisionConfig)
    for f in dataclasses.fields(DivisionConfig):
        help_text = f"hf-division: {f.metadata['help']}"
        out.append((PREFIX + f.name, types[f.name], dataclasses.field(default=f.default, metadata={"help": help_text})))
    return out


def _division_config(self) -> DivisionConfig:
    """The :class:`DivisionConfig` these arguments describe."""
    return DivisionConfig(**{name: getattr(self, PREFIX + name) for name in DivisionConfig.field_names()})


def with_division(args_cls: type) -> type:
    """``args_cls`` (a ``TrainingArguments`` class) plus the ``division`` / ``division_*`` fields."""

    def __post_init__(self):
        args_cls.__post_init__(self)
        try:
            self.division_config()
        except ValueError as err:  # name the argument the user wrote, not the config field
            raise ValueError(str(err).replace("DivisionConfig.", PREFIX)) from None

    cls = dataclasses.make_dataclass(
        args_cls.__name__,
        _division_fields(),
        bases=(args_cls,),
        namespace={"division_config": _division_config, "__post_init__": __post_init__, "__module__": __name__},
    )
    cls.__doc__ = __doc__
    return cls


TrainingArguments = with_division(transformers.TrainingArguments)
Seq2SeqTrainingArguments = with_division(transformers.Seq2SeqTrainingArguments)


def _apply(model, args) -> None:
    if getattr(args, "division", False) and model is not None:
        apply_division(model, args.division_config())


class DivisionCallback(transformers.TrainerCallback):
    """Applies division to the Trainer's model when training begins, if ``args.division``, and
    restarts the rounding noise at every optimizer step from ``(seed, step, process)``, so that a
    run resumed from a checkpoint continues with the noise of the uninterrupted run."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _apply(model, args)

    def on_step_begin(self, args, state, control, **kwargs):
        if getattr(args, "division", False):
            reseed(step_seed(args.seed, state.global_step, args.process_index))


def add_division_callback(trainer) -> None:
    """Install :class:`DivisionCallback` on ``trainer`` once."""
    if not any(isinstance(cb, DivisionCallback) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(DivisionCallback)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that applies division when training starts if ``args.division``."""

    def train(self, *args, **kwargs):
        _apply(self.model, self.args)
        add_division_callback(self)
        return super().train(*args, **kwargs)


class Seq2SeqTrainer(transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` that applies division when training starts if ``args.division``."""

    def train(self, *args, **kwargs):
        _apply(self.model, self.args)
        add_division_callback(self)
        return super().train(*args, **kwargs)
