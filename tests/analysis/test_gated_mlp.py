"""``analysis.gated_mlp.gate_up_error``: the expected error of low-bit gate/up inputs, against the
error of actually rounding them stochastically, draw by draw."""
import pytest
import torch
import torch.nn.functional as F

from hf_division.analysis.gated_mlp import gate_up_error


def rounded(t, mask, bits, group, gen):
    """``t`` (B, T, C) stochastically rounded to ``bits`` in groups of ``group`` real tokens of a channel."""
    B, T, C = t.shape
    pad = (-T) % group
    keep = F.pad(mask, (0, pad), value=False).reshape(B, -1, group, 1)
    tt = F.pad(t, (0, 0, 0, pad)).reshape(B, -1, group, C)
    lo = tt.masked_fill(~keep, torch.inf).amin(2, keepdim=True).nan_to_num(0.0, posinf=0.0)
    hi = tt.masked_fill(~keep, -torch.inf).amax(2, keepdim=True).nan_to_num(0.0, neginf=0.0)
    step = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-30)
    q = lo + step * torch.floor((tt - lo) / step + torch.rand(tt.shape, generator=gen, dtype=tt.dtype))
    return torch.where(keep, q, tt).reshape(B, -1, C)[:, :T]


def test_expected_error_matches_stochastic_rounding(padded_llama):
    model, batch = padded_llama(45, 30)  # right padding: left out of the ranges
    mlp = model.model.layers[1].mlp
    got = {}

    def output_grad(module, args):  # the gradient at the down projection's input: dh
        args[0].register_hook(lambda grad: got.__setitem__("dh", grad))

    hooks = [mlp.gate_proj.register_forward_hook(lambda m, a, o: got.__setitem__("g", o.detach())),
             mlp.up_proj.register_forward_hook(lambda m, a, o: got.__setitem__("u", o.detach())),
             mlp.down_proj.register_forward_pre_hook(output_grad)]
    rows = gate_up_error(model, batch, bits=2, group=8)
    for h in hooks:
        h.remove()
    assert [r.layer for r in rows] == [0, 1]
    g, u, dh = got["g"], got["u"], got["dh"]
    wg, wu = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()

    def dx(g, u):  # the MLP's input gradient from the held gate and up, as its backward computes it
        s = torch.sigmoid(g)
        return (dh * u * s * (1 + g * (1 - s))) @ wg + (dh * g * s) @ wu

    exact = dx(g, u)
    mask = batch["attention_mask"].bool()
    gen = torch.Generator().manual_seed(0)
    sq = [(dx(rounded(g, mask, 2, 8, gen), rounded(u, mask, 2, 8, gen)) - exact).pow(2).sum() for _ in range(400)]
    measured = (torch.stack(sq).mean().sqrt() / exact.norm()).item()
    assert rows[1].relative == pytest.approx(measured, rel=0.05), (rows[1].relative, measured)
    assert 0 < rows[1].token_share <= 1 and 0 < rows[1].channel_share <= 1


def test_declines_a_model_without_gated_mlp():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    ids = torch.randint(0, 50, (1, 8))
    with pytest.raises(ValueError, match="no gated MLP"):
        gate_up_error(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
