"""hf_division/analysis/gpu_resources.py: the occupancy arithmetic, the parsing of Triton's tools,
and every kernel variant compiled for sm_90 on this CPU machine: no register spilled, enough warps
resident to keep loads in flight, no unrolled code bloat (docs/DESIGN.md, "On a GPU": registers)."""
import json
import os
import subprocess
import sys

import pytest

from hf_division.analysis import gpu_resources as gr
from hf_division.kernels import triton_codec
from hf_division.kernels.triton_variants import COMPILED_VARIANTS

from conftest import CHILD_TIMEOUT_S

pytestmark = pytest.mark.heavy

#: the least warps each kernel keeps resident on a multiprocessor: 8 is two programs of 4 warps,
#: or one of 8 (the RMSNorm gradient at its widest rows, 32 values a thread)
MIN_RESIDENT_WARPS = 8
#: the most machine instructions a variant compiles to: unrolled loops over a whole group's words
#: compile to several times more (and spill)
MAX_INSTRUCTIONS = 20000


def _suite(tmp_path, *args) -> tuple[dict, str]:
    """``python -m hf_division.bench kernels *args`` in a process without the interpreter (the
    kernels compile, as a GPU's first launch compiles them): its JSON and its printed report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = tmp_path / "kernels.json"
    out = subprocess.run([sys.executable, "-m", "hf_division.bench", "kernels", *args, "--out", str(path)], env=env,
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(path.read_text()), out.stdout


@pytest.mark.parametrize("registers,warps,shared,blocks", [
    (255, 4, 1024, 2),  # 255 -> 256 a thread, 8192 a warp, 32768 a block: two blocks' registers
    (128, 4, 1024, 4),
    (129, 4, 0, 3),  # 129 -> 136 a thread: 4352 a warp, 17408 a block
    (38, 8, 1024, 6),  # 38 -> 40: 1280 a warp, 10240 a block
    (16, 4, 0, 16),  # the warps' limit: 64 / 4
    (16, 1, 0, 32),  # the blocks' limit
    (32, 4, 100_000, 2),  # shared memory's: 233472 // 101024
])
def test_resident_blocks_take_the_least_of_each_limit(registers, warps, shared, blocks):
    assert gr.resident(registers, warps, shared) == blocks


def test_the_tools_output_is_read_or_refused():
    text = "Resource usage:\n Common:\n  GLOBAL:0\n Function encode_kernel:\n  REG:117 STACK:0 SHARED:1024 LOCAL:8 CONSTANT[0]:672"
    assert gr.resource_line(text) == {"registers": 117, "stack": 0, "shared": 1024, "local": 8}
    with pytest.raises(ValueError, match="no resource usage"):
        gr.resource_line("cuobjdump: fatal")
    sass = "\t.text.k:\n        /*0000*/                   LDC R1, c[0x0][0x28] ;\n        /*0010*/  S2R R0, SR_TID.X ;\n"
    assert gr.count_instructions(sass) == 2
    listing = "  /*0100*/ LDG.E.128 R4, desc[UR6][R2.64] ;\n  /*0110*/ LDG.E R8, desc[UR6][R6.64] ;\n  /*0120*/ STG.E.128 ;"
    assert gr.count_loads(listing) == (2, 1)
    u = gr.Usage(warps=4, registers=255, stack=3584, shared=1024, instructions=10)
    assert u.row()["resident"] == 2 and u.row()["resident_warps"] == 8


@pytest.mark.skipif(not triton_codec.available(), reason="Triton is not installed (pip install hf-division[test])")
def test_every_kernel_compiles_for_an_h200_without_spilling(tmp_path):
    """``python -m hf_division.bench kernels`` (a process without the interpreter, compiling as a
    GPU's first launch does): each variant's cubin for sm_90 has no stack (spilled registers), at
    least :data:`MIN_RESIDENT_WARPS` resident warps and at most :data:`MAX_INSTRUCTIONS`."""
    res, out = _suite(tmp_path)
    rows = res["variants"]
    assert set(rows) == set(COMPILED_VARIANTS) and res["arch"] == 90
    assert not any(_below_the_bars(list(rows.values())).values()), _below_the_bars(list(rows.values()))
    assert "warps/SM" in out


def _below_the_bars(rows: list) -> dict:
    """The rows past :data:`MIN_RESIDENT_WARPS`, :data:`MAX_INSTRUCTIONS` or with stack, by what."""
    return {"stack": [r for r in rows if r["stack"]], "warps": [r for r in rows if r["resident_warps"] < MIN_RESIDENT_WARPS],
            "instructions": [r for r in rows if r["instructions"] > MAX_INSTRUCTIONS]}


@pytest.mark.skipif(not triton_codec.available(), reason="Triton is not installed (pip install hf-division[test])")
def test_a_steps_kernels_as_triton_specializes_them(tmp_path):
    """``kernels --step``: the binaries one SmolLM2-shaped layer's step loads (each specialized for
    the step's own tensors, on the simulated sm_90 device) hold to the same bars, every kernel of
    the GPU's path among them, and each launch's programs as its launcher computes them."""
    res, out = _suite(tmp_path, "--step", "--size", "1x300")
    binaries, launches = res["binaries"], res["launches"]
    assert not any(_below_the_bars(binaries).values()), _below_the_bars(binaries)
    # the held tensors' loads are 16 bytes wide where Triton specializes for their alignment
    for name in ("score_kernel", "encode_kernel", "decode_kernel", "silu_mul_kernel", "rms_grad_kernel", "rotary_kernel"):
        assert all(b["wide_loads"] > 0 for b in binaries if b["kernel"] == name), name
    names = {b["kernel"] for b in binaries}
    assert names == {f"{k}_kernel" for k in ("score", "select", "encode", "decode", "put_rows", "rms_rebuild", "rms_grad",
                                              "silu_mul", "silu_mul_grad", "rotary")}
    # per layer 8 saved tensors and the final norm's input: each scored, selected, encoded, decoded, its rows put
    # back; two norms and the final one rebuilt and differentiated; one gated MLP's product and gradients; the
    # rotary embedding of q and k, forward and backward
    count = {n: sum(binaries[x["binary"]]["kernel"] == n for x in launches) for n in names}
    assert count == {"score_kernel": 9, "select_kernel": 9, "encode_kernel": 9, "decode_kernel": 9,
                     "put_rows_kernel": 9, "rms_rebuild_kernel": 3, "rms_grad_kernel": 3, "silu_mul_kernel": 1,
                     "silu_mul_grad_kernel": 1, "rotary_kernel": 2}
    scores = [x["programs"] for x in launches if binaries[x["binary"]]["kernel"] == "score_kernel"]
    # the tokens of the hidden states, and of k and v per key/value head (3 x 300 of width 64)
    assert set(scores) == {triton_codec.score_launch(300, 576)[0][0], triton_codec.score_launch(3 * 300, 64)[0][0]}
    assert "waves" in out


@pytest.mark.skipif(not triton_codec.available(), reason="Triton is not installed (pip install hf-division[test])")
def test_a_checkpointed_steps_kernels(tmp_path):
    """``kernels --step --checkpointing``: with Transformers' checkpointing each layer's input is
    held (at 8 bits, ``checkpoint_bits``) and the final norm's; the binaries hold to the same bars."""
    res, _ = _suite(tmp_path, "--step", "--checkpointing", "--layers", "2", "--size", "1x300")
    binaries, launches = res["binaries"], res["launches"]
    assert res["checkpointing"] and not any(_below_the_bars(binaries).values()), _below_the_bars(binaries)
    encodes = [binaries[x["binary"]]["constants"]["BITS"] for x in launches if binaries[x["binary"]]["kernel"] == "encode_kernel"]
    assert sorted(encodes) == [4, 8, 8]
