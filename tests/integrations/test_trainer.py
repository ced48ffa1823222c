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


# --- division_checkpointing: decided from the bytes (issue 42, item 7) ------------------------------------

def _causal_lm(vocab: int, layers: int = 2):
    """A tiny Llama with an LM head over ``vocab`` tokens: its logits, which checkpointing keeps
    whole and division compresses, weigh as much as the model's vocabulary makes them; the more
    ``layers``, the smaller the share of one layer recomputed whole in checkpointing's peak."""
    from transformers import LlamaForCausalLM

    from hf_division.bench.tiny_models import tiny_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config("llama", "sdpa", vocab_size=vocab, num_hidden_layers=layers))


def _lm_dataset(seq: int, n=8):
    ids = tiny_batch(batch=n, seq=seq, seed=1)["input_ids"]
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                              "labels": ids.tolist()})


def _per_example(model, seq: int) -> tuple[float, float, float]:
    """MiB one example holds with division alone, with checkpointing alone, and with checkpointing
    while one layer is recomputed whole, measured through the public measurement on the unpatched
    model (not the code under test)."""
    from hf_division.analysis.measure import account

    ids = tiny_batch(batch=1, seq=seq, seed=1)["input_ids"]
    one = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    model.train()
    model.activation_checkpointing_enable()
    kept = account(model, one).total
    model.model.layers[0].gradient_checkpointing = False
    recomputing = account(model, one).total
    model.activation_checkpointing_disable()
    hd.apply_division(model)
    alone = account(model, one).total
    hd.remove_division(model)
    return alone / 2**20, kept / 2**20, recomputing / 2**20


def _train_with_checkpointing(tmp_path, vocab, seq, layers, mode=None):
    kw = {} if mode is None else {"division_checkpointing": mode}
    args = TrainingArguments(output_dir=str(tmp_path), division=True, gradient_checkpointing=True, max_steps=2,
                             per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, seed=0, **kw)
    model = _causal_lm(vocab, layers)
    trainer = Trainer(model=model, args=args, train_dataset=_lm_dataset(seq))
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return model, losses


@pytest.mark.parametrize("vocab,layers,free,replaced", [
    (4096, 2, 0, True),  # checkpointing holds the whole logits: division alone holds less, whatever is free
    (128, 24, 0, False),  # division alone holds more than checkpointing's peak and nothing is free: kept
    (128, 24, 2**40, True),  # the same, with room for what it adds: replaced (faster steps)
])
def test_checkpointing_replaced_by_the_bytes(tmp_path, caplog, monkeypatch, vocab, layers, free, replaced):
    """``auto`` (the default) turns checkpointing off where division alone adds nothing to the peak
    checkpointing had in backward (its layer inputs plus one layer recomputed whole), or adds less
    than half the free memory; it logs the figures it decided from."""
    import logging

    from transformers.utils import logging as hf_logging

    from hf_division.integrations import checkpointing as integration

    import re

    seq = 64
    alone, kept, recomputing = _per_example(_causal_lm(vocab, layers), seq)
    adds = (alone - recomputing) * 4  # a batch of 4
    assert (adds <= 0) == (vocab == 4096) and abs(alone / recomputing - 1) > 0.25, (alone, recomputing)  # clear cases
    monkeypatch.setattr(integration, "free_bytes", lambda module: free)
    hf_logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        model, losses = _train_with_checkpointing(tmp_path, vocab, seq, layers)
    assert model.is_activation_checkpointing is not replaced
    said = [r.getMessage() for r in caplog.records if "one example holds" in r.getMessage()]
    assert len(said) == 1, said
    figures = re.search(r"([\d.]+) MiB for backward with division alone, ([\d.]+) MiB with checkpointing alone, "
                        r"([\d.]+) MiB while it recomputes a layer; the batch of 4 (adds|saves) ([\d.]+) MiB", said[0])
    assert figures, said
    # the same bytes as the public measurement, within its rounding (the patched model under exact()
    # keeps a few hundred bytes of masks differently from the unpatched one)
    for got, want in zip(map(float, figures.group(1, 2, 3, 5)), (alone, kept, recomputing, abs(adds))):
        assert abs(got - want) <= 0.01 + 0.02 * want, (figures.group(0), alone, kept, recomputing, adds)
    assert figures.group(4) == ("adds" if adds > 0 else "saves")
    assert ("division replaces it" in said[0]) is replaced
    # measuring drew no dropout bits nor rounding noise of the steps: the same run as the mode it chose
    _, forced = _train_with_checkpointing(tmp_path, vocab, seq, layers, "replace" if replaced else "combine")
    assert losses == forced and len(losses) == 2


def test_forced_replace_says_when_it_does_not_fit(tmp_path, caplog, monkeypatch):
    import logging

    from transformers.utils import logging as hf_logging

    from hf_division.integrations import checkpointing as integration

    monkeypatch.setattr(integration, "free_bytes", lambda module: 0)
    hf_logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        model, _ = _train_with_checkpointing(tmp_path, 128, 64, 24, "replace")
    assert not model.is_activation_checkpointing
    assert any("auto would keep it" in r.getMessage() for r in caplog.records)
