"""Public API, bad input, sharing, PEFT."""
import re
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_division as hd
from hf_division import api
from hf_division.autograd import store
from hf_division import measure_activation_memory
from hf_division.autograd.accounting import recorded, start_accounting, stop_accounting
from hf_division.api import division_config_of
from hf_division.registry import Family, family, family_defaults
from hf_division.autograd.store import keep, lookup
from hf_division.config import DivisionConfig
from hf_division.analysis.fidelity import flat_grad, gradient_cosine

from conftest import tiny_batch, tiny_model


def test_supported_model_types():
    assert {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "gpt2", "opt", "llama", "mistral",
            "qwen2", "qwen3", "gemma", "gemma2", "phi3"} <= set(hd.supported_model_types())


def test_unsupported_type_names_it():
    cfg = AutoConfig.for_model("stablelm", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                               intermediate_size=64, vocab_size=64)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="stablelm.*supported: .*bert"):
        hd.apply_division(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    "field,value",
    [("linear_bits", 3), ("norm_bits", -1), ("block_size", 0), ("group_size", 12), ("lfc_dtype", "int4"),
     ("method", "gact"), ("rounding", "up"), ("min_numel", -5), ("attention_bits", True), ("outlier_ratio", 0.5),
     ("outlier_ratio", "high")],
)
def test_bad_config_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        DivisionConfig(**{field: value})


def test_reapply_with_other_config_repatches(batch):
    model = tiny_model("bert")
    hd.apply_division(model, DivisionConfig(linear_bits=4))
    hd.apply_division(model, DivisionConfig(linear_bits=8))

    assert division_config_of(model).linear_bits == 8
    hd.remove_division(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_failed_patch_leaves_nothing(monkeypatch):
    real = family("bert")

    def broken(model, state):
        real.apply(model, state)  # patches every module, then fails
        raise RuntimeError("boom")

    monkeypatch.setattr(api, "family", lambda model_type: Family(broken, real.defaults))
    model = tiny_model("bert")
    impl = model.config._attn_implementation
    with pytest.raises(RuntimeError):
        hd.apply_division(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert model.config._attn_implementation == impl


def test_shared_tensor_stored_once_and_keyed_on_live_reference():
    cfg = DivisionConfig()
    x = torch.randn(2, 64, 64)
    a = keep(x, "linear", cfg)
    b = keep(x, "linear", cfg)
    assert a is b and a.uses == 2
    x.add_(1)  # modified in place: a stale copy must not be reused
    assert lookup(x) is None
    # memory freed in the forward is reused at the same address for another tensor
    y = torch.randn(4096)
    keep(y, "linear", cfg)
    del y
    z = torch.randn(4096)
    # whether or not the allocator reused the block (z.data_ptr() == ptr), z must not match
    assert lookup(z) is None


def test_profiler_shows_one_compress_range_per_tensor_and_its_rebuild():
    """A tensor kept twice is compressed once (one range); rebuilding it is a range of its own."""
    from torch.profiler import profile

    from hf_division.autograd.store import COMPRESS_LABEL, REBUILD_LABEL

    cfg, x = DivisionConfig(), torch.randn(2, 64, 64)
    with profile() as prof:
        entry = keep(x, "linear", cfg)
        keep(x, "linear", cfg)
        keep(torch.randn(2, 64, 64), "linear", cfg)
        entry.take()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get(COMPRESS_LABEL) == 2 and counts.get(REBUILD_LABEL) == 1, counts


def test_qkv_share_one_copy():
    model = tiny_model("bert", "eager")
    batch = tiny_batch(batch=2, seq=64)
    model.train()
    hd.apply_division(model, DivisionConfig(attention_bits=0, norm_bits=0, activation_bits=0))
    start_accounting()
    out = model(**batch)
    held = stop_accounting()
    linear = [t for t, k in held if k == "linear"]
    # per layer: one copy for the q/k/v input and one each for the other 3 linear inputs (6
    # linears); pooler/classifier inputs are below min_numel and kept as they are
    packed_copies = {id(t) for t in linear if t.dtype == torch.uint8}
    assert len(packed_copies) == 2 * 4
    del out


def test_dropout_mask_is_bits():
    from hf_division.autograd.dropout import DropoutFn

    x = torch.randn(3, 50, 64, requires_grad=True)
    torch.manual_seed(0)
    y = DropoutFn.apply(x, 0.1)
    torch.manual_seed(0)
    ref = torch.nn.functional.dropout(x, 0.1, training=True)
    assert torch.equal(y, ref)
    assert y.grad_fn.bits.numel() == -(-x.numel() // 8)
    y.sum().backward()
    assert torch.equal(x.grad, (ref != 0).float() / 0.9)


@pytest.mark.parametrize("shape,pad", [((1, 40), None), ((3, 1), None), ((4, 64), [64, 5, 1, 30])])
def test_small_and_padded_batches(shape, pad):
    model = tiny_model("roberta", "sdpa")
    batch = tiny_batch(batch=shape[0], seq=shape[1], pad_from=pad)
    cos = gradient_cosine(model, batch, seeds=(0,))
    assert cos[0] > 0.95


def test_nonfinite_activations_propagate_like_baseline(batch):
    model = tiny_model("bert", "eager")
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight[batch["input_ids"][0, 3]] = float("nan")
    base = flat_grad(model, batch, 0)
    hd.apply_division(model)
    div = flat_grad(model, batch, 0)
    assert not torch.isfinite(base).all()
    assert not torch.isfinite(div).all()


def test_peft_lora_wrapped_model(batch):
    peft = pytest.importorskip("peft")
    model = tiny_model("bert", "sdpa")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    torch.manual_seed(0)
    ref = lora(**batch).logits
    assert hd.apply_division(lora) is lora
    torch.manual_seed(0)
    out = lora(**batch)
    assert torch.equal(out.logits, ref)
    out.loss.backward()
    a = lora.base_model.model.bert.encoder.layer[0].attention.self.query.lora_A["default"]
    assert a.weight.grad is not None and "forward" in a.__dict__
    hd.remove_division(lora)
    assert "forward" not in a.__dict__


def test_forward_signature_kept():
    import inspect

    model = tiny_model("bert")
    before = inspect.signature(model.forward)
    hd.apply_division(model)
    assert inspect.signature(model.forward) == before


def test_functional_dropout_kept_as_bits():
    # OPT calls F.dropout directly: its masks must be bits too, and the forward unchanged
    model = tiny_model("opt", "eager", dropout=0.5)
    batch = tiny_batch(batch=2, seq=64)
    torch.manual_seed(0)
    ref = model(**batch).logits
    hd.apply_division(model)
    start_accounting()
    torch.manual_seed(0)
    out = model(**batch)
    held = stop_accounting()
    assert torch.equal(out.logits, ref)
    masks = [t for t, k in held if k == "dropout"]
    # 2 layers x 2 hidden dropouts, each (2, 64, 64) elements as bits
    assert len(masks) >= 4 and all(t.numel() == 2 * 64 * 64 // 8 for t in masks[:4])


def test_unset_bits_take_the_family_default_and_explicit_bits_win():
    from hf_division.config import DEFAULT_BITS

    cfg = DivisionConfig()
    assert cfg.bits("attention") == DEFAULT_BITS["attention"]  # unresolved: the generic default
    llama = cfg.resolved("llama")
    assert llama.attention_bits == family_defaults("llama")["attention_bits"] == 8 and llama.linear_bits == 4
    assert cfg.resolved("bert") == DivisionConfig(linear_bits=4, attention_bits=4, activation_bits=4, norm_bits=4,
                                                  outlier_ratio=0, early_layers=0, late_layers=0, exact_tokens=0,
                                                  block_size=1)
    assert cfg.resolved("llama").outlier_ratio == cfg.effective_outlier_ratio == 16
    assert cfg.resolved("llama").block_size == cfg.effective_block_size == 16  # decoders keep the LFC
    assert DivisionConfig(block_size=8).resolved("bert").effective_block_size == 8
    assert cfg.resolved("vit").exact_tokens == 1 and DivisionConfig(exact_tokens=0).resolved("vit").exact_tokens == 0
    assert DivisionConfig(attention_bits=2).resolved("llama").attention_bits == 2
    assert DivisionConfig(method="actnn-all").resolved("llama").bits("attention") == 2  # capped at 2
    actnn = DivisionConfig(method="actnn").resolved("llama")  # ActNN's scope: Linear inputs only
    assert [actnn.bits(k) for k in ("linear", "attention", "activation", "norm")] == [2, 0, 0, 0]


def test_actnn_compresses_what_actnn_does(batch):
    """ActNN (arXiv 2104.14129) compresses Linear inputs (2 bits) and dropout masks; LayerNorm,
    GELU and the attention core keep what they save, as without division."""
    model = tiny_model("bert").train()
    base = measure_activation_memory(model, batch, DivisionConfig(method="actnn"))
    for kind in ("activation", "norm"):
        assert base.division_by_kind[kind] == base.baseline_by_kind[kind], kind
    # the attention core keeps its probabilities (only the dropout mask on them becomes bits)
    assert 0.6 * base.baseline_by_kind["attention"] < base.division_by_kind["attention"] <= base.baseline_by_kind["attention"]
    assert base.division_by_kind["linear"] * 5 < base.baseline_by_kind["linear"]  # 2 of 32 bits + scales
    assert base.division_by_kind["dropout"] * 6 < base.baseline_by_kind["dropout"]
    every = measure_activation_memory(model, batch, DivisionConfig(method="actnn-all"))
    assert every.division_bytes < base.division_bytes




def test_compressed_copies_freed_after_last_use_unless_graph_retained():
    model, batch = tiny_model("bert"), tiny_batch(model_type="bert")
    hd.apply_division(model, DivisionConfig(min_numel=0))
    model.train()
    start_accounting()
    loss = model(**batch).loss
    entries = [o for o in recorded() if not isinstance(o, torch.Tensor)]
    stop_accounting()
    assert entries and not any(e.freed for e in entries)
    loss.backward(retain_graph=True)  # kept for a second backward
    first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert not any(e.freed for e in entries)
    model.zero_grad(set_to_none=True)
    loss.backward()  # the same noise-free rebuild: the same gradients; then freed
    second = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(e.freed and e.packed is None for e in entries if e.uses <= 0)
    assert any(e.freed for e in entries)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_bookkeeping_runs_outside_torch_function_modes():
    """Division's own tensor code (compressing, mask bits) skips every TorchFunctionMode's Python
    handler: under the patched forward's ForwardMode each of its torch calls paid one."""
    from torch.overrides import TorchFunctionMode

    from hf_division.autograd.store import bookkeeping

    seen = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    @bookkeeping
    def work(x):
        return store.pack(x * 2, "linear", hd.DivisionConfig(min_numel=0, narrow_linear=0).resolved("bert"))

    x = torch.randn(2, 16, 8)
    with Count():
        packed = work(x)
        assert not seen and packed.bits == 4
        _ = x * 2
    assert seen == ["__mul__"] or seen == ["mul"], seen


OLDER = [("Transformers", v) for v in ("5.17.0", "5.22.2", "4.57.1", "5.0.0rc3")] + \
        [("PyTorch", v) for v in ("2.10.1+cpu", "2.4.0", "2.9.1+cu128", "1.13.1")]
SUPPORTED = [("Transformers", v) for v in ("5.23.0", "5.25.0", "5.30.0.dev0", "6.0.0")] + \
            [("PyTorch", v) for v in ("2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0.dev20261201")]


def _check_and_minimum(name):
    from hf_division import patching
    return {"Transformers": (patching.check_transformers, patching.MIN_TRANSFORMERS),
            "PyTorch": (patching.check_torch, patching.MIN_TORCH)}[name]


@pytest.mark.parametrize("name, version", OLDER)
def test_older_versions_refused_naming_both(name, version):
    check, minimum = _check_and_minimum(name)
    with pytest.raises(ImportError, match=rf"{name} >= {minimum[0]}\.{minimum[1]}, found {re.escape(version)}"):
        check(version)


@pytest.mark.parametrize("name, version", SUPPORTED)
def test_supported_versions_accepted(name, version):
    check, _ = _check_and_minimum(name)
    check(version)
