"""ViT: patch tokens (plus [CLS]) are the token axis; pre-LN encoder, GELU MLP, attention through
the attention interface; image-classification and masked-image-modeling heads.

Nothing but the shared encoder wiring is needed. Two things were measured to matter:

* The residual stream holds rows of very different scale: [CLS] (a learned parameter) and, under
  masked image modeling, the mask-token rows are several times smaller than the patch rows.
  Compressed on the patches' ranges they lost most of their value
  (docs/ARCHITECTURES.md, "ViT"). The norm inputs are therefore compressed per-token normalized
  (``DivisionConfig.norm_row_scale``, hf_division/autograd/store.py).
* The patch projection (``Conv2d``) keeps its input, the caller's ``pixel_values``, uncompressed:
  the caller holds that tensor through the step anyway, so a compressed copy would add memory.
"""
from hf_division.registry import register

from .common import encoder_patcher

#: [CLS] kept exact in every saved tensor: the classification gradient flows through that one row
#: per image, so its quantization error is not averaged over tokens (docs/ARCHITECTURES.md, "ViT").
VIT_DEFAULTS = {"exact_tokens": 1}

apply_division_to_vit = register("vit", defaults=VIT_DEFAULTS)(encoder_patcher())
