"""The rotary embedding as one native pass each way (hf_division.autograd.rotary): Transformers' values to the
bit, taken only in a patched attention module's training forward, and put back when unpatched."""
import gc
import threading
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral

from hf_division import apply_division, remove_division
from hf_division.kernels import configured, native
from hf_division.compress import noise
from hf_division.autograd import rotary

from conftest import tiny_model

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no C compiler: the rotary kernel is native")


def _inputs(gen, b, heads, kv, t, e, batch_cos, transposed, special=False):
    """q as Llama's attention makes it (a transposed view of the projection) or contiguous;
    ``special``: zeros of both signs and an infinity in q, a NaN in cos, a zero in sin."""
    q = torch.randn(b, t, heads, e, generator=gen) if transposed else torch.randn(b, heads, t, e, generator=gen)
    k = torch.randn(b, kv, t, e, generator=gen)
    cos, sin = (torch.randn(batch_cos, t, e, generator=gen) for _ in range(2))
    if special:
        q.view(-1)[: min(3, q.numel())] = torch.tensor([0.0, -0.0, float("inf")])[: min(3, q.numel())]
        cos.view(-1)[0], sin.view(-1)[-1] = float("nan"), 0.0
    q = q.transpose(1, 2) if transposed else q
    return q.requires_grad_(), k.requires_grad_(), cos, sin


def _layout(t):
    """The strides that place elements (a size-1 axis's stride places none)."""
    return tuple(st for st, n in zip(t.stride(), t.shape) if n > 1)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), heads=st.integers(1, 4), kv=st.integers(1, 2), t=st.integers(1, 40),
       half=st.integers(1, 40), shared_cos=st.booleans(), transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_values_and_gradients_are_transformers_to_the_bit(b, heads, kv, t, half, shared_cos, transposed, seed):
    """Forward and backward against ``apply_rotary_pos_emb`` under autograd, with zeros, infinities
    and a NaN planted, and an output gradient that is a transposed view (as sdpa's backward gives it)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, cos, sin = _inputs(gen, b, heads, kv, t, 2 * half, 1 if shared_cos else b, transposed, special=True)
    theirs = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    ours = rotary.RotaryFn.apply(q, k, cos, sin)
    for a, c in zip(theirs, ours):
        assert torch.equal(a.nan_to_num(7.0), c.nan_to_num(7.0)) and _layout(a) == _layout(c)
    grads = (torch.randn(b, t, heads, 2 * half, generator=gen).transpose(1, 2), torch.randn(b, kv, t, 2 * half, generator=gen))
    expected = torch.autograd.grad(theirs, (q, k), grads)
    got = torch.autograd.grad(ours, (q, k), grads)
    for a, c in zip(expected, got):
        assert torch.equal(a.nan_to_num(7.0), c.nan_to_num(7.0))


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = native.rotary
    monkeypatch.setattr(native, "rotary", lambda x, cos, sin, backward: calls.append(backward) or real(x, cos, sin, backward))
    return calls


def _llama_batch():
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(5, 100, (2, 24), generator=gen), "labels": torch.tensor([0, 1])}


def _grads(model, batch, fast):
    with configured(rotary=fast):
        noise.reseed(0)
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_patched_llama_trains_through_the_kernel_with_the_same_gradients(kernel_calls):
    model = apply_division(tiny_model("llama", "sdpa")).train()
    batch = _llama_batch()
    layers = model.config.num_hidden_layers
    kernel_calls.clear()  # the probe when patching
    fast = _grads(model, batch, True)
    assert kernel_calls == [False, False] * layers + [True, True] * layers
    plain = _grads(model, batch, False)
    assert len(kernel_calls) == 4 * layers and fast.keys() == plain.keys()
    assert all(torch.equal(fast[n], plain[n]) for n in fast)


def test_the_original_runs_outside_a_patched_training_forward(kernel_calls):
    """Eval, no_grad, and an unpatched model in the same process: the original function, no kernel.
    Each patched model is one user of the wrapper until it is unpatched or collected."""
    patched, other, second = (tiny_model("llama", "sdpa") for _ in range(3))
    gc.collect()
    before = rotary.users(modeling_llama)
    apply_division(patched)
    apply_division(second)
    assert rotary.users(modeling_llama) == before + 2
    kernel_calls.clear()
    batch = _llama_batch()
    other.train()(**batch).loss.backward()
    patched.eval()(**batch)
    with torch.no_grad():
        patched.train()(**batch)
    assert kernel_calls == []
    remove_division(patched)
    remove_division(patched)
    assert rotary.users(modeling_llama) == before + 1
    second.train()(**batch).loss.backward()
    assert kernel_calls
    del second
    gc.collect()
    assert rotary.users(modeling_llama) == before


def test_the_last_user_puts_the_original_back():
    module = types.ModuleType("hf_division_test_rotary_home")
    module.apply_rotary_pos_emb = original = modeling_llama.apply_rotary_pos_emb.__dict__.get(
        "__wrapped__", modeling_llama.apply_rotary_pos_emb)
    assert rotary.install(module) and rotary.install(module)
    wrapper = module.apply_rotary_pos_emb
    assert wrapper is not original and wrapper.__wrapped__ is original and rotary.users(module) == 2
    rotary.uninstall(module)
    assert module.apply_rotary_pos_emb is wrapper
    rotary.uninstall(module)
    assert module.apply_rotary_pos_emb is original and rotary.users(module) == 0
    rotary.uninstall(module)  # one too many: nothing to undo
    assert module.apply_rotary_pos_emb is original


def test_calls_the_kernel_does_not_take_run_the_original(kernel_calls):
    """bf16, a cos needing a gradient, partial rotary (Phi-3's shorter cos), another unsqueeze_dim."""
    model = apply_division(tiny_model("llama", "sdpa"))
    gen = torch.Generator().manual_seed(1)
    q, k, cos, sin = _inputs(gen, 2, 2, 1, 6, 8, 2, True)
    kernel_calls.clear()
    wrapped = modeling_llama.apply_rotary_pos_emb
    with rotary.enabled():
        wrapped(q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16())
        wrapped(q, k, cos.clone().requires_grad_(), sin)
        wrapped(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
        with pytest.raises(TypeError):  # a keyword the kernel does not know goes to the original
            wrapped(q, k, cos, sin, position_ids=None)
        with torch.no_grad():
            wrapped(q, k, cos, sin)
        assert kernel_calls == []
        wrapped(q, k, cos, sin)
    assert kernel_calls == [False, False]
    assert rotary.takes(q, k, cos, sin) and not rotary.takes(q, k, cos[..., :4], sin[..., :4])
    remove_division(model)


def test_a_function_that_computes_something_else_is_left_alone():
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # the rotation turned the other way
        def turn(x):
            return torch.cat((x[..., x.shape[-1] // 2:], -x[..., : x.shape[-1] // 2]), dim=-1)

        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + turn(q) * sin, k * cos + turn(k) * sin

    module = types.ModuleType("hf_division_test_other_rotary")
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    assert not rotary.matches(apply_rotary_pos_emb) and not rotary.install(module)
    assert module.apply_rotary_pos_emb is apply_rotary_pos_emb
    assert rotary.matches(modeling_mistral.apply_rotary_pos_emb)


def test_a_wrapper_replaced_by_someone_else_is_not_restored_over():
    module = types.ModuleType("hf_division_test_rotary_replaced")
    module.apply_rotary_pos_emb = modeling_mistral.apply_rotary_pos_emb.__dict__.get(
        "__wrapped__", modeling_mistral.apply_rotary_pos_emb)
    assert rotary.install(module)
    theirs = module.apply_rotary_pos_emb = lambda *a, **k: None  # another library's patch, after ours
    rotary.uninstall(module)
    assert module.apply_rotary_pos_emb is theirs and rotary.users(module) == 0


def test_second_derivatives_through_the_kernel_raise_naming_hf_division():
    gen = torch.Generator().manual_seed(2)
    q, k, cos, sin = _inputs(gen, 1, 2, 1, 4, 8, 1, False)
    out_q, _ = rotary.RotaryFn.apply(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="hf-division"):
        torch.autograd.grad(out_q.square().sum(), q, create_graph=True)


def test_an_uninstall_run_by_a_finalizer_inside_install_does_not_deadlock(monkeypatch):
    """A patched model collected while another model installs: its finalizer runs ``uninstall`` in
    the installing thread, from whatever allocation started the collection (the probes' tensors).
    With a non-reentrant lock the thread waited for itself (a CI worker hung so)."""
    first, second = types.ModuleType("hfd_rotary_first"), types.ModuleType("hfd_rotary_second")
    for module in (first, second):
        module.apply_rotary_pos_emb = lambda q, k, cos, sin: (q, k)
    monkeypatch.setattr(rotary, "matches", lambda fn: True)
    assert rotary.install(first) and rotary.users(first) == 1

    def first_collected_meanwhile(fn):
        rotary.uninstall(first)  # what the collected model's patch state's finalizer calls
        return True

    monkeypatch.setattr(rotary, "matches", first_collected_meanwhile)
    done = threading.Event()
    worker = threading.Thread(target=lambda: rotary.install(second) and done.set(), daemon=True)
    worker.start()
    worker.join(30)
    assert done.is_set(), "install waited for itself: uninstall, run inside it, took the same lock"
    assert rotary.users(first) == 0 and rotary.users(second) == 1
    rotary.uninstall(second)
    assert rotary.users(second) == 0 and second.apply_rotary_pos_emb.__name__ == "<lambda>"
