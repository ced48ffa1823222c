"""The family registry: ``model_patches.FAMILIES`` says which module registers which model types,
and a family's module (with its architecture's modeling file) is imported only when its model
type is looked up (hf_division.registry)."""
import importlib
import json
import subprocess
import sys

import pytest

import model_patches
from hf_division import registry

from conftest import CHILD_TIMEOUT_S

ROWS = r"""
import importlib, json
import model_patches
from hf_division import registry
rows, seen = {}, set()
for module in sorted(model_patches.FAMILIES):
    importlib.import_module("model_patches." + module)
    rows[module] = sorted(set(registry.registered()) - seen)
    seen.update(rows[module])
print(json.dumps(rows))
"""


def test_each_module_registers_exactly_its_row():
    """Each module imported in turn, in a fresh process, adds exactly the model types its row names."""
    res = subprocess.run([sys.executable, "-c", ROWS], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert rows == {module: sorted(types) for module, types in model_patches.FAMILIES.items()}


def test_supported_types_are_the_declared_ones():
    for module in model_patches.FAMILIES:
        importlib.import_module(f"model_patches.{module}")
    assert registry.supported_model_types() == registry.registered() == sorted(registry.declared())
    assert registry.fallback().__module__ == "model_patches.generic"


def test_unregistered_hides_a_type_until_the_block_ends():
    assert registry.family("llama") is not None
    with registry.unregistered("llama"):
        assert registry.family("llama") is None and "llama" not in registry.supported_model_types()
    assert registry.family("llama") is not None and "llama" in registry.supported_model_types()


def test_a_training_cache_is_a_kind_not_a_flag():
    """``training_cache`` takes a :class:`~hf_division.registry.TrainingCache`: a flag
    (``dynamic_cache=True`` before there were two kinds) is refused by name, before anything
    registers."""
    with pytest.raises(TypeError, match="training_cache must be a TrainingCache"):
        registry.register("not-a-model-type", training_cache=True)
    assert registry.family("not-a-model-type") is None
    assert registry.family("whisper").training_cache is registry.TrainingCache.ENCODER_DECODER


def test_how_a_checkpointed_layer_runs_is_declared():
    """``checkpoint_forward`` takes a :class:`~hf_division.registry.CheckpointForward`; T5
    declares that its checkpointed first forward runs as the model's checkpointing runs it, the
    other families that it runs bare; ``checkpoint_exact`` takes parameter names (T5's biases)."""
    with pytest.raises(TypeError, match="checkpoint_forward must be a CheckpointForward"):
        registry.register("not-a-model-type", checkpoint_forward=True)
    assert registry.family("not-a-model-type") is None
    assert registry.family("t5").checkpoint_forward is registry.CheckpointForward.AS_CHECKPOINTED
    assert registry.family("llama").checkpoint_forward is registry.CheckpointForward.BARE
    with pytest.raises(TypeError, match="checkpoint_exact must be a tuple of parameter names"):
        registry.register("not-a-model-type", checkpoint_exact="position_bias")
    assert registry.family("t5").checkpoint_exact == ("position_bias", "encoder_decoder_position_bias")
    # mT5 is T5's modeling file under other names: one family, one patcher and policy
    assert registry.family("mt5") == registry.family("umt5") == registry.family("t5")


PROBE = r"""
import json, sys
def modeling():
    return sorted(m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m)
out = {}
import hf_division
out["import"] = modeling()
import transformers
transformers.Trainer, transformers.TrainingArguments  # these load modeling_auto (and bloom's) themselves
own = modeling()
from hf_division import DivisionConfig, Trainer, TrainingArguments, apply_division, supported_model_types
supported_model_types(), DivisionConfig()
out["public names"] = sorted(set(modeling()) - set(own))
from transformers import BertConfig, BertForSequenceClassification
model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                  intermediate_size=64, vocab_size=100))
before = modeling()
apply_division(model)
out["patching bert loads"] = sorted(set(modeling()) - set(before))
print(json.dumps(out))
"""


def test_import_loads_no_modeling_file_and_patching_loads_only_its_own():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"import": [], "public names": [], "patching bert loads": []}
