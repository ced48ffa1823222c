"""``hf_division.enable()`` / ``disable()``: every ``TrainingArguments`` class takes ``division`` and
``division_<field>`` (classes defined before and after, other libraries' included; constructor and
``HfArgumentParser``), every Trainer built afterwards carries ``DivisionCallback``; ``disable()`` undoes it."""
import dataclasses
import logging

import pytest
import transformers
import transformers.trainer as hf_trainer
from datasets import Dataset
from transformers import HfArgumentParser, Seq2SeqTrainingArguments, TrainingArguments
from transformers.utils import logging as hf_logging

import hf_division as hd
from hf_division.api import division_config_of
from hf_division.integrations.trainer import DivisionCallback, enabled

from conftest import tiny_batch, tiny_model


@pytest.fixture(autouse=True)
def off_after():
    """Each test starts and ends with division disabled."""
    hd.disable()
    yield
    hd.disable()


def library_classes() -> list:
    """``TrainingArguments`` classes other libraries define (imported here, before any ``enable()``)."""
    out = [Seq2SeqTrainingArguments]
    try:
        import trl

        out += [trl.SFTConfig, trl.DPOConfig, trl.KTOConfig, trl.GRPOConfig, trl.RewardConfig]
    except ImportError:
        pass
    try:
        from sentence_transformers import SentenceTransformerTrainingArguments

        out.append(SentenceTransformerTrainingArguments)
    except ImportError:
        pass
    return out


def _build(cls, **kw):
    extra = {"bf16": False} if cls.__module__.startswith("trl.") else {}  # TRL defaults to bf16, not on every CPU
    return cls(output_dir="out", **extra, **kw)


@dataclasses.dataclass
class DefinedBefore(TrainingArguments):
    """A script's own arguments class, defined before ``enable()``."""

    my_option: int = 3


def test_enable_is_idempotent():
    hd.enable()
    fields = [f.name for f in dataclasses.fields(TrainingArguments)]
    hd.enable()
    assert enabled() and hd_callbacks() == 1
    assert [f.name for f in dataclasses.fields(TrainingArguments)] == fields
    assert fields.count("division") == 1 and "division_block_size" in fields and "division_checkpointing" in fields
    hd.disable()
    hd.disable()
    assert not enabled() and hd_callbacks() == 0


def hd_callbacks() -> int:
    return sum(cb is DivisionCallback for cb in hf_trainer.DEFAULT_CALLBACKS)


@pytest.mark.parametrize("cls", [TrainingArguments, DefinedBefore, *library_classes()], ids=lambda c: c.__name__)
def test_classes_defined_before_take_the_arguments(cls):
    made_before = _build(cls)
    hd.enable()
    args = _build(cls, division=True, division_block_size=8, division_linear_bits=2)
    assert args.division and args.division_config().block_size == 8 and args.division_config().linear_bits == 2
    assert _build(cls).division is False and _build(cls).division_config() == hd.DivisionConfig()
    assert made_before.to_dict()["division"] is False  # an instance from before reads the defaults
    (parsed,) = HfArgumentParser(cls).parse_args_into_dataclasses(
        ["--output_dir", "x", "--division", "--division_block_size", "16", "--division_rounding", "nearest",
         *(["--bf16", "false"] if cls.__module__.startswith("trl.") else [])])
    assert parsed.division and (parsed.division_block_size, parsed.division_rounding) == (16, "nearest")
    assert isinstance(parsed, cls)


def test_class_defined_after_enable_takes_them():
    hd.enable()

    @dataclasses.dataclass
    class DefinedAfter(Seq2SeqTrainingArguments):
        my_option: int = 3

    (args,) = HfArgumentParser(DefinedAfter).parse_args_into_dataclasses(
        ["--output_dir", "x", "--division", "--division_block_size", "16", "--my_option", "4"])
    assert (args.division, args.division_block_size, args.my_option) == (True, 16, 4)
    assert DefinedAfter(output_dir="x", division_norm_bits=8).division_config().norm_bits == 8
    with pytest.raises(ValueError, match="division_block_size"):
        DefinedAfter(output_dir="x", division_block_size=0)
    hd.disable()
    with pytest.raises(TypeError, match="'division'"):
        DefinedAfter(output_dir="x", division=True)
    assert "division" not in {f.name for f in dataclasses.fields(DefinedAfter)}
    hd.enable()
    assert DefinedAfter(output_dir="x", division=True).division


@pytest.mark.parametrize("cls", [TrainingArguments, DefinedBefore, *library_classes()], ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad,error", [
    ({"division_block_size": 0}, "division_block_size"), ({"division_rounding": "up"}, "division_rounding"),
    ({"division_linear_bits": 3}, "division_linear_bits"), ({"division_checkpointing": "sometimes"}, "division_checkpointing"),
])
def test_bad_value_names_the_argument(cls, bad, error):
    hd.enable()
    with pytest.raises(ValueError, match=error):
        _build(cls, division=True, **bad)


def test_unknown_division_argument_is_refused():
    hd.enable()
    with pytest.raises(TypeError, match="division_bogus"):
        DefinedBefore(output_dir="x", division_bogus=1)


def test_disable_restores_the_classes():
    hd.enable()
    hd.disable()
    for cls in (TrainingArguments, DefinedBefore, *library_classes()):
        with pytest.raises(TypeError, match="'division'"):
            _build(cls, division=True)
        assert not any(f.name.startswith("division") for f in dataclasses.fields(cls))
        assert not hasattr(_build(cls), "division_config")
    with pytest.raises(ValueError, match="--division"):
        HfArgumentParser(DefinedBefore).parse_args_into_dataclasses(["--output_dir", "x", "--division"])
    assert "division" not in TrainingArguments.__annotations__
    # a with_division class keeps its own fields either way
    explicit = hd.with_division(DefinedBefore)
    assert explicit(output_dir="x", division=True, my_option=5).division_config() == hd.DivisionConfig()
    hd.enable()
    hd.disable()
    assert explicit(output_dir="x", division=True).division


def _dataset(n=16, seq=32):
    b = tiny_batch(batch=n, seq=seq, seed=1)
    return Dataset.from_dict({k: v.tolist() for k, v in b.items()})


def test_any_trainer_built_after_enable_applies_division(tmp_path, caplog):
    hd.enable()
    model = tiny_model("bert", "sdpa")
    args = DefinedBefore(output_dir=str(tmp_path), division=True, division_block_size=4, max_steps=1,
                         per_device_train_batch_size=8, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset())
    hf_logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert division_config_of(model).block_size == 4
    said = [r.getMessage() for r in caplog.records if "hf-division" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("hf-division: division on (division); gradient checkpointing off")
    # hf_division's own Trainer carries the callback once
    hd_trainer = hd.Trainer(model=tiny_model("bert", "sdpa"), args=args, train_dataset=_dataset())
    hd_trainer.train()
    assert sum(isinstance(cb, DivisionCallback) for cb in hd_trainer.callback_handler.callbacks) == 1
    # off: division_config_of stays None for a Trainer built after disable()
    hd.disable()
    plain = tiny_model("bert", "sdpa")
    off_args = DefinedBefore(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    off = transformers.Trainer(model=plain, args=off_args, train_dataset=_dataset())
    assert not any(isinstance(cb, DivisionCallback) for cb in off.callback_handler.callbacks)
