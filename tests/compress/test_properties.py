"""Property tests of the compressor (Hypothesis): for random shapes (1-token rows, odd lengths),
dtypes (fp32, bf16, fp16, values up to the dtype's range), bit widths, groupings, blocks and
groups, ``decompress(compress(x))`` has ``x``'s shape and dtype, each element is within one
quantization step of its group (plus the rounding to ``x``'s dtype), the bytes reported are the
bytes held, and the compressed form is never larger than ``x`` (docs/GUIDE.md, "Limits and guarantees")."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_division.compress.pipeline import compress, decompress
from hf_division.kernels import configured
from hf_division.quant.exact_tokens import exceeds_median, outlier_candidates, outlier_tokens

from tests.compress.reference import step_bound

#: largest |x| generated per dtype: fp16 up to its maximum (fp16 activations reach it); fp32 and
#: bf16 to 1e36, where ranges and block sums stay finite in float32 (GUIDE, "Limits and guarantees")
LIMIT = {torch.float32: 1e36, torch.bfloat16: 1e36, torch.float16: torch.finfo(torch.float16).max}

shapes = st.tuples(st.integers(1, 3), st.integers(1, 70), st.integers(1, 40))
layouts = st.fixed_dictionaries({
    "bits": st.sampled_from([1, 2, 4, 8]),
    "grouping": st.sampled_from(["tokens", "flat"]),
    "block_size": st.sampled_from([1, 2, 8, 16, 64, 10**9]),
    "group_size": st.sampled_from([8, 16, 256, 10**9 // 8 * 8]),
    "outlier_ratio": st.sampled_from([0.0, 4.0]),
})


@st.composite
def tensors(draw):
    m, t, c = draw(shapes)
    dtype = draw(st.sampled_from(list(LIMIT)))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 1e4, "max"]))
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(m, t, c, generator=torch.Generator().manual_seed(seed))
    if magnitude == "max":  # a few values at the dtype's largest magnitude, the rest spread below
        x = x / x.abs().amax().clamp(min=1e-12) * LIMIT[dtype]
        x.view(-1)[:: max(1, x.numel() // 3)] = LIMIT[dtype]
    else:
        x = x * magnitude
    return x.to(dtype)


def group_steps(p, x):
    """The quantization step of each element's group, shaped as ``x`` (contiguous ``(M, T, C)``)."""
    m, t, c = x.shape
    if p.grouping == "flat":
        index = torch.arange(x.numel()) // p.group_size
        return p.scale.float()[index].view(x.shape)
    tp = -(-t // p.block_size) * p.block_size
    token = (torch.arange(m).view(m, 1) * tp + torch.arange(t).view(1, t)).view(-1)
    return p.scale.float()[token // p.group_size].view(m, t, c)


@pytest.fixture(autouse=True, scope="module")
def eager():
    with configured(compile=False):  # hundreds of shapes: compiling each would dominate; the math is the same
        yield


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(), layout=layouts)
def test_round_trip_error_bytes_and_size(x, layout):
    p = compress(x, token_dim=-2, generator=torch.Generator().manual_seed(0), **layout)
    y = decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    raw = x.numel() * x.element_size()
    # the bytes reported are the storages held, nothing hidden behind a view
    assert p.nbytes == sum(s.numel() * s.element_size() for s in p.storages()) == p.own_bytes
    if p.bits == 0:  # kept as it is: never larger than the input
        assert y is x or torch.equal(y, x)
        return
    assert p.nbytes < raw
    step = group_steps(p, x)
    err = (y.double() - x.double()).abs()
    # one step of the group (scales are rounded up, so this includes the LFC's own rounding),
    # plus the rounding of the result to x's dtype
    bound = step.double() * (1 + 2**-7) + x.double().abs() * torch.finfo(x.dtype).eps + 1e-30
    worst = (err - bound).max().item()
    assert worst <= 0, f"error exceeds one step by {worst:.3g}"
    # and that step is no larger than the group's own range makes it (computed from x alone)
    lfc = p.grouping == "tokens" and p.lfc is not None
    limit = step_bound(x, p.bits, p.grouping, p.group_size, p.block_size, lfc) * (1 + 2**-6)
    over = (step.double() - limit).max().item()
    assert over <= 1e-30, f"a group's step exceeds its range / (2**bits - 1) by {over:.3g}"


@settings(max_examples=100, deadline=None)
@given(x=tensors(), bits=st.sampled_from([1, 2, 4, 8]))
def test_bit_width_sets_the_code_bytes(x, bits):
    """Token grouping: codes take exactly ``bits`` per element of the (block-padded) tensor's full
    groups; a partial last group is padded to whole bytes per channel (at most ``C`` bytes more)."""
    p = compress(x, bits=bits, block_size=16, group_size=256, token_dim=-2, generator=torch.Generator().manual_seed(0))
    if p.bits == 0:
        return
    m, t, c = x.shape
    block = min(16, t)
    assert p.block_size == block
    tokens = m * (-(-t // block) * block)
    full, rest = divmod(tokens, p.group_size)
    assert p.packed.numel() == full * p.group_size * c * bits // 8 + -(-rest * bits // 8) * c
    assert p.packed.numel() - -(-tokens * c * bits // 8) < c


@st.composite
def scores(draw):
    """Per-token max |x| scores as the outlier search sees them: ties, zeros, planted outliers
    around the threshold, infinities and NaNs, at lengths odd and even."""
    n = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**16))
    r = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    kind = draw(st.sampled_from(["plain", "ties", "zeros", "planted", "inf", "nan", "huge"]))
    if kind == "ties":
        r = (r * 4).floor()
    elif kind == "zeros":
        r[: draw(st.integers(0, n))] = 0.0
    elif kind == "planted":  # a few at ratio x median and just beside it, where rounding decides
        med = r.median()
        for i in range(min(n, draw(st.integers(1, 4)))):
            r[i] = torch.nextafter(4.0 * med, torch.tensor(draw(st.sampled_from([0.0, 1e30])))) if i else 4.0 * med
    elif kind == "inf":
        r[: draw(st.integers(1, n))] = float("inf")
    elif kind == "nan":
        r[draw(st.integers(0, n - 1))] = float("nan")
    else:  # values where ratio x r overflows float32
        r = r * 3e38
    return r


@settings(max_examples=400, deadline=None)
@given(r=scores(), ratio=st.sampled_from([1.5, 4.0, 16.0]))
def test_outlier_search_skips_the_selection_exactly_when_it_would_select_nothing(r, ratio):
    """``exceeds_median`` answers ``max > ratio * median`` without finding the median (the fast
    path of ``outlier_tokens``), and ``outlier_tokens`` returns what the selection returns."""
    assert exceeds_median(r, ratio) == bool(r.max() > ratio * r.median())
    x3 = r.view(1, -1, 1)
    index, selected = outlier_candidates(x3, ratio, r)
    reference = index[selected]
    got = outlier_tokens(x3, ratio, r)
    if reference.numel():
        assert torch.equal(got, reference)
    else:
        assert got is None
