"""The same guarantees on a CUDA device: skipped where none is present (CI runs on CPU).

Run on a GPU machine with ``pytest tests/test_cuda.py``; docs/RESULTS.md ("On a GPU") records
when and where they last ran.
"""
import json
import os

import pytest
import torch

import hf_division as hd
from hf_division.compress.pipeline import compress, decompress
from hf_division.quant.packing import unpack_bits
from hf_division.analysis.fidelity import cosine, flat_grad
from hf_division.kernels import configured
from hf_division.analysis.measure import held_bytes
from hf_division.bench.suites import cuda as cuda_suite

from conftest import eval_before_and_after

#: HF_DIVISION_TEST_DEVICE=cpu runs these on the CPU (to check the tests themselves)
DEV = os.environ.get("HF_DIVISION_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")


def llama(tied=True):
    model = cuda_suite.build("tiny", DEV)
    model.config.tie_word_embeddings = tied
    return model


def batch(rows=2, seq=96, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, seq), generator=g).to(DEV)
    labels = ids.clone()
    labels[0, :9] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("grouping", ["tokens", "flat"])
def test_compressed_round_trip_on_device_within_one_step(bits, grouping):
    x = torch.randn(2, 300, 96, device=DEV) * torch.linspace(0.1, 5, 96, device=DEV)
    p = compress(x, bits=bits, block_size=4, stochastic=True, grouping=grouping,
                 generator=torch.Generator(device=DEV).manual_seed(0))
    y = decompress(p)
    assert y.device == x.device and y.shape == x.shape
    assert (y - x).abs().max() <= p.scale.float().max() * 1.0001 + 1e-5


@pytest.mark.parametrize("grouping", ["tokens", "flat"])
def test_compiled_kernels_match_eager_on_device(grouping):
    tokens = (4096 + 3) * 4 if grouping == "flat" else 17 * 256 + 48
    x = torch.randn(1, tokens, 64, device=DEV)
    out = {}
    for fused in (True, False):
        with configured(compile=fused):
            out[fused] = compress(x, bits=4, block_size=16, stochastic=True, grouping=grouping,
                                  generator=torch.Generator(device=DEV).manual_seed(0))
    codes_f, codes_e = unpack_bits(out[True].packed, 4), unpack_bits(out[False].packed, 4)
    assert (codes_f != codes_e).float().mean() < 1e-4  # at most last-bit ties differ
    torch.testing.assert_close(decompress(out[True]), decompress(out[False]), atol=out[True].scale.float().max().item(),
                               rtol=0)


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_training_gradient_close_and_fewer_bytes(amp):
    model = llama().train()
    inputs = batch()
    exact = flat_grad(model, inputs, 0, autocast=amp)
    before, _ = held_bytes(model, inputs)
    hd.apply_division(model)
    after, _ = held_bytes(model, inputs)
    approx = flat_grad(model, inputs, 0, autocast=amp, reseed_noise=True)
    assert cosine(exact, approx) >= 0.98
    assert after * 3 < before


def test_eval_bit_identical_and_removal_restores():
    model, inputs = llama(), batch()
    ref, out = eval_before_and_after(model, inputs, hd.apply_division)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    hd.remove_division(model)
    model.train()
    a = model(**inputs).logits
    hd.apply_division(model)
    b = model(**inputs).logits  # the training forward is bit-identical too; only backward differs
    assert torch.equal(a, b)


def test_causal_lm_loss_and_gradient_match_transformers_in_bf16():
    model = llama(tied=False).train()
    inputs = {**batch(), "num_items_in_batch": torch.tensor(150, device=DEV)}
    exact = flat_grad(model, inputs, 0, autocast=torch.bfloat16)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        ref = model(**inputs).loss
    hd.apply_division(model, hd.DivisionConfig(linear_bits=0, attention_bits=0, activation_bits=0, norm_bits=0))
    with torch.autocast(DEV, dtype=torch.bfloat16):
        out = model(**inputs).loss
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    assert cosine(exact, flat_grad(model, inputs, 0, autocast=torch.bfloat16)) >= 0.999


def test_suite_runs_on_device(tmp_path):
    out = tmp_path / "r.json"
    cuda_suite.main(["--device", DEV, "--shapes", "tiny", "--sizes", "2x64", "--rounds", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    arms = rows[0]["arms"]
    assert arms["division"]["held_mib"] < arms["none"]["held_mib"]
    assert arms["division"]["cosine"] > 0.95
    if DEV == "cuda":  # the steps captured in CUDA graphs: replayed, the gradients those of the eager steps
        assert arms["none+graph"]["cosine"] > 0.9999 and arms["none+graph"]["step_s"] > 0, arms["none+graph"]
        assert arms["division+graph"]["cosine"] > 0.95 and arms["division+graph"]["step_s"] > 0, arms["division+graph"]


@pytest.mark.skipif(DEV != "cuda", reason="host synchronisation is a CUDA notion")
@pytest.mark.parametrize("exact_tokens", [0, 1])
def test_compress_without_host_sync(exact_tokens):
    """Outlier tokens and leading exact tokens are split at a fixed size on CUDA: compressing
    reads nothing back to the host (``torch.cuda.set_sync_debug_mode("error")`` raises if it does)."""
    x = torch.randn(4, 256, 64, device=DEV, dtype=torch.bfloat16)
    x[0, 0] *= 500
    compress(x, bits=4, block_size=1, group_size=32, outlier_ratio=16.0, exact_tokens=exact_tokens)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p = compress(x, bits=4, block_size=1, group_size=32, outlier_ratio=16.0, exact_tokens=exact_tokens)
        y = decompress(p)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y[0, 0], x[0, 0])


needs_cuda = pytest.mark.skipif(DEV != "cuda", reason="the Triton kernels and CUDA graphs need a CUDA device")


@needs_cuda
@pytest.mark.parametrize("seed", [None, 2**32 - 7])
def test_triton_codes_equal_the_reference_on_device(seed):
    """Compiled for the GPU (no multiply-add fusion, IEEE division), the kernels give the reference's
    codes, block means and ranges to the bit, as under the interpreter (tests/test_triton.py)."""
    from hf_division.compress.backends import EAGER, pick
    from hf_division.kernels import triton_codec

    assert pick(torch.device(DEV), "tokens", torch.bfloat16).name == "triton"
    x = (torch.randn(3, 301, 96, device=DEV) * torch.linspace(0.1, 5, 96, device=DEV)).bfloat16()
    s = None if seed is None else torch.tensor(seed, dtype=torch.int64, device=DEV)
    got = triton_codec.encode_tokens(x, s, 4, 16, 256, torch.bfloat16)
    ref = EAGER.encode_tokens(x.float(), s, 4, 16, 256, torch.bfloat16)
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.lfc, ref.lfc)
    assert torch.equal(got.lo, ref.lo) and torch.equal(got.scale, ref.scale)


@needs_cuda
def test_kept_kernels_launch_as_tritons_dispatch_on_device():
    """Launched again through hf_division/kernels/launcher.py and each call site's plan (the
    ``triton_launch`` and ``planned_launch`` switches), the kernels give what Triton's dispatch gives, to the bit, for an aligned tensor and a view 2 bytes
    off (a specialization of its own), on the current stream (a side stream here)."""
    flat = torch.randn(2 * 300 * 96 + 8, device=DEV).bfloat16()
    kw = dict(bits=4, block_size=16, group_size=256, outlier_ratio=4.0)
    side = torch.cuda.Stream()
    for x in (flat[:57600].view(2, 300, 96), flat[1:57601].view(2, 300, 96)):
        got = {}
        for direct in (False, True, True):  # the second direct pass launches the kept kernels
            with configured(triton_launch=direct), torch.cuda.stream(side):
                p = compress(x, generator=torch.Generator(DEV).manual_seed(3), **kw)
                got[direct] = (p.packed.clone(), p.lfc.clone(), p.scale.clone(), decompress(p))
            side.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got[False], got[True]))


@pytest.mark.skipif(DEV != "cuda" or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_tensor_on_a_device_not_current_compresses_as_on_the_current_one():
    """A model spread over two GPUs in one process (``device_map="auto"``): a tensor on cuda:1 while
    cuda:0 is current compresses and rebuilds as the same tensor on cuda:0, to the bit (Triton
    refuses another device's pointers where its kernels launch on the current one)."""
    x = torch.randn(2, 300, 96, device="cuda:0").bfloat16()
    kw = dict(bits=4, block_size=16, group_size=256, outlier_ratio=4.0)
    with torch.cuda.device(0):
        here = [compress(t, generator=torch.Generator(t.device).manual_seed(3), **kw) for t in (x, x.to("cuda:1"))]
        rebuilt = [decompress(p).cpu() for p in here]
    assert torch.equal(here[0].packed.cpu(), here[1].packed.cpu()) and torch.equal(*rebuilt)


@needs_cuda
def test_training_step_without_host_sync_on_device():
    """A whole division step (forward, backward) reads nothing back: CUDA's sync debug mode raises
    at the first op that would."""
    model, inputs = llama().train(), batch()
    hd.apply_division(model)
    for checked in (False, True):  # the first step compiles the kernels and draws the seeds
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            with torch.autocast(DEV, dtype=torch.bfloat16):
                loss = model(**inputs).loss
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_cuda_graph_captured_step_matches_eager(rounding):
    """A division training step captured in a CUDA graph replays: rounding to nearest, its gradient
    equals the eager step's; with stochastic rounding (division's noise generators registered
    with the graph) each replay draws new noise, and stays as close to the exact gradient."""
    from hf_division.compress.noise import generators

    model, inputs = llama().train(), batch()
    exact = flat_grad(model, inputs, 0)
    hd.apply_division(model, hd.DivisionConfig(rounding=rounding))
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad.zero_()
        model(**inputs).loss.backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(**inputs).loss.backward()  # the grads allocated, the kernels compiled, the generators made
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    step()
    eager = torch.cat([p.grad.double().flatten() for p in params])
    graph = torch.cuda.CUDAGraph()
    for gen in generators(DEV):
        graph.register_generator_state(gen)
    with torch.cuda.graph(graph):
        step()
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(torch.cat([p.grad.double().flatten() for p in params]))
    if rounding == "nearest":
        assert torch.equal(replays[0], eager) and torch.equal(replays[1], eager)
    else:
        assert not torch.equal(replays[0], replays[1])
        assert min(cosine(exact, r) for r in replays) >= 0.98
