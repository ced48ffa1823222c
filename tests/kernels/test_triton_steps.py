"""Training steps on the GPU's path on a CPU machine (every saved tensor through the Triton kernels
of hf_division/kernels/, under Triton's interpreter as tests/test_triton.py runs them one at a
time): to the bit against the CPU path's torch kernels, against the unpatched model across
precision, padding and attention, and with no op that reads back on the host beyond the unpatched
model's own.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_triton_steps.py
"""
import contextlib

import pytest
import torch

from hf_division.analysis.launches import GPU_SWITCHES, KernelCounter
from hf_division.kernels import configured
from hf_division.kernels import triton_codec as tc

from conftest import TRITON_MARKS

pytestmark = [*TRITON_MARKS, pytest.mark.heavy]


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_a_training_step_through_the_kernels_matches_the_torch_path(amp):
    """A Llama step (2 layers, sdpa) with every saved tensor through the Triton kernels, rounding to
    nearest: with the norms' and the gated MLPs' torch ops, the gradient equals the CPU path's to the
    bit (the same codes, exact tokens and rebuild); with their Triton kernels (kernels/triton_norm.py,
    kernels/triton_gated.py), to float32 rounding; against the unpatched model it is as close as the
    CPU path's."""
    import hf_division as hd
    from hf_division.analysis.fidelity import cosine, flat_grad
    from hf_division.bench.suites import cuda as cuda_suite

    model = cuda_suite.build("tiny", "cpu")
    ids = torch.randint(1, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    exact = flat_grad(model, batch, 0, amp)
    hd.apply_division(model, hd.DivisionConfig(rounding="nearest"))
    with configured(**GPU_SWITCHES):
        before = tc.launches()
        fused_norms = flat_grad(model, batch, 0, amp)
        # every saved tensor, each norm's rebuild and gradient, each gated MLP's product and gradients
        assert tc.launches() - before >= 40 + 2 * 5 + 2 * 2
        with configured(triton_rms_norm=False, triton_gated=False):
            triton_path = flat_grad(model, batch, 0, amp)
        with configured(triton=False):
            before = tc.launches()
            torch_path = flat_grad(model, batch, 0, amp)
            assert tc.launches() == before
    assert torch.equal(triton_path, torch_path)
    assert cosine(fused_norms, triton_path) > 1 - 1e-6
    assert cosine(exact, triton_path) > 0.99


#: (autocast, padding, attention): with the unpadded sdpa steps above (fp32 and bf16), every pair of
#: two of them's values in some case
COMBINATIONS = [(None, "right", "eager"), (None, "left", "sdpa"), (torch.bfloat16, "right", "sdpa"),
                (torch.bfloat16, "left", "eager"), (torch.float16, "right", "eager"), (torch.float16, "left", "sdpa"),
                (torch.float16, "none", "eager")]


@pytest.mark.parametrize("amp,padding,attention", COMBINATIONS)
def test_a_training_step_on_the_gpus_path_across_precision_padding_and_attention(amp, padding, attention):
    """The combinations users hit on the GPU's path (every Triton kernel, the GPU's switches): fp32,
    bf16 and fp16 autocast, no padding, right and left padding, sdpa and eager attention, 40 tokens
    (off the 16-token block): the gradient against the unpatched model's, whole and per tensor
    (those with at least 1% of its norm), rounding to nearest."""
    import hf_division as hd
    from hf_division.analysis.fidelity import cosine, named_grads
    from hf_division.bench.suites import cuda as cuda_suite

    model = cuda_suite.build("tiny", "cpu")
    model.set_attn_implementation(attention)
    ids = torch.randint(1, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 29:] = 0 if padding == "right" else 1
    mask[1, :11] = 0 if padding == "left" else 1
    batch = {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100)}
    if padding != "none":
        batch["attention_mask"] = mask
    exact = named_grads(model, batch, 0, amp)
    hd.apply_division(model, hd.DivisionConfig(rounding="nearest"))
    with configured(**GPU_SWITCHES):
        before = tc.launches()
        grads = named_grads(model, batch, 0, amp)
        assert tc.launches() - before >= 40
    whole = torch.cat(list(exact.values())).norm()
    per_tensor = [cosine(exact[k], grads[k]) for k in exact if exact[k].norm() >= 0.01 * whole]
    assert cosine(torch.cat(list(exact.values())), torch.cat(list(grads.values()))) > 0.999
    assert min(per_tensor) > 0.99


def test_a_training_step_through_the_kernels_reads_nothing_back():
    """Forward and backward of a division step on the CUDA path (the kernels, the GPU's switches,
    bf16 autocast, a padded batch): no op that would synchronise with the host beyond those the
    unpatched model runs itself (Transformers' sdpa mask checks whether it can skip the mask), the
    condition for capturing the step in a CUDA graph (tests/test_cuda.py captures one on a GPU)."""
    import hf_division as hd
    from hf_division.bench.suites import cuda as cuda_suite

    model = cuda_suite.build("tiny", "cpu").train()
    ids = torch.randint(1, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 31:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    syncs = {}
    with configured(**GPU_SWITCHES), tc.on_cpu():
        for arm in ("unpatched", "division"):
            if arm == "division":
                hd.apply_division(model)
            for watched in (False, True):  # the first step pays the one-time set-up
                mode = KernelCounter()
                with mode if watched else contextlib.nullcontext():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(**batch).loss
                    loss.backward()
            syncs[arm] = sorted(mode.readbacks)
    assert syncs["division"] == syncs["unpatched"]
