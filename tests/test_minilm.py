"""Real pretrained MiniLM-L6 on a real SST-2 dev batch (32 x 128 tokens), default config."""
import os

import pytest
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import hf_division as hd
from hf_division.fidelity import gradient_cosine
from hf_division.minilm import minilm_path, sst2_batch

DEV = os.path.join(os.path.dirname(hd.__file__), "data", "sst2_dev_sample.tsv")


@pytest.fixture(scope="module")
def minilm():
    try:
        path = minilm_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(path)
    return path, sst2_batch(tok, DEV, n=32, max_length=128)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_minilm_default_policy(minilm, impl):
    path, batch = minilm
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, attn_implementation=impl)
    cos = gradient_cosine(model, batch, seeds=(0, 1, 2))
    assert min(cos) >= 0.98, cos
    mem = hd.measure_activation_memory(model, batch)
    assert mem.ratio >= 6, mem.table()
