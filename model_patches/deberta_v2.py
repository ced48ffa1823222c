"""DeBERTa-v2 / DeBERTa-v3 (model_type "deberta-v2"): post-LN encoder, GELU MLP, disentangled
attention with relative positions.

Linear, LayerNorm and activation inputs take the shared encoder wiring. The attention
(``DisentangledSelfAttention``) does not go through Transformers' attention interface: it builds
its ``T x T`` scores from content (q.k) and, with ``relative_attention``, content-to-position
(c2p: q against the projected relative embeddings) and position-to-content (p2c: k against them)
terms, gathered by relative distance. Unpatched it keeps q, k, v, the repeated position
projections, the gather indices, the softmax output, its dropout mask and the dropped
probabilities. Here it runs through :class:`~hf_division.autograd.ops.AttentionFn`: q, k, v kept
compressed, the dropout mask as bits, the scores recomputed in backward. The position
projections (``(heads, 2 * span, head_dim)``, independent of batch and sequence length) are the
differentiated ``extra`` inputs, kept as they are and once per layer, not repeated per sequence;
their own projection keeps the (dropped) relative embeddings through the patched Linear.

The core below repeats the arithmetic of Transformers' forward op for op (same kernels, same
order, same dropout draw), so the training output is bit-identical; eval, no-grad and
``output_attentions`` call the original forward.
"""
import weakref

import torch
from torch import nn
from transformers.models.deberta_v2.modeling_deberta_v2 import (DisentangledSelfAttention, build_relative_position,
                                                                build_rpos, scaled_size_sqrt)

from hf_division.autograd.accounting import account_tensors
from hf_division.autograd.ops import AttentionFn
from hf_division.patching.wrappers import config_for, in_training, wrap_forward
from hf_division.registry import register

from .common import ENCODER_DEFAULTS, encoder_patcher, with_patches

#: id(mask) -> (weak reference to the mask, its version, its boolean form): every layer gets the
#: same attention mask tensor from the encoder, so its boolean form is made and held once per step
#: instead of once per layer (the original holds one per layer for ``masked_fill``'s backward)
_bool_masks: dict = {}


def _shared_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask.bool()``, the same tensor for every layer that is passed the same live mask."""
    if mask.dtype == torch.bool:
        return mask
    key = id(mask)
    found = _bool_masks.get(key)
    if found is not None and found[0]() is mask and found[1] == mask._version:
        return found[2]

    def drop(ref, key=key):  # the mask died: forget its boolean form
        if _bool_masks.get(key, (None,))[0] is ref:
            del _bool_masks[key]

    out = mask.bool()
    _bool_masks[key] = (weakref.ref(mask, drop), mask._version, out)
    return out


def _position_inputs(self, query, key, relative_pos, rel_embeddings):
    """``(relative_pos as 4-D long, position projections)``: what the original's
    ``disentangled_attention_bias`` prepares, minus the per-sequence ``repeat`` (done inside the
    recomputed core so that only one copy per head is kept). Projections in c2p, p2c order."""
    if relative_pos is None:
        relative_pos = build_relative_position(query, key, bucket_size=self.position_buckets,
                                               max_position=self.max_relative_positions)
    if relative_pos.dim() == 2:
        relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)
    elif relative_pos.dim() == 3:
        relative_pos = relative_pos.unsqueeze(1)
    elif relative_pos.dim() != 4:
        raise ValueError(f"Relative position ids must be of dim 2 or 3 or 4. {relative_pos.dim()}")
    relative_pos = relative_pos.to(device=query.device, dtype=torch.long)
    rel = rel_embeddings[0 : self.pos_ebd_size * 2, :].unsqueeze(0)
    # the projections the original makes, in its order: with shared keys both, the query's first,
    # whichever terms are used (an adapter's dropout inside a projection draws: PEFT's LoRA)
    if self.share_att_key:
        made = {"p2c": self.query_proj(rel), "c2p": self.key_proj(rel)}
    else:
        made = {}
        if "c2p" in self.pos_att_type:
            made["c2p"] = self.pos_key_proj(rel)
        if "p2c" in self.pos_att_type:
            made["p2c"] = self.pos_query_proj(rel)
    pos = [self.transpose_for_scores(made[term], self.num_attention_heads) for term in ("c2p", "p2c")
           if term in self.pos_att_type]
    return relative_pos, tuple(pos)


def _disentangled_bias(self, query, key, relative_pos, pos, scale_factor):
    """The c2p + p2c score terms, as ``DisentangledSelfAttention.disentangled_attention_bias``
    computes them from its repeated projections (``pos``: one per head, repeated here)."""
    span, repeat = self.pos_ebd_size, query.size(0) // self.num_attention_heads
    pos = iter(pos)
    score = 0  # as the original: a term is added to 0 even when it is the only one
    if "c2p" in self.pos_att_type:
        pos_key = next(pos).repeat(repeat, 1, 1)
        scale = scaled_size_sqrt(pos_key, scale_factor)
        c2p = torch.bmm(query, pos_key.transpose(-1, -2))
        c2p_pos = torch.clamp(relative_pos + span, 0, span * 2 - 1)
        index = c2p_pos.squeeze(0).expand([query.size(0), query.size(1), relative_pos.size(-1)])
        score += torch.gather(c2p, dim=-1, index=index) / scale.to(dtype=c2p.dtype)
    if "p2c" in self.pos_att_type:
        pos_query = next(pos).repeat(repeat, 1, 1)
        scale = scaled_size_sqrt(pos_query, scale_factor)
        # argument order as the original passes it (only used when key and query lengths differ)
        r_pos = build_rpos(query, key, relative_pos, self.max_relative_positions, self.position_buckets)
        p2c_pos = torch.clamp(-r_pos + span, 0, span * 2 - 1)
        p2c = torch.bmm(key, pos_query.transpose(-1, -2))
        index = p2c_pos.squeeze(0).expand([query.size(0), key.size(-2), key.size(-2)])
        p2c = torch.gather(p2c, dim=-1, index=index).transpose(-1, -2)
        score += p2c / scale.to(dtype=p2c.dtype)
    return score


def _core(self, mask, relative_pos, scale_factor):
    """``call(q, k, v, *pos) -> context`` ``(batch * heads, T, head_dim)``: scores, mask, softmax,
    dropout and the product with v; what AttentionFn runs in forward and recomputes in backward."""

    def call(query, key, value, *pos):
        scale = scaled_size_sqrt(query, scale_factor)
        scores = torch.bmm(query, key.transpose(-1, -2) / scale.to(dtype=query.dtype))
        if self.relative_attention:
            scores = scores + _disentangled_bias(self, query, key, relative_pos, pos, scale_factor)
        scores = scores.view(-1, self.num_attention_heads, scores.size(-2), scores.size(-1))
        scores = scores.masked_fill(~mask, torch.finfo(query.dtype).min)
        probs = self.dropout(nn.functional.softmax(scores, dim=-1))
        return torch.bmm(probs.view(-1, probs.size(-2), probs.size(-1)), value)

    return call


def _patch_attention(state, attn: DisentangledSelfAttention) -> None:
    config = config_for(state, attn)

    def make(orig):
        def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
                    relative_pos=None, rel_embeddings=None):
            if output_attentions or not (in_training(self) and config.bits("attention")):
                return orig(hidden_states, attention_mask, output_attentions, query_states=query_states,
                            relative_pos=relative_pos, rel_embeddings=rel_embeddings)
            heads = self.num_attention_heads
            source = hidden_states if query_states is None else query_states
            query = self.transpose_for_scores(self.query_proj(source), heads)
            key = self.transpose_for_scores(self.key_proj(hidden_states), heads)
            value = self.transpose_for_scores(self.value_proj(hidden_states), heads)
            scale_factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
            pos = ()
            if self.relative_attention:  # the position dropout draws here, before the attention's
                relative_pos, pos = _position_inputs(self, query, key, relative_pos, self.pos_dropout(rel_embeddings))
            mask = _shared_bool_mask(attention_mask)
            call = _core(self, mask, relative_pos, scale_factor)
            if any(t.requires_grad for t in (query, key, value, *pos)):
                # held by ``call`` for the recomputation: shared by the layers (counted once)
                account_tensors([mask] + ([relative_pos] if pos else []), "attention")
                context = AttentionFn.apply(query, key, value, call, config, True, *pos)
            else:
                context = call(query, key, value, *pos)
            context = context.view(-1, heads, context.size(-2), context.size(-1)).permute(0, 2, 1, 3).contiguous()
            return context.view(context.size()[:-2] + (-1,)), None

        return forward

    wrap_forward(state, attn, make)


apply_division_to_deberta_v2 = register("deberta-v2", defaults=ENCODER_DEFAULTS)(
    with_patches(encoder_patcher(), (DisentangledSelfAttention, _patch_attention))
)
