"""TRL as a client: ``hf_division.integrations.trl`` in Python, and TRL's unmodified ``sft.py`` through
``hf-division run``, on a tiny Llama with a word-level tokenizer built here (no download)."""
import json
import logging
import os
import subprocess
import sys

import peft
import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from hf_division.api import division_config_of
from hf_division.bench.malloc_env import MALLOC_ENV
from hf_division.integrations.launcher import STEP_LOG_ENV
from hf_division.integrations.trl import SFTConfig, SFTTrainer
from hf_division.bench.suites.sft import sft_script
from hf_division.bench.textdata import BUNDLED_SST2_DEV, sft_texts
from hf_division.integrations.trainer import TRL_TILE_TOKENS, bound_trl_tiles

from conftest import CHILD_TIMEOUT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = sft_texts(BUNDLED_SST2_DEV, 48, sentences=(1, 3))


def word_tokenizer() -> PreTrainedTokenizerFast:
    words = sorted({w for t in TEXTS for w in t.split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def tiny_model(tok) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def train(tmp_path, division: bool, **extra):
    tok = word_tokenizer()
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                     logging_steps=1, report_to="none", save_strategy="no", bf16=False, seed=0, max_length=64,
                     division=division, division_linear_bits=0, division_attention_bits=0,
                     division_activation_bits=0, division_norm_bits=0, **extra)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=tiny_model(tok), args=args, processing_class=tok, peft_config=lora,
                         train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]))
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return trainer, losses


def test_sft_trainer_with_division_trains_like_trl(tmp_path, caplog):
    _, base = train(tmp_path, division=False)
    hf_logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        trainer, got = train(tmp_path, division=True, division_checkpointing="replace")
    assert division_config_of(trainer.model) is not None
    # TRL turns checkpointing on by default; division replaces it as asked, and says so with the bytes
    assert trainer.args.gradient_checkpointing and not trainer.model.get_base_model().is_activation_checkpointing
    said = [r.getMessage() for r in caplog.records if "division replaces it" in r.getMessage()]
    assert len(said) == 1 and "one example holds" in said[0], said
    # every kind kept exact: the same training up to summation order (the fused loss)
    assert len(got) == len(base) == 4
    assert max(abs(a - b) for a, b in zip(base, got)) < 1e-4
    assert bound_trl_tiles(None) != TRL_TILE_TOKENS  # TRL's tile restored after training


def test_combine_keeps_checkpointing(tmp_path):
    _, base = train(tmp_path, division=False)
    trainer, losses = train(tmp_path, division=True, division_checkpointing="combine")
    assert division_config_of(trainer.model) is not None
    assert trainer.model.get_base_model().is_activation_checkpointing
    # every kind exact (see train): the layers recomputed from their compressed inputs, otherwise
    # TRL's own training up to summation order, as in the test above
    assert len(losses) == len(base) == 4
    assert max(abs(a - b) for a, b in zip(base, losses)) < 1e-4


def test_bad_checkpointing_mode_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="division_checkpointing"):
        SFTConfig(output_dir=str(tmp_path), division=True, division_checkpointing="sometimes", bf16=False)


def test_unmodified_trl_script_through_hf_division_run(tmp_path):
    tok = word_tokenizer()
    tok.save_pretrained(tmp_path / "model")
    tiny_model(tok).save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    log = tmp_path / "steps.jsonl"
    argv = [sys.executable, "-m", "hf_division.integrations.launcher", sft_script(), "--model_name_or_path", str(tmp_path / "model"),
            "--dataset_name", str(tmp_path / "data"), "--per_device_train_batch_size", "4", "--max_length", "64",
            "--max_steps", "3", "--use_peft", "--lora_r", "4", "--lora_target_modules", "all-linear",
            "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--bf16", "false",
            "--output_dir", str(tmp_path / "out"), "--division"]
    env = dict(os.environ, **MALLOC_ENV, **{STEP_LOG_ENV: str(log)}, PYTHONPATH=ROOT)
    res = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=CHILD_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "hf-division: division on" in res.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "seconds" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["peak_bytes"] > 0 for r in steps)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
