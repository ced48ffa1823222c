"""TRL's preference and reward trainers as clients of ``hf_division.enable()``: ``DPOConfig(division=True)``
(likewise KTO, reward) on a tiny random-init Llama with a word-level tokenizer built here (no download)
trains two steps with division applied; ``GRPOConfig`` takes the arguments too."""
import logging

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from hf_division.api import division_config_of

trl = pytest.importorskip("trl")

#: (prompt, chosen, rejected)
PAIRS = [("the film is", "a quiet delight", "a tedious mess"), ("the plot was", "sharp and clever", "dull and slow"),
         ("i found the acting", "warm and true", "flat and stiff"), ("the ending felt", "earned and moving", "rushed and cheap")]


pytestmark = pytest.mark.usefixtures("enabled_division")


def word_tokenizer() -> PreTrainedTokenizerFast:
    words = sorted({w for row in PAIRS for text in row for w in text.split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def tiny_llama(tok, cls=LlamaForCausalLM, **extra):
    torch.manual_seed(0)
    return cls(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id, bos_token_id=None, max_position_embeddings=64, **extra))


def build(kind: str, tok, out: str):
    """``(trainer, model)`` for TRL's ``kind`` trainer, its config built with ``division=True``."""
    # min_numel 0: the tiny model's saved tensors are compressed too, so the trainer's step runs division's Functions
    args = dict(output_dir=out, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                report_to="none", save_strategy="no", bf16=False, use_cpu=True, seed=0, disable_tqdm=True,
                division=True, division_min_numel=0)
    if kind == "dpo":
        model = tiny_llama(tok)
        data = Dataset.from_list([{"prompt": p, "chosen": " " + c, "rejected": " " + r} for p, c, r in PAIRS])
        return trl.DPOTrainer(model=model, ref_model=tiny_llama(tok), args=trl.DPOConfig(**args), train_dataset=data,
                              processing_class=tok), model
    if kind == "kto":
        model = tiny_llama(tok)
        data = Dataset.from_list([{"prompt": p, "completion": " " + text, "label": good}
                                  for p, c, r in PAIRS for text, good in ((c, True), (r, False))])
        return trl.KTOTrainer(model=model, ref_model=tiny_llama(tok), args=trl.KTOConfig(**args), train_dataset=data,
                              processing_class=tok), model
    model = tiny_llama(tok, LlamaForSequenceClassification, num_labels=1)
    data = Dataset.from_list([{"chosen": f"{p} {c}", "rejected": f"{p} {r}"} for p, c, r in PAIRS])
    return trl.RewardTrainer(model=model, args=trl.RewardConfig(**args), train_dataset=data, processing_class=tok), model


@pytest.mark.parametrize("kind", ["dpo", "kto", "reward"])
def test_trl_trainer_applies_division(kind, tmp_path, caplog):
    trainer, model = build(kind, word_tokenizer(), str(tmp_path))
    before = [p.detach().clone() for p in model.parameters()]
    hf_logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        trainer.train()
    applied = division_config_of(model)
    assert applied is not None and applied.min_numel == 0  # the arguments' config, resolved for Llama
    assert any(r.getMessage().startswith("hf-division: division on") for r in caplog.records)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_grpo_config_takes_division_arguments(tmp_path):
    (args,) = trl.TrlParser(trl.GRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--bf16", "false", "--division", "--division_block_size", "16"])
    assert args.division and args.division_config().block_size == 16
    assert trl.GRPOConfig(output_dir=str(tmp_path), bf16=False, division=True).division
