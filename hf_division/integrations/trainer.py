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
import sys
import typing

import transformers
from transformers.utils import logging

from hf_division.api import apply_division, unwrap
from hf_division.config import DivisionConfig
from hf_division.compress.noise import reseed, step_seed

PREFIX = "division_"
logger = logging.get_logger(__name__)

#: values of ``division_checkpointing`` (docs/GUIDE.md, "Division and gradient checkpointing")
CHECKPOINTING = ("replace", "combine")
#: tokens per tile of TRL's fused LM head under division (``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``,
#: 4096 in TRL 1.16): bounds its float32 logits tile, which would otherwise grow with the batch up to
#: 4096 tokens and set the step's peak once the activations are compressed
TRL_TILE_TOKENS = 256


def _division_fields():
    """``division`` plus one ``division_<field>`` per config field, with its type, default and help."""
    out = [("division", bool, dataclasses.field(default=False, metadata={
        "help": "hf-division: keep the activations saved for backward compressed (DIVISION)."}))]
    types = typing.get_type_hints(DivisionConfig)
    for f in dataclasses.fields(DivisionConfig):
        help_text = f"hf-division: {f.metadata['help']}"
        out.append((PREFIX + f.name, types[f.name], dataclasses.field(default=f.default, metadata={"help": help_text})))
    out.append((PREFIX + "checkpointing", str, dataclasses.field(default="replace", metadata={"help": (
        "hf-division: what --division does when gradient checkpointing is on (TRL's default): 'replace' turns "
        "checkpointing off, every layer's activations are kept compressed (faster steps); 'combine' keeps it, "
        "layer inputs kept compressed and each layer recomputed in backward (least memory, slower).")})))
    return out


def _division_config(self) -> DivisionConfig:
    """The :class:`DivisionConfig` these arguments describe."""
    return DivisionConfig(**{name: getattr(self, PREFIX + name) for name in DivisionConfig.field_names()})


def with_division(args_cls: type) -> type:
    """``args_cls`` (a ``TrainingArguments`` class) plus the ``division`` / ``division_*`` fields."""

    def __post_init__(self):
        args_cls.__post_init__(self)
        if self.division_checkpointing not in CHECKPOINTING:
            raise ValueError(f"{PREFIX}checkpointing must be one of {CHECKPOINTING}, got {self.division_checkpointing!r}")
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


def apply_from_args(model, args) -> None:
    """Apply division to ``model`` as the Trainer arguments ``args`` say (nothing unless ``args.division``)."""
    if getattr(args, "division", False) and model is not None:
        apply_division(model, args.division_config())


def settle_checkpointing(model, mode: str) -> str:
    """Apply ``division_checkpointing`` to ``model`` once the Trainer has enabled checkpointing;
    returns what was done, for the log line at training start."""
    base = unwrap(model)
    if not getattr(base, "is_activation_checkpointing", False):
        return "gradient checkpointing off"
    if mode == "combine":
        return "gradient checkpointing kept: layer inputs compressed, each layer recomputed in backward"
    base.activation_checkpointing_disable()
    return "gradient checkpointing turned off, division replaces it (--division_checkpointing combine keeps both)"


def bound_trl_tiles(tokens: int | None) -> int | None:
    """Set the token tile of TRL's fused LM head (if TRL is loaded) to ``tokens`` (None: leave it);
    returns the previous value, or None if TRL's kernel is not loaded."""
    kernel = sys.modules.get("trl.kernels.chunked_logprob")
    if kernel is None or not hasattr(kernel, "TOKEN_CHUNK_SIZE"):
        return None
    previous = kernel.TOKEN_CHUNK_SIZE
    if tokens is not None:
        kernel.TOKEN_CHUNK_SIZE = tokens
    return previous


class DivisionCallback(transformers.TrainerCallback):
    """Applies division to the Trainer's model when training begins, if ``args.division``, and
    restarts the rounding noise at every optimizer step from ``(seed, step, process)``, so that a
    run resumed from a checkpoint continues with the noise of the uninterrupted run."""

    def __init__(self):
        self.trl_tiles = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not (getattr(args, "division", False) and model is not None):
            return
        apply_from_args(model, args)
        done = settle_checkpointing(model, getattr(args, PREFIX + "checkpointing", "replace"))
        previous = bound_trl_tiles(None)
        if previous is not None and previous > TRL_TILE_TOKENS:
            self.trl_tiles = bound_trl_tiles(TRL_TILE_TOKENS)
            done += f"; TRL's fused LM head in tiles of {TRL_TILE_TOKENS} tokens"
        logger.warning(f"hf-division: division on ({args.division_config().method}); {done}")

    def on_train_end(self, args, state, control, **kwargs):
        if self.trl_tiles is not None:
            bound_trl_tiles(self.trl_tiles)
            self.trl_tiles = None

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
        apply_from_args(self.model, self.args)
        add_division_callback(self)
        return super().train(*args, **kwargs)


class Seq2SeqTrainer(transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` that applies division when training starts if ``args.division``."""

    def train(self, *args, **kwargs):
        apply_from_args(self.model, self.args)
        add_division_callback(self)
        return super().train(*args, **kwargs)
