"""CLIP and SigLIP: a text tower (tokens) and a vision tower (patch tokens, plus [CLS] in CLIP),
pre-LN encoders with a GELU-family MLP and attention through the attention interface.

As for ViT (model_patches/vit.py), the patch projection (``Conv2d``) keeps its input, the caller's
``pixel_values``. SigLIP's pooling head is ``nn.MultiheadAttention`` over one probe token, which
saves little (one query row) and is left as it is.
"""
from hf_division.registry import register

from .common import encoder_patcher

apply_division_to_clip = register("clip", "siglip")(encoder_patcher())
