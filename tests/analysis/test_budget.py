"""Budget mode (hf_division.analysis.budget): every option measured, the fastest that fits chosen, the
model left as it was."""
import pytest
import torch

import hf_division as hd
from hf_division.api import division_config_of
from hf_division.analysis.budget import Option, candidates, suggest
from hf_division.analysis.measure import account

from conftest import tiny_batch, tiny_model


def _held(model, batch, option):
    option.apply(model)
    torch.manual_seed(0)
    return account(model, batch).device_bytes


def test_options_and_their_bytes_order():
    model = tiny_model("llama", "sdpa")
    names = [o.name for o in candidates(model)]  # 2 layers: every 1 and 2; no offload on a CPU model
    assert names == ["none", "division", "division + ckpt every 2", "division + ckpt every 1", "ckpt every 2",
                     "ckpt every 1"]
    batch = tiny_batch(batch=4, seq=128)
    held = {o.name: _held(model, batch, o) for o in candidates(model)}
    assert held["division"] < held["none"] and held["ckpt every 1"] < held["ckpt every 2"] < held["none"]
    assert held["division + ckpt every 1"] < held["ckpt every 1"]


def test_suggest_picks_the_fastest_that_fits_and_restores_the_model():
    model = tiny_model("bert", "sdpa")
    batch = tiny_batch(batch=4, seq=128)
    hd.apply_division(model, hd.DivisionConfig(block_size=8))
    before = division_config_of(model)
    none = _held(model, batch, Option(False))
    div = _held(model, batch, Option(True))
    hd.apply_division(model, before)
    found = suggest(model, batch, budget_bytes=(none + div) // 2, rounds=1)  # division fits, none does not
    assert division_config_of(model) == before and not model.is_activation_checkpointing
    fits = [m for m in found.measured if m.held_bytes <= found.budget_bytes]
    assert found.chosen in fits and all(m.step_s is not None for m in fits)
    assert found.chosen.step_s == min(m.step_s for m in fits)
    assert "none" not in [m.option.name for m in fits] and "division" in [m.option.name for m in fits]
    assert "<- chosen" in found.table()
    assert suggest(model, batch, budget_bytes=1, rounds=1).chosen is None  # nothing fits one byte
    with pytest.raises(ValueError, match="budget_bytes"):
        suggest(model, batch, budget_bytes=0)


def test_suggest_keeps_layer_by_layer_checkpointing():
    model = tiny_model("llama", "sdpa")
    model.activation_checkpointing_enable(every_n_layers=2)
    flags = [m.gradient_checkpointing for m in model.model.layers]
    suggest(model, tiny_batch(batch=2, seq=32), budget_bytes=2**30, rounds=1, options=[Option(False), Option(True, 1)])
    assert [m.gradient_checkpointing for m in model.model.layers] == flags and division_config_of(model) is None
