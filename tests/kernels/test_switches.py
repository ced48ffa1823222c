"""The switch board (hf_division.kernels.switches): one ``configure`` for every fast path, the
environment read at import, bad names and values refused with the allowed ones named."""
import os
import subprocess
import sys

import pytest
import torch

import hf_division
from hf_division.autograd import rms_norm
from hf_division.kernels import compiled, configure, configured, native, switches
from hf_division.kernels.switches import Switches


def test_one_switch_board_reached_from_the_package():
    assert hf_division.configure is configure and hf_division.configured is configured
    assert Switches.names() == ("native", "native_draws", "compile", "triton", "triton_launch", "planned_launch",
                                "triton_rms_norm", "triton_gated", "gated_from_codes", "shared_recomputation",
                                "sdpa_backward", "rms_norm_backward", "rotary", "triton_rotary", "lazy_forward_mode")
    assert all(getattr(switches(), name) for name in Switches.names())  # all on by default


def test_configure_returns_the_former_values_and_configured_restores_them():
    former = configure(rotary=False, compile=False)
    try:
        assert former == {"rotary": True, "compile": True}
        assert not switches().rotary and not compiled.fused()
    finally:
        configure(**former)
    assert switches().rotary and compiled.fused()
    with pytest.raises(RuntimeError):
        with configured(rms_norm_backward=False):
            assert not rms_norm.takes(1e-6)
            raise RuntimeError("inside")
    assert switches().rms_norm_backward and rms_norm.takes(1e-6)


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler: the native kernels are not built")
def test_the_native_switches_reach_the_library_and_the_draws():
    with configured(native_draws=False):
        assert native.kernels() is not None and not native.draws_apply(torch.empty(4), 0.5)
    with configured(native=False):
        assert native.kernels() is None and not native.applies(torch.device("cpu"), None)
    assert native.kernels() is not None and native.draws_apply(torch.empty(4), 0.5)


def test_unknown_switches_and_values_are_refused_naming_the_allowed_ones():
    with pytest.raises(TypeError, match="unknown switch 'fused'.*native, native_draws, compile"):
        configure(fused=False)
    with pytest.raises(TypeError, match="native must be True or False, got 0"):
        configure(native=0)
    assert switches().native  # nothing changed by a refused call


def test_the_environment_sets_the_switches():
    env = {"HF_DIVISION_NATIVE": "0", "HF_DIVISION_ROTARY": "Off", "HF_DIVISION_COMPILE": "yes", "OTHER": "0"}
    board = Switches.from_environment(env)
    assert (board.native, board.rotary, board.compile, board.native_draws) == (False, False, True, True)
    with pytest.raises(ValueError, match=r"HF_DIVISION_SDPA_BACKWARD='maybe': expected one of 1, true"):
        Switches.from_environment({"HF_DIVISION_SDPA_BACKWARD": "maybe"})


def test_an_environment_variable_reaches_a_fresh_process():
    code = "from hf_division.kernels import native, switches; print(switches().native, native.kernels())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, HF_DIVISION_NATIVE="0"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "None"]
