"""The generic fallback on architectures that have no patcher."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

import hf_division as hd
from hf_division.compress import noise
from hf_division.analysis.fidelity import gradient_cosine

from hf_division.registry import unregistered

from conftest import tiny_batch, tiny_model

UNREGISTERED = {
    "olmo": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
    "stablelm": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", sorted(UNREGISTERED))
def test_generic_fallback(model_type, impl):
    assert model_type not in hd.supported_model_types()
    cfg = AutoConfig.for_model(model_type, vocab_size=128, max_position_embeddings=160, num_labels=3, pad_token_id=1,
                               **UNREGISTERED[model_type])
    torch.manual_seed(0)
    try:
        model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation=impl).train()
    except ValueError as err:
        if "does not support an attention implementation" not in str(err):
            raise
        pytest.skip(f"{model_type} has no {impl} attention in Transformers")
    batch = tiny_batch(batch=4, seq=128)
    with pytest.raises(ValueError, match=model_type):
        hd.apply_division(model)
    fallback = hd.DivisionConfig(generic_fallback=True)
    torch.manual_seed(0)
    ref = model(**batch).logits
    with pytest.warns(UserWarning, match=f"no patcher for model_type '{model_type}'.*generic fallback"):
        hd.apply_division(model, fallback)
    torch.manual_seed(0)
    assert torch.equal(model(**batch).logits, ref)
    hd.remove_division(model)
    with pytest.warns(UserWarning):
        # the noise restarted: the cosine varies with its draw (tiny Gemma3 reads about 0.98),
        # so without it the result depended on what ran before in the process
        noise.reseed(0)
        cosines = sorted(gradient_cosine(model, batch, fallback, seeds=(0, 1, 2)))
        assert cosines[0] >= 0.97 and cosines[1] >= 0.98, cosines
        assert hd.measure_activation_memory(model, batch, fallback).ratio >= 4


#: types people fine-tune whose modules the generic rules must reach without their patcher: inline
#: attention (deberta-v2, longformer; falcon before Transformers 5.25), fused GLU (modernbert), conv front
#: (whisper), experts (MoE). Longformer also scales its global query projection's output in place,
#: which a Function's output may not be where it is a view (``autograd.ops.not_a_view``)
LISTED = ["deberta-v2", "longformer", "modernbert", "bart", "mbart", "whisper", "clip", "siglip", "gemma3_text", "qwen3_moe",
          "mixtral", "gpt_neox", "falcon", "phi"]


@pytest.mark.parametrize("model_type", LISTED)
def test_generic_fallback_on_listed_types(model_type):
    # sdpa holds fewer baseline bytes: the harder case, where Transformers offers it
    impl = "eager" if model_type in ("deberta-v2", "longformer") else "sdpa"
    model = tiny_model(model_type, impl).train()
    batch = tiny_batch(batch=4, seq=128, model_type=model_type)
    fallback = hd.DivisionConfig(generic_fallback=True)
    torch.manual_seed(0)
    ref = model(**batch).logits
    with unregistered(model_type), pytest.warns(UserWarning, match="generic fallback"):
        hd.apply_division(model, fallback)
        torch.manual_seed(0)
        assert torch.equal(model(**batch).logits, ref)
        hd.remove_division(model)
        # the noise restarted: the cosine varies with its draw (tiny Gemma3 reads about 0.98),
        # so without it the result depended on what ran before in the process
        noise.reseed(0)
        cosines = sorted(gradient_cosine(model, batch, fallback, seeds=(0, 1, 2)))
        assert cosines[0] >= 0.97 and cosines[1] >= 0.98, cosines
        assert hd.measure_activation_memory(model, batch, fallback).ratio >= 4
    assert model_type in hd.supported_model_types()  # the family is back after the block


def test_generic_fallback_keeps_a_gated_mlp_that_does_more():
    """Issue 42, item 4: an MLP with a gated MLP's parts whose forward also clamps kept its parts but
    lost the clamp (the generic path replaced its forward with ``down(act(gate) * up)``: training
    the clamp lost moves the training logits). Now it keeps its own forward, and the plain ones are still patched."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    class ClampedMLP(LlamaMLP):
        def forward(self, x):
            return super().forward(x).clamp(-1e-4, 1e-4)

    model = tiny_model("llama").train()
    plain = model.model.layers[0].mlp
    clamped = ClampedMLP(model.config)
    clamped.load_state_dict(model.model.layers[1].mlp.state_dict())
    model.model.layers[1].mlp = clamped
    batch = tiny_batch()
    torch.manual_seed(0)
    ref = model(**batch).logits
    with unregistered("llama"), pytest.warns(UserWarning, match="generic fallback"):
        hd.apply_division(model, hd.DivisionConfig(generic_fallback=True))
    torch.manual_seed(0)
    assert torch.equal(model(**batch).logits, ref)
    assert _wrapper_of(plain).startswith("patch_gated_mlp.")  # the plain form: gate and up kept once
    assert _wrapper_of(clamped).startswith("patch_saved.")  # its own forward, its saves compressed


def _wrapper_of(module) -> str:
    """The qualified name of the patching primitive that wrapped ``module``'s forward."""
    return module.__dict__["forward"].__func__._division_make.__qualname__


def test_generic_fallback_never_recomputes_inline_attention():
    """``recompute_inline_attention`` leaves the generic fallback's inline attentions keeping their
    saves: a recomputation replays torch's random draws only, and an attention the fallback does not
    know may draw elsewhere (BigBird's block-sparse attention, with NumPy). Longformer's, with its
    patcher hidden, holds the same bytes with the field on as off."""
    from hf_division.analysis.measure import account

    model = tiny_model("longformer").train()
    batch = tiny_batch(batch=4, seq=64, model_type="longformer")
    held = {}
    with unregistered("longformer"), pytest.warns(UserWarning, match="generic fallback"):
        for recompute in (False, True):
            hd.apply_division(model, hd.DivisionConfig(generic_fallback=True, recompute_inline_attention=recompute))
            held[recompute] = account(model, batch).by_kind
            hd.remove_division(model)
    assert held[True] == held[False] and held[True]["attention"] > 0
