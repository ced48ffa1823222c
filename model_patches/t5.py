"""T5: encoder-decoder, RMS-style ``T5LayerNorm``, ReLU (``T5DenseActDense``) or gated-GELU
(``T5DenseGatedActDense``) feed-forward, relative position bias, cross-attention.

Attention goes through Transformers' attention interface (eager and sdpa), with the position bias
as a keyword tensor: ``AttentionFn`` takes it as an extra differentiated input, so the bias
embedding still gets its gradient. The bias is ``(1, heads, T, T)``, computed once per stack and
shared by its layers, so it is kept as it is (one copy per stack). Cross-attention keys/values are
the encoder output, kept compressed once and shared by every decoder layer's k and v projections.
The gated feed-forward differs from Llama's only in names and in a dropout between the product and
``wo``, so it gets its own small wrapper around the shared ``gated_product``.
"""
import torch
from transformers.models.t5.modeling_t5 import T5DenseGatedActDense, T5LayerNorm

from hf_division.patching.primitives import config_for, gated_product, in_training, unpatched_forward, wrap_forward
from hf_division.registry import register

from .common import DECODER_DEFAULTS, encoder_patcher, with_patches


def _patch_gated_ff(state, ff: T5DenseGatedActDense) -> None:
    """``wo(dropout(act(wi_0(x)) * wi_1(x)))``: gate and up kept compressed once, product derived."""
    config = config_for(state, ff)
    act_forward = unpatched_forward(ff.act)  # recomputed in backward

    def make(orig):
        def forward(self, x):
            if not (in_training(self) and config.bits("activation")):
                return orig(x)
            h = self.dropout(gated_product(act_forward, False, config, self.wi_0(x), self.wi_1(x)))
            if h.dtype != self.wo.weight.dtype and self.wo.weight.dtype != torch.int8:
                h = h.to(self.wo.weight.dtype)  # T5 keeps ``wo`` in float32 (as the original forward)
            return self.wo(h)

        return forward

    wrap_forward(state, ff, make)


apply_division_to_t5 = register("t5", defaults=DECODER_DEFAULTS)(
    with_patches(encoder_patcher(norm_types=(T5LayerNorm,)), (T5DenseGatedActDense, _patch_gated_ff))
)
