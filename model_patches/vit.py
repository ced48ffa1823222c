"""ViT: patch tokens (plus [CLS]) are the token axis; pre-LN encoder, GELU MLP, attention through
the attention interface; image-classification and masked-image-modeling heads.

Nothing but the shared encoder wiring is needed. Two things were measured to matter:

* The residual stream holds rows of very different scale: [CLS] (a learned parameter) and, under
  masked image modeling, the mask-token rows are several times smaller than the patch rows (5x in
  the tiny conformance model). Compressed on the patches' ranges they lost most of their value
  (gradient cosine 0.906 for image classification, 0.958 for masked image modeling). The norm
  inputs are therefore compressed per-token normalized (``DivisionConfig.norm_row_scale``,
  hf_division/store.py), which brings both to >= 0.99 (docs/ARCHITECTURES.md).
* The patch projection (``Conv2d``) keeps its input, the caller's ``pixel_values``, uncompressed:
  the caller holds that tensor through the step anyway, so a compressed copy would add memory.
"""
from .common import encoder_patcher

apply_division_to_vit = encoder_patcher()
