"""The patched forward's ForwardMode: what its Python handler sees, and what it leaves alone."""
import collections
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import hf_division as hd
from hf_division.autograd import forward_mode

from conftest import tiny_batch, tiny_model


def _seen_by_forward_mode(monkeypatch, model, batch, user_mode=None) -> collections.Counter:
    seen = collections.Counter()
    handler = forward_mode.ForwardMode.__torch_function__

    def count(self, func, types, args=(), kwargs=None):
        seen[getattr(func, "__name__", str(func))] += 1
        return handler(self, func, types, args, kwargs)

    monkeypatch.setattr(forward_mode.ForwardMode, "__torch_function__", count)
    model.train()
    with user_mode or contextlib.nullcontext():
        model(**batch).loss.backward()
    return seen


class _Names(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def test_functions_run_outside_the_forward_mode_and_other_modes_still_see_them(monkeypatch):
    """Inside division's Functions (grad off: the mode routes nothing there) the layers' own torch
    calls skip ForwardMode's handler, which costs host time per call; the model's code between
    them still runs under it, and a mode the user entered around the model still sees every call."""
    model = tiny_model("llama", "sdpa")
    batch = tiny_batch(batch=2, seq=16, model_type="llama")
    hd.apply_division(model, hd.DivisionConfig(min_numel=0))
    seen = _seen_by_forward_mode(monkeypatch, model, batch)
    assert seen["embedding"] == 1  # the model's own code, outside any Function
    assert seen["add"] or seen["__add__"]  # the residual additions
    # F.linear inside LinearFn, sdpa inside AttentionFn, rsqrt inside RMSNorm's Function
    assert not (seen["linear"] or seen["scaled_dot_product_attention"] or seen["rsqrt"]), seen
    user = _Names()
    _seen_by_forward_mode(monkeypatch, model, batch, user_mode=user)
    assert user.seen["linear"] and user.seen["scaled_dot_product_attention"] and user.seen["rsqrt"]
    hd.remove_division(model)


def test_outside_pops_only_the_innermost_forward_mode():
    """Under a user's mode alone nothing is popped; with ForwardMode innermost it is popped for
    the call and back on the stack after, also when the call raises."""
    def names_on_stack():
        return [type(torch._C._get_function_stack_at(i)).__name__ for i in range(torch._C._len_torch_function_stack())]

    inside = []
    run = forward_mode.outside(lambda fail=False: inside.append(names_on_stack()) or (fail and 1 / 0))
    with _Names():
        run()
        with forward_mode.ForwardMode():
            run()
            try:
                run(fail=True)
            except ZeroDivisionError:
                pass
            assert names_on_stack() == ["_Names", "ForwardMode"]
    assert inside == [["_Names"]] * 3


def test_dropout_still_routed_under_the_mode():
    """Popping the mode inside Functions leaves functional dropout in the model's own code
    routed to DropoutFn (1 bit per element kept)."""
    x = torch.randn(4, 64, requires_grad=True)
    with forward_mode.ForwardMode():
        y = F.dropout(x, 0.5, training=True)
    assert type(y.grad_fn).__name__ == "DropoutFnBackward"


def _forwards_seen(monkeypatch, model, batch, n, autocast=None) -> list[int]:
    """Per training step of ``model`` (``n`` of them): how many torch calls ForwardMode's handler saw."""
    counts = [0]
    handler = forward_mode.ForwardMode.__torch_function__

    def count(self, func, types, args=(), kwargs=None):
        counts[-1] += 1
        return handler(self, func, types, args, kwargs)

    monkeypatch.setattr(forward_mode.ForwardMode, "__torch_function__", count)
    model.train()
    for _ in range(n):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        counts.append(0)
    return counts[:-1]


def test_a_forward_with_nothing_to_route_runs_without_the_mode_after_its_first(monkeypatch):
    """Llama routes nothing (no dropout, no cast of a held tensor): the first forward of a signature
    runs under the mode, the next ones without it, every REPROBE_EVERY-th under it again; a new
    signature (autocast on, another argument) is probed again. Gradients and bytes held are the same
    to the bit as with every forward under the mode."""
    from hf_division.analysis.measure import held_bytes
    from hf_division.kernels import configured
    from hf_division.patching.primitives import REPROBE_EVERY

    model = tiny_model("llama", "sdpa")
    batch = tiny_batch(batch=2, seq=16, model_type="llama")
    hd.apply_division(model, hd.DivisionConfig(min_numel=0, rounding="nearest"))
    seen = _forwards_seen(monkeypatch, model, batch, REPROBE_EVERY + 1)
    assert seen[0] > 100 and seen[REPROBE_EVERY - 1] > 100, seen  # the first, and the REPROBE_EVERY-th forward
    assert not any(seen[1:REPROBE_EVERY - 1]) and not seen[REPROBE_EVERY], seen
    assert _forwards_seen(monkeypatch, model, batch, 2, torch.bfloat16)[0] > 100  # autocast: a new signature
    unmasked = {k: v for k, v in batch.items() if k != "attention_mask"}
    assert _forwards_seen(monkeypatch, model, unmasked, 2)[0] > 100
    steps = {}
    for lazy in (True, False):
        with configured(lazy_forward_mode=lazy):
            steps[lazy] = (_forwards_seen(monkeypatch, model, batch, 1), held_bytes(model, batch)[0])
            model(**batch).loss.backward()
            steps[lazy] += ([p.grad.clone() for p in model.parameters()],)
            model.zero_grad(set_to_none=True)
    assert steps[True][0] == [0] and steps[False][0][0] > 100
    assert steps[True][1] == steps[False][1]
    assert all(torch.equal(a, b) for a, b in zip(steps[True][2], steps[False][2]))
    hd.remove_division(model)


def test_a_forward_that_routes_always_runs_under_the_mode(monkeypatch):
    """BERT's dropouts are routed to DropoutFn (1 bit a mask element): every forward runs under the
    mode. With every dropout off, its forwards run without it until a reprobe finds one on again."""
    from hf_division.patching.primitives import REPROBE_EVERY

    model = tiny_model("bert", "eager")
    batch = tiny_batch(batch=2, seq=16, model_type="bert")
    hd.apply_division(model, hd.DivisionConfig(min_numel=0))
    assert all(n > 0 for n in _forwards_seen(monkeypatch, model, batch, 3))
    model2 = tiny_model("bert", "eager", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hd.apply_division(model2, hd.DivisionConfig(min_numel=0))
    seen = _forwards_seen(monkeypatch, model2, batch, 2)
    assert seen[0] > 0 and seen[1] == 0, seen
    for m in model2.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    seen = _forwards_seen(monkeypatch, model2, batch, REPROBE_EVERY + 1)
    first = next(i for i, n in enumerate(seen) if n)  # the reprobe: from there on, every forward
    assert first < REPROBE_EVERY and all(seen[first:]), seen


def test_modules_added_after_patching_are_probed_again(monkeypatch):
    """PEFT's adapters added after apply_division cast LoRA's input (a cast the mode makes derivable):
    the patch state's record is cleared with the repatch, and the next forward runs under the mode."""
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", "sdpa")
    batch = tiny_batch(batch=2, seq=16, model_type="llama")
    hd.apply_division(model, hd.DivisionConfig(min_numel=0))
    assert _forwards_seen(monkeypatch, model, batch, 2)[1] == 0
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert _forwards_seen(monkeypatch, lora, batch, 1)[0] > 0
