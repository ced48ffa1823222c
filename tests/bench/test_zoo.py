"""The shared measurement helpers: model zoo, text batches, flat gradients."""
import pytest
import torch

import hf_division as hd
from hf_division.analysis.fidelity import cosine, flat_grad, gradient_cosine
from hf_division.bench.textdata import (
    BUNDLED_SST2_DEV, causal_lm_batch, classification_batch, glue_sentences, random_tokens, read_tsv,
    sentence_batch, sst2_rows,
)
from hf_division.bench.zoo import FAMILIES, LLAMA_SHAPE, SHAPES, build_classifier, family_model

from conftest import tiny_batch, tiny_model


class WordTokenizer:
    """A stand-in tokenizer: one id per character, so packing is easy to check by hand."""

    eos_token = "|"

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


# ----------------------------------------------------------------------------- textdata
def test_sst2_rows_reads_every_row_after_the_header():
    rows = sst2_rows(BUNDLED_SST2_DEV)
    lines = read_tsv(BUNDLED_SST2_DEV)
    assert lines[0] == ["sentence", "label"] and len(rows) == len(lines) - 1 == 200
    assert rows[0] == (lines[1][0], int(lines[1][1]))
    assert {y for _, y in rows} == {0, 1}


def test_classification_batch_cycles_and_pads():
    rows = [(f"row {i}", i % 2) for i in range(5)]

    class Tok:
        def __call__(self, texts, padding, max_length, truncation, return_tensors):
            assert padding == "max_length" and truncation and return_tensors == "pt"
            ids = torch.tensor([[int(t.split()[1])] + [0] * (max_length - 1) for t in texts])
            return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": (ids > 0).long()}

    batch = classification_batch(Tok(), rows, 7, 12, offset=3)
    assert batch["input_ids"].shape == (7, 12)
    assert batch["input_ids"][:, 0].tolist() == [3, 4, 0, 1, 2, 3, 4]  # from the offset, wrapping round
    assert batch["labels"].tolist() == [1, 0, 0, 1, 0, 1, 0]
    assert list(batch) == ["input_ids", "token_type_ids", "attention_mask", "labels"]
    assert "token_type_ids" not in classification_batch(Tok(), rows, 2, 4, token_type_ids=False)


def test_causal_lm_batch_packs_sentences_with_eos(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("sentence\tlabel\nab \t1\ncd\t0\n", encoding="utf-8")
    batch = causal_lm_batch(str(path), WordTokenizer(), batch=1, seq=5)
    assert batch["input_ids"].tolist() == [[ord(c) for c in "ab|cd"]]
    assert torch.equal(batch["labels"], batch["input_ids"]) and batch["labels"] is not batch["input_ids"]
    with pytest.raises(ValueError, match="fewer than batch x seq = 6"):
        causal_lm_batch(str(path), WordTokenizer(), batch=2, seq=3)
    path.write_text("text\tlabel\nab\t1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="first column is 'sentence'"):
        causal_lm_batch(str(path), WordTokenizer())


def test_glue_sentences_and_padded_sentence_batches(tmp_path):
    mrpc = tmp_path / "mrpc.tsv"
    mrpc.write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\t a b \tc\n0\t3\t4\td e f\tg h\n",
                    encoding="utf-8")
    sentences = glue_sentences(str(mrpc))
    assert sentences == ["a b", "c", "d e f", "g h"]  # both sentences of each row, in order, stripped
    sst2 = tmp_path / "sst2.tsv"
    sst2.write_text("sentence\tlabel\nx y\t1\n", encoding="utf-8")
    assert glue_sentences(str(sst2)) == ["x y"]
    sst2.write_text("text\tlabel\nx\t1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="'sentence' or '#1 String'"):
        glue_sentences(str(sst2))

    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[PAD]", "a", "b", "c", "d", "e", "f", "g", "h"])}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="[PAD]")
    longest = sentence_batch(tok, sentences, 1, 3, "longest")
    assert longest["input_ids"].tolist() == [[3, 0, 0], [4, 5, 6], [7, 8, 0]]
    assert longest["attention_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert longest["labels"].tolist() == [[3, -100, -100], [4, 5, 6], [7, 8, -100]]  # padding out of the loss
    fixed = sentence_batch(tok, sentences, 0, 2, 2)
    assert fixed["input_ids"].tolist() == [[1, 2], [3, 0]] and fixed["labels"].tolist() == [[1, 2], [3, -100]]
    with pytest.raises(ValueError, match="sentences 3..4 asked, 4 in the file"):
        sentence_batch(tok, sentences, 3, 2)


def test_random_tokens_are_reproducible_and_leave_torch_rng_alone():
    state = torch.get_rng_state()
    a, b = random_tokens(50, 2, 8, seed=3), random_tokens(50, 2, 8, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].shape == (2, 8)
    assert a["input_ids"].min() >= 1 and a["input_ids"].max() < 50 and a["labels"].shape == (2,)


# ----------------------------------------------------------------------------- zoo
def test_llama_shape_is_smollm_135m():
    assert LLAMA_SHAPE["hidden_size"] == 576 and LLAMA_SHAPE["num_attention_heads"] == 9
    assert LLAMA_SHAPE["num_key_value_heads"] == 3 and LLAMA_SHAPE["intermediate_size"] == 1536
    assert LLAMA_SHAPE["num_hidden_layers"] == 4 and LLAMA_SHAPE["vocab_size"] == 49152
    assert {k: v for k, v in SHAPES["llama-4l"][1].items() if k in LLAMA_SHAPE and k != "vocab_size"} == \
        {k: v for k, v in LLAMA_SHAPE.items() if k != "vocab_size"}


def test_build_classifier_is_seeded_and_takes_overrides():
    a = build_classifier("tiny-llama", "eager")
    b = build_classifier("tiny-llama", "eager", num_hidden_layers=1)
    assert type(a).__name__ == "LlamaForSequenceClassification" and a.training
    assert a.config.vocab_size == 30522 and a.config.num_labels == 2 and a.config.hidden_size == 64
    assert b.config.num_hidden_layers == 1 and a.config.num_hidden_layers == 2
    again = build_classifier("tiny-llama", "eager", dtype=torch.bfloat16)
    assert next(again.parameters()).dtype == torch.bfloat16
    assert torch.equal(a.model.embed_tokens.weight.to(torch.bfloat16), again.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="unknown model 'gpt9'"):
        build_classifier("gpt9")


@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "llama"])
def test_family_models_take_their_batch(name):
    model, batch = family_model(name)
    assert batch["labels"].shape == (4,)
    if name.startswith("vit"):
        size = 48 if name == "vit" else 64
        assert batch["pixel_values"].shape == (4, 3, size, size)
    else:
        assert batch["input_ids"].shape == (4, 128) and (batch["input_ids"][:, -1] == 1).all()  # T5's eos
    assert model(**batch).logits.shape == (4, 3)
    with pytest.raises(ValueError, match="--families"):
        family_model("gpt9")


# ----------------------------------------------------------------------------- fidelity
def test_flat_grad_is_the_float64_autograd_gradient():
    model, batch = tiny_model("bert"), tiny_batch()
    got = flat_grad(model, batch, seed=5)
    assert got.dtype == torch.float64
    torch.manual_seed(5)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(model(**batch).loss, params, allow_unused=True)
    want = torch.cat([g.flatten().double() for g in grads if g is not None])
    assert torch.equal(got, want)
    assert all(p.grad is None for p in model.parameters())  # left zeroed
    head = flat_grad(model, batch, seed=5, select=lambda n: n.startswith("classifier."))
    assert head.numel() == sum(p.numel() for n, p in model.named_parameters() if n.startswith("classifier."))
    assert torch.equal(head, got[-head.numel():])


def test_flat_grad_autocast_and_noise_reseed():
    model, batch = tiny_model("llama"), tiny_batch(2, 32)
    exact = flat_grad(model, batch, 0)
    bf16 = flat_grad(model, batch, 0, autocast=torch.bfloat16)
    assert not torch.equal(bf16, exact) and cosine(bf16, exact) > 0.99
    hd.apply_division(model)
    try:
        first = flat_grad(model, batch, 0, reseed_noise=True)
        continued = flat_grad(model, batch, 0)  # same torch seed: the noise stream goes on
        again = flat_grad(model, batch, 0, reseed_noise=True)
    finally:
        hd.remove_division(model)
    assert torch.equal(first, again) and not torch.equal(first, continued)


def test_cosine_in_float64():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert cosine(a, a) == pytest.approx(1.0, abs=1e-15) and cosine(a, -a) == pytest.approx(-1.0, abs=1e-15)
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])) == 0.0


def test_gradient_cosine_of_selected_parameters():
    model, batch = tiny_model("bert"), tiny_batch(2, 32)
    whole = gradient_cosine(model, batch, seeds=(0,))
    head = gradient_cosine(model, batch, seeds=(0,), select=lambda n: n.startswith("bert.encoder.layer.0."))
    assert 0.9 < whole[0] <= 1 and 0.5 < head[0] <= 1 and head != whole
