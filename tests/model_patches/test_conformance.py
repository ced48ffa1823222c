"""One conformance suite, parametrized over every registered model type and attention impl."""
import pytest
import torch
import hf_division as hd
from hf_division.analysis.fidelity import flat_grad, gradient_cosine
from model_patches import falcon

from conftest import case, tiny_batch, tiny_model

pytestmark = pytest.mark.heavy

TYPES = hd.supported_model_types()
INLINE_ATTENTION = ("falcon",) if falcon.INLINE else ()
IMPLS = ["eager", "sdpa"]


@pytest.fixture
def batch(model_type):
    """The default batch for ``model_type`` (tokens, or pixels for ViT)."""
    return tiny_batch(model_type=model_type)


def _forward(model, batch, seed):
    torch.manual_seed(seed)
    return model(**batch)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model_type", TYPES)
def test_training_forward_bit_identical(model_type, impl, batch):
    """The unpatched model's logits to the bit. Where the unpatched forward builds a KV cache
    itself (the decoders a ``DynamicCache``, Whisper an ``EncoderDecoderCache``, from
    ``config.use_cache``), division's returns one of the same kind whose layers hold nothing, and
    its family says which (``Family.training_cache``); where it builds none, neither does
    division's (tests/patching/test_training_cache.py: the encoder-decoders' heads)."""
    from transformers import DynamicCache, EncoderDecoderCache

    from hf_division.patching.training_cache import UnheldCache, output_cache
    from hf_division.registry import TrainingCache, family

    model = tiny_model(model_type, impl).train()
    ref = _forward(model, batch, 3)
    hd.apply_division(model)
    out = _forward(model, batch, 3)
    assert torch.equal(ref.logits, out.logits)
    kind = {DynamicCache: TrainingCache.DECODER, EncoderDecoderCache: TrainingCache.ENCODER_DECODER}
    built = kind.get(type(output_cache(ref)), TrainingCache.NONE)
    got, held = output_cache(out), output_cache(ref)
    if built is TrainingCache.NONE:  # BART's and T5's classification heads, given labels, build none
        assert type(got) is type(held)
        assert family(model_type).training_cache in (TrainingCache.NONE, TrainingCache.ENCODER_DECODER)
        return
    assert family(model_type).training_cache is built
    if built is TrainingCache.DECODER:
        parts, held = (got,), (held,)
    else:
        assert type(got) is EncoderDecoderCache
        parts, held = (got.self_attention_cache, got.cross_attention_cache), (held.self_attention_cache, held.cross_attention_cache)
    for part, whole in zip(parts, held):
        assert isinstance(part, UnheldCache) and len(part.layers) == len(whole.layers)
        assert not any(layer.is_initialized for layer in part.layers)


@pytest.mark.parametrize("use_cache", [None, False])
def test_training_forward_with_packed_position_ids_bit_identical(use_cache):
    """Position ids that restart inside a row (padding-free packing, no attention mask) and the
    caller's ``use_cache`` as given: the unpatched model's logits to the bit. Transformers reads
    packing from the position ids only where no cache is built (``masking_utils``), and a training
    forward builds one from ``config.use_cache``: division must not change whether it does, nor
    the mask that follows (a cache-less forward also reads the packing back on the host)."""
    model = tiny_model("llama", "sdpa").train()
    batch = {k: v for k, v in tiny_batch(model_type="llama").items() if k != "attention_mask"}
    b, t = batch["input_ids"].shape
    batch["position_ids"] = torch.cat([torch.arange(t // 2), torch.arange(t - t // 2)]).expand(b, -1)
    if use_cache is not None:
        batch["use_cache"] = use_cache
    ref = _forward(model, batch, 3).logits
    hd.apply_division(model)
    assert torch.equal(ref, _forward(model, batch, 3).logits)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model_type", TYPES)
def test_eval_and_no_grad_bit_identical(model_type, impl, batch):
    model = tiny_model(model_type, impl)
    model.eval()
    ref = model(**batch).logits.detach()
    hd.apply_division(model)
    assert torch.equal(model(**batch).logits.detach(), ref)
    model.train()
    with torch.no_grad():
        torch.manual_seed(0)
        a = model(**batch).logits
    hd.remove_division(model)
    with torch.no_grad():
        torch.manual_seed(0)
        b = model(**batch).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model_type", TYPES)
def test_gradient_fidelity_and_bytes(model_type, impl):
    model = tiny_model(model_type, impl)
    batch = tiny_batch(batch=4, seq=128, model_type=model_type)
    cos = gradient_cosine(model, batch, seeds=(0, 1))
    assert min(cos) >= 0.98, cos
    mem = hd.measure_activation_memory(model, batch)
    assert mem.ratio >= 4, mem.table()
    two = hd.measure_activation_memory(model, tiny_batch(batch=2, seq=128, model_type=model_type))
    assert two.ratio >= 3.5, two.table()  # fixed per-step costs weigh more in a smaller batch


@pytest.mark.parametrize("model_type", TYPES)
def test_remove_restores_exactly(model_type, batch):
    model = tiny_model(model_type, "eager")
    impl = model.config._attn_implementation
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hd.apply_division(model)
    # Falcon before Transformers 5.25 computes attention inline and branches on the implementation's name: not switched
    assert model.config._attn_implementation != impl or model_type in INLINE_ATTENTION
    hd.apply_division(model)  # idempotent
    hd.remove_division(model)
    hd.remove_division(model)  # no-op
    assert model.config._attn_implementation == impl
    after = {name: dict(m.__dict__) for name, m in model.named_modules()}
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].keys() == after[name].keys(), name
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    g0 = flat_grad(model, batch, 0)
    g1 = flat_grad(tiny_model(model_type, "eager"), batch, 0)
    assert torch.equal(g0, g1)


@pytest.mark.parametrize("model_type", TYPES)
def test_save_pretrained_reload_plain(model_type, batch, tmp_path):
    model = tiny_model(model_type, "eager")
    hd.apply_division(model)
    flat_grad(model, batch, 0)
    model.save_pretrained(tmp_path)
    plain = case(model_type).auto.from_pretrained(tmp_path)
    assert plain.config._attn_implementation in ("eager", "sdpa")
    sd = model.state_dict()
    assert set(plain.state_dict()) == set(sd)
    assert all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())


DECODERS = [t for t in TYPES if t in ("gpt2", "opt", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
                                     "gemma3_text", "gpt_neox", "phi", "falcon", "mixtral", "qwen3_moe", "qwen2_moe")]


@pytest.mark.parametrize("model_type", DECODERS)
def test_causal_lm_head(model_type):
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, "eager"), attn_implementation="eager")
    ids = tiny_batch(batch=2, seq=128)["input_ids"]
    batch = {"input_ids": ids, "labels": ids}
    ref = _forward(model.train(), batch, 0).logits
    hd.apply_division(model)
    assert torch.equal(_forward(model, batch, 0).logits, ref)
    hd.remove_division(model)
    assert min(gradient_cosine(model, batch, seeds=(0,))) >= 0.98


@pytest.mark.parametrize("model_type", TYPES)
def test_trainer_three_steps(model_type, tmp_path):
    from datasets import Dataset

    from hf_division import Trainer, TrainingArguments
    from hf_division.api import division_config_of

    model = tiny_model(model_type, "eager")
    data = Dataset.from_dict({k: v.tolist() for k, v in tiny_batch(batch=12, seq=32, seed=2, model_type=model_type).items()})
    args = TrainingArguments(output_dir=str(tmp_path), division=True, max_steps=3, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert division_config_of(model) is not None


@pytest.mark.parametrize("model_type", TYPES)
def test_later_forwards_hold_and_compute_what_the_first_does(model_type, batch):
    """The forward's TorchFunctionMode is left out of later forwards where the first routed
    nothing (no dropout kept as bits, no cast of a held tensor shared: the ``lazy_forward_mode``
    switch): every later forward holds the bytes the first held, as many as with the mode in
    every forward, and computes the unpatched model's outputs to the bit."""
    from hf_division.analysis.measure import held_bytes
    from hf_division.kernels import configured

    model = tiny_model(model_type, "eager").train()
    ref = _forward(model, batch, 3).logits
    hd.apply_division(model, hd.DivisionConfig(min_numel=0))
    held = [held_bytes(model, batch)[0] for _ in range(3)]
    with configured(lazy_forward_mode=False):
        held.append(held_bytes(model, batch)[0])
    assert len(set(held)) == 1, held
    assert torch.equal(_forward(model, batch, 3).logits, ref)
