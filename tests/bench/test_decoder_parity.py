"""The decoder-parity suite's core (TRL SFT baseline vs division, then scoring) on a tiny random-init
Llama with a word-level tokenizer built here, so that it runs offline without SmolLM2."""
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_division.bench.suites import decoder_parity as parity
from hf_division.bench.suites.common import read_json, write_json
from hf_division.bench.textdata import BUNDLED_SST2_DEV
from hf_division.bench.tiny_models import DECODER

pytest.importorskip("trl")


def word_tokenizer(examples: list[dict]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words of ``examples``: the prompts tokenize the same alone and
    with their answer, as TRL's prompt-completion split needs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    split = pre_tokenizers.Whitespace().pre_tokenize_str
    words = sorted({w for e in examples for w, _ in split(e["prompt"] + e["completion"])})
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_core_runs_both_arms_and_division_is_on_only_in_its_arm(mode, tmp_path):
    if mode == "lora":
        pytest.importorskip("peft")
    examples = parity.sst2_examples(BUNDLED_SST2_DEV, 40)
    tokenizer = word_tokenizer(examples)
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), max_position_embeddings=160,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **DECODER)

    def load_model():
        torch.manual_seed(0)  # the same weights in every arm, as a pretrained folder gives
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    plan = dict(steps=2, batch=2, lr=1e-3, train_rows=32)
    result = parity.run_mode(load_model, tokenizer, mode, [0], plan, examples[:32], examples[32:], str(tmp_path),
                             log=lambda *_: None)
    assert [(r["arm"], r["seed"]) for r in result["rows"]] == [("baseline", 0), ("division", 0)]
    base, div = result["rows"]
    assert base["division"] is None and div["division"] is not None  # patched while it trained, and only then
    assert base["checkpointing"] is True  # TRL's default, left to division to settle in its arm
    assert {base["autocast"], div["autocast"]} == ({"bfloat16"} if mode == "full" else {None})
    for r in (*result["rows"], result["zero_shot"]):
        assert 0 <= r["accuracy"] <= 1 and r["loss"] > 0
    assert all(len(r["train_losses"]) == 2 for r in result["rows"])
    summary = result["summary"]
    assert set(summary["within_baseline_range"]) == {"accuracy", "loss"}
    assert summary["division"]["accuracy"]["values"] == [div["accuracy"]]
    table = parity.report(result)
    assert "| zero-shot |" in table and "| division |" in table and "seed range" in table
    out = tmp_path / "parity.json"
    write_json(str(out), result)
    back = read_json(str(out))
    assert back["rows"][1]["division"] == div["division"] and "provenance" in json.loads(out.read_text())
