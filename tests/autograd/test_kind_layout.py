"""Per-kind HFC group and LFC block (``linear_*`` / ``attention_*`` / ``activation_*`` / ``norm_*``
``_group_size`` / ``_block_size``)."""
import pytest
import torch

from hf_division.compress.pipeline import compress, decompress
from hf_division.config import DivisionConfig


def test_kind_layout_falls_back_to_global_fields():
    c = DivisionConfig(group_size=128, block_size=8, attention_group_size=32, activation_block_size=1)
    assert c.compressor_args("attention")["group_size"] == 32
    assert c.compressor_args("attention")["block_size"] == 8
    assert c.compressor_args("activation")["group_size"] == 128
    assert c.compressor_args("activation")["block_size"] == 1
    assert c.compressor_args("linear")["group_size"] == 128 and c.compressor_args("norm")["block_size"] == 8
    norm = DivisionConfig(group_size=128, norm_group_size=32).compressor_args("norm")
    assert (norm["group_size"], norm["block_size"]) == (32, 16)
    gated = DivisionConfig().resolved("llama")  # the residual stream in groups of 32 tokens, with the LFC
    assert (gated.compressor_args("norm")["group_size"], gated.compressor_args("norm")["block_size"]) == (32, 16)
    linear = DivisionConfig(linear_group_size=32, linear_block_size=1).compressor_args("linear")
    assert (linear["group_size"], linear["block_size"]) == (32, 1)
    assert DivisionConfig(method="actnn", attention_block_size=16).compressor_args("attention")["block_size"] == 1


def test_unset_kind_layout_survives_resolution():
    c = DivisionConfig().resolved("llama")
    assert c.attention_group_size is None and c.compressor_args("attention")["group_size"] == c.group_size


@pytest.mark.parametrize("field, value", [("attention_group_size", 12), ("activation_group_size", 0),
                                          ("linear_group_size", 20), ("linear_block_size", 0),
                                          ("attention_group_size", True), ("activation_block_size", 0),
                                          ("attention_block_size", 2.0), ("norm_group_size", 12),
                                          ("norm_block_size", 0)])
def test_invalid_kind_layout_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"DivisionConfig.{field}"):
        DivisionConfig(**{field: value})


def test_small_groups_without_lfc_are_unbiased_and_finer():
    torch.manual_seed(0)
    x = torch.randn(4, 128, 24) * torch.linspace(0.1, 10, 24)
    x[:, ::37] *= 8  # a few large tokens per channel widen the 256-token groups
    args = dict(bits=4, lfc_dtype=torch.bfloat16, stochastic=True)
    gen = torch.Generator().manual_seed(1)
    mean = torch.zeros_like(x)
    for _ in range(400):
        mean += decompress(compress(x, block_size=1, group_size=32, generator=gen, **args))
    step = x.abs().amax() / 15
    assert ((mean / 400 - x).abs().max() < 0.15 * step)  # unbiased: the mean of draws converges to x
    err_small = (decompress(compress(x, block_size=1, group_size=32, generator=gen, **args)) - x).pow(2).mean()
    err_wide = (decompress(compress(x, block_size=16, group_size=256, generator=gen, **args)) - x).pow(2).mean()
    assert err_small < err_wide
