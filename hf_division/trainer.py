"""Trainer integration: ``TrainingArguments(division=True, division_<field>=...)`` and ``Trainer``.

``TrainingArguments`` gains ``division`` plus one ``division_<field>`` argument per
:class:`DivisionConfig` field (same types and defaults), so ``HfArgumentParser`` exposes
``--division --division_block_size 8 ...``. ``Trainer`` applies division when training starts,
as Transformers does for ``use_liger_kernel``; evaluation and prediction run the original forward
(division only acts in train mode with grad enabled), and checkpoints are plain Transformers ones.
"""
from __future__ import annotations

import dataclasses

import transformers

from .config import DivisionConfig
from .patching import apply_division

PREFIX = "division_"


def _division_fields():
    out = [("division", bool, dataclasses.field(default=False, metadata={"help": "Compress saved activations (hf-division)."}))]
    for f in dataclasses.fields(DivisionConfig):
        out.append(
            (PREFIX + f.name, f.type if not isinstance(f.type, str) else eval(f.type),  # noqa: S307 - our own annotations
             dataclasses.field(default=f.default, metadata={"help": f"DivisionConfig.{f.name} (hf-division)."}))
        )
    return out


def _division_config(self) -> DivisionConfig:
    """The :class:`DivisionConfig` these arguments describe."""
    return DivisionConfig(**{name: getattr(self, PREFIX + name) for name in DivisionConfig.field_names()})


def _post_init(self):
    transformers.TrainingArguments.__post_init__(self)
    self.division_config()  # a bad division_* value fails here, naming the field


TrainingArguments = dataclasses.make_dataclass(
    "TrainingArguments",
    _division_fields(),
    bases=(transformers.TrainingArguments,),
    namespace={"division_config": _division_config, "__post_init__": _post_init, "__module__": __name__},
)
TrainingArguments.__doc__ = __doc__


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that applies division when training starts if ``args.division``."""

    def train(self, *args, **kwargs):
        if getattr(self.args, "division", False):
            apply_division(self.model, self.args.division_config())
        return super().train(*args, **kwargs)
