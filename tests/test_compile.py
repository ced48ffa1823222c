"""torch.compile(model) with division: division's ops run eagerly as graph breaks, the rest compiles.

Without that, Dynamo fails on the ops' Python state ("Guard failed on the same frame it was
created", from the weak-reference finalizers of the saved-tensor registry). Under compile, dropout
is left to the compiler (masks not kept as bits: Dynamo mis-traces Llama inside a
TorchFunctionMode). ``aot_eager`` runs Dynamo and AOTAutograd (where the failure happened) without
inductor's code generation, which is slow on 2 CPU cores; one inductor case checks the default.
"""
import pytest
import torch

import hf_division as hd
from hf_division.autograd import store
from hf_division.analysis.fidelity import flat_grad

from conftest import tiny_batch, tiny_model

pytestmark = pytest.mark.heavy


def _step(compiled, model, batch, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = compiled(**batch)
    out.loss.backward()
    grad = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grad


def _cos(a, b):
    return (a @ b / (a.norm() * b.norm())).item()


# llama with the compiled wrapper patched (wrap first): test_compiled_inductor
@pytest.mark.parametrize("model_type, wrap_first", [("bert", False)])
def test_compiled_model_with_division(model_type, wrap_first, monkeypatch):
    model = tiny_model(model_type, "sdpa").train()  # bert: dropout 0.1
    batch = tiny_batch(batch=4, seq=64)
    exact = flat_grad(model, batch, 0).double()
    torch._dynamo.reset()
    ref, _ = _step(torch.compile(model, backend="aot_eager"), model, batch)  # compiled, no division
    packed = []
    pack = store.pack
    monkeypatch.setattr(store, "pack", lambda t, kind, config: packed.append(kind) or pack(t, kind, config))
    torch._dynamo.reset()
    if wrap_first:  # apply_division accepts the compiled wrapper (it unwraps _orig_mod)
        compiled = torch.compile(model, backend="aot_eager")
        hd.apply_division(compiled)
    else:
        hd.apply_division(model)
        compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):  # the second call runs the cached graphs
        packed.clear()
        logits, grad = _step(compiled, model, batch)
        assert torch.equal(logits, ref)  # the compiled forward is unchanged by division
        assert {"linear", "attention"} <= set(packed)  # division really acted inside the compiled model
        assert _cos(grad, exact) >= 0.98
    hd.remove_division(model)
    torch._dynamo.reset()
    packed.clear()
    _step(torch.compile(model, backend="aot_eager"), model, batch)
    assert packed == []


def test_root_forward_checks_for_new_or_lost_modules_outside_the_trace(monkeypatch):
    """The patched root forward's check for modules added or replaced since patching runs eagerly:
    traced by PyTorch 2.11's Dynamo it re-recorded division's own wrappers as the forwards to
    restore, and after ``remove_division`` the model still compressed (the test above, on 2.11)."""
    from hf_division.patching import primitives
    seen = []
    forget = primitives.forget_lost
    monkeypatch.setattr(primitives, "forget_lost", lambda state: seen.append(torch.compiler.is_compiling()) or forget(state))
    model = tiny_model("bert", "sdpa").train()
    hd.apply_division(model)
    torch._dynamo.reset()
    torch.compile(model, backend="aot_eager")(**tiny_batch(batch=2, seq=32)).loss.backward()
    torch._dynamo.reset()
    assert seen and not any(seen)


def test_compiled_inductor(monkeypatch):
    model = tiny_model("llama", "sdpa").train()
    batch = tiny_batch(batch=2, seq=32)
    torch.manual_seed(0)
    ref = model(**batch).logits.detach()
    exact = flat_grad(model, batch, 0).double()
    torch._dynamo.reset()
    compiled = torch.compile(model)
    hd.apply_division(compiled)  # the compiled wrapper: apply_division unwraps ``_orig_mod``
    packed = []
    pack = store.pack
    monkeypatch.setattr(store, "pack", lambda t, kind, config: packed.append(kind) or pack(t, kind, config))
    logits, grad = _step(compiled, model, batch)
    assert {"linear", "attention"} <= set(packed)  # division acted inside the compiled model
    assert torch.allclose(logits, ref, atol=1e-5)  # inductor may order float ops differently from eager
    assert _cos(grad, exact) >= 0.98


def test_dynamo_never_traces_the_saved_tensor_registry():
    """Dynamo inlines an autograd Function's forward where it can; division's bookkeeping must stay
    opaque to it: tracing the registry (a dict weak-reference finalizers change at any garbage
    collection) failed at random with "dictionary changed size during iteration"."""
    model = tiny_model("llama", "sdpa").train()
    hd.apply_division(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**tiny_batch(batch=2, seq=32))
    torch._dynamo.reset()
    traced = [(f.filename, f.lineno) for b in explained.break_reasons for f in b.user_stack
              if f.filename.replace("\\", "/").endswith("hf_division/autograd/store.py")]
    assert explained.graph_break_count > 0 and traced == [], traced
