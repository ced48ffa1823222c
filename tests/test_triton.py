"""The compressor's Triton kernels (hf_division/kernels/triton_kernels.py), on a CPU machine under
Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` where there is no CUDA device):
the same codes, block means and ranges as the reference math (hf_division/quant/codecs.py) for both
roundings, every bit width and LFC dtype, ragged blocks and groups, any input dtype and strides; the
rebuild to the bit; the exact tokens; the launch budget with no host synchronisation; and that
every kernel compiles for an H200 (sm_90) with the Triton installed here. Whole training steps
through these kernels: tests/kernels/test_triton_steps.py.

    TRITON_INTERPRET=1 python -m pytest tests/test_triton.py
"""
import collections
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_division.analysis.launches import KernelCounter
from hf_division.compress.backends import EAGER
from hf_division.compress.pipeline import compress, decompress
from hf_division.kernels import configured
from hf_division.kernels import triton_codec as tc
from hf_division.kernels.triton_variants import COMPILED_VARIANTS
from hf_division.quant.exact_tokens import split_static

from conftest import CHILD_TIMEOUT_S, TRITON_MARKS

pytestmark = [*TRITON_MARKS, pytest.mark.heavy]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
LFC = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


#: the reference path of the pipeline: the torch kernels, eager (the Triton kernels off)
REFERENCE = dict(triton=False, native=False, compile=False)


def _tokens(m, t, c, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, t, c, generator=g) * torch.linspace(0.05, 4, c) + torch.randn(1, 1, c, generator=g)
    return x.to(dtype).to(DEV)


def _seed(value):
    return None if value is None else torch.tensor(value, dtype=torch.int64, device=DEV)


# (M, T, C, block, group): T off the block, M*Tp off the group (a ragged last group), one group
# shorter than a block's multiple of words, and a row shorter than a block
SHAPES = [(2, 37, 40, 4, 16), (3, 50, 24, 8, 24), (1, 300, 20, 16, 256), (4, 5, 33, 8, 64)]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("lfc", list(LFC))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_codes_means_and_ranges_equal_the_reference(bits, lfc, rounding):
    shape = SHAPES[(bits + len(lfc)) % len(SHAPES)]
    m, t, c, block, group = shape
    block = 1 if lfc == "none" else min(block, t)
    group = max(block, group // block * block)
    while group * bits % 8:
        group += block
    dtype = [torch.float32, torch.bfloat16, torch.float16][bits % 3]
    x = _tokens(m, t, c, dtype, seed=bits)
    seed = _seed(None if rounding == "nearest" else 2**32 - 5 - bits)  # the index + seed wraps modulo 2**32
    got = tc.encode_tokens(x, seed, bits, block, group, LFC[lfc])
    ref = EAGER.encode_tokens(x.float(), seed, bits, block, group, LFC[lfc])
    assert torch.equal(got.codes, ref.codes), f"{(got.codes != ref.codes).sum()} code bytes differ"
    assert torch.equal(got.lo.float(), ref.lo.float()) and torch.equal(got.scale.float(), ref.scale.float())
    if lfc == "none" or block == 1:
        assert got.lfc is None and ref.lfc is None
    else:
        assert got.lfc.dtype == ref.lfc.dtype and torch.equal(got.lfc.float(), ref.lfc.float())


@pytest.mark.parametrize("bits,block,group,t,c", [
    (4, 1, 256, 506, 40),  # a last group of 250 tokens in bytes: 125 rows of words, 4 tiles of 32
    (8, 8, 512, 1000, 24),  # full groups of 128 rows of words, 16 channels wide: 2 tiles of 64
])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_groups_wider_than_a_tile_taken_in_several(bits, block, group, t, c, rounding):
    """A group whose rows of words outnumber a tile's (``RCH`` below ``RT``) is encoded and rebuilt
    a tile at a time: the same codes, ranges, means and rebuild as the reference."""
    n_full, rest = divmod(t, group)
    meta = tc.group_launch(c, n_full, rest, group, bits, block)[3]
    assert meta["RCH_LAST" if bits == 4 else "RCH_FULL"] < meta["RT_LAST" if bits == 4 else "RT_FULL"]
    x = _tokens(1, t, c, torch.bfloat16, seed=bits)
    seed = _seed(None if rounding == "nearest" else 2**32 - 3)
    lfc = None if block == 1 else torch.bfloat16
    got = tc.encode_tokens(x, seed, bits, block, group, lfc)
    ref = EAGER.encode_tokens(x.float(), seed, bits, block, group, lfc)
    assert torch.equal(got.codes, ref.codes), f"{(got.codes != ref.codes).sum()} code bytes differ"
    assert torch.equal(got.lo.float(), ref.lo.float()) and torch.equal(got.scale.float(), ref.scale.float())
    assert (got.lfc is None) == (lfc is None) and (lfc is None or torch.equal(got.lfc.float(), ref.lfc.float()))
    kw = dict(bits=bits, block_size=block, group_size=group, stochastic=False)
    with configured(**REFERENCE):
        want = decompress(compress(x, **kw))
    assert torch.equal(decompress(compress(x, **kw)), want)


#: a child that encodes and scores a (3, 32, 64) view whose rows lie 2**30 + 64 elements apart:
#: its last row starts past 2**31, where int32 offsets wrap (untouched pages of the 4 GiB storage
#: are never committed on a CPU)
_WIDE_CHILD = """
import sys, torch
from hf_division.kernels import triton_codec as tc
from hf_division.compress.backends import EAGER
dev = sys.argv[1]
sm = 2**30 + 64
x = torch.empty(2 * sm + 32 * 64, dtype=torch.bfloat16, device=dev).as_strided((3, 32, 64), (sm, 64, 1))
g = torch.Generator().manual_seed(0)
for m in range(3):
    x[m] = (torch.randn(32, 64, generator=g) * 3).to(torch.bfloat16)
seed = torch.tensor(12345, dtype=torch.int64, device=dev)
with tc.on_cpu():
    ex = tc.exact_tokens(x, 4.0)
    got = tc.encode_tokens(x, seed, 4, 16, 32, torch.bfloat16)
ref = EAGER.encode_tokens(x.float(), seed, 4, 16, 32, torch.bfloat16)
score = ex["slot"][96:192].view(torch.float32)
print(torch.equal(got.codes, ref.codes), torch.equal(got.lfc.float(), ref.lfc.float()),
      torch.equal(score, x.float().abs().amax(-1).flatten()))
"""


def test_a_tensor_spanning_past_2_31_elements():
    """Offsets into the held tensor are int64 (``token_rows``, the score kernel): a view whose
    last token lies past element 2**31 encodes and scores as the reference (int32 offsets
    wrapped there and read outside the tensor: a segmentation fault under the interpreter)."""
    out = subprocess.run([sys.executable, "-c", _WIDE_CHILD, DEV], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.split() == ["True", "True", "True"]


def test_any_strides_read_in_place():
    """A per-head tensor ``(B, H, T, d)`` stored as ``(B, T, H, d)``: the kernel reads its
    ``(B, T, H*d)`` view with its strides, and a transposed view with its own."""
    x = _tokens(2, 40, 48, torch.bfloat16).view(2, 40, 3, 16).transpose(1, 2)  # (B, H, T, d), not contiguous
    p = compress(x, bits=4, block_size=8, group_size=32, stochastic=False)
    with configured(**REFERENCE):
        ref = compress(x, bits=4, block_size=8, group_size=32, stochastic=False)
        want = decompress(ref)
    assert torch.equal(p.packed, ref.packed) and torch.equal(p.lfc.float(), ref.lfc.float())
    y = decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.equal(y, want)
    z = _tokens(1, 64, 24).transpose(1, 2)  # channels-major: the token axis has stride 1
    out = tc.encode_tokens(z.transpose(1, 2), _seed(7), 4, 8, 32, torch.bfloat16)
    ref = EAGER.encode_tokens(z.transpose(1, 2).contiguous(), _seed(7), 4, 8, 32, torch.bfloat16)
    assert torch.equal(out.codes, ref.codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 4])
def test_rebuild_equals_the_reference_to_the_bit(dtype, bits):
    x = _tokens(3, 45, 40, dtype)
    if dtype == torch.float16:
        x[0, 3, :4] = 65504.0  # at the edge of fp16's range: the rebuild is clamped, not inf
    kw = dict(bits=bits, block_size=8, group_size=64, outlier_ratio=0.0, stochastic=False)
    with configured(**REFERENCE):
        ref = decompress(compress(x, **kw))
    got = decompress(compress(x, **kw))
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert torch.equal(got, ref)


def test_stochastic_rounding_unbiased_and_within_one_step():
    x = _tokens(1, 32, 16)
    group, n = 32, 32
    gen = torch.Generator().manual_seed(0)
    packs = [compress(x, bits=2, block_size=8, group_size=group, generator=gen) for _ in range(n)]
    assert all(torch.equal(p.scale, packs[0].scale) for p in packs)  # the noise moves codes, not ranges
    draws = torch.stack([decompress(p) for p in packs])
    step = packs[0].scale.float().view(1, 1, 16)
    assert ((draws - x).abs() <= step * (1 + 1e-6) + 1e-6).all()
    # the mean of n draws errs by about 0.8 * sqrt(f (1 - f) / n) steps (f: the element's fraction),
    # 0.06 on average here; rounding to nearest would err by 0.25 on average, a floor by 0.5
    bias = (draws.mean(0) - x).abs() / step.clamp(min=1e-12)
    assert bias.mean() < 0.1 and bias.max() < 0.5


@pytest.mark.parametrize("low_bit", [0, 1])
def test_the_median_found_to_its_last_bit(low_bit):
    """The select kernel's median is the sample's lower median to the bit: with ``ratio`` 1 and
    every token but one scoring the median, only the one a unit above it is taken (a median one
    unit low, its last bit lost, takes as many as there are slots; one unit high, none)."""
    n = 128
    med = ((torch.tensor(1.0 + 2**-20).view(torch.int32) & ~1) | low_bit).view(torch.float32)
    scores = med.repeat(n)
    scores[77] = (med.view(torch.int32) + 1).view(torch.float32)
    x = torch.zeros(1, n, 8)
    x[0, :, 3] = -scores  # max |x| per token is its score
    got = tc.exact_tokens(x.to(DEV), 1.0)
    assert (got["slot"][:n].cpu() >= 0).nonzero().flatten().tolist() == [77]


def test_exact_tokens_chosen_as_the_reference_chooses_them():
    """Up to :data:`SAMPLE` tokens the median is exact: the same tokens held exact as
    ``split_static``, the same bytes and the same rebuild."""
    x = _tokens(2, 200, 32, torch.bfloat16)
    x[0, 5] *= 100
    x[1, 17, 3] = 500
    kw = dict(bits=4, block_size=8, group_size=64, outlier_ratio=16.0, static_rows=True, stochastic=False)
    with configured(**REFERENCE):
        ref = compress(x, **kw)
        want = decompress(ref)
    p = compress(x, **kw)
    got = decompress(p)
    assert sorted(p.row_index[p.row_keep].tolist()) == sorted(ref.row_index[ref.row_keep].tolist()) == [5, 217]
    assert p.nbytes == ref.nbytes == p.own_bytes and torch.equal(p.packed, ref.packed)
    assert torch.equal(got, want) and torch.equal(got[0, 5], x[0, 5])
    _, _, index, keep = split_static(x.float(), 16.0, 0, x.dtype)
    assert sorted(index[keep].tolist()) == [5, 217]


def test_exact_tokens_past_the_sample_and_past_the_capacity():
    """Past :data:`SAMPLE` tokens the median is a strided sample's: the massive tokens are still
    found; past ``k`` candidates, ``k`` of them are held and the rest compressed."""
    x = _tokens(4, 700, 8)  # 2800 tokens: sampled
    x[1, 3] *= 200
    x[3, 650, 2] = 1e4
    ex = tc.exact_tokens(x, 16.0)
    held = ex["row_index"][ex["row_keep"]].tolist()
    assert sorted(held) == [703, 2750]
    assert ex["row_index"].numel() == 2800 // 64
    crowded = _tokens(1, 128, 8)
    crowded[0, :10] *= 1000  # 10 outliers, room for 2
    ex = tc.exact_tokens(crowded, 16.0)
    assert ex["row_keep"].sum() == 2 and set(ex["row_index"][ex["row_keep"]].tolist()) <= set(range(10))
    with tc.on_cpu():
        p = compress(crowded, bits=4, block_size=8, group_size=32, outlier_ratio=16.0, static_rows=True,
                     generator=torch.Generator().manual_seed(0))
        y = decompress(p)
    kept = p.row_index[p.row_keep]
    assert torch.equal(y[0, kept], crowded[0, kept])
    assert ((y - crowded).abs() <= p.scale.float().max() * 1.0001).all()


def test_the_median_sample_spans_every_token():
    """Past :data:`SAMPLE` tokens the sample is strided over all of them, not over the first ones:
    here the first 700 of 2047 tokens are tiny, and a sample of the first 1024 would put the median
    among them and hold ordinary tokens exact; spread over all, only the massive one is held."""
    x = _tokens(1, 2047, 8)
    x[0, :700] *= 0.01
    x[0, 1500] *= 100
    ex = tc.exact_tokens(x, 16.0)
    assert ex["row_index"][ex["row_keep"]].tolist() == [1500]


@pytest.mark.parametrize("ratio", [16.0, 0.0])
def test_launch_budget_and_no_host_synchronisation(ratio):
    """One saved tensor as on a GPU (exact tokens at a fixed capacity, the seed from a block drawn
    ahead): at most 3 launches to compress it and 2 to rebuild it, torch ops included, and no op
    that reads a value back on the host."""
    x = _tokens(2, 96, 64, torch.bfloat16)
    x[0, 0] *= 100
    gen = torch.Generator().manual_seed(0)
    kw = dict(bits=4, block_size=16, group_size=64, outlier_ratio=ratio, static_rows=True, generator=gen)
    compress(x, **kw)  # warm: the kernels defined and this generator's block of seeds drawn
    with KernelCounter() as mode:
        p = compress(x, **kw)
    assert not mode.readbacks, mode.readbacks
    assert mode.triton >= 1 and mode.triton + sum(mode.ops.values()) <= 3, (mode.triton, mode.ops)
    with KernelCounter() as mode:
        y = decompress(p)
    assert not mode.readbacks, mode.readbacks
    assert mode.triton >= 1 and mode.triton + sum(mode.ops.values()) <= 2, (mode.triton, mode.ops)
    assert y.dtype == x.dtype and (ratio == 0 or torch.equal(y[0, 0], x[0, 0]))


def _rms(x):
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).mul_(x.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lfc", ["bf16", "fp16", "none"])
def test_row_scaled_equals_dividing_then_multiplying(dtype, lfc):
    """A norm input kept relative to its rows' RMS (``compress_row_scaled``), the division and the
    product inside the kernels: the codes, block means, ranges and exact tokens that compressing
    ``x / rms`` gives, and the rebuild of multiplying that back, clamped to the dtype, to the bit;
    rows of every scale, an outlier, a zero row, one at the edge of fp16's range."""
    from hf_division.compress.pipeline import cast_finite, compress_row_scaled

    x = _tokens(2, 70, 40, torch.float32) * torch.logspace(-2, 2, 70).view(1, 70, 1)
    x[0, 3] *= 300  # an outlier of its own row scale too
    x[1, 9] = 0.0
    if dtype == torch.float16:
        x[1, 5, :4] = 65504.0
    x = x.to(dtype)
    rms = _rms(x).clamp_(min=torch.finfo(torch.float32).tiny)
    kw = dict(bits=4, block_size=8 if lfc != "none" else 1, group_size=32, lfc_dtype=LFC[lfc] or torch.bfloat16,
              outlier_ratio=16.0)
    p = compress_row_scaled(x, rms, generator=torch.Generator().manual_seed(3), **kw)
    assert p is not None and p.bits == 4 and p.row_scale is rms and p.dtype == dtype
    with configured(**REFERENCE):
        ref = compress(x / rms, generator=torch.Generator().manual_seed(3), **kw)
        want = cast_finite(decompress(ref) * rms, dtype)
    assert torch.equal(p.packed, ref.packed) and torch.equal(p.lo.float(), ref.lo.float())
    assert torch.equal(p.scale.float(), ref.scale.float())
    assert (p.lfc is None) == (ref.lfc is None) and (p.lfc is None or torch.equal(p.lfc, ref.lfc))
    assert torch.equal(p.row_index[p.row_keep], ref.row_index[ref.row_keep])
    assert p.rows.dtype == dtype and p.own_bytes == p.nbytes
    got = decompress(p)
    assert got.dtype == dtype and torch.isfinite(got).all()
    # the zero row (scale: the smallest normal float32) rebuilds as subnormals or zeros, which the
    # interpreter's arithmetic may flush: (almost) zero, not to the bit
    sub = torch.zeros_like(got, dtype=torch.bool)
    sub[1, 9] = True
    assert torch.equal(got[~sub], want[~sub]) and got[sub].float().abs().max() < 1e-30
    with configured(triton=False):  # what the torch kernels rebuild from the same bundle
        assert torch.equal(decompress(p)[~sub], want[~sub])


def test_row_scaled_launch_budget_and_where_it_declines():
    """The row-scaled encode in 3 launches and its rebuild in 2, nothing read back; declined
    (None: the caller divides) where the tokens are not in memory order or leading tokens are kept."""
    from hf_division.compress.pipeline import compress_row_scaled

    x = _tokens(2, 96, 64, torch.bfloat16)
    x[0, 0] *= 100
    rms = _rms(x)
    kw = dict(bits=4, block_size=16, group_size=64, lfc_dtype=torch.bfloat16, outlier_ratio=16.0,
              generator=torch.Generator().manual_seed(0))
    compress_row_scaled(x, rms, **kw)
    with KernelCounter() as mode:
        p = compress_row_scaled(x, rms, **kw)
    assert not mode.readbacks and mode.triton + sum(mode.ops.values()) <= 3, (mode.triton, mode.ops)
    with KernelCounter() as mode:
        decompress(p)
    assert not mode.readbacks and mode.triton + sum(mode.ops.values()) <= 2, (mode.triton, mode.ops)
    xt = x.transpose(0, 1)
    assert compress_row_scaled(xt, _rms(xt), **kw) is None
    assert compress_row_scaled(x, rms, exact_tokens=2, **kw) is None


class _HostOps(TorchDispatchMode):
    """Every torch op the host issues outside the kernels, views and allocations included."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not tc.launching():
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_launch_makes_its_tensors_gpu_current_where_another_is(monkeypatch):
    """With two GPUs, a tensor on the one that is not current (``device_map="auto"``) is launched for
    under ``torch.cuda.device`` of its own (Triton launches on the current device); one GPU, the
    current one or a CPU tensor: no switch, nothing paid for it (tests/test_cuda.py runs both GPUs)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: ("switch to", d))

    class On:  # a tensor's device, as launch_kernel reads it
        def __init__(self, device):
            self.device = torch.device(device)

    assert tc.device_switch(On("cuda:1")) == ("switch to", torch.device("cuda:1"))
    assert tc.device_switch(On("cuda:0")) is None and tc.device_switch(On("cpu")) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert tc.device_switch(On("cuda:1")) is None


def test_host_ops_per_saved_tensor():
    """What the host does around the kernels for one saved tensor, each op a dispatch (several
    microseconds on a GPU's host, docs/DESIGN.md "On a GPU"): at most 13 torch ops to compress it
    (its buffers, a seed) and 6 to rebuild it; the codes are passed as one buffer, not as typed
    views, and the outlier search's scratch is one allocation."""
    x = _tokens(1, 64, 96, torch.bfloat16)
    kw = dict(bits=4, block_size=16, group_size=256, outlier_ratio=16.0, generator=torch.Generator().manual_seed(0))
    decompress(compress(x, **kw))
    with tc.not_run():
        with _HostOps() as mode:
            p = compress(x, **kw)
        assert sum(mode.ops.values()) <= 13 and mode.ops["empty"] + mode.ops["empty_like"] <= 8, mode.ops
        with _HostOps() as mode:
            decompress(p)
        assert sum(mode.ops.values()) <= 6, mode.ops


def test_seeds_drawn_in_blocks_follow_the_generator():
    """Blocks of seeds: one per tensor, distinct; the same again from a generator seeded alike; a
    generator reseeded since the draw draws a new block, as a fresh one would."""
    from hf_division.compress.noise import SEED_BLOCK, tensor_seed

    def seeds(gen, n):
        return [int(tensor_seed(torch.device("cpu"), gen, blocks=True)) for _ in range(n)]

    gen = torch.Generator().manual_seed(5)
    first = seeds(gen, SEED_BLOCK + 3)
    assert len(set(first)) == len(first) and all(0 <= s < 2**32 for s in first)
    assert seeds(torch.Generator().manual_seed(5), SEED_BLOCK + 3) == first
    gen.manual_seed(5)
    assert seeds(gen, 4) == first[:4]
    assert seeds(torch.Generator().manual_seed(6), 4) != first[:4]


def test_seed_blocks_kept_without_weak_references_to_generators(monkeypatch):
    """PyTorch 2.11 (the lent GPU machines') takes no weak reference to a ``torch.Generator``: the
    blocks are kept by id, each with its generator, so an entry left under the id by another
    generator is not read, and past ``KEPT_BLOCKS`` the oldest is dropped and drawn anew."""
    import weakref
    from hf_division.compress import noise

    real_ref = weakref.ref

    def ref(obj, *callback):  # what 2.11 does
        if isinstance(obj, torch.Generator):
            raise TypeError("cannot create weak reference to 'torch._C.Generator' object")
        return real_ref(obj, *callback)

    monkeypatch.setattr(weakref, "ref", ref)
    kept = {}
    monkeypatch.setattr(noise, "_blocks", kept)
    monkeypatch.setattr(noise, "KEPT_BLOCKS", 2)
    cpu = torch.device("cpu")

    def block(seed, n):  # the n-th block a generator seeded with ``seed`` draws
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(0, 2**32, (noise.SEED_BLOCK,), dtype=torch.int64, generator=gen) for _ in range(n)][-1]

    def draw(gen):
        return int(noise.tensor_seed(cpu, gen, blocks=True))

    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert [draw(g) for g in gens] == [int(block(i, 1)[0]) for i in range(3)]
    assert len(kept) == 2 and id(gens[0]) not in kept
    assert draw(gens[2]) == int(block(2, 1)[1])  # kept: the block's next seed
    assert draw(gens[0]) == int(block(0, 2)[0])  # dropped: a new block
    assert draw(gens[1]) == int(block(1, 2)[0])
    kept[id(gens[1])] = (torch.Generator().manual_seed(9), kept[id(gens[1])][1])  # another generator had this id
    assert draw(gens[1]) == int(block(1, 3)[0])


def test_kernels_compile_for_an_h200():
    """Every kernel compiles to sm_90 PTX and a cubin (no GPU needed; a process without the
    interpreter), with no multiply-add fused where the reference rounds each product: what the
    interpreter cannot check (types, layouts, register allocation)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from hf_division.kernels.triton_variants import compile_all\n"
            "ptx = compile_all(90)\n"
            "print(len(ptx), [v for v, p in ptx.items() if v.startswith(('encode', 'decode', 'rotary')) and 'fma.rn.f32' in p])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == f"{len(COMPILED_VARIANTS)} []"
