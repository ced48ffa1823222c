"""``patching.checkpointing.patch_recomputed``: a module run as a checkpoint of its own, through
``recompute_inline_attention`` on the long-input families' sparse attentions (docs/RESULTS.md,
"Long-input attentions"), with and without the user's checkpointing around them."""
import pytest
import torch

import hf_division as hd
from hf_division.analysis.fidelity import cosine, named_grads
from hf_division.analysis.measure import account

from conftest import tiny_batch, tiny_model

RECOMPUTE = hd.DivisionConfig(recompute_inline_attention=True)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("model_type", ["longt5", "longformer", "led"])
def test_recomputed_inline_attention(model_type, checkpointing):
    """The training forward to the bit (its dropout drawn as unpatched), the attention holding its
    inputs only: at most half the attention bytes of division's default, which keeps its saves
    compressed (the tiny LongT5: 16.7x fewer than unpatched against 4.2x, ``scripts/sparse_attention.py``),
    the gradient within the matrix's bounds over two draws, and ``remove_division`` leaving every
    module's class forward."""
    model = tiny_model(model_type).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    batch = tiny_batch(batch=4, seq=64, pad_from=[64, 59, 47, 34], model_type=model_type)
    torch.manual_seed(3)
    ref = model(**batch).logits
    exact = named_grads(model, batch, 0)
    hd.apply_division(model)
    default = account(model, batch).by_kind.get("attention", 0)
    hd.remove_division(model)
    hd.apply_division(model, RECOMPUTE)
    torch.manual_seed(3)
    assert torch.equal(ref, model(**batch).logits)
    if not checkpointing:  # checkpointed, the layers' own checkpoints hold their inputs only either way
        assert account(model, batch).by_kind.get("attention", 0) <= default / 2, default
    norm = torch.cat(list(exact.values())).norm()
    for draw in range(2):
        got = named_grads(model, batch, 0, noise_seed=1000 + draw)
        assert set(got) == set(exact)
        assert cosine(torch.cat(list(exact.values())), torch.cat([got[n] for n in exact])) >= 0.985
        assert all(cosine(g, got[n]) >= 0.95 for n, g in exact.items() if g.norm() >= 0.01 * norm)
    hd.remove_division(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("model_type", ["longt5", "longformer", "led"])
def test_recomputed_inline_attention_with_lora(model_type):
    """PEFT's LoRA on every linear layer, adapters' dropout on: the first layer's attention takes a
    frozen embedding's output, which needs no gradient, and a recomputed module's parameters get
    theirs only through a recorded node, so its input is made a leaf that needs one; without that
    its adapters got no gradient at all. Every adapter's gradient present, within the LoRA sweep's
    bounds (tests/model_patches/test_matrix_lora.py)."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_model(model_type).train(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.1))
    batch = tiny_batch(batch=3, seq=37, pad_from=[37, 30, 20], model_type=model_type)
    adapters = lambda name: "lora_" in name  # noqa: E731
    torch.manual_seed(3)
    ref = lora(**batch).logits
    exact = named_grads(lora, batch, 0, select=adapters)
    hd.apply_division(lora, RECOMPUTE)
    torch.manual_seed(3)
    assert torch.equal(ref, lora(**batch).logits)
    got = named_grads(lora, batch, 0, select=adapters, noise_seed=1000)
    assert set(got) == set(exact)
    norm = torch.cat(list(exact.values())).norm()
    assert cosine(torch.cat(list(exact.values())), torch.cat([got[n] for n in exact])) >= 0.975
    assert all(cosine(g, got[n]) >= 0.9 for n, g in exact.items() if g.norm() >= 0.01 * norm)
