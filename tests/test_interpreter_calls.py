"""tests/interpreter_calls.py: the interpreter spared its re-patching computes what Triton's does."""
import contextlib
import os

import pytest
import torch

import interpreter_calls
from hf_division.analysis.launches import gpu_path
from hf_division.compress.pipeline import compress, decompress
from hf_division.kernels import triton_codec


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton_codec.available(),
                    reason="Triton's interpreter only")
def test_the_kernels_give_what_tritons_own_interpreter_gives():
    from triton.runtime import interpreter

    if os.environ.get("HF_DIVISION_TEST_REPATCH") == "1":
        pytest.skip("HF_DIVISION_TEST_REPATCH=1: not installed")
    assert interpreter_calls.ORIGINAL, "not installed: Triton's interpreter is not the one tests/interpreter_calls.py describes"
    patches = []
    real = interpreter._patch_lang

    def counted(fn):
        patches.append(fn.__name__)
        return real(fn)

    x = torch.randn(2, 300, 96).bfloat16()  # a ragged last group, outlier tokens scored
    x[0, 5] *= 40
    out = {}
    interpreter._patch_lang = counted
    try:
        with gpu_path():
            for way in ("spared", "triton"):
                patches.clear()
                with interpreter_calls.as_triton_has_it() if way == "triton" else contextlib.nullcontext():
                    p = compress(x, bits=4, block_size=16, group_size=256, outlier_ratio=16.0,
                                 generator=torch.Generator().manual_seed(0))
                    out[way] = (p, decompress(p), len(patches))
    finally:
        interpreter._patch_lang = real
    (spared, rebuilt, n), (theirs, rebuilt_theirs, n_theirs) = out["spared"], out["triton"]
    assert spared.rows is not None  # the exact-token kernels ran too
    for name in ("packed", "lo", "scale", "lfc", "row_index", "row_keep"):
        assert torch.equal(getattr(spared, name), getattr(theirs, name)), name
    keep = spared.row_keep  # held at a fixed capacity: the rows not kept are never written
    assert keep.any() and torch.equal(spared.rows[keep], theirs.rows[keep])
    assert torch.equal(rebuilt, rebuilt_theirs)
    assert n < n_theirs / 5, (n, n_theirs)
