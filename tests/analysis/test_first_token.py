"""``analysis.first_token.first_token_gradient``: the first token's share of the backward, per layer."""
import torch

from hf_division.analysis.first_token import first_token_gradient


def test_ratios_are_the_gradient_norms_at_the_first_token_over_the_median_real_one(padded_llama):
    model, batch = padded_llama(21, 15)
    rows = first_token_gradient(model, batch)
    assert [r.layer for r in rows] == [0, 1]
    # the same figures from the outputs themselves, their gradients taken by autograd.grad
    outs = {}
    layer = model.model.layers[1]
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, a, o: outs.__setitem__("v", o)),
             layer.input_layernorm.register_forward_hook(lambda m, a, o: outs.__setitem__("norm", o))]
    loss = model(**batch).loss
    for h in hooks:
        h.remove()
    dv, dn = torch.autograd.grad(loss, [outs["v"], outs["norm"]])
    for got, g in ((rows[1].v, dv), (rows[1].norm, dn)):
        n = g.norm(dim=-1)
        want = n[:, 0].median() / n[:, 1:][batch["attention_mask"][:, 1:].bool()].median()
        assert abs(got - float(want)) < 1e-6 * float(want)  # float32 norms
    assert all(r.k > 0 and r.v > 0 and r.norm > 0 for r in rows)
