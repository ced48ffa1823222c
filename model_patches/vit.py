"""ViT: patch tokens are the token axis; pre-LN encoder, GELU MLP, attention through the attention
interface, image-classification (and masked-image-modeling) heads.

What differs from BERT: the [CLS] token is not a patch. In the residual stream (the LayerNorm
inputs, which nothing normalizes before the first layer) its row is a learned parameter, several
times smaller than the patch rows (5x in the tiny conformance model); compressed in the same
quantization groups and LFC blocks as the patches it lost ~60% of its normalized value, and the
classification gradient flows through it alone (gradient cosine 0.906 -> 0.995, docs/ARCHITECTURES.md).
So each LayerNorm input keeps its [CLS] row exact (``B x C``, 1/145 of the tensor in the tiny model)
and the LFC/HFC run over the patch rows only. After a LayerNorm every row has the same scale, so
q/k/v and the MLP inputs are compressed as they are.

The patch projection (``Conv2d``) keeps its input, the caller's ``pixel_values``, uncompressed: the
caller holds that tensor through the step anyway, so a compressed copy would add memory.
"""
import torch
from torch import nn

from hf_division import store
from hf_division.functions import RecomputeFn
from hf_division.patching import _training, _wrap

from .common import encoder_patcher


def _keep_cls_exact(x: torch.Tensor, config) -> None:
    """Register ``x`` ``(B, 1 + patches, C)`` as its [CLS] row kept exact + the patch rows
    compressed, so that the norm's own ``store.keep(x)`` reuses this entry."""
    if x.dim() != 3 or x.shape[1] < 2 or store.lookup(x) is not None:
        return
    patches = store.keep(x[:, 1:], "norm", config)
    cls = x[:, :1].detach().clone()
    store.derive(x, (patches,), lambda p: torch.cat([cls.to(p.dtype), p], dim=1), extra=[cls])
    patches.done()  # the recipe holds its own use


def _patch_norm(state, norm: nn.LayerNorm) -> None:
    """LayerNorm: input kept ([CLS] exact, patches compressed), output recomputed in backward."""
    config = state.config
    params = tuple(norm.parameters(recurse=False))

    def make(orig):
        def forward(self, x):
            if _training(self) and config.bits("norm") and (x.requires_grad or any(p.requires_grad for p in params)):
                _keep_cls_exact(x, config)
                return RecomputeFn.apply(orig, config, "norm", False, x, *params)
            return orig(x)

        return forward

    _wrap(state, norm, make)


def apply_division_to_vit(model, state):
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            _patch_norm(state, module)
    encoder_patcher()(model, state)  # the norms are already ours: it patches the rest
