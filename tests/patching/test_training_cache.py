"""The KV cache of a training forward with division (hf_division/patching/training_cache.py): a
decoder's ``DynamicCache`` and an encoder-decoder's ``EncoderDecoderCache`` (T5, BART, Whisper)."""
import inspect
import weakref

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache

import hf_division as hd
from hf_division.analysis.fidelity import flat_grad
from hf_division.patching.training_cache import UnheldCache, output_cache
from hf_division.registry import TrainingCache, family

from conftest import tiny_batch, tiny_model


@pytest.fixture
def returned_keys(monkeypatch):
    """Weak references to every key tensor a cache's ``update`` returned."""
    refs = []
    update = DynamicCache.update

    def recording(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        refs.append(weakref.ref(keys))
        return keys, values

    monkeypatch.setattr(DynamicCache, "update", recording)
    return refs


@pytest.mark.parametrize("model_type,impl", [("llama", "eager"), ("llama", "sdpa"), ("gemma3_text", "sdpa")])
def test_no_key_outlives_the_forward_unless_asked(model_type, impl, returned_keys):
    """With division, once the forward has returned (its output still held) no layer's keys are
    alive: autograd keeps compressed copies, and the cache none. Asked for (``use_cache=True``),
    the cache keeps every layer's. Gemma 3's sliding-window layers keep a view of the keys
    (``DynamicSlidingWindowLayer``), which held the whole tensor too."""
    model = tiny_model(model_type, impl).train()
    hd.apply_division(model)
    batch = tiny_batch(model_type=model_type)
    out = model(**batch)
    assert isinstance(output_cache(out), UnheldCache)
    assert len(returned_keys) == model.config.num_hidden_layers
    assert [r for r in returned_keys if r() is not None] == []
    returned_keys.clear()
    asked = model(**batch, use_cache=True)
    assert type(output_cache(asked)) is DynamicCache
    assert len(returned_keys) == model.config.num_hidden_layers
    assert all(r() is not None for r in returned_keys)
    del out, asked


def test_asked_for_cache_is_the_unpatched_models():
    """``use_cache=True``: the cache the unpatched model returns, equal to it; ``use_cache=False``:
    none. Division's choice is only for a caller who did not say."""
    model = tiny_model("llama", "sdpa").train()
    batch = tiny_batch(model_type="llama")
    ref = output_cache(model(**batch, use_cache=True))
    hd.apply_division(model)
    got = output_cache(model(**batch, use_cache=True))
    assert type(got) is DynamicCache
    for a, b in zip(ref.layers, got.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert output_cache(model(**batch, use_cache=False)) is None


def test_continuing_from_the_unheld_cache_raises():
    """Continuing from the training forward's cache would attend to none of the past: it raises,
    naming the way to get a cache that holds the keys."""
    model = tiny_model("llama", "sdpa").train()
    hd.apply_division(model)
    batch = tiny_batch(model_type="llama")
    cache = output_cache(model(**batch))
    with pytest.raises(RuntimeError, match="use_cache=True"):
        cache.get_seq_length()
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with pytest.raises(RuntimeError, match="use_cache=True"):
        model(input_ids=batch["input_ids"][:, -1:], **{name: cache})


def test_gradient_is_the_one_with_the_cache_held():
    """Holding nothing changes no computation: the gradient, noise draws the same, equals to the
    bit the one of a forward whose cache holds the keys (``use_cache=True``)."""
    model = tiny_model("llama", "eager").train()
    batch = tiny_batch(model_type="llama")
    hd.apply_division(model)
    unheld = flat_grad(model, batch, 0, noise_seed=1)
    held = flat_grad(model, dict(batch, use_cache=True), 0, noise_seed=1)
    assert torch.equal(unheld, held)


DECODERS = [t for t in hd.supported_model_types() if family(t).training_cache is TrainingCache.DECODER]


@pytest.mark.parametrize("name", DECODERS + ["t5", "bart", "whisper"])
def test_no_cache_under_checkpointing(name):
    """Transformers builds no cache under gradient checkpointing; division gives none either (a
    cache there would change the layers' inputs' layout, not only what is held, and a layer's
    recomputation in backward would update it once closed). The flag is that of the module that
    builds the cache: an encoder-decoder's decoder, OPT's ``OPTDecoder`` inside ``OPTModel``."""
    if name in DECODERS:
        model, batch = tiny_model(name, "eager"), tiny_batch(model_type=name)
    else:
        model, batch = _seq2seq(name)
        batch = dict(batch, decoder_input_ids=torch.randint(5, 100, (2, 8), generator=torch.Generator().manual_seed(1)))
    model.train().activation_checkpointing_enable()
    assert output_cache(model(**batch)) is None
    hd.apply_division(model)
    assert output_cache(model(**batch)) is None


def test_whisper_holds_no_cross_attention_keys_unless_asked(returned_keys):
    """Whisper's head builds an ``EncoderDecoderCache`` with labels given: self-attention's keys
    and, per layer, cross-attention's over every audio frame. With division neither outlives the
    forward, both halves are closed after it, the gradient is the one with them held to the bit,
    and ``use_cache=True`` gets the cache that holds them, equal to the unpatched model's."""
    model = tiny_model("whisper", "sdpa").train()
    batch = tiny_batch(model_type="whisper")
    ref = output_cache(model(**batch, use_cache=True))
    hd.apply_division(model)
    returned_keys.clear()
    out = model(**batch)
    cache = output_cache(out)
    assert type(cache) is EncoderDecoderCache
    assert len(returned_keys) == 2 * model.config.decoder_layers  # each layer's self- and cross-attention
    assert [r for r in returned_keys if r() is not None] == []
    with pytest.raises(RuntimeError, match="use_cache=True"):
        cache.get_seq_length()
    with pytest.raises(RuntimeError, match="use_cache=True"):
        cache.cross_attention_cache.get_seq_length()
    del out, cache
    got = output_cache(model(**batch, use_cache=True))
    for part in ("self_attention_cache", "cross_attention_cache"):
        assert type(getattr(got, part)) is DynamicCache
        for a, b in zip(getattr(ref, part).layers, getattr(got, part).layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    unheld = flat_grad(model, batch, 0, noise_seed=1)
    held = flat_grad(model, dict(batch, use_cache=True), 0, noise_seed=1)
    assert torch.equal(unheld, held)


def _seq2seq(name: str):
    """A tiny encoder-decoder with its conditional-generation head, 2 encoder and 3 decoder layers
    (so that a cache sized by the encoder's depth shows), and its inputs without labels."""
    import transformers as tf

    ids = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    sizes = dict(d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                 decoder_start_token_id=0)
    if name == "t5":
        config = tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
                             vocab_size=128, decoder_start_token_id=0, dropout_rate=0.0)
        return tf.T5ForConditionalGeneration(config), {"input_ids": ids}
    if name == "whisper":
        config = tf.WhisperConfig(**sizes, max_source_positions=16, max_target_positions=32, num_mel_bins=8)
        features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
        return tf.WhisperForConditionalGeneration(config), {"input_features": features}
    head = {"bart": tf.BartForConditionalGeneration, "mbart": tf.MBartForConditionalGeneration}[name]
    config = {"bart": tf.BartConfig, "mbart": tf.MBartConfig}[name](**sizes, dropout=0.0)
    return head(config), {"input_ids": ids}


@pytest.mark.parametrize("labels", [True, False], ids=["labels", "no-labels"])
@pytest.mark.parametrize("name", ["t5", "bart", "mbart", "whisper"])
def test_encoder_decoder_heads_cache_as_the_unpatched_ones(name, labels):
    """The conditional-generation heads, with labels and without (a loss computed outside the
    model, as the Trainer's label smoothing does): where the unpatched head builds an
    ``EncoderDecoderCache`` (T5's and Whisper's always, BART's without labels), division's
    builds one of the decoder's depth that holds nothing; where the head turns ``use_cache`` off
    (BART's given labels), none, as the unpatched one; the logits to the bit either way."""
    model, batch = _seq2seq(name)
    model.train()
    targets = torch.randint(5, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    batch = dict(batch, labels=targets) if labels else dict(batch, decoder_input_ids=targets)
    torch.manual_seed(0)
    ref = model(**batch)
    hd.apply_division(model)
    torch.manual_seed(0)
    out = model(**batch)
    assert torch.equal(ref.logits, out.logits)
    held, got = output_cache(ref), output_cache(out)
    assert (held is None) == (name in ("bart", "mbart") and labels)
    if held is None:
        assert got is None
        return
    assert type(got) is EncoderDecoderCache
    for part in ("self_attention_cache", "cross_attention_cache"):
        mine, theirs = getattr(got, part), getattr(held, part)
        assert isinstance(mine, UnheldCache) and len(mine.layers) == len(theirs.layers) == 3
        assert not any(layer.is_initialized for layer in mine.layers)
