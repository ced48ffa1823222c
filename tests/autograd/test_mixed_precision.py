"""Mixed precision: bf16/fp16 saved tensors, fp16 range, autocast in backward recomputation.

Figures on real MiniLM and the full Llama-shaped model: ``python -m hf_division.bench precision``
(docs/GUIDE.md, "Mixed precision"). Here: tiny-but-shaped configs, CPU autocast.
"""
import dataclasses

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, BertConfig, LlamaConfig

import hf_division as hd
from hf_division.autograd import store
from hf_division import api
from hf_division import Trainer, TrainingArguments
from hf_division.compress.pipeline import compress, decompress

pytestmark = pytest.mark.heavy

FP16_MAX = torch.finfo(torch.float16).max


# ----------------------------------------------------------------------------- compressor
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("lfc_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_fp16_edge_of_range_stays_finite(bits, lfc_dtype, block_size):
    g = torch.Generator().manual_seed(bits)
    x = (torch.rand(4, 64, 256, generator=g) * 2 - 1) * FP16_MAX
    x[:, ::3, ::5] = FP16_MAX
    x[:, 1::3, ::7] = -FP16_MAX
    x = x.half()
    p = compress(x, bits=bits, block_size=block_size, lfc_dtype=lfc_dtype, generator=g)
    y = decompress(p)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    # the same values rebuilt in float32 do leave fp16's range: without the clamp they would be inf
    wide = decompress(dataclasses.replace(p, dtype=torch.float32))
    if bits <= 4:
        assert wide.abs().max() > FP16_MAX
    assert (y.float() - wide.clamp(-FP16_MAX, FP16_MAX)).abs().max() <= 32  # only the final rounding


def test_fp16_lfc_widened_when_block_means_overflow():
    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(0)) * 1e6  # float32 beyond fp16
    p = compress(x, bits=4, block_size=16, lfc_dtype=torch.float16)
    assert p.lfc.dtype == torch.float32
    y = decompress(p)
    ref = decompress(compress(x, bits=4, block_size=16, lfc_dtype=torch.bfloat16))
    assert torch.isfinite(y).all()
    assert (y - x).norm() / x.norm() < 1.2 * ((ref - x).norm() / x.norm())
    small = compress(x * 1e-6, bits=4, block_size=16, lfc_dtype=torch.float16)
    assert small.lfc.dtype == torch.float16  # the configured dtype where it fits


@pytest.mark.parametrize("lfc_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_near_constant_channel_does_not_swamp_the_others(lfc_dtype):
    """A channel constant at a value the LFC dtype cannot hold (a tiny mean flushed to 0 by fp16,
    or a mean between two bf16 values) must not widen the groups it shares with other channels."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, 64, generator=g)
    err = {}
    for name, value in (("plain", None), ("tiny", 3e-9), ("offset", 5.001)):
        xc = x.clone()
        if value is not None:
            xc[..., 7] = value + 1e-12 * torch.randn(8, 128, generator=g)
        y = decompress(compress(xc, bits=4, block_size=16, lfc_dtype=lfc_dtype, generator=g))
        others = [c for c in range(64) if c != 7]
        err[name] = ((y[..., others] - xc[..., others]).norm() / xc[..., others].norm()).item()
        if value is not None:  # the channel itself: within its LFC's rounding
            assert (y[..., 7] - xc[..., 7]).abs().max() <= 0.02 * value + 1e-7
    assert err["tiny"] < 1.1 * err["plain"] and err["offset"] < 1.1 * err["plain"], err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_roundtrip_like_float32(dtype):
    x = torch.randn(4, 128, 96, generator=torch.Generator().manual_seed(1)) * 3
    xh = x.to(dtype)
    y = decompress(compress(xh, bits=4, block_size=16))
    assert y.dtype == dtype and y.shape == xh.shape
    e16 = ((y.float() - xh.float()).norm() / xh.float().norm()).item()
    e32 = ((decompress(compress(x, bits=4, block_size=16)) - x).norm() / x.norm()).item()
    assert e16 < 1.05 * e32 + 4 * torch.finfo(dtype).eps


# ----------------------------------------------------------------------------- models under autocast
def minilm_like(attn):
    """MiniLM-L6's layer shape (hidden 384, 12 heads, intermediate 1536), 2 layers, small vocab."""
    cfg = BertConfig(vocab_size=1000, hidden_size=384, num_hidden_layers=2, num_attention_heads=12,
                     intermediate_size=1536, max_position_embeddings=512, num_labels=2)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(cfg, attn_implementation=attn)


def llama_shaped(attn, layers=2):
    """The Llama-shaped config of docs/ARCHITECTURES.md (SmolLM-135M's layer), fewer layers."""
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                      num_hidden_layers=layers, vocab_size=1000, max_position_embeddings=1024, num_labels=2,
                      pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(cfg, attn_implementation=attn)


MODELS = {"minilm-like": minilm_like, "llama-shaped": llama_shaped}


def batch_for(model, batch=4, seq=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (batch,), generator=g)}


def amp_grad(model, batch, dtype, seed, backward_in_autocast=False):
    """Flat float64 gradient of one training step under CPU autocast ``dtype`` (None: fp32)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(**batch)
        if backward_in_autocast:
            out.loss.backward()
    if not backward_in_autocast:
        out.loss.backward()
    grad = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grad, out.logits.detach()


def cosine(a, b):
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_autocast_bytes_and_fidelity(name, attn):
    model = MODELS[name](attn)
    batch = batch_for(model, batch=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mem = hd.measure_activation_memory(model, batch)
    ratio_bf16 = mem.ratio
    fp32 = hd.measure_activation_memory(model, batch)
    # the baseline really ran under autocast: the activation-function input is bf16. (The total
    # barely drops: autocast saves one bf16 cast of a hidden state per Linear that reads it.)
    assert mem.baseline_by_kind["activation"] <= 0.5 * fp32.baseline_by_kind["activation"]
    assert ratio_bf16 >= 3, mem.table()
    cos = []
    for seed in (0,):
        hd.remove_division(model)
        exact, ref_logits = amp_grad(model, batch, torch.bfloat16, seed)
        hd.apply_division(model)
        approx, logits = amp_grad(model, batch, torch.bfloat16, seed)
        assert logits.dtype == ref_logits.dtype and torch.equal(logits, ref_logits)  # forward untouched
        cos.append(cosine(exact, approx))
    hd.remove_division(model)
    assert min(cos) >= 0.98, cos


@pytest.mark.parametrize("name", list(MODELS))
def test_fp16_autocast_finite_and_close(name):
    model = MODELS[name]("sdpa")
    batch = batch_for(model, batch=2, seed=3)
    exact, _ = amp_grad(model, batch, torch.float16, 0)
    hd.apply_division(model)
    approx, _ = amp_grad(model, batch, torch.float16, 0)
    hd.remove_division(model)
    assert torch.isfinite(approx).all()
    assert cosine(exact, approx) >= 0.98


def test_backward_inside_autocast_matches_backward_outside():
    """Recomputations in backward run under the forward's autocast state, wherever backward is
    called (without the restore, backward outside autocast mixes bf16 and float32 and fails)."""
    model = MODELS["minilm-like"]("eager")
    hd.apply_division(model, hd.DivisionConfig(rounding="nearest"))
    batch = batch_for(model, batch=2, seq=64)
    outside, _ = amp_grad(model, batch, torch.bfloat16, 0)
    inside, _ = amp_grad(model, batch, torch.bfloat16, 0, backward_in_autocast=True)
    assert torch.equal(outside, inside)


def test_trainer_division_checkpointing_bf16_together(tmp_path, monkeypatch):
    """TrainingArguments(division=True, gradient_checkpointing=True, bf16=True) on CPU."""
    model = llama_shaped("sdpa", layers=2)
    rows = batch_for(model, batch=8, seq=64, seed=5)
    data = Dataset.from_dict({k: v.tolist() for k, v in rows.items() if k != "attention_mask"})
    args = TrainingArguments(output_dir=str(tmp_path), division=True, gradient_checkpointing=True, bf16=True,
                             division_checkpointing="combine", use_cpu=True, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-4,
                             report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1)
    packed = []
    pack, row_scaled = store.pack, store.compress_row_scaled
    monkeypatch.setattr(store, "pack", lambda t, kind, config: packed.append((kind, t.dtype)) or pack(t, kind, config))

    def fused(x, *args, **kw):  # norm inputs kept relative to their rows' RMS, in the kernels' passes
        p = row_scaled(x, *args, **kw)
        if p is not None:
            packed.append(("norm", x.dtype))
        return p

    monkeypatch.setattr(store, "compress_row_scaled", fused)
    dtypes = []
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    handle.remove()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert api.division_config_of(model) is not None and model.is_gradient_checkpointing
    assert set(dtypes) == {torch.bfloat16}  # forward and checkpoint recomputation under autocast
    # compressed: the checkpointed layers' boundary inputs (norm) and what the head keeps
    assert ("norm", torch.float32) in packed or ("norm", torch.bfloat16) in packed, packed


def test_lora_under_bf16_autocast():
    """A PEFT LoRA model (frozen base) under bf16 autocast: adapter gradients close to the exact bf16 ones."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(minilm_like("sdpa"), peft.LoraConfig(r=8, lora_alpha=16, task_type="SEQ_CLS",
                                                                    target_modules=["query", "value", "dense"]))
    batch = batch_for(model.base_model.model, batch=2, seed=7)
    exact, _ = amp_grad(model, batch, torch.bfloat16, 0)
    hd.apply_division(model)
    approx, _ = amp_grad(model, batch, torch.bfloat16, 0)
    hd.remove_division(model)
    assert approx.numel() == exact.numel() < sum(p.numel() for p in model.parameters()) // 10  # adapters only
    assert torch.isfinite(approx).all() and cosine(exact, approx) >= 0.98


def test_trainer_fp16_on_cpu_runs_float32(tmp_path):
    """Documents why fp16 is "unsupported on CPU" in docs/GUIDE.md ("Support matrix"): Accelerate only autocasts fp16 on
    accelerators, so TrainingArguments(fp16=True, use_cpu=True) trains in float32."""
    model = minilm_like("sdpa")
    rows = batch_for(model, batch=4, seq=32, seed=6)
    data = Dataset.from_dict({k: v.tolist() for k, v in rows.items()})
    args = TrainingArguments(output_dir=str(tmp_path), division=True, fp16=True, use_cpu=True, max_steps=1,
                             per_device_train_batch_size=4, report_to=[], save_strategy="no", disable_tqdm=True)
    dtypes = []
    model.bert.encoder.layer[0].intermediate.dense.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert trainer.accelerator.mixed_precision == "fp16" and set(dtypes) == {torch.float32}
