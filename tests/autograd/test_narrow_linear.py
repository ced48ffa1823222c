"""``DivisionConfig.narrow_linear``: Linear inputs of a few channels (LoRA's rank-r intermediate,
``lora_B``'s input) are kept as they are (docs/DESIGN.md, "Policy")."""
import pytest
import torch

import hf_division as hd
from hf_division.config import DivisionConfig

from conftest import tiny_batch, tiny_model


def _lora_b_grads(config):
    """lora_B's weight gradients of a tiny Llama with r=8 LoRA on q and v at 4 x 256 tokens (the
    rank-r intermediate: 8192 elements, above ``min_numel``); unpatched if ``config`` is None."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model("llama", "sdpa"), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    if config is not None:
        hd.apply_division(model, config)
    model.train()
    torch.manual_seed(1)
    model(**tiny_batch(batch=4, seq=256, model_type="llama")).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_B" in n}


def test_rank_r_input_kept_exact():
    """Every kind but the linear one kept: lora_B's weight gradient needs only its input and the
    output gradient, so it is the unpatched one when its input is kept, and not when compressed."""
    exact = _lora_b_grads(None)
    others = dict(attention_bits=0, activation_bits=0, norm_bits=0, linear_bits=4)
    kept, lost = _lora_b_grads(DivisionConfig(**others)), _lora_b_grads(DivisionConfig(narrow_linear=0, **others))
    for name, g in exact.items():
        assert torch.allclose(kept[name], g, rtol=1e-4, atol=1e-6 * g.abs().max()), name
    assert not all(torch.allclose(lost[n], g, rtol=1e-2, atol=1e-3 * g.abs().max()) for n, g in exact.items())


@pytest.mark.parametrize("value", [-1, 2.0, True])
def test_invalid_narrow_linear_names_the_field(value):
    with pytest.raises(ValueError, match="DivisionConfig.narrow_linear"):
        DivisionConfig(narrow_linear=value)
