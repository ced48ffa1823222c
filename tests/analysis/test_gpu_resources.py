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

from conftest import CHILD_TIMEOUT_S

#: the least warps each kernel keeps resident on a multiprocessor: 8 is two programs of 4 warps,
#: or one of 8 (the RMSNorm gradient at its widest rows, 32 values a thread)
MIN_RESIDENT_WARPS = 8
#: the most machine instructions a variant compiles to: the encode kernel's unrolled loops once
#: compiled to about 133,000, past any multiprocessor's instruction cache
MAX_INSTRUCTIONS = 20000


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
    u = gr.Usage(warps=4, registers=255, stack=3584, shared=1024, instructions=10)
    assert u.row()["resident"] == 2 and u.row()["resident_warps"] == 8


@pytest.mark.skipif(not triton_codec.available(), reason="Triton is not installed (pip install hf-division[test])")
def test_every_kernel_compiles_for_an_h200_without_spilling(tmp_path):
    """``python -m hf_division.bench kernels`` (a process without the interpreter, compiling as a
    GPU's first launch does): each variant's cubin for sm_90 has no stack (spilled registers), at
    least :data:`MIN_RESIDENT_WARPS` resident warps and at most :data:`MAX_INSTRUCTIONS`; a saved
    tensor's launches spread as the launchers compute them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = tmp_path / "kernels.json"
    out = subprocess.run([sys.executable, "-m", "hf_division.bench", "kernels", "--out", str(path)], env=env,
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(path.read_text())
    rows = res["variants"]
    assert set(rows) == set(triton_codec.COMPILED_VARIANTS) and res["arch"] == 90
    spilled = {v: r["stack"] for v, r in rows.items() if r["stack"]}
    assert not spilled, f"registers spilled to the stack (bytes a thread): {spilled}"
    few = {v: r["resident_warps"] for v, r in rows.items() if r["resident_warps"] < MIN_RESIDENT_WARPS}
    assert not few, f"warps resident per multiprocessor: {few}"
    long = {v: r["instructions"] for v, r in rows.items() if r["instructions"] > MAX_INSTRUCTIONS}
    assert not long, f"instructions: {long}"
    # 8192 tokens at width 576 with the defaults: 32 groups x 18 tiles of 32 channels; 512 score programs of 16 tokens
    smollm2 = res["spread"][0]
    assert (smollm2["shape"], smollm2["width"]) == ("smollm2", 576)
    assert smollm2["programs"] == {"score": 512, "encode": 32 * 18, "decode": 32 * 18}
    assert "warps/SM" in out.stdout
