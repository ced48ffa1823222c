"""The patched forward's ForwardMode: what its Python handler sees, and what it leaves alone."""
import collections
import contextlib

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
