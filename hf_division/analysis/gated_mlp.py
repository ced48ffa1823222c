"""Where low-bit gate/up inputs hurt a gated MLP's backward: an expected-error estimate per layer.

A SiLU-gated MLP (``down(act(gate(x)) * up(x))``, Llama's) keeps its gate and up outputs for
backward. Stochastic rounding of each to ``bits`` in groups of ``group`` tokens of one channel adds
zero-mean noise of variance ``step**2 * f * (1 - f)`` per element (``step``: the group's range over
``2**bits - 1``; ``f``: the element's remainder above its lower level, in steps). Through the
backward this noise reaches the MLP's input gradient linearly; :func:`gate_up_error` sums its expected square exactly for that linear map and
reports it relative to the input gradient's own norm, from one exact forward and backward of the
unpatched model. It names the token and the channel that carry the largest share, which is how the
policy's ``late_layers`` was found (docs/DESIGN.md, "Policy", "Early and late layers").
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from hf_division.analysis.fidelity import hooked_backward


@dataclasses.dataclass
class LayerError:
    layer: int
    relative: float  #: sqrt(E |noise in the MLP's input gradient|^2) / |input gradient|
    token: tuple[int, int]  #: (row, position) holding the largest share of the expected error
    token_share: float
    channel: int  #: intermediate channel holding the largest share
    channel_share: float
    channel_max: float  #: that channel's largest |gate| or |up| over the real tokens
    median_channel_max: float  #: the median over channels of the same


def _variance(t: torch.Tensor, mask: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per element of ``t`` (B, T, C): the variance of its stochastic rounding in its ``group``-token
    group; padding positions (``mask`` False) are left out of the ranges and get none, as the store
    rebuilds them exactly."""
    B, T, C = t.shape
    pad = (-T) % group
    keep = F.pad(mask, (0, pad), value=False).reshape(B, -1, group, 1)
    tt = F.pad(t, (0, 0, 0, pad)).reshape(B, -1, group, C)
    hi = tt.masked_fill(~keep, -torch.inf).amax(2, keepdim=True).nan_to_num(0.0, neginf=0.0)
    lo = tt.masked_fill(~keep, torch.inf).amin(2, keepdim=True).nan_to_num(0.0, posinf=0.0)
    step = (hi - lo) / (2 ** bits - 1)
    f = torch.where(step > 0, (tt - lo) / step.where(step > 0, 1.0), 0.0)
    f = f - f.floor()
    var = (step * step * f * (1 - f)).masked_fill(~keep, 0.0)
    return var.reshape(B, -1, C)[:, :T]


def _mlps(model) -> list:
    mlps = [m for m in model.modules() if all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))]
    for m in mlps:
        if "silu" not in type(m.act_fn).__name__.lower():
            raise ValueError(f"gate_up_error: {type(m).__name__}'s activation is {type(m.act_fn).__name__}, not SiLU")
    return mlps


def gate_up_error(model, batch: dict, bits: int = 4, group: int = 32) -> list[LayerError]:
    """One float32 step of the unpatched ``model`` on ``batch`` (a causal-LM batch with labels and
    an attention mask); per SiLU-gated MLP, in order, the expected relative error that ``bits``-bit
    stochastic rounding of its gate and up outputs would put into its input gradient."""
    mlps = _mlps(model)
    if not mlps:
        raise ValueError("gate_up_error: the model has no gated MLP (gate_proj, up_proj, down_proj, act_fn)")
    caught: dict[int, dict] = {i: {} for i in range(len(mlps))}
    handles = []
    for i, mlp in enumerate(mlps):
        def keep(name, i=i):
            def hook(module, args, out=None):  # a Linear's output, or (pre-hook) down_proj's input
                t = args[0] if out is None else out
                t.retain_grad()
                caught[i][name] = t
            return hook
        handles += [mlp.gate_proj.register_forward_hook(keep("gate")), mlp.up_proj.register_forward_hook(keep("up")),
                    mlp.down_proj.register_forward_pre_hook(keep("h"))]
    hooked_backward(model, batch, handles)
    mask = batch["attention_mask"].bool()
    return [_layer_error(i, mlp, caught[i], mask, bits, group) for i, mlp in enumerate(mlps)]


def _layer_error(i: int, mlp, got: dict, mask: torch.Tensor, bits: int, group: int) -> LayerError:
    g, u = got["gate"].detach().double(), got["up"].detach().double()
    dh = got["h"].grad.double()  # the gradient at act(gate) * up
    s = torch.sigmoid(g)
    d1 = s * (1 + g * (1 - s))
    d2 = s * (1 - s) * (2 + g * (1 - 2 * s))
    var_g, var_u = _variance(g, mask, bits, group), _variance(u, mask, bits, group)
    wg, wu = mlp.gate_proj.weight.detach().double(), mlp.up_proj.weight.detach().double()
    ng, nu, cross = (wg * wg).sum(1), (wu * wu).sum(1), (wg * wu).sum(1)
    # noise in dx from gate's eps: dh * (up * act'' * Wg[c] + act' * Wu[c]); from up's: dh * act' * Wg[c]
    a = u * d2
    e = dh ** 2 * (var_g * (a * a * ng + d1 * d1 * nu + 2 * a * d1 * cross) + var_u * d1 * d1 * ng)
    dx = got["gate"].grad.double() @ wg + got["up"].grad.double() @ wu
    total = e.sum()
    per_token, per_channel = e.sum(-1), e.sum((0, 1))
    t = int(per_token.flatten().argmax())
    c = int(per_channel.argmax())
    share = (lambda x: float(x / total) if total > 0 else 0.0)
    peaks = torch.maximum(g.abs(), u.abs())[mask].amax(0)  # per channel, over the real tokens
    return LayerError(i, float(total.sqrt() / dx.norm()), divmod(t, per_token.shape[1]),
                      share(per_token.flatten()[t]), c, share(per_channel[c]), float(peaks[c]), float(peaks.median()))
