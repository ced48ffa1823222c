"""State that belongs to one thread: ``exact()`` / recomputation depth (autograd/store.py) and the
model whose rounding noise is drawn (compress/noise.py). A forward in one thread must not see what
another thread entered (issue 42, item 6)."""
import threading

import torch

import hf_division as hd
from hf_division.analysis.measure import held_bytes
from hf_division.autograd import store
from hf_division.compress import noise
from tests.conftest import tiny_model
from hf_division.bench.tiny_models import tiny_batch


def _in_thread_while(ctx, fn):
    """``fn()`` run in this thread while another thread sits inside ``ctx``."""
    entered, release = threading.Event(), threading.Event()

    def hold():
        with ctx:
            entered.set()
            release.wait(30)

    other = threading.Thread(target=hold)
    other.start()
    try:
        assert entered.wait(30)
        return fn()
    finally:
        release.set()
        other.join(30)


def test_exact_in_another_thread_leaves_this_threads_forward_compressed():
    model = tiny_model("bert", "eager")
    hd.apply_division(model)
    model.train()
    batch = tiny_batch(batch=2, seq=32)
    alone, _ = held_bytes(model, batch)
    with hd.exact():
        exact_here, _ = held_bytes(model, batch)
    assert exact_here > 2 * alone  # exact() does switch compression off in its own thread
    assert not store.in_recomputation()
    beside = _in_thread_while(hd.exact(), lambda: (store.in_recomputation(), held_bytes(model, batch)[0]))
    assert beside == (False, alone)


def test_exact_holds_in_the_thread_that_entered_it():
    seen = {}

    def run():
        with hd.exact():
            seen["inside"] = store.in_recomputation()
        seen["after"] = store.in_recomputation()

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert seen == {"inside": True, "after": False}


def test_noise_stream_of_a_model_in_another_thread_is_not_drawn_here():
    cpu = torch.device("cpu")
    noise.reseed(1234)
    first, second = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    with noise.model_stream(first):  # numbered 0: the lone model's stream
        pass
    own = noise.generator(cpu)  # no model forwarding in this thread: stream 0
    with noise.model_stream(second):
        assert noise.generator(cpu) is not own
    beside = _in_thread_while(noise.model_stream(second), lambda: noise.generator(cpu))
    assert beside is own
