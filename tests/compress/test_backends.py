"""The compressor's backends (hf_division.compress.backends) against the reference, the eager torch
kernels: the same codes, ranges, block means and rebuilt values, on ragged shapes (a partial last
group, rows off the block size), every bit width and LFC dtype; and which backend a tensor gets."""
import pytest
import torch

from hf_division.compress import backends
from hf_division.compress.backends import COMPILED, EAGER, NATIVE, pick
from hf_division.compress.pipeline import compress, decompress
from hf_division.kernels import configured, native
from hf_division.quant.packed import FLAT, TOKENS, Layout, Packed, token_group
from hf_division.quant.rounding import noise_seed

HAS_NATIVE = native.kernels() is not None
#: (M, T, C): a partial last group and rows off the block size; one token per row; wide channels
SHAPES = [(2, 37, 24), (3, 5, 8), (1, 70, 40)]


def _encode(backend, x3, bits, block, group, lfc_dtype, stochastic):
    seed = noise_seed(x3.device, torch.Generator().manual_seed(5)) if stochastic else None
    return backend.encode_tokens(x3, seed, bits, block, group, lfc_dtype)


def _as_packed(enc, x3, bits, block, group):
    m, t, c = x3.shape
    return Packed(packed=enc.codes, lo=enc.lo, scale=enc.scale, lfc=enc.lfc, shape=x3.shape, dtype=torch.float32,
                  layout=Layout((0, 1, 2), (m, t, c), 1), bits=bits, block_size=block, group_size=group, grouping=TOKENS)


@pytest.mark.skipif(not HAS_NATIVE, reason="no C compiler: the native kernels are not built")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("lfc_dtype, block", [(None, 1), (torch.bfloat16, 8), (torch.float32, 4)])
@pytest.mark.parametrize("stochastic", [True, False])
def test_native_encodes_and_decodes_as_the_reference(shape, bits, lfc_dtype, block, stochastic):
    x3 = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    block = min(block, shape[1])
    group = token_group(16, block, bits)
    ours, ref = (_encode(b, x3, bits, block, group, lfc_dtype or torch.bfloat16, stochastic) for b in (NATIVE, EAGER))
    for name in ("codes", "lfc", "lo", "scale"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))), name
    p = _as_packed(ours, x3, bits, block, group)
    torch.testing.assert_close(NATIVE.decode_tokens(p), EAGER.decode_tokens(p), rtol=0, atol=0)
    assert torch.equal(NATIVE.token_absmax(x3), EAGER.token_absmax(x3))


def test_compiled_encodes_as_the_reference_but_for_last_bit_ties():
    x3 = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(0))
    group = token_group(256, 16, 4)
    ours, ref = (_encode(b, x3, 4, 16, group, torch.bfloat16, True) for b in (COMPILED, EAGER))
    assert torch.equal(ours.lo, ref.lo) and torch.equal(ours.scale, ref.scale) and torch.equal(ours.lfc, ref.lfc)
    assert (ours.codes != ref.codes).float().mean() < 1e-4
    flat = x3.reshape(-1)[: 256 * 300]
    seed = noise_seed(flat.device, torch.Generator().manual_seed(1))
    a, b = COMPILED.encode_flat(flat, seed, 2, 256), EAGER.encode_flat(flat, seed, 2, 256)
    assert torch.equal(a.lo, b.lo) and torch.equal(a.scale, b.scale) and (a.codes != b.codes).float().mean() < 1e-4


def test_the_torch_backends_refuse_what_only_the_native_one_does():
    x3 = torch.randn(1, 16, 8)
    with pytest.raises(ValueError, match="eager backend neither scales rows nor scores"):
        EAGER.encode_tokens(x3, None, 4, 1, 16, torch.bfloat16, score=True)
    assert NATIVE.scores_in_encode and NATIVE.scales_rows and not EAGER.scores_in_encode and not COMPILED.scales_rows


def test_one_backend_per_tensor_by_device_grouping_lfc_and_switches():
    cpu = torch.device("cpu")
    expect_native = NATIVE if HAS_NATIVE else COMPILED
    assert pick(cpu, TOKENS, torch.bfloat16) is expect_native and pick(cpu, TOKENS, None) is expect_native
    assert pick(cpu, TOKENS, torch.float16) is COMPILED  # the C kernels hold no fp16 LFC
    assert pick(cpu, FLAT, None) is COMPILED  # nor flat groups
    assert pick(torch.device("meta"), TOKENS, torch.bfloat16) is COMPILED
    with configured(native=False):
        assert pick(cpu, TOKENS, torch.bfloat16) is COMPILED
    with configured(native=False, compile=False):
        assert pick(cpu, TOKENS, torch.bfloat16) is EAGER


def test_compress_asks_for_one_backend_and_encodes_once(monkeypatch):
    """The pipeline picks a backend once per tensor (again only where it widens an fp16 LFC) and,
    where no outlier token turns up, encodes once."""
    picks, encodes = [], []
    real_pick = backends.pick

    def counting_pick(*args):
        backend = real_pick(*args)
        picks.append(backend.name)
        real = backend.encode_tokens
        monkeypatch.setattr(backend, "encode_tokens", lambda *a, **k: encodes.append(1) or real(*a, **k))
        return backend

    from hf_division.compress import pipeline
    monkeypatch.setattr(pipeline, "pick", counting_pick)
    x = torch.randn(2, 64, 32)
    p = compress(x, bits=4, block_size=8, group_size=64, outlier_ratio=16.0)
    assert len(picks) == 1 and len(encodes) == 1 and p.row_index is None
    decompress(p)
    assert len(picks) == 2  # the rebuild picks its own, for the device it runs on
