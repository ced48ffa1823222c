"""Per-module bit overrides (DivisionConfig.module_bits) and auto-precision."""
import itertools
import json

import pytest
import torch

import hf_division as hd
from hf_division import api
from hf_division.analysis.auto_precision import (
    Sensitivity, Unit, assign, assign_bits, assign_for_cosine, auto_precision, layer_of, measure_sensitivity,
    model_error,
)
from hf_division.config import KINDS, DivisionConfig
from hf_division.analysis.fidelity import gradient_cosine
from hf_division.analysis.measure import held_bytes

from conftest import tiny_batch, tiny_model


def _held(model, batch, config):
    hd.apply_division(model, config)
    try:
        return held_bytes(model.train(), batch)[0]
    finally:
        hd.remove_division(model)


def _everything(model, bits):
    return {name: bits for name, _ in model.named_children()}


# ----------------------------------------------------------------------------- module_bits
def test_bits_lookup_longest_name_wins_per_kind():
    c = DivisionConfig(module_bits={"bert": 8, "bert.encoder.layer.0": {"norm": 2}, "bert.encoder.layer.0.attention": 1})
    assert c.bits("norm", "bert.encoder.layer.0.output.LayerNorm") == 2
    assert c.bits("linear", "bert.encoder.layer.0.output.dense") == 8  # layer.0 sets only norm
    assert c.bits("norm", "bert.encoder.layer.0.attention.output.LayerNorm") == 1
    assert c.bits("norm", "bert.encoder.layer.00") == 8  # a name prefix, not a string prefix
    assert c.bits("linear", "classifier") == 4  # no override: the field
    assert c.for_module("classifier") is c
    assert c.for_module("bert.encoder.layer.0.output").bits("norm") == 2


def test_overrides_honoured_in_bytes(batch):
    model = tiny_model("bert")
    default = _held(model, batch, DivisionConfig())
    all8_fields = _held(model, batch, DivisionConfig(**{f"{k}_bits": 8 for k in KINDS}))
    all8_overrides = _held(model, batch, DivisionConfig(module_bits=_everything(model, 8)))
    layer0 = _held(model, batch, DivisionConfig(module_bits={"bert.encoder.layer.0": 8}))
    assert all8_overrides == all8_fields  # every module overridden = the uniform setting, exactly
    assert default < layer0 < all8_fields  # one layer overridden: in between
    # JSON text and a file path mean the same as the dict
    assert _held(model, batch, DivisionConfig(module_bits=json.dumps({"bert.encoder.layer.0": 8}))) == layer0


def test_overrides_from_file_and_argument_parser(tmp_path):
    from transformers import HfArgumentParser

    from hf_division.integrations.trainer import TrainingArguments

    path = tmp_path / "bits.json"
    path.write_text(json.dumps({"bert.encoder.layer.1": {"attention": 8}}))
    assert DivisionConfig(module_bits=str(path)).bits("attention", "bert.encoder.layer.1.attention.self") == 8
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--division", "--division_module_bits", str(path)])
    assert args.division_config().bits("attention", "bert.encoder.layer.1.x") == 8


def test_actnn_overrides_bypass_its_two_bit_cap(batch):
    model = tiny_model("bert")
    full = dict(linear_bits=8, attention_bits=8, activation_bits=8, norm_bits=8)
    capped = _held(model, batch, DivisionConfig(method="actnn-all", **full))
    assert capped == _held(model, batch, DivisionConfig(method="actnn-all"))  # the fields stay capped at 2
    assert _held(model, batch, DivisionConfig(method="actnn-all", module_bits=_everything(model, 8))) > capped
    # ActNN's own scope: the fields cannot widen it, overrides can
    scoped = _held(model, batch, DivisionConfig(method="actnn", **full))
    assert scoped == _held(model, batch, DivisionConfig(method="actnn"))
    assert _held(model, batch, DivisionConfig(method="actnn", module_bits=_everything(model, 8))) < scoped


@pytest.mark.parametrize("value,match", [
    ('{"a": 3}', r"module_bits\['a'\]\['linear'\]"),
    ({"a": {"lin": 2}}, "module_bits.*unknown kind 'lin'"),
    ("no/such/file.json", "module_bits"),
    ("{not json", "module_bits is not valid JSON"),
    ({"": 2}, "module_bits"),
    ({"a": True}, "module_bits"),
])
def test_bad_module_bits_names_field(value, match):
    with pytest.raises(ValueError, match=match):
        DivisionConfig(module_bits=value)


def test_unknown_module_name_names_field():
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="module_bits.*BertForSequenceClassification.*bert.encoder.layer.9"):
        hd.apply_division(model, DivisionConfig(module_bits={"bert.encoder.layer.9": 2}))
    assert all("forward" not in m.__dict__ for m in model.modules())


# ----------------------------------------------------------------------------- auto-precision pieces
def test_layer_of():
    assert layer_of("bert.encoder.layer.3.attention.self") == "bert.encoder.layer.3"
    assert layer_of("model.layers.10.mlp") == "model.layers.10"
    assert layer_of("classifier") == "classifier"


def test_error_model_scales_with_step_squared():
    e = model_error({2: 9e-3, 4: 9e-3 * (3 / 15) ** 2}, (1, 2, 4, 8))
    assert e[1] == pytest.approx(9e-3 * 9)
    assert e[8] == pytest.approx(9e-3 * (3 / 15) ** 2 * (15 / 255) ** 2)
    assert e[1] > e[2] > e[4] > e[8]


def test_assignment_is_optimal_and_within_budget():
    g = torch.Generator().manual_seed(0)
    bits = (1, 2, 4, 8)
    units = []
    for i in range(6):
        n = int(torch.randint(1, 50, (1,), generator=g)) * 256
        e2 = float(torch.rand(1, generator=g)) * 10 ** float(torch.randint(-5, -1, (1,), generator=g))
        units.append(Unit(f"l.{i}", "linear", n, {2: e2}, model_error({2: e2}, bits)))
    total = sum(u.numel for u in units)
    for budget in (1.5, 2.0, 3.0, 5.0):
        assign_bits(units, bits, budget, resolution=4000)
        used = sum(u.numel * u.bits for u in units)
        got = sum(u.errors[u.bits] for u in units)
        def best(cap):
            return min(sum(u.errors[b] for u, b in zip(units, c)) for c in itertools.product(bits, repeat=len(units))
                       if sum(u.numel * b for u, b in zip(units, c)) <= cap)

        assert used <= budget * total
        # costs are rounded up to whole steps (< 1 step per unit): at least as good as the exact
        # optimum under the budget less that slack, and never better than the exact optimum
        assert best(budget * total) <= got <= best(budget * total * (1 - len(units) / 4000))


def _synthetic_units(n=6, seed=0, bits=(1, 2, 4, 8)):
    g = torch.Generator().manual_seed(seed)
    units = []
    for i in range(n):
        numel = int(torch.randint(1, 50, (1,), generator=g)) * 256
        e2 = float(torch.rand(1, generator=g)) * 10 ** float(torch.randint(-4, -1, (1,), generator=g))
        units.append(Unit(f"l.{i}", "linear", numel, {2: e2}, model_error({2: e2}, bits)))
    return units


def test_assign_for_cosine_is_the_fewest_bits_reaching_the_target():
    sens = Sensitivity(DivisionConfig(), (1, 2, 4, 8), _synthetic_units(), 0.0)
    for target in (0.95, 0.99, 0.999):
        result = assign_for_cosine(sens, target)
        assert result.predicted_cosine >= target
        assert assign(sens, result.budget - 1 / 32).predicted_cosine < target  # a little less budget falls short
    with pytest.raises(ValueError, match="target_cosine"):
        assign_for_cosine(sens, 1.5)


def test_bad_auto_precision_input_names_field(batch):
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="budget"):
        auto_precision(model, batch, 0.5)
    with pytest.raises(ValueError, match="budget"):
        auto_precision(model, batch, "3")
    with pytest.raises(ValueError, match="bits"):
        auto_precision(model, batch, 3.0, bits=(3, 4))
    with pytest.raises(ValueError, match="probe_bits"):
        auto_precision(model, batch, 3.0, probe_bits=(5,))
    with pytest.raises(ValueError, match="probe_bits"):
        auto_precision(model, batch, 3.0, bits=(1, 2), probe_bits=(4,))
    with pytest.raises(ValueError, match="module_bits"):
        auto_precision(model, batch, 3.0, DivisionConfig(module_bits={"classifier": 2}))
    with pytest.raises(ValueError, match="one of budget and target_cosine"):
        auto_precision(model, batch, 3.0, target_cosine=0.95)
    with pytest.raises(ValueError, match="target_cosine"):
        auto_precision(model, batch, target_cosine=1.0)
    with pytest.raises(ValueError, match="compresses no kind"):
        auto_precision(model, batch, 3.0, DivisionConfig(linear_bits=0, attention_bits=0, activation_bits=0, norm_bits=0))


# ----------------------------------------------------------------------------- auto-precision end to end
@pytest.mark.parametrize("method", ["division", "actnn-all"])
def test_auto_beats_uniform_at_equal_bytes(method):
    torch.manual_seed(0)
    model = tiny_model("bert")
    calib, evaluate = tiny_batch(4, 32, seed=1), tiny_batch(4, 32, seed=2)
    sens = measure_sensitivity(model, calib, DivisionConfig(method=method), probe_bits=(1, 2))
    assert {u.kind for u in sens.units} == set(KINDS)
    assert {u.name for u in sens.units} >= {"bert.encoder.layer.0", "bert.encoder.layer.1"}
    result = assign(sens, 2.0)
    assert result.average_bits <= 2.0
    assert "forward" not in model.__dict__ and api.division_config_of(model) is None  # left as found
    uniform = DivisionConfig(method=method, **{f"{k}_bits": 2 for k in KINDS})
    # equal bytes: never more than every unit at the budget's width
    assert _held(model, evaluate, result.config) <= _held(model, evaluate, uniform)
    auto_cos = min(gradient_cosine(model, evaluate, result.config, seeds=(0, 1)))
    uniform_cos = min(gradient_cosine(model, evaluate, uniform, seeds=(0, 1)))
    assert auto_cos > uniform_cos
    # more budget, no less precision anywhere it matters: the predicted error does not grow
    assert assign(sens, 4.0).predicted_error <= result.predicted_error
