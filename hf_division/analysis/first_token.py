"""How much of a decoder's backward passes through each row's first token: per layer, the gradient
norm at that token over the median real token's, at the outputs of ``k_proj``, ``v_proj`` and the
``input_layernorm``.

Every later query attends to the first token (the "attention sink", Xiao et al., "Efficient
Streaming Language Models with Attention Sinks", 2023), so its key and value gather the gradient of
all of them, and an error in what that token's k/v and norm-input codes rebuild is multiplied by
that gradient: what ``exact_tokens=1`` would keep exact (docs/DESIGN.md, "Policy", "Short padded
texts"). One exact forward and backward of the unpatched model.
"""
from __future__ import annotations

import dataclasses

import torch

from hf_division.analysis.fidelity import hooked_backward

#: module name endings whose output gradient is read, in the order of :class:`FirstToken`'s fields
POINTS = ("self_attn.k_proj", "self_attn.v_proj", "input_layernorm")


@dataclasses.dataclass
class FirstToken:
    layer: int
    k: float  #: |dk| at the first token over the median real token's (the first excluded)
    v: float
    norm: float  #: the same at the input_layernorm's output (q, k and v's input)


def first_token_gradient(model: torch.nn.Module, batch: dict) -> list[FirstToken]:
    """One :class:`FirstToken` per decoder layer (``model.layers.<i>``) for ``batch`` (with
    ``labels``; right padding, whose positions ``attention_mask`` marks, left out of the median)."""
    grads: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        parts = name.split(".layers.")
        if len(parts) != 2:
            continue
        index, _, rest = parts[1].partition(".")
        if index.isdigit() and rest in POINTS:
            def keep(mod, grad_in, grad_out, key=(int(index), rest)):
                grads[key] = grad_out[0].detach().float().norm(dim=-1)
            hooks.append(module.register_full_backward_hook(keep))
    hooked_backward(model, batch, hooks)
    mask = batch.get("attention_mask")
    mask = torch.ones(batch["input_ids"].shape, dtype=torch.bool) if mask is None else mask.bool()
    rest = mask[:, 1:]

    def ratio(g: torch.Tensor) -> float:
        return float(g[:, 0].median() / g[:, 1:][rest].median())

    layers = sorted({i for i, _ in grads})
    return [FirstToken(i, *(ratio(grads[(i, p)]) for p in POINTS)) for i in layers]
