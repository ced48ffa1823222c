"""Reliability (docs/GUIDE.md, "Limits and guarantees"): copies and pickles train themselves, higher-order
gradients fail naming hf-division, never more bytes than the baseline, no fp16 overflow from the
norm rebuild, shared configs, strict config types, script arguments, per-model noise, and a
forward or backward interrupted half-way leaves nothing behind."""
import copy
import gc
import io
import pickle

import pytest
import torch

import hf_division as hd
from hf_division import DivisionConfig, apply_division, measure_activation_memory, remove_division
from hf_division.api import division_config_of, patched_modules
from hf_division.analysis.measure import held_bytes
from hf_division.bench.glue import DataTrainingArguments, parse_loop_args
from hf_division.compress.noise import reseed
from hf_division.autograd.store import live_count

from conftest import tiny_batch, tiny_model

NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def grads_on(model) -> int:
    return sum(p.grad is not None for p in model.parameters())


def eval_logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


# ----------------------------------------------------------------------------- 1. copies
@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "pickle"])
def test_copy_of_patched_model_trains_itself(how, batch):
    model = apply_division(tiny_model("bert"))
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    else:
        clone = pickle.loads(pickle.dumps(model))
    assert division_config_of(clone) == division_config_of(model)
    clone.train()
    assert held_bytes(clone, batch)[0] < held_bytes(tiny_model("bert").train(), batch)[0] / 2  # compresses
    assert len(patched_modules(clone)) == len(patched_modules(model))
    assert not set(map(id, patched_modules(clone))) & set(map(id, model.modules()))
    clone.train()
    clone(**batch).loss.backward()
    assert grads_on(model) == 0 and grads_on(clone) > 0
    before = eval_logits(clone, batch)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    assert not torch.equal(eval_logits(clone, batch), before)  # the copy's weights decide its output
    remove_division(model)
    assert not any(k in m.__dict__ for m in model.modules() for k in ("forward", "__deepcopy__", "__reduce_ex__"))


def test_apply_remove_apply_is_exact(batch):
    model = tiny_model("llama", "sdpa")
    plain = eval_logits(model, batch)
    keys = {id(m): set(m.__dict__) for m in model.modules()}
    impl = model.config._attn_implementation
    for _ in range(2):
        apply_division(model)
        apply_division(model)  # idempotent
        assert torch.equal(eval_logits(model, batch), plain)
        remove_division(model)
        assert {id(m): set(m.__dict__) for m in model.modules()} == keys
        assert model.config._attn_implementation == impl
    assert torch.equal(eval_logits(model, batch), plain)


# ----------------------------------------------------------------------------- 2. higher order
def test_higher_order_gradients_raise_naming_hf_division(batch):
    model = apply_division(tiny_model("bert", **NO_DROPOUT))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match="hf-division.*higher-order"):
        torch.autograd.grad(model(**batch).loss, params, create_graph=True, allow_unused=True)
    with pytest.raises(RuntimeError, match="hf-division.*higher-order"):
        model(**batch).loss.backward(create_graph=True)


def penalty_grads(model, batch):
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.autograd.grad(model(**batch).loss, params, create_graph=True, allow_unused=True)
    penalty = sum((x ** 2).sum() for x in g if x is not None)
    return torch.autograd.grad(penalty, params, allow_unused=True)


def test_exact_context_gives_the_unpatched_second_derivatives(batch):
    plain = tiny_model("bert", **NO_DROPOUT).train()
    patched = apply_division(tiny_model("bert", **NO_DROPOUT)).train()
    want = penalty_grads(plain, batch)
    with hd.exact():
        got = penalty_grads(patched, batch)
    assert sum(g is not None for g in want) > 10
    for a, b in zip(want, got):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- 3. bytes
@pytest.mark.parametrize("model_type,config,batch_size,seq", [
    ("bert", DivisionConfig(block_size=256), 32, 17),
    ("bert", DivisionConfig(block_size=4096), 32, 17),
    ("bert", DivisionConfig(block_size=10**9), 32, 17),
    ("bert", DivisionConfig(), 128, 1),
    ("llama", DivisionConfig(), 128, 1),
    ("llama", DivisionConfig(linear_bits=8, attention_bits=8, activation_bits=8, norm_bits=8), 64, 3),
])
def test_never_more_bytes_than_the_baseline(model_type, config, batch_size, seq):
    """Before the fix (issue 13) blocks longer than the rows padded every row to a whole block:
    more bytes than the baseline, or (block 10**9) an allocation of about a terabyte."""
    report = measure_activation_memory(tiny_model(model_type), tiny_batch(batch=batch_size, seq=seq), config)
    assert report.division_bytes <= report.baseline_bytes, report.ratio


# ----------------------------------------------------------------------------- 4. fp16
def nonfinite_fp16_grads(patch: bool) -> int:
    """A tiny fp16 Llama whose residual stream gets one token with 6e4 in 16 of its 64 channels
    (a massive activation): rebuilt as (token / its RMS) x RMS, it used to round past 65504."""
    torch.manual_seed(0)
    model = tiny_model("llama").half()
    if patch:
        apply_division(model)
    model.train()

    def massive(module, args, out):
        h = out[0].clone() if isinstance(out, tuple) else out.clone()
        h[0, 5, :16] = 6e4
        return (h, *out[1:]) if isinstance(out, tuple) else h

    model.model.layers[0].register_forward_hook(massive)
    torch.manual_seed(0)
    model(**tiny_batch()).loss.float().backward()
    return sum(int((~torch.isfinite(p.grad)).sum()) for p in model.parameters() if p.grad is not None)


def test_fp16_norm_rebuild_stays_finite():
    assert nonfinite_fp16_grads(patch=False) == 0
    assert nonfinite_fp16_grads(patch=True) == 0  # 77,128 non-finite entries before the fix


# ----------------------------------------------------------------------------- 5. shared config
def test_models_sharing_one_config(batch):
    a = tiny_model("llama", "sdpa")
    b = type(a)(a.config)
    assert a.config is b.config
    apply_division(a)
    apply_division(b)
    remove_division(a)
    assert b.config._attn_implementation == "division_sdpa"  # b still compresses its attention
    a.train(), b.train()
    assert held_bytes(b, batch)[1]["attention"] < held_bytes(a, batch)[1]["attention"] / 2
    remove_division(b)
    assert a.config._attn_implementation == "sdpa"


# ----------------------------------------------------------------------------- 6. config types
@pytest.mark.parametrize("field,value,message", [
    ("linear_bits", 4.0, "linear_bits"), ("dropout_bits", "no", "dropout_bits"),
    ("generic_fallback", "yes", "generic_fallback"), ("norm_row_scale", 1, "norm_row_scale"),
    ("recompute_inline_attention", "no", "recompute_inline_attention"),
    ("min_numel", -1, "min_numel must be a non-negative integer"), ("module_bits", {"bert": 4.0}, "module_bits"),
])
def test_config_types_are_strict(field, value, message):
    with pytest.raises(ValueError, match=message):
        DivisionConfig(**{field: value})
    assert DivisionConfig(min_numel=0).min_numel == 0


# ----------------------------------------------------------------------------- 7. scripts
@pytest.mark.parametrize("argv,message", [
    (["--max_train_samples", "0"], "--max_train_samples must be >= 1"),
    (["--max_eval_samples", "0"], "--max_eval_samples must be >= 1"),
    (["--num_train_epochs", "0"], "--num_train_epochs must be > 0"),
])
def test_loop_arguments_refuse_empty_runs(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_loop_args(["--output_dir", "unused", *argv])


def test_glue_arguments_refuse_empty_runs():
    with pytest.raises(ValueError, match="--max_train_samples must be >= 1"):
        DataTrainingArguments(task_name="sst2", max_train_samples=0)


# ----------------------------------------------------------------------------- 8. noise
def second_step_grads(train_other_in_between: bool) -> torch.Tensor:
    a = apply_division(tiny_model("bert", seed=0, **NO_DROPOUT)).train()
    b = apply_division(tiny_model("bert", seed=1, **NO_DROPOUT)).train()
    reseed(3)
    batch = tiny_batch()
    a(**batch).loss.backward()
    a.zero_grad()
    if train_other_in_between:
        b(**batch).loss.backward()
    a(**batch).loss.backward()
    return torch.cat([p.grad.flatten() for p in a.parameters() if p.grad is not None])


def test_each_model_draws_its_own_noise():
    assert torch.equal(second_step_grads(False), second_step_grads(True))


# ----------------------------------------------------------------------------- faults
class Stop(Exception):
    pass


@pytest.mark.parametrize("error", [Stop, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_interrupted_step_leaves_nothing_behind(where, error, batch):
    model = tiny_model("llama", "sdpa")
    plain = eval_logits(model, batch)
    apply_division(model).train()
    layer = model.model.layers[1]

    def in_forward(module, args, out):
        raise error()

    def in_backward(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h.register_hook(lambda g: (_ for _ in ()).throw(error()))

    handle = layer.register_forward_hook(in_forward if where == "forward" else in_backward)
    # freed by reference counting alone: a cycle through an entry would hold its compressed copy
    # until the collector happened to run, so the collector stays off while this checks
    gc.collect()
    # entries an earlier test of this process left alive are not this step's to answer for
    # (test_matrix.py's last test counts the graphs its steps leave)
    before = live_count()
    gc.disable()
    try:
        with pytest.raises(error) as caught:
            model(**batch).loss.backward()
        handle.remove()
        del caught  # the traceback holds the interrupted frames, as any caught exception does
        assert live_count() == before
        model(**batch).loss.backward()  # still trains
        assert grads_on(model) > 0
        assert live_count() == before
    finally:
        gc.enable()
    remove_division(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(eval_logits(model, batch), plain)


def _instance_forwards(model) -> int:
    return sum("forward" in m.__dict__ for m in model.modules())


def test_a_forward_removed_by_another_library_is_patched_again(batch):
    """What Transformers' hub-kernel support does to the layers it marks at a train/eval switch
    (drops their instance forward, ours included): the next training forward patches them again,
    with the bytes and gradients of the model before, and remove_division still restores it exactly."""
    model = apply_division(tiny_model("bert").train())

    def step():
        reseed(0)
        torch.manual_seed(0)  # dropout
        model.zero_grad()
        model(**batch).loss.backward()
        return held_bytes(model, batch)[0], [p.grad.clone() for p in model.parameters()]

    held, grads = step()
    gelus = [m for m in model.modules() if type(m).__name__ == "GELUActivation"]
    assert gelus and all("forward" in m.__dict__ for m in gelus)
    for m in gelus:
        del m.forward  # as kernels' re-kernelization does where no hub kernel applies
    again, regrads = step()
    assert again == held and all("forward" in m.__dict__ for m in gelus)
    assert all(torch.equal(a, b) for a, b in zip(grads, regrads))
    remove_division(model)
    assert _instance_forwards(model) == 0


def test_a_pretrained_model_patched_in_eval_mode_keeps_division_through_train(tmp_path, batch):
    """``from_pretrained`` leaves a model in eval mode (with ``use_kernels`` where the ``kernels``
    package is installed); the Trainer patches it, then calls ``model.train()``."""
    from transformers import AutoModelForSequenceClassification

    tiny_model("bert").save_pretrained(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert not model.training
    apply_division(model)
    model.train()
    reference = apply_division(tiny_model("bert").train())
    assert held_bytes(model, batch)[0] == held_bytes(reference, batch)[0]
    model.eval()
    model.train()
    assert held_bytes(model, batch)[0] == held_bytes(reference, batch)[0]
    remove_division(model)
    assert _instance_forwards(model) == 0


def _replace_parameters(model) -> None:
    """Every parameter a new ``nn.Parameter`` object (the values kept), as ``load_state_dict(assign=True)``,
    ``to_empty()`` followed by loading, and FSDP2's swaps around each forward leave a model."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


@pytest.mark.parametrize("model_type", ["bert", "llama"])
@pytest.mark.parametrize("how", ["replaced", "assign", "to_empty"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_parameters_replaced_after_patching_get_their_gradients(model_type, how, autocast, batch):
    """Every parameter of a model patched and then given new parameter objects gets a gradient, the
    one it gets when the parameters are replaced before patching (issue 42, item 1: the norm paths
    held the objects of patch time, so their new weights got none, silently, under bf16 autocast)."""
    def grads(replace_after: bool):
        torch.manual_seed(0)
        model = tiny_model(model_type).train()
        if not replace_after:
            _replace_parameters(model)
        apply_division(model, DivisionConfig(rounding="nearest"))
        if replace_after and how == "replaced":
            _replace_parameters(model)
        elif replace_after and how == "assign":
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        elif replace_after:  # what meta-device initialisation does: storage swapped, then loaded
            state = {k: v.clone() for k, v in model.state_dict().items()}
            buffers = {k: v.clone() for k, v in model.named_buffers()}  # non-persistent ones too
            model.to_empty(device="cpu")
            model.load_state_dict(state)
            with torch.no_grad():
                for k, v in model.named_buffers():
                    v.copy_(buffers[k])
        reseed(0)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = model(**batch).loss
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    before, after = grads(False), grads(True)
    missing = sorted(n for n, g in after.items() if g is None)
    assert missing == sorted(n for n, g in before.items() if g is None), missing
    for name, g in after.items():
        if g is not None:
            torch.testing.assert_close(g, before[name], rtol=0, atol=0, msg=name)


def _replicate_on_cpu(network):
    """What ``torch.nn.parallel.replicate`` does for one replica (it needs GPUs): each module copied
    by ``_replicate_for_data_parallel``, children pointed at the copies, every parameter a tensor of
    the replica's own (a leaf here, a broadcast there)."""
    modules = list(network.modules())
    copies = [m._replicate_for_data_parallel() for m in modules]
    index = {m: i for i, m in enumerate(modules)}
    for i, module in enumerate(modules):
        for key, child in module._modules.items():
            setattr(copies[i], key, copies[index[child]])
        for key, param in module._parameters.items():
            if param is None:
                copies[i]._parameters[key] = None
            else:
                setattr(copies[i], key, param.detach().clone().requires_grad_(param.requires_grad))
    return copies[0]


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_data_parallel_replicas_run_their_own_modules(model_type, batch):
    """Issue 42, item 3: a replica copies each module's instance dict, so the patched forwards were
    the original modules' (their parameters, their devices). Each replica's gradient now reaches
    its own tensors, equal to the original model's own step, and none reaches the original's."""
    model = apply_division(tiny_model(model_type).train(), DivisionConfig(rounding="nearest"))
    replica = _replicate_on_cpu(model)
    reseed(0)
    torch.manual_seed(1)
    replica(**batch).loss.backward()
    assert all(p.grad is None for p in model.parameters())
    got = {n: t.grad for n, t in ((n, getattr(m, k)) for n, m, k in _tensor_names(replica))}
    reseed(0)
    torch.manual_seed(1)
    model(**batch).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is None) == (got[name] is None), name
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, rtol=0, atol=0, msg=name)
    remove_division(model)
    assert "_replicate_for_data_parallel" not in model.__dict__


def _tensor_names(replica):
    """``(parameter name, module, attribute)`` of a replica's tensors, named as the model's parameters."""
    for mod_name, module in replica.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                yield (f"{mod_name}.{key}" if mod_name else key), module, key


class _ScaledLinear(torch.nn.Linear):
    """A fake-quantized QAT linear's shape: the weight times a learned scalar in its own forward."""

    def __init__(self, linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.load_state_dict(linear.state_dict())
        self.s = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight * self.s, self.bias)


def test_a_linear_subclass_with_its_own_forward_is_left_exact(batch):
    """Issue 42, item 2: a Linear subclass was patched by isinstance, its backward assumed
    ``x @ W.T + b`` with the raw weight: no gradient for the scalar, an input gradient from the
    wrong weight. Now it is left exact, with one warning naming the class; plain Linears are patched."""
    def model_with_scaled():
        torch.manual_seed(0)
        model = tiny_model("bert").train()
        for layer in model.bert.encoder.layer:
            layer.intermediate.dense = _ScaledLinear(layer.intermediate.dense)
        return model

    def grads(model):
        reseed(0)
        torch.manual_seed(1)
        model(**batch).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    exact = grads(model_with_scaled())
    model = model_with_scaled()
    with pytest.warns(UserWarning, match=r"_ScaledLinear \(e\.g\. bert\.encoder\.layer\.0\.intermediate\.dense\) overrides"):
        # Linear inputs compressed, the rest exact: no compressed tensor lies on the scalar's gradient path
        apply_division(model, DivisionConfig(linear_bits=8, attention_bits=0, activation_bits=0, norm_bits=0))
    scaled = [m for m in model.modules() if isinstance(m, _ScaledLinear)]
    assert scaled and all("forward" not in m.__dict__ for m in scaled)
    assert "forward" in model.bert.encoder.layer[0].attention.self.query.__dict__  # a plain Linear
    got = grads(model)
    for name, g in exact.items():
        if name.endswith("intermediate.dense.s"):
            assert got[name] is not None, name
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=0, msg=name)
