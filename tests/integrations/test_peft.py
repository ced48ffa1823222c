"""PEFT adapters with division: before or after ``get_peft_model``, via the Trainer flag,
adapter save/load, LoRA / DoRA / IA3."""
import pytest
import torch

import hf_division as hd
from hf_division import api
from hf_division.analysis.fidelity import flat_grad, gradient_cosine

from conftest import tiny_batch, tiny_model

peft = pytest.importorskip("peft")


def _lora(model, **kw):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"], task_type="SEQ_CLS", **kw)
    return peft.get_peft_model(model, cfg)


def _lora_a(model):
    return model.base_model.model.bert.encoder.layer[0].attention.self.query.lora_A["default"]


def test_apply_before_get_peft_model_patches_adapters():
    model = tiny_model("bert", "sdpa")
    batch = tiny_batch()
    hd.apply_division(model)
    lora = _lora(model)
    a = _lora_a(lora)
    assert "forward" not in a.__dict__  # added after patching ...
    torch.manual_seed(0)
    lora.train()
    lora(**batch).loss.backward()
    assert "forward" in a.__dict__  # ... and patched before its first training forward
    assert a.weight.grad is not None and torch.isfinite(a.weight.grad).all()
    hd.remove_division(lora)
    assert "forward" not in a.__dict__


@pytest.mark.parametrize("order", ["before", "after"])
def test_lora_adapter_inputs_compressed(order):
    batch = tiny_batch(batch=4, seq=128)
    model = tiny_model("bert", "sdpa")
    if order == "before":
        hd.apply_division(model)
        lora = _lora(model)
        hd.remove_division(lora)
    else:
        lora = _lora(model)
    mem = hd.measure_activation_memory(lora, batch)
    # the lora_A inputs are the only large linear inputs LoRA keeps: they must shrink too
    base_linear, div_linear = mem.by_kind["linear"]
    assert div_linear * 4 < base_linear, mem.table()
    assert mem.ratio >= 4, mem.table()
    cos = gradient_cosine(lora, batch, seeds=(0, 1))
    assert min(cos) >= 0.98, cos


def test_trainer_flag_on_peft_model_and_adapter_roundtrip(tmp_path):
    from datasets import Dataset

    from hf_division import Trainer, TrainingArguments

    model = tiny_model("bert", "sdpa")
    lora = _lora(model)
    b = tiny_batch(batch=16, seq=32)
    ds = Dataset.from_dict({k: v.tolist() for k, v in b.items()})
    args = TrainingArguments(output_dir=str(tmp_path / "run"), division=True, max_steps=3, per_device_train_batch_size=8,
                             learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    before = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    Trainer(model=lora, args=args, train_dataset=ds).train()
    assert api.division_config_of(lora) is not None
    changed = [n for n, p in lora.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("lora_A" in n for n in changed)
    lora.save_pretrained(tmp_path / "adapter")
    hd.remove_division(lora)
    lora.eval()
    fresh = peft.PeftModel.from_pretrained(tiny_model("bert", "sdpa"), tmp_path / "adapter").eval()
    batch = tiny_batch()
    with torch.no_grad():
        assert torch.equal(lora(**batch).logits, fresh(**batch).logits)


@pytest.mark.parametrize("method", ["dora", "ia3"])
def test_other_peft_methods(method):
    batch = tiny_batch(batch=4, seq=128)
    model = tiny_model("bert", "sdpa")
    if method == "dora":
        wrapped = _lora(model, use_dora=True)
    else:
        wrapped = peft.get_peft_model(model, peft.IA3Config(target_modules=["key", "value", "output.dense"],
                                                            feedforward_modules=["output.dense"], task_type="SEQ_CLS"))
    wrapped.train()
    torch.manual_seed(1)
    ref = wrapped(**batch).logits
    hd.apply_division(wrapped)
    torch.manual_seed(1)
    assert torch.equal(wrapped(**batch).logits, ref)  # training forward unchanged
    hd.remove_division(wrapped)
    cos = gradient_cosine(wrapped, batch, seeds=(0, 1))
    assert min(cos) >= 0.98, cos
    mem = hd.measure_activation_memory(wrapped, batch)
    assert mem.ratio >= 2, mem.table()


def _saved_during_forward(model, batch, autocast=torch.bfloat16):
    """Every tensor autograd saves in one training forward of ``model`` under ``autocast``."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    model.train()
    with torch.autocast("cpu", dtype=autocast), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    return saved


def test_frozen_base_layers_keep_no_autocast_weight_copy():
    """LoRA's frozen base layers under bf16 autocast keep their weight by reference, not autocast's
    bf16 copy of it, which the unpatched forward keeps for the input gradient: a copy of every base
    weight held until backward."""
    lora = peft.get_peft_model(tiny_model("llama", "sdpa"), peft.LoraConfig(r=4, target_modules="all-linear"))
    batch = tiny_batch(batch=2, seq=32, model_type="llama")
    frozen = [m.base_layer.weight for m in lora.modules() if hasattr(m, "base_layer")
              and isinstance(m.base_layer, torch.nn.Linear)]
    shapes = {tuple(w.shape) for w in frozen} | {tuple(w.shape[::-1]) for w in frozen}

    def copies(saved):
        return [t for t in saved if t.dtype == torch.bfloat16 and t.dim() == 2 and tuple(t.shape) in shapes]

    assert len(copies(_saved_during_forward(lora, batch))) >= len(frozen)  # the unpatched forward keeps them
    exact = flat_grad(lora, batch, 0, torch.bfloat16, select=lambda n: "lora_" in n)
    hd.apply_division(lora)
    assert not copies(_saved_during_forward(lora, batch))
    hd.remove_division(lora)
    # every kind exact: the adapters' gradient is the unpatched one (the input gradient through the
    # frozen weights computed from the same bf16 rounding of them)
    hd.apply_division(lora, hd.DivisionConfig(linear_bits=0, attention_bits=0, activation_bits=0, norm_bits=0))
    got = flat_grad(lora, batch, 0, torch.bfloat16, select=lambda n: "lora_" in n)
    assert torch.nn.functional.cosine_similarity(got, exact, dim=0).item() > 0.9999
    hd.remove_division(lora)


def test_adapter_input_cast_shares_the_held_copy():
    """PEFT casts LoRA's input to the adapter's float32 under bf16 autocast; that copy of what the
    model already holds (the gated product ``down_proj`` takes, the attention output ``o_proj``
    takes) is derived from it, not kept again at the linear kind's 4 bits (issue 41: on real
    SmolLM2 a second copy took a ``down_proj.lora_A`` gradient to cosine 0.59, and bf16 held 9.0x
    fewer bytes than unpatched where float32 held 10.3x)."""
    lora = peft.get_peft_model(tiny_model("llama", "sdpa"), peft.LoraConfig(r=4, target_modules=["down_proj", "o_proj"]))
    batch = tiny_batch(batch=4, seq=128, model_type="llama")
    linear = {}
    for amp in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            linear[amp] = hd.measure_activation_memory(lora, batch).by_kind.get("linear", (0, 0))[1]
    assert linear[True] <= linear[False], linear  # float32: lora_A shares what the model holds
    # the derived copy rebuilds the cast: with every kind but the linear one kept exact, the
    # adapters' gradient is the unpatched one's (a 4-bit copy of the cast would not be)
    config = hd.DivisionConfig(attention_bits=0, activation_bits=0, norm_bits=0, linear_bits=4)
    grads = []
    for patched in (False, True):
        if patched:
            hd.apply_division(lora, config)
        lora.train()
        lora.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lora(**batch).loss
        loss.backward()
        grads.append({n: p.grad.double() for n, p in lora.named_parameters() if p.grad is not None})
        hd.remove_division(lora)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=0, atol=1e-3 * grads[0][name].abs().max()), name
