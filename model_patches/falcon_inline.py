"""Falcon under Transformers before 5.25 (model_patches/falcon.py picks it). There
``FalconAttention.forward`` takes ``alibi`` as an argument, computes its attention inline instead
of calling Transformers' attention interface, and picks its sdpa branch by
``config._attn_implementation == "sdpa"``: the config is therefore *not* switched to
``division_<impl>`` (the original forward would then take its eager branch and differ). Each
``FalconAttention`` gets an instance forward instead: in training it runs the projection, head split
and rotary embedding as the original does, and the attention core (sdpa or eager, rotary or ALiBi)
through ``AttentionFn``, which keeps q, k, v compressed and recomputes the core in backward, so no
``T x T`` map is held. Evaluation, no-grad, ``output_attentions`` and a cache that already holds
tokens (decoding) run the original forward.

Grouped keys/values (``new_decoder_architecture``): the original broadcasts each key/value head
to its query heads before the attention; we keep the ``num_kv_heads`` heads and broadcast inside
the core (recomputed in backward), so k and v cost ``num_kv_heads / num_heads`` of what they would.
The mask the core reads (ALiBi's is ``(b, heads, t, t)`` float) is held as bits (``_HeldMask``).
The MLP, norms and all projections are the shared ``patch_modules`` wiring (``FalconLinear`` is an
``nn.Linear``).
"""
import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.falcon.modeling_falcon import FalconAttention, apply_rotary_pos_emb

from hf_division.autograd.accounting import account_tensors
from hf_division.autograd.ops import AttentionFn
from hf_division.patching.primitives import patch_modules
from hf_division.patching.wrappers import config_for, in_training, wrap_forward
from hf_division.quant.packing import pack_mask, unpack_mask

from .common import ACTIVATIONS


def _heads(attn: FalconAttention, fused_qkv: torch.Tensor):
    """``(q, k, v)`` as ``(batch, heads, tokens, head_dim)``, made by the original's own ops (same
    values and strides), except that grouped keys/values keep their ``num_kv_heads`` heads."""
    if attn.new_decoder_architecture:
        b, t, _ = fused_qkv.shape
        qkv = fused_qkv.view(b, t, -1, attn.num_heads // attn.num_kv_heads + 2, attn.head_dim)
        q = qkv[:, :, :, :-2].flatten(2, 3)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        kv_heads = k.shape[2]
    else:
        q, k, v = attn._split_heads(fused_qkv)
        kv_heads = attn.num_kv_heads
    b, t = q.shape[:2]
    return (q.transpose(1, 2).reshape(b, attn.num_heads, t, attn.head_dim),
            k.transpose(1, 2).reshape(b, kv_heads, t, attn.head_dim),
            v.transpose(1, 2).reshape(b, kv_heads, t, attn.head_dim))


def _broadcaster(attn: FalconAttention, cached: bool):
    """For grouped keys/values: ``(b, kv_heads, t, d) -> (b, heads, t, d)``, query head ``i`` using
    kv head ``i // group`` as the original's broadcast does. The layout matters for bit-identity
    (a matmul's kernel depends on strides): the original's keys are token-major (``(b, t, heads, d)``
    in memory, views of its flattened split) or, after a cache update, contiguous (``torch.cat``)."""
    if not attn.new_decoder_architecture:
        return None
    group = attn.num_heads // attn.num_kv_heads

    def expand(x):
        b, kv, t, d = x.shape
        if cached:
            return x.unsqueeze(2).expand(b, kv, group, t, d).reshape(b, kv * group, t, d)
        x = x.transpose(1, 2).unsqueeze(3).expand(b, t, kv, group, d)
        return x.reshape(b, t, kv * group, d).transpose(1, 2)

    return expand


class _HeldMask:
    """The attention mask as the recomputation in backward gets it.

    FalconModel's masks are "blocked -> dtype min" over a base: 0 (eager), ``alibi / sqrt(head_dim)``
    (ALiBi: a float ``(b, heads, t, t)`` mask, as large as a layer's attention probabilities), or a
    bool mask (sdpa, True = attend). Held whole, the ALiBi mask would outweigh every compressed q,
    k, v; it is held as 1 bit per ``(b, 1, t, t)`` position plus the small ALiBi tensor, and rebuilt
    by the ops FalconModel builds it with (so the same values). A mask of any other form (a custom
    4D mask) fails the check in forward and is held as it is.
    """

    def __init__(self, mask: torch.Tensor, alibi, head_dim: int):
        self.live = weakref.ref(mask)  # the forward (and a backward while it is alive) reads it directly
        self.alibi, self.head_dim, self.dtype = alibi, head_dim, mask.dtype
        self.mask = self.bits = None
        if mask.dim() == 4:
            blocked = (~mask if mask.dtype == torch.bool else mask == torch.finfo(mask.dtype).min)[:, :1]
            self.bits, self.shape = pack_mask(blocked), blocked.shape
            if torch.equal(self._rebuild(blocked), mask):
                return
        self.mask, self.bits = mask, None

    def _rebuild(self, blocked: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.bool:
            return ~blocked
        if self.alibi is None:
            base = torch.zeros((), dtype=self.dtype, device=blocked.device)
        else:
            base = self.alibi / math.sqrt(self.head_dim)
        return torch.masked_fill(base, blocked, torch.finfo(self.dtype).min)

    def get(self) -> torch.Tensor:
        mask = self.live()
        if mask is not None:
            return mask
        return self.mask if self.bits is None else self._rebuild(unpack_mask(*self.bits, self.shape).bool())

    def tensors(self) -> list:
        """What it holds, for the byte accounting."""
        held = [self.mask] if self.bits is None else [self.bits[0]]
        return held + ([self.alibi] if self.alibi is not None else [])


#: id(mask) -> (weak reference to the mask, weak reference to its _HeldMask): every layer of a
#: forward gets the same mask, so it is checked and packed once and its bits held once
_HELD: dict = {}


def _held_mask(mask, alibi, head_dim: int):
    if mask is None:
        return None
    found = _HELD.get(id(mask))
    held = found[1]() if found is not None and found[0]() is mask else None
    if held is None or held.alibi is not alibi:
        held = _HeldMask(mask, alibi, head_dim)
        key = id(mask)
        _HELD[key] = (weakref.ref(mask, lambda _, key=key: _HELD.pop(key, None)), weakref.ref(held))
    return held


def _core(attn: FalconAttention, dtype, held: _HeldMask | None, alibi, expand):
    """``call(q, k, v) -> (b, t, heads * d)``: the attention core of ``FalconAttention.forward``
    (its four branches: sdpa or eager, rotary or ALiBi), up to the ``dense`` projection. What
    ``AttentionFn`` runs in forward and recomputes in backward."""
    sdpa = attn.config._attn_implementation == "sdpa"

    def call(q, k, v):
        if expand is not None:
            k, v = expand(k), expand(v)
        b, h, t, d = q.shape
        attention_mask = held.get() if held is not None else None
        is_causal = attn.is_causal and attention_mask is None and t > 1
        if sdpa:
            # the rotary branch has no attention dropout (as the original), the ALiBi one does
            p = attn.attention_dropout.p if alibi is not None and attn.training else 0.0
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=p, is_causal=is_causal)
        elif alibi is None:
            scores = q @ k.transpose(-1, -2)
            scores /= math.sqrt(attn.head_dim)
            o = F.softmax(scores + attention_mask, dim=-1, dtype=dtype) @ v
        else:
            scores = q @ k.transpose(-1, -2)
            if scores.dtype in (torch.float16, torch.bfloat16):
                scores = scores.to(torch.float32)  # as the original: ALiBi logits in float32
            logits = scores + alibi.view(b, h, 1, -1)
            logits *= attn.inv_norm_factor
            probs = attn.attention_dropout(F.softmax(logits + attention_mask, dim=-1, dtype=dtype))
            o = probs @ v
        # every branch of the original merges heads as (b, h, t, d) -> (b, t, h * d)
        return o.transpose(1, 2).reshape(b, t, h * d)

    return call


def _compressed_attention(attn, config, hidden_states, alibi, attention_mask, layer_past, position_embeddings):
    """The training forward of ``FalconAttention`` up to ``dense``, the core through ``AttentionFn``."""
    q, k, v = _heads(attn, attn.query_key_value(hidden_states))
    if alibi is None:
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    expand = _broadcaster(attn, cached=layer_past is not None)
    if layer_past is not None:
        # an empty cache (``use_cache`` defaults to True in training too) gets what the original
        # stores in it; the core reads the same values back
        if expand is None:
            k, v = layer_past.update(k, v, attn.layer_idx)
        else:
            layer_past.update(expand(k), expand(v), attn.layer_idx)
    held = _held_mask(attention_mask, alibi, attn.head_dim)
    call = _core(attn, hidden_states.dtype, held, alibi, expand)
    if not any(t.requires_grad for t in (q, k, v)):
        return call(q, k, v)
    # held by ``call`` for the recomputation: one of each per forward, shared by the layers
    account_tensors(held.tensors() if held is not None else [a for a in (alibi,) if a is not None], "attention")
    # the core draws random numbers only for its attention dropout (both eager branches, and sdpa's
    # ALiBi one), which draws nothing at p = 0
    draws = attn.training and attn.attention_dropout.p > 0
    return AttentionFn.apply(q, k, v, call, config, draws)


def _patch_attention(state, attn: FalconAttention) -> None:
    config = config_for(state, attn)

    def make(orig):
        def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
                    use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
            decoding = layer_past is not None and layer_past.get_seq_length(self.layer_idx) > 0
            if (output_attentions or decoding or not torch.is_grad_enabled()
                    or not (in_training(self) and config.bits("attention"))):
                return orig(hidden_states, alibi, attention_mask, position_ids=position_ids, layer_past=layer_past,
                            use_cache=use_cache, output_attentions=output_attentions,
                            position_embeddings=position_embeddings, **kwargs)
            out = _compressed_attention(self, config, hidden_states, alibi, attention_mask, layer_past,
                                        position_embeddings)
            # the original returns the eager probabilities too; only ``output_attentions`` reads them
            return self.dense(out), None

        return forward

    wrap_forward(state, attn, make)


def apply_inline(model, state):
    """The patcher for a Falcon whose ``FalconAttention.forward`` takes ``alibi`` (Transformers < 5.25)."""
    for module in model.modules():
        # exactly FalconAttention: FalconFlashAttention2 (a subclass) has its own forward, left as is
        if type(module) is FalconAttention:
            _patch_attention(state, module)
    patch_modules(state, model, norm_types=(nn.LayerNorm,), activation_types=ACTIVATIONS)
