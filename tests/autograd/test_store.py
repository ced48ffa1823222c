"""Store entries: what one rebuild serves."""
import pytest
import torch

from hf_division.analysis.launches import KernelCounter
from hf_division.autograd import store
from hf_division.config import DivisionConfig


def test_consumers_asking_for_one_dtype_share_one_cast():
    """Three consumers of one held float32 tensor taking it as bf16 (the q, k and v projections
    under autocast): one rebuild, one cast, the same values as casting the rebuild; the cast is
    let go with the last consumer."""
    x = torch.randn(2, 64, 32)
    entry = store.keep(x, "linear", DivisionConfig(min_numel=0))
    for _ in range(2):
        entry.add_user()
    with KernelCounter() as counter:
        got = [entry.take(torch.bfloat16) for _ in range(3)]
    assert counter.ops["_to_copy"] == 1, counter.ops
    assert all(g is got[0] for g in got) and got[0].dtype == torch.bfloat16
    y = store.keep(x * 2, "linear", DivisionConfig(min_numel=0))
    plain = y.take()
    assert plain.dtype == torch.float32 and y._cast is None and entry._cast is None and entry._cache is None
    whole = store.keep(x + 1, "linear", DivisionConfig(min_numel=0))
    whole.add_user()
    rebuilt = whole.get()
    assert torch.equal(whole.take(torch.bfloat16), rebuilt.to(torch.bfloat16))
    assert whole.take().dtype == torch.float32  # the other consumer still gets the rebuild itself


def test_row_scales_of_zero_and_nan_rows_are_the_smallest_normal():
    """A norm input kept relative to its rows' RMS: a zero row (a padding embedding) and a row
    holding a NaN get the smallest normal float32 as their scale (as ``where(rms > 0, rms, tiny)``
    gives them), every other row its RMS."""
    x = torch.randn(1, 64, 32)
    x[0, 3] = 0.0
    x[0, 7, 5] = float("nan")
    entry = store.keep(x, "norm", DivisionConfig(min_numel=0))
    scale = entry.packed.row_scale.view(-1)
    tiny = torch.finfo(torch.float32).tiny
    assert scale[3] == tiny and scale[7] == tiny
    others = torch.ones(64, dtype=torch.bool)
    others[[3, 7]] = False
    want = torch.linalg.vector_norm(x[0], dim=-1)[others] * 32 ** -0.5
    assert torch.equal(scale[others], want)


def test_a_parameter_fed_to_a_layer_is_held_by_reference():
    """A parameter kept as a layer's input (DeBERTa's relative-position embedding weight
    goes through a LayerNorm in every forward) is held as it is, sharing its storage, and counts no
    bytes held: the model holds it anyway, as autograd's own saves of it are not counted. Compressed,
    it cost bytes the unpatched model does not hold, and its first forward held more than later ones
    (tests/model_patches/test_conformance.py, the later forwards' test)."""
    import hf_division as hd
    from hf_division.analysis.measure import account
    from hf_division.bench import tiny_models as tiny

    weight = torch.nn.Parameter(torch.randn(64, 32))
    entry = store.keep(weight, "norm", DivisionConfig(min_numel=0))
    assert entry.packed is None and [t.data_ptr() for t in entry.tensors()] == [weight.data_ptr()]
    assert store.lookup(weight) is entry and torch.equal(entry.get(), weight)
    with torch.no_grad():  # changed in place before the backward: an error, as autograd raises for its own saves
        weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        entry.take()
    # another leaf needing a gradient is an activation (PEFT's enable_input_require_grads makes the
    # embedding's output one): compressed
    leaf = torch.randn(64, 32).requires_grad_()
    assert store.keep(leaf, "norm", DivisionConfig(min_numel=0)).packed.bits == 4
    model = tiny.tiny_model("deberta-v2", "eager").train()
    batch = tiny.tiny_batch(model_type="deberta-v2")
    hd.apply_division(model, hd.DivisionConfig(min_numel=0))
    first, second = account(model, batch), account(model, batch)
    assert first.total == second.total and first.by_kind == second.by_kind
    rel = model.deberta.encoder.rel_embeddings.weight
    assert [t.data_ptr() for t in store.lookup(rel).tensors()] == [rel.data_ptr()]


def test_a_precise_consumer_reuses_a_held_tensor_only_where_held_as_precisely():
    """A tensor derived from a held one (a norm's output from its compressed input) is reused by
    any consumer, except a ``precise`` one (a checkpointed layer's input, at ``checkpoint_bits``)
    asking for more bits than the copy behind it holds, or for the tensor exact: it gets a copy of
    its own, which later consumers share. Reused, T5's decoder layers under checkpointing
    recomputed their cross-attention from the encoder output rebuilt from its final norm's 4-bit
    input (tests/model_patches/test_matrix_lora.py, the T5 family's test)."""
    x = torch.randn(2, 64, 32)
    at = {bits: DivisionConfig(min_numel=0, norm_bits=bits) for bits in (0, 4, 8)}
    source = store.keep(x, "norm", at[4])
    y = x * 2
    store.derive(y, (source,), lambda v: v * 2)
    derived = store.lookup(y)
    assert source.bits() == derived.bits() == 4
    assert store.keep(y, "norm", at[8]) is derived  # not precise: shared as it is held
    assert store.keep(y, "norm", at[4], precise=True) is derived  # as precise as asked: shared
    own = store.keep(y, "norm", at[8], precise=True)
    assert own is not derived and own.packed.bits == own.bits() == 8
    assert store.lookup(y) is own and store.keep(y, "norm", at[4]) is own  # later consumers share it
    z = x + 1
    store.derive(z, (source,), lambda v: v + 1)
    exact = store.keep(z, "norm", at[0], precise=True)
    assert exact.packed.bits == 0 and exact.bits() == store.EXACT and torch.equal(exact.get(), z)
    assert store.keep(z, "norm", at[8], precise=True) is exact  # exact serves every consumer
    assert store.keep(x + 2, "norm", DivisionConfig(min_numel=10**9)).bits() == store.EXACT  # too small: exact
