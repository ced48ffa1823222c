import math

import pytest
import torch

from hf_division.compress.pipeline import compress, decompress
from hf_division.kernels import configured
from hf_division.kernels.compiled import compiled
from hf_division.quant.packing import (
    code_layout, pack_bits, pack_mask, pack_tokens, unpack_bits, unpack_mask, unpack_tokens,
)
from hf_division.quant.codecs import encode_groups
from hf_division.quant.rounding import hash_uniform, noise_words, uniform

from tests.compress.reference import step_bound


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_roundtrip(bits):
    q = torch.randint(0, 2**bits, (4096,), dtype=torch.uint8)
    p = pack_bits(q, bits)
    assert p.numel() == 4096 * bits // 8
    assert torch.equal(unpack_bits(p, bits), q)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("group", [256, 40, 7])
def test_pack_tokens_roundtrip_and_layout(bits, group):
    word, rows = code_layout(group, bits)
    assert word == (torch.int32 if group * bits % 32 == 0 else torch.uint8)
    q = torch.randint(0, 2**bits, (3, group, 5), dtype=torch.uint8).to(word)
    packed = pack_tokens(q, bits)
    assert packed.dtype == word and packed.shape == (3, rows, 5)
    assert torch.equal(unpack_tokens(packed, bits, group), q)
    # word (k, u, j) holds token u + i * rows of channel j at bits i * bits
    per, mask = word.itemsize * 8 // bits, (1 << bits) - 1
    for i in range(per):
        for u in range(rows):
            if u + i * rows < group:
                assert torch.equal((packed[:, u] >> (bits * i)) & mask, q[:, u + i * rows])


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_token_codes_take_about_bits_per_element(bits):
    # 903 tokens = 3 full groups of 256 and a partial one of 135: the partial group's codes are
    # padded to whole bytes per channel, at most C bytes beyond the bits end to end
    x = torch.randn(7, 129, 96)
    p = compress(x, bits=bits, block_size=1)
    end_to_end = -(-x.numel() * bits // 8)
    assert end_to_end <= p.packed.numel() <= end_to_end + 96


def _step_of_each_element(p, x):
    """The quantization step of the group of each element of ``x`` (contiguous ``(M, T, C)``)."""
    if p.grouping == "flat":
        return p.scale.float().repeat_interleave(p.group_size)[: x.numel()].view_as(x)
    m, t, c = x.shape
    tp = -(-t // p.block_size) * p.block_size
    per_token = p.scale.float().repeat_interleave(p.group_size, dim=0)[: m * tp]
    return per_token.view(m, tp, c)[:, :t]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("grouping", ["tokens", "flat"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_error_within_one_step_of_each_group(bits, grouping, block_size):
    x = torch.randn(3, 40, 96) * torch.linspace(0.1, 20, 96)  # outlier channels; 40 tokens: a partial block
    p = compress(x, bits=bits, group_size=64, block_size=block_size, grouping=grouping)
    assert p.grouping == grouping and (p.lfc is not None) == (grouping == "tokens" and block_size > 1)
    err = (decompress(p) - x).abs()
    step = _step_of_each_element(p, x)
    assert (err <= step * 1.0001 + 1e-5).all()
    assert err.mean() < step.mean()
    # the step itself from x alone: no larger than each group's range over 2**bits - 1 codes
    bound = step_bound(x, bits, grouping, p.group_size, p.block_size, p.lfc is not None)
    assert (step.double() <= bound * (1 + 2**-6)).all()


def test_token_groups_keep_each_channel_to_its_own_range():
    # the point of grouping tokens within a channel: a channel 200x larger than another does
    # not set the other's quantization step (flat groups of consecutive elements mix them)
    x = torch.randn(4, 256, 96) * torch.linspace(0.1, 20, 96)
    err = {g: (decompress(compress(x, bits=4, block_size=16, grouping=g)) - x).abs() for g in ("tokens", "flat")}
    small = x[..., 0].abs().mean()
    assert err["tokens"][..., 0].mean() < 0.25 * small  # 4 bits over the channel's own range
    assert err["flat"][..., 0].mean() > small  # swamped by the large channels


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("grouping", ["tokens", "flat"])
def test_nearest_error_is_half_step(bits, grouping):
    x = torch.randn(2, 160, 64)
    p = compress(x, bits=bits, group_size=64, stochastic=False, block_size=1, grouping=grouping)
    bound = step_bound(x, bits, grouping, p.group_size, 1, lfc=False)  # from x alone, not the chosen scale
    assert ((decompress(p) - x).abs().double() <= bound * 0.5 * (1 + 2**-6) + 1e-6).all()


def test_stochastic_rounding_is_unbiased():
    # mean of K independent compressions converges to x; a biased rounding would leave a
    # systematic error many standard errors away from zero
    torch.manual_seed(0)
    x = torch.randn(1, 64, 32)
    K = 400
    acc = torch.zeros_like(x)
    g = torch.Generator().manual_seed(1)
    for _ in range(K):
        p = compress(x, bits=2, group_size=64, generator=g)
        acc += decompress(p)
    mean_err = acc / K - x
    step = float(x.max() - x.min()) / 3  # 2 bits: 3 steps span the range (an upper bound for each group's)
    # per-element standard error <= step / 2 / sqrt(K); test the average over all elements
    se = step / 2 / math.sqrt(K) / math.sqrt(x.numel())
    assert mean_err.mean().abs() < 4 * se
    # and each element is within 5 standard errors
    assert (mean_err.abs() < 5 * step / 2 / math.sqrt(K)).all()
    # nearest rounding, by contrast, is biased per element (sanity check the test can fail)
    p = compress(x, bits=2, group_size=64, stochastic=False)
    assert ((decompress(p) - x).abs() > 5 * step / 2 / math.sqrt(K)).any()


@pytest.mark.parametrize("source", ["generator", "hash"])
def test_rounding_noise_uniform(source):
    n = 1 << 20
    if source == "generator":
        u = uniform(noise_words(n, torch.device("cpu"), torch.Generator().manual_seed(0)))
    else:
        u = hash_uniform(torch.arange(n), torch.tensor(123456789))
        other = hash_uniform(torch.arange(n), torch.tensor(987654321))
        assert abs(torch.corrcoef(torch.stack([u, other]))[0, 1].item()) < 0.005  # seeds give unrelated streams
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.002
    assert abs(u.var().item() - 1 / 12) < 0.001
    hist = torch.histc(u, bins=64, min=0, max=1) / u.numel()
    assert (hist - 1 / 64).abs().max() < 0.001
    # neighbours (consecutive indices) are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.005


def _hash_reference(i: int, seed: int) -> float:
    """The hash of ``hash_uniform`` on Python integers, modulo 2**32 at every step."""
    m = 0xFFFFFFFF
    x = (i + seed) & m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x5BD1E995) & m
    x ^= x >> 16
    return ((x >> 8) + 0.5) / 2**24


@pytest.mark.parametrize("seed", [0, 123456789, 2**31 - 1, 2**31 + 7, 2**32 - 3])
def test_hash_uniform_int32_matches_the_32_bit_hash(seed):
    """int32 arithmetic (wrapping products, masked arithmetic shifts) gives the hash modulo 2**32,
    eager and compiled alike, also where ``index + seed`` passes 2**31 or 2**32."""
    index = torch.cat([torch.arange(64), torch.arange(2**31 - 40, 2**31 + 40)]).to(torch.int64)
    ref = torch.tensor([_hash_reference(i, seed) for i in index.tolist()], dtype=torch.float32)
    s = torch.tensor(seed, dtype=torch.int64)
    assert torch.equal(hash_uniform(index, s), ref)
    small = torch.arange(64, dtype=torch.int32)
    compiled = torch.compile(hash_uniform, dynamic=False)(small, s)
    assert torch.equal(compiled, ref[:64])


@pytest.mark.parametrize("shape", [(2, 1, 16), (2, 5, 16), (1, 9, 24), (3, 8, 8), (7, 40), (13,), (2, 3, 17, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shapes_and_dtypes(shape, dtype):
    x = torch.randn(shape).to(dtype)
    p = compress(x, bits=4, group_size=32)
    y = decompress(p)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert (y.float() - x.float()).abs().max() < 0.5 * x.float().abs().max() + 1e-3


def test_non_contiguous_and_token_dim():
    base = torch.randn(4, 12, 30, 16)
    x = base.transpose(1, 2)  # (4, 30, 12, 16), token axis 1
    p = compress(x, bits=8, group_size=64, token_dim=1)
    assert (decompress(p) - x).abs().max() < 0.05


@pytest.mark.parametrize("grouping", ["tokens", "flat"])
def test_exact_bytes(grouping):
    x = torch.randn(4, 100, 96)  # 100 tokens: a partial last block, and a partial last group
    bits, g, b = 2, 256, 8
    p = compress(x, bits=bits, group_size=g, block_size=b, grouping=grouping)
    if grouping == "tokens":
        tokens = 4 * math.ceil(100 / b) * b
        groups = math.ceil(tokens / g)
        expect = math.ceil(tokens * 96 * bits / 8) + groups * 96 * 2 * 2 + tokens // b * 96 * 2
        assert p.nbytes < x.numel() * 4 / 7  # 2-bit HFC + bf16 LFC per 8 tokens ~ 4.1 bits
    else:
        groups = math.ceil(x.numel() / g)
        expect = groups * g * bits // 8 + groups * 2 * 2
    assert p.nbytes == expect


def test_nonfinite_propagates():
    x = torch.randn(2, 16, 32)
    x[0, 3, 5] = float("nan")
    x[1, 7, 1] = float("inf")
    y = decompress(compress(x, bits=2, group_size=32))
    assert not torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).all()


@pytest.fixture
def torch_kernels():
    """The compressor's torch kernels, not the native CPU ones (hf_division.kernels.native)."""
    with configured(native=False):
        yield


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("grouping", ["tokens", "flat"])
def test_fused_matches_eager(bits, stochastic, grouping, torch_kernels):
    # flat: 4096 + 256 + 3 groups of 256; tokens (64 channels): 64 + 16 + 1 groups of 256 tokens
    # and a partial one: every compiled chunk size, the eager remainder and the partial group
    # (the torch.compile kernels: what runs on GPUs, and on CPUs without the native kernels)
    tokens = (4096 + 256 + 3) * 4 if grouping == "flat" else (64 + 16 + 1) * 256 + 48
    x = torch.randn(1, tokens, 64)
    out = {}
    for fused in (True, False):
        with configured(compile=fused):
            p = compress(x, bits=bits, block_size=16, stochastic=stochastic, grouping=grouping,
                         generator=torch.Generator().manual_seed(0))
            out[fused] = (p, decompress(p))
    (pf, yf), (pe, ye) = out[True], out[False]
    assert torch.equal(pf.lo, pe.lo) and torch.equal(pf.scale, pe.scale)
    if pf.lfc is not None:
        assert torch.equal(pf.lfc, pe.lfc)
    codes_f, codes_e = unpack_bits(pf.packed, bits), unpack_bits(pe.packed, bits)
    # compiled code may fuse a multiply-add differently: at most a last-bit tie changes a code
    assert (codes_f != codes_e).float().mean() < 1e-4
    assert torch.allclose(yf, ye, atol=pf.scale.float().max().item() * 1.0001)


def test_compiled_token_kernels_do_not_grow_with_tensor_size(torch_kernels):
    # kernels are compiled per chunk size, not per tensor: a tensor of another length reuses them
    compress_and_back = lambda x: decompress(compress(x, bits=4, block_size=16))  # noqa: E731
    compress_and_back(torch.randn(8, 128, 64))  # 4 groups of 256 tokens
    before = compiled.cache_info().currsize
    y = compress_and_back(x := torch.randn(12, 96, 64))  # 4 groups and a partial one
    assert compiled.cache_info().currsize == before
    assert (y - x).abs().max() < 1


@pytest.mark.parametrize("n", [1, 7, 8, 13, 4096 + 3])
def test_pack_mask_roundtrip_and_bit_order(n):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(2 * n, generator=g) > 0.5
    view = mask[::2]  # non-contiguous input
    packed, count = pack_mask(view)
    assert count == n and packed.dtype == torch.uint8 and packed.numel() == -(-n // 8)
    assert torch.equal(unpack_mask(packed, count, (n,)).bool(), view)
    flat = torch.nn.functional.pad(view.to(torch.uint8), (0, -n % 8))
    assert torch.equal(packed, pack_bits(flat, 1))  # same layout as the generic packer


def _massive(dtype=torch.float32):
    """(2, 64, 96) activations with two "massive" tokens (1000x in two channels), as decoder LLMs have."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 96, generator=g)
    x[0, 0, 7], x[1, 0, 7], x[0, 0, 50] = 3000.0, -2500.0, 1000.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outlier_tokens_are_kept_exact_and_counted(dtype):
    x = _massive(dtype)
    p = compress(x, bits=4, block_size=16, outlier_ratio=16, generator=torch.Generator().manual_seed(1))
    assert p.row_index.tolist() == [0, 64] and p.rows.dtype == dtype  # token 0 of each sequence
    y = decompress(p)
    assert torch.equal(y[:, 0], x[:, 0])
    plain = compress(x, bits=4, block_size=16, generator=torch.Generator().manual_seed(1))
    assert p.nbytes == plain.nbytes + p.rows.untyped_storage().nbytes() + p.row_index.untyped_storage().nbytes()
    # the other tokens: their error no longer scales with the massive values
    err = (y[:, 1:] - x[:, 1:]).float().norm() / x[:, 1:].float().norm()
    err_plain = (decompress(plain)[:, 1:] - x[:, 1:]).float().norm() / x[:, 1:].float().norm()
    assert err < 0.25 and err_plain > 2, (err, err_plain)  # measured 0.15 vs 16


def test_no_outliers_no_extra_storage():
    x = torch.randn(2, 64, 96, generator=torch.Generator().manual_seed(0))
    p = compress(x, bits=4, block_size=16, outlier_ratio=16)
    assert p.rows is None and p.row_index is None
    x[0, 3] = 1e4  # one token: kept, the others are not
    assert compress(x, bits=4, block_size=16, outlier_ratio=16).row_index.tolist() == [3]


def test_outlier_count_is_capped():
    x = torch.randn(1, 128, 32, generator=torch.Generator().manual_seed(0))
    x[0, :10] *= 1000  # 10 "outliers" in 128 tokens; at most 128 // 64 = 2 are kept, the largest
    p = compress(x, bits=4, block_size=16, outlier_ratio=16)
    assert p.row_index.numel() == 2 and set(p.row_index.tolist()) <= set(range(10))


def test_each_kernel_variant_compiles_on_its_own_code_object():
    """dynamo compiles at most 8 versions per code object and runs further ones eagerly (a silent
    slowdown once bit widths x chunk sizes x rounding modes exceed it): each variant gets its own."""
    a = compiled(encode_groups, ((4, 256), 1024, (False,) * 5))
    b = compiled(encode_groups, ((8, 256), 1024, (False,) * 5))
    assert a is compiled(encode_groups, ((4, 256), 1024, (False,) * 5))
    code_a, code_b = (f._torchdynamo_orig_callable.__code__ for f in (a, b))
    assert code_a is not code_b and code_a is not encode_groups.__code__
    assert code_a.co_code == encode_groups.__code__.co_code  # the same kernel


@pytest.mark.parametrize("ratio", [0.0, 16.0])
def test_exact_tokens_kept_exact(ratio):
    """``exact_tokens=k``: the first k tokens of every sequence come back bit-exact (with or without
    outlier tokens split off too), the input is not modified, the rest is compressed as before."""
    from hf_division.compress.pipeline import compress, decompress
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 4, 16, generator=g).transpose(1, 2)  # (B, H, T, d) viewing (B, T, H, d)
    x[1, :, 7] *= 100  # an outlier token
    before = x.clone()
    p = compress(x, bits=4, block_size=8, group_size=64, exact_tokens=2, outlier_ratio=ratio)
    y = decompress(p)
    assert torch.equal(x, before)
    assert torch.equal(y[:, :, :2], x[:, :, :2])
    if ratio:
        assert torch.equal(y[1, :, 7], x[1, :, 7])
    rest = (y - x)[:, :, 2:]
    assert 0 < rest.norm() < 0.3 * x[:, :, 2:].norm()
    assert torch.equal(decompress(compress(x, bits=4, exact_tokens=40)), x)  # every token exact


def _with_outliers(seed=0, shape=(3, 128, 24)):  # room for 6 outlier tokens (1 in 64)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[0, 0] *= 400.0  # a massive-activation token, also a leading token
    x[1, 7, :3] = 900.0  # one more, not leading
    x[2, 5] *= 1.5  # a candidate below the ratio
    return x


@pytest.mark.parametrize("exact_tokens", [0, 1, 3])
@pytest.mark.parametrize("grouping,block", [("tokens", 1), ("tokens", 8), ("flat", 1)])
def test_static_rows_rebuild_the_same_tensor(exact_tokens, grouping, block):
    """The fixed-size split (the CUDA path, no host sync) rebuilds exactly what the CPU path does:
    same tokens exact, same codes; it only holds more rows."""
    x = _with_outliers()
    kw = dict(bits=4, block_size=block, group_size=16, outlier_ratio=16.0, grouping=grouping, exact_tokens=exact_tokens)
    dynamic = compress(x, generator=torch.Generator().manual_seed(1), static_rows=False, **kw)
    static = compress(x, generator=torch.Generator().manual_seed(1), static_rows=True, **kw)
    assert static.row_keep is not None and static.rows.shape[0] >= dynamic.rows.shape[0]
    assert torch.equal(static.packed, dynamic.packed)
    assert torch.equal(decompress(static), decompress(dynamic))
    exact = decompress(static)
    assert torch.equal(exact[0, 0], x[0, 0]) and torch.equal(exact[1, 7], x[1, 7])  # the outliers, exact
    if exact_tokens and grouping == "tokens":  # ActNN's flat groups have no token axis to keep
        assert torch.equal(exact[:, :exact_tokens], x[:, :exact_tokens])


def test_static_rows_without_outliers_change_nothing():
    x = torch.randn(2, 64, 16)
    kw = dict(bits=4, block_size=1, group_size=16, outlier_ratio=16.0)
    static = compress(x, generator=torch.Generator().manual_seed(1), static_rows=True, **kw)
    dynamic = compress(x, generator=torch.Generator().manual_seed(1), static_rows=False, **kw)
    assert dynamic.rows is None and not static.row_keep.any()
    assert torch.equal(decompress(static), decompress(dynamic))
