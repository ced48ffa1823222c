"""Trainer + HfArgumentParser end to end on a tiny model."""
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, HfArgumentParser

import hf_division as hd
from hf_division import Trainer, TrainingArguments
from hf_division.api import division_config_of

from conftest import tiny_batch, tiny_model


def _dataset(n=24, seq=32):
    b = tiny_batch(batch=n, seq=seq, seed=1)
    return Dataset.from_dict({k: v.tolist() for k, v in b.items()})


def test_parser_exposes_division_fields():
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "x", "--division", "--division_block_size", "4", "--division_norm_bits", "8",
         "--division_rounding", "nearest", "--division_outlier_ratio", "0"]
    )
    assert args.division is True
    cfg = args.division_config()
    assert (cfg.block_size, cfg.norm_bits, cfg.rounding, cfg.outlier_ratio) == (4, 8, "nearest", 0)
    assert cfg.attention_bits is None  # unset: the model family's default, resolved by apply_division
    assert {f"division_{n}" for n in hd.DivisionConfig.field_names()} <= set(vars(args))
    (plain,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--output_dir", "x"])
    assert plain.division is False and plain.division_config() == hd.DivisionConfig()


def test_bad_division_argument_names_field():
    with pytest.raises(ValueError, match="block_size"):
        TrainingArguments(output_dir="x", division=True, division_block_size=0)


def test_trainer_trains_saves_resumes_and_evaluates_uncompressed(tmp_path):
    model = tiny_model("bert", "sdpa")
    args = TrainingArguments(
        output_dir=str(tmp_path), division=True, division_linear_bits=4, max_steps=3,
        per_device_train_batch_size=8, save_steps=2, save_strategy="steps", logging_steps=1,
        report_to=[], use_cpu=True, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(), eval_dataset=_dataset(8))
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert division_config_of(model) == args.division_config().resolved(model.config.model_type)
    # evaluation runs the original forward: identical to an unpatched copy
    metrics = trainer.evaluate()
    hd.remove_division(model)
    ref = Trainer(model=model, args=args, eval_dataset=_dataset(8)).evaluate()
    assert metrics["eval_loss"] == ref["eval_loss"]
    # checkpoints are plain Transformers checkpoints with the same keys
    ckpt = tmp_path / "checkpoint-2"
    reloaded = AutoModelForSequenceClassification.from_pretrained(ckpt)
    assert set(reloaded.state_dict()) == set(model.state_dict())
    # resume from the checkpoint with division on
    args2 = TrainingArguments(**{**args.to_dict(), "max_steps": 4, "output_dir": str(tmp_path)})
    model2 = tiny_model("bert", "sdpa")
    t2 = Trainer(model=model2, args=args2, train_dataset=_dataset())
    t2.train(resume_from_checkpoint=str(ckpt))
    assert t2.state.global_step == 4
    assert division_config_of(model2) is not None


def test_division_off_leaves_model_alone(tmp_path):
    model = tiny_model("bert", "eager")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=_dataset()).train()
    assert division_config_of(model) is None
