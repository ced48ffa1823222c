"""DivisionConfig's typed choices: each is an enum whose members equal their strings, validated
with the allowed values named, offered as choices on the command line, and serialised as strings."""
import json

import pytest
import torch
from transformers import HfArgumentParser

from hf_division.config import DivisionConfig, LfcDtype, Method, Rounding


@pytest.mark.parametrize("field, enum", [("method", Method), ("rounding", Rounding), ("lfc_dtype", LfcDtype)])
def test_a_choice_takes_its_string_or_its_member_and_names_the_others(field, enum):
    for member in enum:
        for given in (member, member.value):
            value = getattr(DivisionConfig(**{field: given}), field)
            assert value is member and value == member.value and str(value) == member.value
    allowed = ", ".join(repr(m.value) for m in enum)
    with pytest.raises(ValueError, match=f"DivisionConfig.{field} must be one of {allowed}, got 'bogus'"):
        DivisionConfig(**{field: "bogus"})


def test_members_behave_as_their_strings():
    config = DivisionConfig(method="actnn-all", lfc_dtype="float16", rounding="nearest")
    assert config.is_actnn and config.torch_lfc_dtype == torch.float16
    assert config.compressor_args("linear")["stochastic"] is False
    assert {"actnn-all": 1}[config.method] == 1  # hashes as its string
    assert json.loads(json.dumps(config.to_dict()))["method"] == "actnn-all"


def test_the_command_line_offers_the_choices():
    parser = HfArgumentParser(DivisionConfig)
    (config,) = parser.parse_args_into_dataclasses(["--method", "actnn", "--lfc_dtype", "float32"])
    assert config.method is Method.ACTNN and config.lfc_dtype is LfcDtype.FLOAT32
    actions = {a.dest: a for a in parser._actions}
    assert list(actions["rounding"].choices) == ["stochastic", "nearest"]
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--rounding", "up"])


def test_derived_settings_follow_a_changed_field():
    """bits() and compressor_args() are memoized (asked for every saved tensor); changing a field
    after they were read, on the config or on a copy made for one module, is still seen."""
    import copy

    config = DivisionConfig()
    assert config.bits("linear") == 4 and config.compressor_args("linear")["bits"] == 4
    config.linear_bits = 8
    assert config.bits("linear") == 8 and config.compressor_args("linear")["bits"] == 8
    config.compressor_args("linear")["bits"] = 0  # the caller's own dict
    assert config.compressor_args("linear")["bits"] == 8
    other = copy.copy(config)
    other._resolved = {"linear": 2}
    assert other.bits("linear") == 2 and other.compressor_args("linear")["bits"] == 2 and config.bits("linear") == 8
    config.group_size = 128
    assert config.compressor_args("norm")["group_size"] == 128
