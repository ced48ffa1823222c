"""``early_layers`` and ``late_layers``: activation inputs of the first and last layers at 8 bits
(gated decoders' default)."""
import json

import pytest
import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

import hf_division as hd
from hf_division.api import division_config_of
from hf_division.config import EDGE_ACTIVATION_BITS, DivisionConfig
from hf_division.analysis.measure import held_bytes

NAMES = [f"model.layers.{i}" for i in range(10)]


def llama(layers=5):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.parametrize("fraction, count", [(0, 0), (0.05, 1), (0.4, 4), (0.45, 5), (1, 10)])
def test_first_ceil_fraction_of_layers(fraction, count):
    c = DivisionConfig(early_layers=fraction).with_edge_layers(NAMES)
    early = [n for n in NAMES if c.for_module(n + ".mlp").bits("activation") == EDGE_ACTIVATION_BITS]
    assert early == NAMES[:count]
    assert all(c.for_module(n).bits("linear") == c.bits("linear") for n in NAMES)


def test_module_bits_keep_their_layers_and_folding_is_idempotent():
    c = DivisionConfig(early_layers=0.3, module_bits=json.dumps({"model.layers.1": 2, "model.layers.2.mlp": {"linear": 8}}))
    folded = c.with_edge_layers(NAMES)
    assert folded.for_module("model.layers.0.mlp").bits("activation") == 8
    assert folded.for_module("model.layers.1.mlp").bits("activation") == 2  # named by the user: theirs
    assert folded.for_module("model.layers.2.mlp").bits("activation") == c.bits("activation")  # a module of it named
    assert folded.with_edge_layers(NAMES) == folded


@pytest.mark.parametrize("early, late, chosen", [(0, 0.05, [9]), (0, 0.25, [7, 8, 9]), (0.4, 0.05, [0, 1, 2, 3, 9]),
                                                 (0.6, 0.6, list(range(10))), (0, 1, list(range(10)))])
def test_last_ceil_fraction_of_layers(early, late, chosen):
    c = DivisionConfig(early_layers=early, late_layers=late).with_edge_layers(NAMES)
    raised = [i for i, n in enumerate(NAMES) if c.for_module(n + ".mlp").bits("activation") == EDGE_ACTIVATION_BITS]
    assert raised == chosen
    assert c.with_edge_layers(NAMES) == c


@pytest.mark.parametrize("bits", [0, 8])
def test_only_raises_the_bits(bits):
    c = DivisionConfig(early_layers=0.5, activation_bits=bits)
    assert c.with_edge_layers(NAMES) == c


@pytest.mark.parametrize("value", [-0.1, 1.5, True, "0.4"])
def test_invalid_fraction_names_the_field(value):
    with pytest.raises(ValueError, match="DivisionConfig.early_layers"):
        DivisionConfig(early_layers=value)
    with pytest.raises(ValueError, match="DivisionConfig.late_layers"):
        DivisionConfig(late_layers=value)


def test_gated_decoder_default_costs_bytes_only_in_edge_layers():
    model = llama(layers=5).train()
    ids = torch.randint(1, 300, (2, 64), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    hd.apply_division(model)
    assert (division_config_of(model).early_layers, division_config_of(model).late_layers) == (0.4, 0.05)
    held = {}
    for early, late in ((0.4, 0.05), (0, 0.05), (0, 0)):
        hd.apply_division(model, DivisionConfig(early_layers=early, late_layers=late))
        held[early, late] = held_bytes(model, inputs)
    # 2 first and 1 last of 5 layers' gate/up inputs at 8 bits, then only the last, then none
    layer = held[0, 0.05][1]["activation"] - held[0, 0][1]["activation"]
    assert layer > 0
    assert held[0.4, 0.05][1]["activation"] - held[0, 0][1]["activation"] == 3 * layer
    assert held[0.4, 0.05][0] - held[0, 0][0] == 3 * layer


def test_command_line_field():
    (args,) = HfArgumentParser(hd.TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "o", "--division", "--division_early_layers", "0.25", "--division_late_layers", "0.1"])
    assert (args.division_config().early_layers, args.division_config().late_layers) == (0.25, 0.1)
