"""hf_division.analysis.launches: what a step would launch on a GPU, counted on the CPU."""
import torch

from hf_division.analysis.launches import KernelCounter


def test_counts_kernels_not_views_and_flags_readbacks():
    x = torch.arange(12.0).view(3, 4)
    with KernelCounter() as c:
        y = x.t().t().view(-1)  # views: no kernel
        z = (y + 1).mul_(2)  # two kernels
        torch.empty(5)
        n = int((z > 3).sum())  # a comparison, a sum, then a readback
        picked = z[z > 10]  # a comparison, then indexing by a mask: a readback of its count
    assert c.ops == {"add": 1, "mul_": 1, "gt": 2, "sum": 1}
    assert c.readbacks == ["_local_scalar_dense", "index"]
    assert c.triton == 0 and n == 11 and picked.numel() == 7
