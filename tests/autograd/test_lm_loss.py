"""The causal-LM loss computed without holding vocabulary-sized tensors (hf_division.autograd.lm_loss)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from hf_division import DivisionConfig, apply_division, remove_division
from hf_division.analysis.fidelity import cosine, flat_grad
from hf_division.autograd import lm_loss
from hf_division.autograd.lm_loss import CausalLMLossFn, head_of
from hf_division.analysis.measure import held_bytes

from conftest import eval_before_and_after

EXACT = DivisionConfig(linear_bits=0, attention_bits=0, activation_bits=0, norm_bits=0)
VOCAB = 3000


def tiny_llama(tied=True, cls=LlamaForCausalLM):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=0)
    return cls(config)


def batch(seed=0, rows=2, seq=40):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt left out of the loss
    return {"input_ids": ids, "labels": labels}


def test_function_gradients_are_exact_in_float64(monkeypatch):
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 0)  # chunks of the minimum 16 tokens: 3 of them
    torch.manual_seed(0)
    h = torch.randn(2, 20, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (40,))
    targets[::5] = -100

    def fused(h, w, b):
        return CausalLMLossFn.apply(h, w, b, F.linear(h, w, b).detach(), targets, -100, None)

    assert torch.autograd.gradcheck(fused, (h, w, b))
    ref = F.cross_entropy(F.linear(h, w, b).view(-1, 7), targets, ignore_index=-100)
    torch.testing.assert_close(fused(h, w, b), ref)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("num_items", [None, 53])
@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_model_loss_and_gradient_match_transformers(tied, num_items, amp):
    model = tiny_llama(tied)
    inputs = batch()
    if num_items is not None:  # the Trainer's gradient-accumulation denominator
        inputs["num_items_in_batch"] = torch.tensor(num_items)
    model.train()
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        ref = model(**inputs)
    exact = flat_grad(model, inputs, 0, autocast=amp)
    apply_division(model, EXACT)
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        out = model(**inputs)
    assert type(out.loss.grad_fn).__name__ == "CausalLMLossFnBackward"
    assert torch.equal(out.logits, ref.logits)  # the logits callers read are the head's own
    assert torch.equal(out.loss, ref.loss)  # Transformers' loss to the bit
    got = flat_grad(model, inputs, 0, autocast=amp)
    # float32: summation order only; bf16: the fused backward accumulates the head's weight
    # gradient in float32 where autocast's matmul rounds it to bf16
    assert cosine(exact, got) > (0.999999 if amp is None else 0.9999)


def test_shift_labels_are_used_as_given():
    model = tiny_llama()
    inputs = batch()
    shift = torch.roll(inputs["labels"], -1, dims=1)
    shift[:, -1] = -100
    model.train()
    ref = model(input_ids=inputs["input_ids"], labels=inputs["labels"], shift_labels=shift).loss
    apply_division(model, EXACT)
    out = model(input_ids=inputs["input_ids"], labels=inputs["labels"], shift_labels=shift).loss
    torch.testing.assert_close(out, ref)


def test_no_vocabulary_sized_tensor_is_held():
    model = tiny_llama()
    inputs = batch(rows=4, seq=64)
    model.train()
    base, base_kinds = held_bytes(model, inputs)
    apply_division(model)
    div, kinds = held_bytes(model, inputs)
    vocab_tensor = 4 * 64 * VOCAB * 4  # one float32 (tokens, vocab) tensor
    assert base_kinds["other"] >= vocab_tensor
    assert kinds.get("other", 0) < vocab_tensor / 20
    assert div < base / 4


def test_softcapped_logits_fall_back_to_the_model_loss():
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=30.0)
    model = Gemma2ForCausalLM(config)
    inputs = batch()
    model.train()
    ref = model(**inputs).loss
    apply_division(model, EXACT)
    out = model(**inputs)
    assert head_of(out.logits) is None  # soft-capped after the head: not the head's output
    assert type(out.loss.grad_fn).__name__ != "CausalLMLossFnBackward"
    torch.testing.assert_close(out.loss, ref)


def test_custom_loss_function_is_left_alone_and_patching_is_reversible():
    model = tiny_llama()
    apply_division(model)
    assert "_loss_function" in model.__dict__
    remove_division(model)
    assert "_loss_function" not in model.__dict__

    def custom(logits, labels, vocab_size, **kwargs):
        return logits.float().pow(2).mean()

    model.loss_function = custom
    apply_division(model)
    assert model.loss_function is custom
    remove_division(model)
    assert model.loss_function is custom


def test_eval_and_sequence_classification_are_untouched():
    ref, out = eval_before_and_after(tiny_llama(), batch(), apply_division)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    classifier = tiny_llama(cls=LlamaForSequenceClassification)
    apply_division(classifier)
    assert "_loss_function" not in classifier.__dict__


def test_all_ignored_labels_give_nan_like_transformers():
    model = tiny_llama()
    inputs = batch()
    inputs["labels"] = torch.full_like(inputs["labels"], -100)
    model.train()
    ref = model(**inputs).loss
    apply_division(model)
    out = model(**inputs).loss
    assert torch.isnan(ref) and torch.isnan(out)


def test_bf16_autocast_holds_no_low_precision_copy_of_the_head():
    # autocast's Linear keeps its bf16 cast of the (vocabulary-sized) weight for as long as the
    # logits live; the patched head keeps the parameter itself and casts again in backward
    model = tiny_llama(tied=True).train()
    inputs = batch()
    apply_division(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs)
        held, _ = held_bytes(model, inputs)
    head_copy = VOCAB * model.config.hidden_size * 2
    assert held < head_copy / 2
    out.logits.float().pow(2).mean().backward()  # the logits stay differentiable
    assert model.lm_head.weight.grad is not None and model.model.embed_tokens.weight.grad is not None
