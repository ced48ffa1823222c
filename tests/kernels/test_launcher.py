"""hf_division/kernels/launcher.py: a kept Triton kernel launched as Triton's dispatch would launch it.

The key in-process; the launches themselves in a child process without the interpreter, where the
kernels compile for a simulated sm_90 device (``launcher_child.py``)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from hf_division.kernels import configured, launcher, switches, triton_codec

from conftest import CHILD_TIMEOUT_S


class _Fn:
    """What the key reads of a jit function: its parameters' names."""

    arg_names = ["x_ptr", "n", "scale", "out_ptr", "BLOCK"]


def _key(x, n, scale, out, meta=None, options=None):
    return launcher.key(_FN, (x, n, scale, out), meta or {"BLOCK": 64}, options or {})[1]


_FN = _Fn()


def test_the_key_tells_apart_what_triton_specializes_on():
    a, out = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64)
    k = _key(a, 32, 0.5, out)
    assert k == _key(torch.ones(64, dtype=torch.bfloat16), 32, 0.5, torch.ones(64))  # values do not matter
    assert k == _key(a[8:], 32, 0.5, out)  # 16 bytes on: still aligned
    differing = [
        _key(a[1:], 32, 0.5, out),  # a pointer off 16 bytes
        _key(a.half(), 32, 0.5, out),  # a dtype
        _key(a, 33, 0.5, out), _key(a, 1, 0.5, out),  # an integer (1 is a constant to Triton)
        _key(a, 32.0, 0.5, out),  # a float equal to the integer
        _key(a, 32, 0.5, out, meta={"BLOCK": 128}),  # a constexpr
        _key(a, 32, 0.5, out, options={"enable_fp_fusion": False}),  # an option
    ]
    assert all(d != k for d in differing) and len(set(differing)) == len(differing)
    assert _key(a, 1, 0.5, out) != _key(a, True, 0.5, out)  # a bool is unsigned 1-bit to Triton
    assert _key(a, 32, 1, out) != _key(a, 32, 1.0, out)  # an integer where a float was (equal, hashed alike)


def test_keys_are_kept_per_kernel_and_bounded(monkeypatch):
    launcher.forget()
    k, _ = launcher.key(_FN, (torch.zeros(4), 3, 0.5, torch.zeros(4)), {"BLOCK": 64}, {})
    assert k.fn is _FN and k.compiled == {}
    monkeypatch.setattr(launcher, "MAX_KEYS", 2)
    kernel = type("Compiled", (), {"run": None, "function": None, "packed_metadata": None, "launch_metadata": None})()

    class Jit(_Fn):
        def __getitem__(self, grid):
            return lambda *args, **kw: kernel

    jit = Jit()
    for n in range(5):
        k, spec = launcher.key(jit, (torch.zeros(4), n, 0.5, torch.zeros(4)), {"BLOCK": 64}, {})
        launcher.keep_first(k, (0, spec), (1,), (torch.zeros(4), n, 0.5, torch.zeros(4)), {"BLOCK": 64}, {})
        assert 1 <= len(k.compiled) <= 2
        assert next(iter(k.compiled.values())) == (kernel, (64,))  # the constexprs in parameter order
    # a pointer argument that is not a tensor (or a constexpr not named) keeps nothing: Triton's way each time
    k, spec = launcher.key(jit, (None, 3, 0.5, torch.zeros(4)), {"BLOCK": 64}, {})
    assert spec is None
    k.compiled.clear()
    launcher.keep_first(k, (0, 1), (1,), (None, 3, 0.5, torch.zeros(4)), {"BLOCK": 64}, {})
    launcher.keep_first(k, (0, 2), (1,), (torch.zeros(4), 3, 0.5, torch.zeros(4)), {}, {})
    assert k.compiled == {}
    launcher.forget()


@pytest.mark.skipif(not triton_codec.available(), reason="Triton is not installed (pip install hf-division[test])")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a stand-in driver here; tests/test_cuda.py has the real one")
def test_a_launcher_that_refuses_its_arguments_turns_the_switch_off():
    """A Triton whose ``CompiledKernel.run`` takes other arguments: that launch and every later one
    go through Triton's dispatch, with a warning saying so."""
    from triton.runtime.driver import driver

    dispatched = []

    class Kernel:
        function = packed_metadata = None

        def run(self, *args):
            raise TypeError("function takes exactly 12 arguments")

        def launch_metadata(self, *args):
            return None

    class Jit(_Fn):
        def __getitem__(self, grid):
            return lambda *args, **kw: dispatched.append(args) or Kernel()

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

    args, jit = (torch.zeros(4), 3, 0.5, torch.zeros(4)), Jit()
    driver.set_active(Driver())
    try:
        with configured(triton_launch=True):
            launcher.launch(jit, (1,), args, {"BLOCK": 64}, {})  # through Triton's dispatch: kept
            assert len(dispatched) == 1
            with pytest.warns(RuntimeWarning, match="the triton_launch switch is off"):
                launcher.launch(jit, (1,), args, {"BLOCK": 64}, {})
            assert len(dispatched) == 2 and not switches().triton_launch
    finally:
        driver.set_active(None)  # the default driver again, made when next asked for
        launcher.forget()


@pytest.mark.skipif(not triton_codec.available(), reason="Triton is not installed (pip install hf-division[test])")
@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda.py launches on the GPU itself")
def test_a_kept_kernel_gets_the_launch_tritons_dispatch_gives():
    """Per case (the layer ops' kernels; a pointer off 16 bytes, an integer of 1, the row-scaled
    variants of compressing and rebuilding a tensor), launching through the launcher hands the
    (simulated) CUDA launcher the same kernels, grids, stream, metadata and arguments as Triton's
    dispatch does, without going through that dispatch, or building the launcher's key, once the
    kernels are kept; a launch hook added later is still called."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, os.path.join(here, "launcher_child.py")], env=env, capture_output=True,
                         text=True, timeout=CHILD_TIMEOUT_S, cwd=os.path.dirname(os.path.dirname(here)))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    cases, (hooks,) = lines[:-1], lines[-1:]
    assert [case["case"] for case in cases][:1] == ["layer ops"] and len(cases) == 5
    assert cases[0]["launches"] == 6  # the norm's two, the gated MLP's two, the rotary embedding's two
    for case in cases:
        assert case["same"], case
        assert case["launches"] >= 3 and case["dispatched"] == 0 and case["keyed"] == 0, case
    kernels = ["score_kernel", "select_kernel", "encode_kernel", "decode_kernel", "put_rows_kernel"]
    assert hooks["hooked"] == kernels * 2 and hooks["same"]
