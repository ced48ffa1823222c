"""Trainer integration: division for every ``transformers.Trainer`` and ``TrainingArguments`` class.

Two ways in, one set of arguments (``division`` plus one ``division_<field>`` per
:class:`DivisionConfig` field, same types and defaults, and ``division_checkpointing``):

* :func:`enable` (``hf_division.enable()``, what ``hf-division run`` does before a script runs):
  every ``TrainingArguments`` class, those already defined (TRL's ``DPOConfig``, sentence-transformers'
  ``SentenceTransformerTrainingArguments``, ...) and those defined later, accepts the arguments as
  constructor keywords and through ``HfArgumentParser`` / ``TrlParser``, and every ``Trainer`` built
  afterwards carries :class:`DivisionCallback`, which applies division when training begins.
  :func:`disable` undoes it.
* :func:`with_division` (explicit, no global change): ``with_division(ArgsClass)`` is a subclass with
  the fields; ``TrainingArguments`` / ``Seq2SeqTrainingArguments`` here are Transformers' so extended,
  and ``Trainer`` / ``Seq2SeqTrainer`` apply division when training starts, as Transformers does for
  ``use_liger_kernel``. With any other Trainer, add :class:`DivisionCallback` to its callbacks.

Evaluation and prediction run the original forward (division only acts in train mode with grad
enabled), and checkpoints are plain Transformers ones.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import typing

import transformers
import transformers.trainer as hf_trainer
from transformers.utils import logging

from hf_division.api import apply_division
from hf_division.config import Choice, DivisionConfig
from hf_division.compress.noise import reseed, step_seed
from hf_division.integrations.checkpointing import settle_checkpointing

PREFIX = "division_"
logger = logging.get_logger(__name__)

class Checkpointing(Choice):
    """What ``--division`` does when gradient checkpointing is on (``division_checkpointing``; docs/GUIDE.md,
    "Gradient accumulation and checkpointing")."""

    AUTO = "auto"  # replace where the bytes that adds fit in the free memory, else combine
    REPLACE = "replace"  # checkpointing off: every layer's activations kept compressed
    COMBINE = "combine"  # both: layer inputs kept compressed, each layer recomputed in backward
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
    out.append((PREFIX + "checkpointing", Checkpointing, dataclasses.field(default=Checkpointing.AUTO, metadata={"help": (
        "hf-division: what --division does when gradient checkpointing is on (TRL's default): 'replace' turns "
        "checkpointing off, every layer's activations are kept compressed (faster steps); 'combine' keeps it, "
        "layer inputs kept compressed and each layer recomputed in backward (least memory, slower); 'auto' "
        "replaces it unless the bytes that adds to the peak in backward, measured on one example of the first "
        "training batch, would take more than half the free memory; it logs what it decided.")})))
    return out


#: class attribute that marks a :func:`with_division` class (its fields are its own; :func:`disable` leaves them)
EXPLICIT = "__hf_division_fields__"


def _division_config(self) -> DivisionConfig:
    """The :class:`DivisionConfig` these arguments describe."""
    return DivisionConfig(**{name: getattr(self, PREFIX + name) for name in DivisionConfig.field_names()})


def check_division_args(args) -> None:
    """Raise a ``ValueError`` naming the ``division_<field>`` argument of ``args`` that is invalid;
    ``division_checkpointing`` becomes its :class:`Checkpointing` member."""
    mode = getattr(args, PREFIX + "checkpointing", Checkpointing.AUTO)
    object.__setattr__(args, PREFIX + "checkpointing", Checkpointing.parse(mode, f"{PREFIX}checkpointing"))
    try:
        _division_config(args)
    except ValueError as err:  # name the argument the user wrote, not the config field
        raise ValueError(str(err).replace("DivisionConfig.", PREFIX)) from None


def with_division(args_cls: type) -> type:
    """``args_cls`` (a ``TrainingArguments`` class) plus the ``division`` / ``division_*`` fields: a
    dataclass subclass of the same name, for explicit use without :func:`enable`."""

    def __post_init__(self):
        args_cls.__post_init__(self)
        check_division_args(self)

    cls = dataclasses.make_dataclass(
        args_cls.__name__,
        _division_fields(),
        bases=(args_cls,),
        namespace={"division_config": _division_config, "__post_init__": __post_init__, "__module__": __name__,
                   EXPLICIT: True},
    )
    cls.__doc__ = f"``{args_cls.__qualname__}`` plus ``division`` / ``division_*`` (hf_division's with_division)."
    return cls


TrainingArguments = with_division(transformers.TrainingArguments)
Seq2SeqTrainingArguments = with_division(transformers.Seq2SeqTrainingArguments)


def apply_from_args(model, args) -> None:
    """Apply division to ``model`` as the Trainer arguments ``args`` say (nothing unless ``args.division``)."""
    if getattr(args, "division", False) and model is not None:
        apply_division(model, args.division_config())


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
        done = settle_checkpointing(model, getattr(args, PREFIX + "checkpointing", Checkpointing.AUTO))
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


# --- enable(): every TrainingArguments class, in place -------------------------------------------------

#: the dataclass fields :func:`enable` adds to every ``TrainingArguments`` class (the same objects in
#: each, so that :func:`disable` finds its own and leaves a :func:`with_division` class's)
ADDED_FIELDS = {f.name: f for f in dataclasses.fields(dataclasses.make_dataclass("DivisionFields", _division_fields()))}
#: attribute of an ``__init__`` wrapper made here: the ``__init__`` it wraps
WRAPPED = "__hf_division_wraps__"
_enabled = False
#: what :func:`enable` replaced on ``transformers.TrainingArguments``: name -> original (absent: None)
_saved: dict = {}


def _subclasses(cls: type) -> list[type]:
    """``cls`` and every class below it."""
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        if c not in out:
            out.append(c)
            todo.extend(c.__subclasses__())
    return out


def _accepting(init):
    """``init`` (a ``TrainingArguments`` ``__init__`` without the division parameters) taking them too:
    they are set on the instance before ``init`` runs, so that ``__post_init__`` sees them."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name, f in ADDED_FIELDS.items():
            if name in kwargs:
                object.__setattr__(self, name, kwargs.pop(name))
            elif name not in self.__dict__:
                object.__setattr__(self, name, f.default)
        init(self, *args, **kwargs)

    setattr(__init__, WRAPPED, init)
    return __init__


def _rejecting(init):
    """``init`` (generated while :func:`enable` was on, so with the division parameters) refusing them."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        given = [name for name in kwargs if name in ADDED_FIELDS]
        if given:
            raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword argument {given[0]!r} "
                            "(hf_division.disable() was called; hf_division.enable() turns it back on)")
        init(self, *args, **kwargs)

    setattr(__init__, WRAPPED, init)
    return __init__


def _set_init(cls: type, on: bool) -> None:
    """Make ``cls``'s own ``__init__`` take the division keywords (``on``) or refuse them (off)."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return  # inherited: the parent's decides
    init = getattr(init, WRAPPED, init)
    params = inspect.signature(init).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        cls.__init__ = init  # passes the keywords on to a parent's __init__
    elif "division" not in params:  # defined before enable(): set them around it
        cls.__init__ = _accepting(init) if on else init
    elif on or any(EXPLICIT in c.__dict__ for c in cls.__mro__):  # its own (with_division) fields
        cls.__init__ = init
    else:  # generated while enable() was on
        cls.__init__ = _rejecting(init)


def _patch_base(base: type) -> None:
    """Give ``base`` (``transformers.TrainingArguments``) the annotations and defaults of the added fields,
    ``division_config()``, and a ``__post_init__`` that checks them."""
    original = base.__dict__["__post_init__"]

    def __post_init__(self):
        original(self)
        check_division_args(self)

    names = ["__post_init__", "division_config", *ADDED_FIELDS]
    _saved.update({name: base.__dict__.get(name) for name in names})
    base.__post_init__, base.division_config = functools.wraps(original)(__post_init__), _division_config
    for name, f in ADDED_FIELDS.items():
        setattr(base, name, f.default)  # the value for instances built before enable()
        base.__annotations__[name] = f.type  # HfArgumentParser reads the types with typing.get_type_hints


def _restore_base(base: type) -> None:
    for name, value in _saved.items():
        if value is None:
            delattr(base, name)
        else:
            setattr(base, name, value)
    for name in ADDED_FIELDS:
        base.__annotations__.pop(name, None)
    _saved.clear()


def enable() -> None:
    """Turn division on for every ``transformers.Trainer`` and its arguments, in this process
    (what ``hf-division run`` does before a script runs). Idempotent; :func:`disable` undoes it.

    Every ``TrainingArguments`` class, those already defined (``Seq2SeqTrainingArguments``, TRL's
    ``SFTConfig`` / ``DPOConfig`` / ``KTOConfig`` / ``GRPOConfig`` / ``RewardConfig``,
    sentence-transformers' ``SentenceTransformerTrainingArguments``, ...) and those defined later,
    accepts ``division=True`` and ``division_<field>=...`` as constructor keywords and through
    ``HfArgumentParser`` / ``TrlParser`` (``--division --division_block_size 16``); an invalid value is
    a ``ValueError`` naming the argument. Every Trainer built afterwards carries
    :class:`DivisionCallback` (it joins Transformers' default callbacks), which applies division when
    training begins if ``args.division``.

    How: the fields join ``transformers.TrainingArguments`` (its dataclass fields, annotations and
    class attributes), so a dataclass defined later inherits them as its own; each class defined
    before gets them in its ``__dataclass_fields__`` and an ``__init__`` that sets them before its
    own runs; ``TrainingArguments.__post_init__`` checks them.
    """
    global _enabled
    if _enabled:
        return
    base = transformers.TrainingArguments
    _patch_base(base)
    for cls in _subclasses(base):
        fields = cls.__dict__.get("__dataclass_fields__")
        if fields is not None:
            for name, f in ADDED_FIELDS.items():
                fields.setdefault(name, f)
        _set_init(cls, on=True)
    if DivisionCallback not in hf_trainer.DEFAULT_CALLBACKS:
        hf_trainer.DEFAULT_CALLBACKS.append(DivisionCallback)
    _enabled = True


def disable() -> None:
    """Undo :func:`enable`: ``TrainingArguments`` classes no longer take the division arguments (those
    made by :func:`with_division` keep theirs) and new Trainers no longer carry
    :class:`DivisionCallback`. Models already patched stay patched (``remove_division`` undoes that)."""
    global _enabled
    if not _enabled:
        return
    base = transformers.TrainingArguments
    for cls in _subclasses(base):
        fields = cls.__dict__.get("__dataclass_fields__")
        if fields is not None:
            for name, f in ADDED_FIELDS.items():
                if fields.get(name) is f:
                    del fields[name]
        _set_init(cls, on=False)
    _restore_base(base)
    while DivisionCallback in hf_trainer.DEFAULT_CALLBACKS:
        hf_trainer.DEFAULT_CALLBACKS.remove(DivisionCallback)
    _enabled = False


def enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _enabled
