"""The native CPU kernels (hf_division/kernels/csrc/division_cpu.c) against the tensor code they write out
(hf_division/quant/codecs.py, run eagerly): the same bytes, the same rebuilt values; built once per
machine, with a warning and the torch kernels where no compiler works; the library's edges (failed
allocations, a cache others may write, wrong arguments, stale libraries, ranks building at once)."""
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_division.kernels import native
from hf_division.quant import exact_tokens, packing
from hf_division.compress.pipeline import compress, compress_row_scaled, decompress
from hf_division.kernels import configured
from hf_division.quant.packed import TokenBuffers

from conftest import CHILD_TIMEOUT_S


def both(x, **kw):
    """``{native: (Packed, rebuilt)}`` for the native kernels and the eager tensor code."""
    out = {}
    for use in (True, False):
        with configured(native=use, compile=use):  # the reference is the eager tensor code, not a compiled copy
            p = compress(x, generator=torch.Generator().manual_seed(3), **kw)
            out[use] = (p, decompress(p))
    return out[True], out[False]


pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no C compiler: the native kernels are not built")


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("shape, group", [((4, 128, 96), 256), ((3, 77, 40), 32), ((2, 129, 64), 256), ((1, 3, 200), 8)])
def test_same_bytes_and_values_without_lfc(bits, stochastic, shape, group):
    # full groups, a partial last group, groups shorter than a word, a transposed view below
    x = torch.randn(*shape) * 3
    (pn, yn), (pe, ye) = both(x, bits=bits, block_size=1, group_size=group, stochastic=stochastic)
    assert pn.layout == pe.layout and pn.group_size == pe.group_size
    for a, b in zip(pn.storages(), pe.storages()):
        assert torch.equal(a, b)
    assert torch.equal(yn, ye)


@pytest.mark.parametrize("lfc_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 100, 64), (3, 37, 128), (1, 5, 64)])
def test_same_bytes_with_lfc_and_padding(lfc_dtype, shape):
    # sequences padded to whole blocks by repeating the last token; 64 channels: ATen sums the
    # block in the same order as the C loop (another channel count can differ in the last bit)
    x = torch.randn(*shape) * 3
    (pn, yn), (pe, ye) = both(x, bits=4, block_size=16, group_size=64, lfc_dtype=lfc_dtype)
    for a, b in zip(pn.storages(), pe.storages()):
        assert torch.equal(a, b)
    assert torch.equal(yn, ye)


def test_any_channel_count_within_a_step():
    # with 70 channels ATen may add a block's tail channels in another order: LFC and codes can
    # differ by float32 rounding, the rebuilt values by at most one quantization step
    x = torch.randn(2, 37, 70) * 3
    (pn, yn), (pe, ye) = both(x, bits=4, block_size=16, group_size=256, lfc_dtype=torch.float32)
    assert torch.allclose(pn.lfc, pe.lfc, rtol=1e-6, atol=1e-6)
    assert ((yn - ye).abs() <= pe.scale.float().max() * 1.0001).all()


def test_transposed_view_and_outlier_tokens():
    # q of attention: (B, H, T, d) viewing (B, T, H*d) memory; decoders keep outlier tokens exact
    x = torch.randn(2, 64, 4 * 24).view(2, 64, 4, 24).transpose(1, 2)
    x[0, :, 0] *= 500.0
    (pn, yn), (pe, ye) = both(x, bits=4, block_size=16, group_size=32, outlier_ratio=16.0)
    assert pn.rows is not None and torch.equal(pn.row_index, pe.row_index)
    assert torch.equal(yn, ye) and yn.shape == x.shape and yn.stride() == x.stride()


def test_nonfinite_values_rebuild_nonfinite_where_the_tensor_code_does():
    x = torch.randn(2, 40, 64)
    x[0, 3, 5], x[1, 7, 1], x[1, 20, 9] = float("nan"), float("inf"), -float("inf")
    (_, yn), (_, ye) = both(x, bits=4, block_size=1, group_size=32)
    assert torch.equal(torch.isnan(yn), torch.isnan(ye)) and torch.equal(torch.isinf(yn), torch.isinf(ye))
    assert torch.equal(yn[torch.isfinite(yn)], ye[torch.isfinite(ye)])


def test_result_does_not_depend_on_the_thread_count():
    x = torch.randn(8, 96, 200)
    before = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out.append(compress(x, bits=4, block_size=16, group_size=64, generator=torch.Generator().manual_seed(0)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(out[0].storages(), out[1].storages()):
        assert torch.equal(a, b)


def test_a_broken_compiler_raises_naming_the_command(tmp_path):
    with pytest.raises((OSError, subprocess.SubprocessError), match="false"):
        native.build(cc="false", cache=tmp_path)
    assert not list(tmp_path.glob("*.so"))  # nothing half-written is left to load


def test_built_once_then_loaded_from_the_cache(tmp_path):
    first = native.build(cache=tmp_path)
    (built,) = tmp_path.glob("*.so")
    mtime = built.stat().st_mtime_ns
    second = native.build(cache=tmp_path)
    assert built.stat().st_mtime_ns == mtime and first._name == second._name == str(built)


def test_disabled_native_kernels_fall_back_to_the_tensor_code():
    x = torch.randn(2, 64, 32)
    with configured(native=False, compile=False):  # eager: the compiled copy is tested in test_compressor.py
        assert not native.applies(x.device, None)
        y = decompress(compress(x, bits=8, block_size=1, group_size=32))
    assert native.applies(x.device, None) and (y - x).abs().max() < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 4099])
def test_mask_bits_are_the_tensor_codes(dtype, n):
    # a dropout noise tensor (0 or 1 / (1 - p)), a 0/1 draw, a bool mask: bit i set where element i is not 0
    draw = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.3
    mask = draw.to(dtype) if dtype == torch.bool else draw.to(dtype).div_(0.7)
    bits, count = native.pack_mask(mask)
    assert count == n and torch.equal(bits, packing.pack_mask(mask)[0])
    assert torch.equal(packing.unpack_mask(bits, n, (n,)).bool(), draw)


@pytest.mark.parametrize("n", [5, 64, 4099])
def test_dropout_backward_is_the_gradient_times_the_noise(n):
    g = torch.Generator().manual_seed(n)
    noise = (torch.rand(n, generator=g) > 0.1).float().div_(0.9)  # as F.dropout's CPU path makes it
    grad = torch.randn(n, generator=g)
    grad[:3] = torch.tensor([float("inf"), -2.0, float("nan")])  # inf * 0 is NaN, -2 * 0 is -0
    bits, count = native.pack_mask(noise)
    out = native.masked_scale(grad, bits, count, (n,), torch.float32, 0.9)
    assert torch.equal(out.view(torch.int32), (grad * noise).view(torch.int32))  # to the bit, NaN and -0 included


@pytest.mark.parametrize("block", [1, 16])
def test_row_scaled_is_dividing_first_and_multiplying_after(block):
    # norm inputs: each token relative to its RMS (store._keep_row_scaled); with the division and
    # the product inside the kernels, the codes and the rebuilt tensor are the same to the bit
    x = torch.randn(3, 37, 96) * torch.logspace(-2, 2, 37).view(1, 37, 1)
    rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).mul_(96**-0.5)
    args = dict(bits=4, block_size=block, group_size=64, lfc_dtype=torch.bfloat16)
    fused = compress_row_scaled(x, rms, generator=torch.Generator().manual_seed(4), **args)
    plain = compress(x / rms, generator=torch.Generator().manual_seed(4), **args)
    for a, b in zip(plain.storages(), fused.storages()):
        assert torch.equal(a, b)
    assert fused.row_scale is rms and fused.nbytes == plain.nbytes + rms.numel() * 4
    assert torch.equal(decompress(fused), decompress(plain) * rms)
    with configured(native=False):  # a Packed built natively still rebuilds through the tensor code
        assert torch.equal(decompress(fused), decompress(plain) * rms)


@pytest.mark.parametrize("block", [1, 16])
def test_row_scaled_outlier_tokens_are_the_divided_tensors(block):
    # decoder norm inputs: the outlier search runs on x / rms (a token's max |x| / rms, without
    # the division); the same tokens, codes and rebuilt tensor as dividing first, the held rows
    # being what the divided tensor's rebuild times rms gives there. A NaN token, an inf token
    # (NaN after the division) and a zero token besides.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 40, 96, generator=g) * torch.logspace(-1, 1, 40).view(1, 40, 1)  # room for 160 // 64 = 2 rows
    # a token's max |x| / RMS is at most sqrt(C) (one channel): spikes in one channel stand out
    x[0, 0, 3] = 3e3
    x[1, 5, 7] = -400.0
    x[2, 3] = 0.0
    args = dict(bits=4, block_size=block, group_size=64, lfc_dtype=torch.bfloat16, outlier_ratio=3.0)
    for special in (None, float("nan"), float("inf")):
        y = x.clone()
        if special is not None:
            y[2, 9, 1] = special
        r = torch.linalg.vector_norm(y, dim=-1, keepdim=True).mul_(96**-0.5)
        r = torch.where(r > 0, r, torch.ones_like(r))
        fused = compress_row_scaled(y, r, generator=torch.Generator().manual_seed(4), **args)
        plain = compress(y / r, generator=torch.Generator().manual_seed(4), **args)
        assert (fused.row_index is None) == (plain.row_index is None) == (special is not None)
        if special is None:
            assert torch.equal(fused.row_index, plain.row_index) and fused.row_index.numel() == 2
        for a, b in zip((fused.packed, fused.lo, fused.scale), (plain.packed, plain.lo, plain.scale)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # the bits: NaN included
        want = decompress(plain) * r
        assert torch.equal(decompress(fused).nan_to_num(), want.nan_to_num())
        assert torch.equal(decompress(fused).isnan(), want.isnan())


@pytest.mark.parametrize("block, lead, ratio", [(1, 1, 0.0), (16, 1, 3.0), (16, 3, 3.0), (1, 2, 3.0)])
def test_row_scaled_leading_tokens_are_the_divided_tensors(block, lead, ratio):
    # exact_tokens (ViT's [CLS], a decoder's first token) on norm inputs: fused, the same codes,
    # rows and rebuilt tensor as dividing first, the leading tokens replaced by their neighbour in
    # what is encoded. Token (0, 0) is an outlier and a leading token, token (1, lead) an outlier
    # whose zeroed row the leading tokens copy
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 40, 96, generator=g) * torch.logspace(-1, 1, 40).view(1, 40, 1)
    x[0, 0, 3] = 3e3
    x[1, lead, 7] = -400.0
    x[:, 0] *= 50  # the sinks' scale, far above their neighbours'
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True).mul_(96**-0.5)
    args = dict(bits=4, block_size=block, group_size=64, lfc_dtype=torch.bfloat16, outlier_ratio=ratio,
                exact_tokens=lead)
    fused = compress_row_scaled(x, r, generator=torch.Generator().manual_seed(4), **args)
    plain = compress(x / r, generator=torch.Generator().manual_seed(4), **args)
    assert torch.equal(fused.row_index, plain.row_index)
    assert fused.row_index.numel() == 4 * lead + (2 if ratio else 0) - (1 if ratio else 0)  # (0, 0) counted once
    for a, b in zip((fused.packed, fused.lo, fused.scale, fused.lfc), (plain.packed, plain.lo, plain.scale, plain.lfc)):
        assert (a is None and b is None) or torch.equal(a, b)
    assert fused.nbytes == plain.nbytes + r.numel() * 4
    rebuilt = decompress(fused)
    assert torch.equal(rebuilt, decompress(plain) * r)
    assert torch.allclose(rebuilt[:, :lead], x[:, :lead], rtol=1e-6, atol=0)  # the leading tokens exact
    with configured(native=False):
        assert torch.equal(decompress(fused), rebuilt)


@pytest.mark.parametrize("shape, dims", [((1, 3, 64), (0, 1)), ((3, 1, 5, 64), (0, 1)), ((1, 4, 1, 32), (0, 2))])
def test_row_scaled_size_one_dimensions_with_any_stride(shape, dims):
    # a transposed (1, B, C) is contiguous to torch (a size-1 dimension's stride addresses nothing):
    # the native kernels take it, with one row scale per token. Its tokens were laid out as one
    # (1, 1, B*C) token, and the encode raised (SigLIP's pooling head under min_numel=0, float32)
    x = torch.randn(shape).transpose(*dims)
    assert x.is_contiguous() and x.stride() != torch.empty(x.shape).stride()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt().contiguous()
    args = dict(bits=4, block_size=16, group_size=64, lfc_dtype=torch.float32, outlier_ratio=3.0)
    fused = compress_row_scaled(x, rms, generator=torch.Generator().manual_seed(4), **args)
    plain = compress((x / rms).contiguous(), generator=torch.Generator().manual_seed(4), **args)
    for a, b in zip(plain.storages(), fused.storages()):
        assert torch.equal(a, b)
    assert torch.equal(decompress(fused), decompress(plain) * rms)


def test_row_scaled_declines_what_it_cannot_fuse():
    x = torch.randn(2, 40, 64)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    args = dict(bits=4, block_size=1, group_size=64, lfc_dtype=torch.bfloat16)
    assert compress_row_scaled(x, rms, **args) is not None
    # every token kept exact; bf16 input; a transposed view
    assert compress_row_scaled(x, rms, exact_tokens=40, **args) is None
    assert compress_row_scaled(x.bfloat16(), rms, **args) is None
    assert compress_row_scaled(x.transpose(0, 1), rms.transpose(0, 1), **args) is None


# ----------------------------------------------------------------------------- dropout draws
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), before=st.integers(0, 1400), n=st.integers(1, 2600),
       p=st.one_of(st.sampled_from([0.0, 1.0, 0.9, 0.5, 1 / 3]), st.floats(0.0, 1.0)))
def test_bernoulli_bits_are_atens_draws_and_stream(seed, before, n, p):
    # any point of the engine's 624-word block (`before` words drawn first), sizes across blocks
    def run(draw):
        torch.manual_seed(seed)
        torch.randint(0, 2, (before,))
        mask = draw()
        return mask, torch.get_rng_state(), torch.rand(5)

    bits, state, after = run(lambda: native.bernoulli_bits(n, p))
    mask, ref_state, ref_after = run(lambda: torch.empty(n).bernoulli_(p))
    assert torch.equal(bits, packing.pack_mask(mask)[0])
    assert torch.equal(state, ref_state) and torch.equal(after, ref_after)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 5), t=st.integers(1, 40), c=st.integers(1, 150), seed=st.integers(0, 2**16),
       specials=st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e30]), max_size=4))
def test_token_absmax_is_the_tensor_codes(m, t, c, seed, specials):
    # the outlier search's score: NaN where a token has one (so the search selects nothing, as
    # the tensor code's median does), infinities and signed zeros as amax/amin give them
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, t, c, generator=g) * torch.rand(m, t, 1, generator=g) * 10
    for v in specials:
        x.view(-1)[torch.randint(0, x.numel(), (1,), generator=g)] = v
    ours, theirs = native.token_absmax(x), exact_tokens.token_absmax(x)
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())
    for ratio in (2.0, 16.0):
        a, b = exact_tokens.outlier_candidates(x, ratio, ours), exact_tokens.outlier_candidates(x, ratio)
        assert torch.equal(a[1], b[1]) and torch.equal(a[0][a[1]], b[0][b[1]])


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 3), t=st.integers(1, 40), c=st.integers(1, 300), block=st.sampled_from([1, 8]),
       seed=st.integers(0, 2**16), specials=st.lists(st.sampled_from([float("nan"), float("inf"), -0.0]), max_size=3))
def test_encode_scores_each_token_in_its_first_pass(m, t, c, block, seed, specials):
    # the score read by the encode (a part per tile of channels, several tiles past 128 channels;
    # sequences padded to whole blocks) is the one-pass score, NaN and all; the codes are unchanged
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, t, c, generator=g) * torch.rand(m, t, 1, generator=g) * 10
    for v in specials:
        x.view(-1)[torch.randint(0, x.numel(), (1,), generator=g)] = v
    n = m * (-(-t // block) * block)
    outs = []
    for score in (True, False):
        codes, lo = torch.zeros(n * c, dtype=torch.uint8), torch.zeros(n, c, dtype=torch.bfloat16)
        scale, lfc = torch.zeros_like(lo), torch.zeros(n // block, c, dtype=torch.bfloat16) if block > 1 else None
        got = native.encode_tokens(x, codes, lfc, lo, scale, 7, 4, block, 16 if block > 1 else 4, score=score)
        outs.append(((codes, lo, scale, lfc), got))
    (first, absmax), (plain, none) = outs
    want = native.token_absmax(x)
    assert none is None and torch.equal(absmax.isnan(), want.isnan())
    assert torch.equal(absmax.nan_to_num(), want.nan_to_num())
    for a, b in zip(first, plain):
        assert a is b is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("row_scaled", [False, True])
@pytest.mark.parametrize("planted", [False, True])
def test_outlier_search_reads_the_tensor_in_the_encode(monkeypatch, row_scaled, planted):
    # no pass of its own for the score; a second encode only where outlier tokens turn up, and the
    # bytes of the former order (score, split, encode) either way: the tensor code's, and for the
    # row-scaled path those of dividing first
    x = torch.randn(3, 70, 300)
    if planted:
        x[1, 4, 250] = 5e3
    calls = {"encode": 0, "score": 0}
    encode, score = native.encode_tokens, native.token_absmax
    def counted(name, fn):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return run

    monkeypatch.setattr(native, "encode_tokens", counted("encode", encode))
    monkeypatch.setattr(native, "token_absmax", counted("score", score))
    # a spike in one channel: its token's max |x| / RMS is about sqrt(300), 5x the others'
    args = dict(bits=4, block_size=8, group_size=64, lfc_dtype=torch.bfloat16, outlier_ratio=4.0)
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True).mul_(300**-0.5)
    with configured(native=False, compile=False):  # the reference: the eager tensor code
        ref = compress(x / r if row_scaled else x, generator=torch.Generator().manual_seed(3), **args)
    calls.update(encode=0, score=0)
    if row_scaled:
        p = compress_row_scaled(x, r, generator=torch.Generator().manual_seed(3), **args)
    else:
        p = compress(x, generator=torch.Generator().manual_seed(3), **args)
    assert calls == {"encode": 1 + planted, "score": 0}
    assert (p.row_index is not None) == planted and (ref.row_index is not None) == planted
    if planted:
        assert torch.equal(p.row_index, ref.row_index)
    for a, b in zip((p.packed, p.lo, p.scale, p.lfc), (ref.packed, ref.lo, ref.scale, ref.lfc)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_token_absmax_leaves_what_it_does_not_take_to_the_caller():
    x = torch.randn(2, 8, 16)
    assert native.token_absmax(x.transpose(1, 2)) is None and native.token_absmax(x.double()) is None
    with configured(native=False):
        assert native.token_absmax(x) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_filled_draws_are_the_bernoulli_tensor(dtype):
    torch.manual_seed(1)
    ref = torch.empty(3, 5, 77, dtype=dtype).bernoulli_(0.8)
    torch.manual_seed(1)
    bits = native.bernoulli_bits(ref.numel(), 0.8)
    assert torch.equal(native.fill_draws(torch.empty_like(ref).fill_(7), bits), ref)


def test_native_draws_only_where_they_are_atens():
    x = torch.empty(4, 6)
    assert native.draws_apply(x, 0.9)
    assert not native.draws_apply(x, 0.9, torch.Generator())  # another generator: ATen draws it
    assert not native.draws_apply(x.t(), 0.9)  # ATen's order over a strided tensor is not the flat one
    assert not native.draws_apply(x, 1.5) and not native.draws_apply(x, -0.1)  # ATen raises: let it
    assert not native.draws_apply(torch.empty(0), 0.9)


def test_dropout_falls_back_to_aten_where_the_draws_differ(monkeypatch):
    from hf_division.autograd.dropout import DropoutFn

    real = native.draw_bits
    monkeypatch.setattr(native, "draw_bits", lambda state, p, n: real(state, p, n) ^ 1)  # one draw off per byte
    native.checked_draws.cache_clear()
    try:
        assert not native.draws_match_aten()
        x = torch.randn(4, 300, requires_grad=True)
        torch.manual_seed(0)
        y = DropoutFn.apply(x, 0.1)
        torch.manual_seed(0)
        assert torch.equal(y, torch.nn.functional.dropout(x, 0.1, training=True))
    finally:
        monkeypatch.undo()
        native.checked_draws.cache_clear()
    assert native.draws_match_aten()


def test_draws_follow_the_native_switch():
    # checked per library: turning the kernels off and on again does not leave the draws off
    with configured(native=False):
        assert not native.draws_match_aten() and not native.draws_apply(torch.empty(4), 0.5)
    assert native.draws_match_aten() and native.draws_apply(torch.empty(4), 0.5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_model_dropout_draws_are_the_baselines(attn, monkeypatch):
    # hidden and attention dropout drawn natively: the same outputs and the same RNG stream after
    from conftest import tiny_batch, tiny_model
    import hf_division as hd
    from hf_division.autograd import dropout

    sizes = []
    monkeypatch.setattr(dropout, "bernoulli_bits", lambda n, p: sizes.append(n) or native.bernoulli_bits(n, p))

    model = tiny_model("bert", attn, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.4)
    batch = tiny_batch(batch=3, seq=40)

    def forward():
        torch.manual_seed(5)
        out = model(**batch).logits
        return out, torch.get_rng_state()

    ref, ref_state = forward()
    hd.apply_division(model)
    out, state = forward()
    assert torch.equal(out, ref) and torch.equal(state, ref_state)
    layers = model.config.num_hidden_layers
    assert sizes.count(3 * model.config.num_attention_heads * 40 * 40) == layers  # attention probabilities
    assert sizes.count(3 * 40 * model.config.hidden_size) == 2 * layers + 1  # two per layer, the embeddings'


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_drawn_as_bits_is_atens_dropout(dtype, p):
    from hf_division.autograd.dropout import DropoutFn

    x = torch.randn(5, 33, 48, dtype=dtype)
    x[0, :3, 0] = torch.tensor([float("inf"), -2.0, float("nan")])  # dropped: NaN, -0, NaN as ATen's product
    x.requires_grad_(True)
    torch.manual_seed(7)
    y = DropoutFn.apply(x, p)
    state = torch.get_rng_state()
    torch.manual_seed(7)
    ref = torch.nn.functional.dropout(x, p, training=True)
    assert torch.equal(y.view(torch.int8), ref.view(torch.int8)) and torch.equal(state, torch.get_rng_state())
    grad = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, grad)[0], torch.autograd.grad(ref, x, grad)[0])


def _vectorized_lines(flags: list) -> set:
    """Source lines whose loops GCC reports vectorized when compiling the kernels with ``flags``."""
    done = subprocess.run(["gcc", *flags, "-fopt-info-vec-optimized", str(native.SOURCE), "-o", "/dev/null"],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return {int(line.split(":")[1]) for line in done.stderr.splitlines()
            if line.startswith(str(native.SOURCE)) and "loop vectorized" in line}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="reads GCC's vectorizer report")
def test_silu_gated_loops_vectorize_with_the_build_flags():
    """The SiLU-gated kernel's two element loops (product; gradients) must compile to vector code:
    left scalar, they carried most of the Llama shape's backward overhead on an AVX2 machine
    (docs/RESULTS.md, "What each kernel buys" and "How these figures moved")."""
    lines = native.SOURCE.read_text().splitlines()
    loops = [i + 1 for i, line in enumerate(lines) if "for (int64_t j = 0; j < tj; j++)" in line
             and ("out_h[at + j]" in line or "float e = 1.0f + exp_f32" in lines[i + 1])]
    assert len(loops) == 2, loops
    assert set(loops) <= _vectorized_lines(native.FLAGS + ["-march=native"])


# ----------------------------------------------------------------------------- the library's edges
CC = shutil.which("cc") or shutil.which("gcc") or "cc"
#: a library without the kernels' symbols whose loading leaves a file behind: code run by dlopen
STUB = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen("%s", "a"); if (f) fclose(f); }
long long hfd_encode_tile(void) { return 1; }
"""


def _stub_source(tmp_path) -> Path:
    src = tmp_path / "stub.c"
    src.write_text(STUB % (tmp_path / "loaded"))
    return src


def _plant(tmp_path, target: Path) -> Path:
    """The stub library built at ``target``; ``tmp_path / "loaded"`` appears if it is ever loaded."""
    subprocess.run([CC, "-shared", "-fPIC", str(_stub_source(tmp_path)), "-o", str(target)], check=True)
    return target


@pytest.fixture
def fake_cc(tmp_path):
    """A compiler script that counts its builds and, by ``use(how)``, builds the stub in place of the
    kernels (``"stub"``), copies this session's library there (``"copy"``; ``"slow copy"`` after a
    second: two builds at once overlap), else compiles. Its ``--version`` is the compiler's: the
    cache key is the same."""
    builds, how, script = tmp_path / "builds", tmp_path / "how", tmp_path / "fake-cc"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = --version ] && exec "{CC}" --version
        echo build >> "{builds}"
        out=; prev=
        for a in "$@"; do [ "$prev" = -o ] && out=$a; prev=$a; done
        case "$(cat "{how}")" in
            stub) exec "{CC}" -shared -fPIC "{_stub_source(tmp_path)}" -o "$out" ;;
            "slow copy") sleep 1; exec cp "{native.kernels()._name}" "$out" ;;
            copy) exec cp "{native.kernels()._name}" "$out" ;;
        esac
        exec "{CC}" "$@"
        """))
    script.chmod(0o755)
    return SimpleNamespace(path=str(script), use=how.write_text,
                           builds=lambda: len(builds.read_text().split()) if builds.exists() else 0)


def _tokens(x3, bits=4, block=16, group=64, lfc_dtype=torch.bfloat16):
    m, t, c = x3.shape
    b = TokenBuffers.empty(m, t, c, bits, block, group, lfc_dtype, torch.bfloat16, "cpu")
    native.encode_tokens(x3, b.codes, b.lfc, b.lo, b.scale, 7, bits, block, group)
    return b


# 1. allocations
@pytest.mark.parametrize("kernel", ["encode", "decode", "silu_gated"])
def test_a_failed_allocation_is_reported_and_nothing_written(kernel):
    # 37 tokens in blocks of 16: padded, so encode and decode allocate a row map; unchecked, its NULL
    # had padded tokens read and written as rows 37.. of the tensor
    lib = native.kernels()
    x = torch.randn(2, 37, 64)
    if kernel == "encode":
        b = TokenBuffers.empty(2, 37, 64, 4, 16, 64, torch.bfloat16, torch.bfloat16, "cpu")
        for v in (b.codes, b.lo, b.scale, b.lfc):
            v.view(torch.uint8).fill_(0xAB)
        call = lambda: native.encode_tokens(x, b.codes, b.lfc, b.lo, b.scale, 7, 4, 16, 64)
        written = (b.codes, b.lo, b.scale, b.lfc)
    elif kernel == "decode":
        b, out = _tokens(x), torch.full((2, 37, 64), 123.0)
        call = lambda: native.decode_tokens(out, b.codes, b.lfc, b.lo, b.scale, 4, 16, 64)
        written = (out,)
    else:
        gate, up = (_tokens(v, block=1, group=32, lfc_dtype=None) for v in (x.view(1, 74, 64), x.view(1, 74, 64) * 2))
        out = (torch.full((74, 64), 123.0),)
        ops = [(v.codes, v.lo, v.scale, 4, None, None) for v in (gate, up)]
        call = lambda: native.silu_gated(74, 64, 32, *ops, None, out)
        written = out
    before = [v.clone() for v in written]
    lib.hfd_fail_next_allocs(1)
    try:
        with pytest.raises(MemoryError, match=f"hfd_{kernel}"):
            call()
    finally:
        lib.hfd_fail_next_allocs(0)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(written, before))
    call()  # the next allocation succeeds: the same call runs
    assert not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(written, before))


# 2. the cache folder and library belong to this user, writable by no one else
@pytest.mark.parametrize("how", ["shared folder", "library others may write", "another user's"])
def test_a_planted_library_is_not_loaded(tmp_path, monkeypatch, how):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    name = Path(native.kernels()._name).name  # the file build() loads first, on this machine
    library = _plant(tmp_path, cache / name)
    if how == "shared folder":  # HF_DIVISION_CACHE on a folder others may write
        cache.chmod(0o777)
        where, reason = cache, "writable by group"
    elif how == "library others may write":
        library.chmod(0o666)
        where, reason = library, "writable by group"
    else:
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
        where, reason = cache, "owned by uid"
    with pytest.raises(OSError, match=re.escape(f"{where} is {reason}")):
        native.build(cache=cache)
    assert not (tmp_path / "loaded").exists()


def test_an_unsafe_cache_falls_back_with_one_warning_naming_it(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    _plant(tmp_path, shared / Path(native.kernels()._name).name)
    monkeypatch.setenv("HF_DIVISION_CACHE", str(shared))
    monkeypatch.setattr(native, "_state", {"lib": None, "tried": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.kernels() is None and native.kernels() is None
        assert not native.applies(torch.device("cpu"), None)
        with configured(compile=False):  # the tensor code instead
            x = torch.randn(2, 40, 64)
            assert (decompress(compress(x, bits=8, block_size=1, group_size=32)) - x).abs().max() < 0.1
    (warning,) = [w for w in caught if "native CPU kernels" in str(w.message)]
    assert f"{shared} is writable by group" in str(warning.message)
    assert not (tmp_path / "loaded").exists()


# 3. the wrappers check what they hand to C
def _gated_call(grad_dtype):
    x = torch.randn(1, 40, 64)
    ops = [(b.codes, b.lo, b.scale, 4, None, None) for b in (_tokens(v, block=1, group=32, lfc_dtype=None)
                                                             for v in (x, x * 2))]
    grad = torch.randn(40, 64, dtype=grad_dtype)
    return lambda: native.silu_gated(40, 64, 32, *ops, grad, (torch.empty(40, 64), torch.empty(40, 64)))


def _bad_calls():
    """(argument, call) pairs the C code would have run on, each within its buffers' storage."""
    x = torch.randn(2, 37, 64)
    b = _tokens(x)
    dec = {"codes": b.codes, "lfc": b.lfc, "lo": b.lo, "scale": b.scale, "bits": 4, "block": 16, "group": 64}
    enc = {**dec, "seed": 7}
    big = torch.zeros(2 * b.codes.numel(), dtype=torch.uint8)
    q, cos = torch.randn(2, 3, 5, 8), torch.randn(1, 5, 8, dtype=torch.float64)
    bits = torch.zeros(16, dtype=torch.uint8)
    return {
        "out float64": ("out", lambda: native.decode_tokens(torch.empty(2, 37, 64, dtype=torch.float64), **dec)),
        "out transposed": ("out", lambda: native.decode_tokens(torch.empty(2, 64, 37).transpose(1, 2), **dec)),
        "row_scale off the CPU": ("row_scale", lambda: native.decode_tokens(
            torch.empty(2, 37, 64), **dec, row_scale=torch.empty(74, device="meta"))),
        "lo float32": ("lo", lambda: native.encode_tokens(x, **dict(enc, lo=torch.empty(b.lo.shape)))),
        "codes too short": ("codes", lambda: native.encode_tokens(x, **dict(enc, codes=big[: b.codes.numel() // 2]))),
        "lfc int32": ("lfc", lambda: native.encode_tokens(
            x, **dict(enc, lfc=torch.empty(b.lfc.shape, dtype=torch.int32)))),
        "cos float64": ("cos", lambda: native.rotary(q, cos, cos.clone(), False)),
        "grad float64": ("grad", _gated_call(torch.float64)),
        "bits too short": ("bits", lambda: native.masked_scale(
            torch.randn(64), bits[:2], 64, (64,), torch.float32, 0.9)),
        "state too long": ("state", lambda: native.draw_bits(torch.cat([torch.get_rng_state(), bits]), 0.5, 100)),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_a_wrong_argument_raises_naming_it(case):
    name, call = _bad_calls()[case]
    with pytest.raises((TypeError, ValueError), match=f"argument '{name}'"):
        call()


# 4. a missing symbol: a stale library, rebuilt once
def test_a_stale_library_is_rebuilt_once(tmp_path, fake_cc):
    cache = tmp_path / "cache"
    fake_cc.use("stub")  # a compiler that keeps building a library without the symbols
    with pytest.raises(OSError, match="undefined symbol: hfd_"):
        native.build(cc=fake_cc.path, cache=cache)
    assert fake_cc.builds() == 2  # built, then rebuilt once; not tried again with other flags
    fake_cc.use("copy")  # the stale library is still in the cache: rebuilt, this time with its symbols
    lib = native.build(cc=fake_cc.path, cache=cache)
    assert fake_cc.builds() == 3 and lib.hfd_encode_tile() == 128
    assert native.build(cc=fake_cc.path, cache=cache)._name == lib._name and fake_cc.builds() == 3


def test_a_failed_build_falls_back_once_per_process(tmp_path, fake_cc, monkeypatch):
    fake_cc.use("stub")
    monkeypatch.setenv("CC", fake_cc.path)
    monkeypatch.setenv("HF_DIVISION_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_state", {"lib": None, "tried": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert native.kernels() is None and not native.applies(torch.device("cpu"), None)
    (warning,) = [w for w in caught if "native CPU kernels" in str(w.message)]
    assert "undefined symbol: hfd_" in str(warning.message)
    assert fake_cc.builds() == 2  # built and rebuilt once, then remembered: not on every call


# 5. ranks building at once
def test_ranks_building_at_once_build_once(tmp_path, fake_cc):
    cache = tmp_path / "new" / "hf_division"  # made by whichever rank gets there first
    fake_cc.use("slow copy")
    code = textwrap.dedent("""\
        import sys
        from pathlib import Path
        from hf_division.kernels import native
        print("ready", flush=True)
        sys.stdin.readline()  # both start together
        print(native.build(cc=sys.argv[1], cache=Path(sys.argv[2]))._name, flush=True)
        """)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    ranks = [subprocess.Popen([sys.executable, "-c", code, fake_cc.path, str(cache)], cwd=root, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    try:
        for rank in ranks:
            assert rank.stdout.readline() == "ready\n", rank.communicate()[1][-2000:]
        for rank in ranks:
            rank.stdin.write("go\n")
            rank.stdin.flush()
        outs = [rank.communicate(timeout=CHILD_TIMEOUT_S) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-2000:] for _, err in outs]
    (name,) = {out.strip() for out, _ in outs}
    assert fake_cc.builds() == 1
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert sorted(p.name for p in cache.iterdir()) == [".build.lock", Path(name).name]  # no temporary file left
