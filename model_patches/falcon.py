"""Falcon (RW-1B/7B, 7B/40B/180B, Falcon2-11B): fused ``query_key_value`` projection, rotary or
ALiBi positions, multi-query or grouped (``new_decoder_architecture``) keys and values, LayerNorm,
GELU MLP (``FalconLinear`` -> activation -> ``FalconLinear``).

Since Transformers 5.25 ``FalconAttention`` calls the attention interface, and an ALiBi model gets
its position bias inside the attention mask (``FalconModel.forward`` adds ``alibi / sqrt(head_dim)``
under the causal mask): Falcon then takes the shared wiring, and ``store.keep_mask`` holds that
mask as bits plus the per-key bias (docs/DESIGN.md, "Attention masks as bits"). Before 5.25 the
attention was computed inline with ``alibi`` passed as an argument: :mod:`.falcon_inline`.
"""
import inspect

from transformers.models.falcon.modeling_falcon import FalconAttention

from hf_division.registry import TrainingCache, register

from .common import DECODER_DEFAULTS, encoder_patcher
from .falcon_inline import apply_inline

#: True where this Transformers computes Falcon's attention inline (before 5.25): the config is then
#: not switched to ``division_<impl>``
INLINE = "alibi" in inspect.signature(FalconAttention.forward).parameters

apply_division_to_falcon = register("falcon", defaults=DECODER_DEFAULTS, training_cache=TrainingCache.DECODER)(apply_inline if INLINE else encoder_patcher())
