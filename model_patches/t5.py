"""T5, mT5 and umT5: encoder-decoder, RMS-style ``T5LayerNorm``, ReLU (``T5DenseActDense``) or gated-GELU
(``T5DenseGatedActDense``) feed-forward, relative position bias, cross-attention.

Attention goes through Transformers' attention interface (eager and sdpa), with the position bias
as a keyword tensor: ``AttentionFn`` takes it as an extra differentiated input, so the bias
embedding still gets its gradient. The bias is ``(1, heads, T, T)``, computed once per stack and
shared by its layers, so it is kept as it is (one copy per stack). Cross-attention keys/values are
the encoder output, kept compressed once and shared by every decoder layer's k and v projections.
The gated feed-forward differs from Llama's only in names and in a dropout between the product and
``wo``, so it gets its own small wrapper around the shared ``gated_product``.

Checkpointed: the additive mask built from the bias needs a gradient, and sdpa picks its kernel by
that, so a layer's first forward runs under autograd as the unpatched one's does
(``CheckpointForward.AS_CHECKPOINTED``); and a layer holds the biases it is passed as they are
(``checkpoint_exact``): they carry the padding mask's ``finfo.min``, which an 8-bit group spanning
it and the bias would keep at the bias's cost, and each layer passes them on unchanged, so they
stay one tensor a stack.

mT5 (``model_type`` ``mt5``) is T5's modeling file copied under ``MT5`` names (the same attention,
block and stack forwards, Transformers' "Copied from" markers), so it takes T5's patcher and policy
with its own norm and feed-forward classes. umT5 (``umt5``) has the same layers but a position bias
in every self-attention (its own embedding), computed inside the attention from the layer's own
parameters and passed to the attention interface as a keyword tensor with the mask apart: each
layer's ``AttentionFn`` holds its bias as it is, and no bias crosses a checkpointed layer's inputs.
"""
from transformers.models.mt5.modeling_mt5 import MT5DenseGatedActDense, MT5LayerNorm
from transformers.models.t5.modeling_t5 import T5DenseGatedActDense, T5LayerNorm
from transformers.models.umt5.modeling_umt5 import UMT5DenseGatedActDense, UMT5LayerNorm

from hf_division.registry import CheckpointForward, TrainingCache, register

from .common import DECODER_DEFAULTS, encoder_patcher, patch_t5_gated_ff, with_patches


apply_division_to_t5 = register("t5", "mt5", "umt5", defaults=DECODER_DEFAULTS,
                               training_cache=TrainingCache.ENCODER_DECODER,
                               checkpoint_forward=CheckpointForward.AS_CHECKPOINTED,
                               checkpoint_exact=("position_bias", "encoder_decoder_position_bias"))(
    with_patches(encoder_patcher(norm_types=(T5LayerNorm, MT5LayerNorm, UMT5LayerNorm)),
                 ((T5DenseGatedActDense, MT5DenseGatedActDense, UMT5DenseGatedActDense), patch_t5_gated_ff))
)
