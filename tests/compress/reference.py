"""Bounds the compressor tests check against, computed from the input alone: never from the scale
the implementation chose (a scale too large would otherwise pass every "within one step" test)."""
import torch


def group_index(x: torch.Tensor, grouping: str, group_size: int, block_size: int) -> torch.Tensor:
    """The group of each element of ``x`` (contiguous ``(M, T, C)``), shaped as ``x``: flat groups are
    ``group_size`` consecutive elements in memory; token groups are ``group_size`` consecutive tokens
    of one channel, counted over the rows padded to whole blocks (docs/DESIGN.md, "Compressor")."""
    m, t, c = x.shape
    if grouping == "flat":
        return (torch.arange(x.numel()) // group_size).view(m, t, c)
    tp = -(-t // block_size) * block_size
    token = torch.arange(m).view(m, 1) * tp + torch.arange(t).view(1, t)
    groups = -(-(m * tp) // group_size)
    return (token // group_size).view(m, t, 1) + groups * torch.arange(c).view(1, 1, c)


def step_bound(x: torch.Tensor, bits: int, grouping: str, group_size: int, block_size: int, lfc: bool) -> torch.Tensor:
    """An upper bound on the quantization step of each element's group, in float64: the range of
    the group's values (and of the zeros padding a partial group) over ``2**bits - 1`` codes. With the LFC the codes cover ``x`` less its block
    means, whose range is at most twice the group's (each block lies inside one group), plus the
    rounding of the means to bfloat16. Either way the group's minimum is stored rounded down to
    bfloat16, which lowers it by less than ``2**-7`` of its magnitude and widens the range by that
    (a 1-bit group of 8 values near -1.2 spanning 0.53: 1.3% of its range)."""
    xd = x.double()
    index = group_index(x, grouping, group_size, block_size).reshape(-1)
    flat = xd.reshape(-1)
    n = int(index.max()) + 1
    hi = torch.full((n,), -torch.inf, dtype=torch.float64).scatter_reduce(0, index, flat, "amax")
    lo = torch.full((n,), torch.inf, dtype=torch.float64).scatter_reduce(0, index, flat, "amin")
    # a group with fewer elements than group_size is padded with zeros, which join its range
    partial = torch.bincount(index, minlength=n) < group_size
    hi, lo = torch.where(partial, hi.clamp(min=0), hi), torch.where(partial, lo.clamp(max=0), lo)
    span = hi - lo
    bottom = lo.abs()
    if lfc:
        span = 2 * span + 2 * torch.maximum(hi.abs(), lo.abs()) * 2**-8
        bottom = span  # the residual's minimum: x less a mean of its own block, within the group's range of 0
    span = span + bottom * 2**-7
    return (span / (2**bits - 1))[index].view(x.shape)
