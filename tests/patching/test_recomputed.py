"""``patching.checkpointing.patch_recomputed``: a module run as a checkpoint of its own, on the module it
was measured on (LongT5's block-sparse attention; docs/RESULTS.md, "LongT5"), with and without the
user's checkpointing around it."""
import pytest
import torch
import transformers as tf

import hf_division as hd
from hf_division.analysis.fidelity import cosine, named_grads
from hf_division.analysis.measure import account
from hf_division.api import STATE_ATTR
from hf_division.patching.checkpointing import patch_recomputed
from hf_division.patching.wrappers import restore_forward, unwrap
from model_patches.longt5 import SPARSE_ATTENTION

from conftest import tiny_batch, tiny_config


def _recomputing(model) -> list:
    """Division on ``model``, its sparse attentions recomputed instead of keeping their saves."""
    hd.apply_division(model)
    state = getattr(unwrap(model), STATE_ATTR)
    swapped = [(m, p) for m, p in state.modules if isinstance(m, SPARSE_ATTENTION)]
    for module, previous in swapped:
        restore_forward(module, previous)
        state.modules.remove((module, previous))
        patch_recomputed(state, module)
    return [m for m, _ in swapped]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_recomputed_attention_forward_bytes_gradient_and_removal(checkpointing):
    """The training forward to the bit (its dropout drawn as unpatched), the attention holding its
    input only (16.7x fewer bytes for the kind on this batch: ``scripts/longt5_attention.py``),
    the gradient within the matrix's bounds, and ``remove_division`` leaving the class forward."""
    torch.manual_seed(0)
    model = tf.LongT5ForConditionalGeneration(tiny_config("longt5", "eager", encoder_attention_type="local")).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    batch = tiny_batch(batch=4, seq=64, pad_from=[64, 59, 47, 34], model_type="longt5")
    torch.manual_seed(3)
    ref = model(**batch).logits
    before = account(model, batch)
    exact = named_grads(model, batch, 0)
    swapped = _recomputing(model)
    assert len(swapped) == 2
    torch.manual_seed(3)
    assert torch.equal(ref, model(**batch).logits)
    held = account(model, batch)
    if not checkpointing:  # checkpointed, the layer's own checkpoint holds its inputs only either way
        assert before.by_kind["attention"] / held.by_kind["attention"] >= 10, (before.by_kind, held.by_kind)
    norm = torch.cat(list(exact.values())).norm()
    for draw in range(2):
        got = named_grads(model, batch, 0, noise_seed=1000 + draw)
        assert set(got) == set(exact)
        assert cosine(torch.cat(list(exact.values())), torch.cat([got[n] for n in exact])) >= 0.985
        assert all(cosine(g, got[n]) >= 0.95 for n, g in exact.items() if g.norm() >= 0.01 * norm)
    hd.remove_division(model)
    assert all("forward" not in m.__dict__ for m in swapped)
