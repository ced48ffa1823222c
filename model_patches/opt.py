"""OPT: pre-LN decoder, ReLU MLP. Its hidden dropout is functional (``F.dropout``): the root
patch routes every ``F.dropout`` of a training forward to bit-packed masks, so those masks are
stored as bits like ``nn.Dropout``'s (``hf_division.patching.primitives.patch_root``)."""
from hf_division.registry import TrainingCache, register

from .common import DECODER_DEFAULTS, encoder_patcher

apply_division_to_opt = register("opt", defaults=DECODER_DEFAULTS, training_cache=TrainingCache.DECODER)(encoder_patcher())
