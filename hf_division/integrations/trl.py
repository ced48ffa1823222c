"""TRL integration: ``SFTConfig(division=True, division_<field>=...)`` and ``SFTTrainer``.

``SFTConfig`` is TRL's with the same ``division`` / ``division_*`` fields as
:class:`hf_division.integrations.trainer.TrainingArguments` (``TrlParser`` and ``HfArgumentParser`` expose them
as ``--division ...``); ``SFTTrainer`` applies division when training starts, through
:class:`~hf_division.integrations.trainer.DivisionCallback`, which also settles gradient checkpointing
(TRL's default; ``division_checkpointing``) and bounds the token tile of TRL's fused LM head
(docs/GUIDE.md, "TRL"). An unmodified TRL script gets the same through ``hf-division run``.
"""
from __future__ import annotations

import trl

from hf_division.integrations.trainer import add_division_callback, apply_from_args, with_division

__all__ = ["SFTConfig", "SFTTrainer"]

SFTConfig = with_division(trl.SFTConfig)


class SFTTrainer(trl.SFTTrainer):
    """``trl.SFTTrainer`` that applies division when training starts if ``args.division``."""

    def train(self, *args, **kwargs):
        apply_from_args(self.model, self.args)
        add_division_callback(self)
        return super().train(*args, **kwargs)
