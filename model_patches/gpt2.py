"""GPT-2: projections are ``Conv1D`` (weight stored in x out), GELU-new MLP."""
from transformers.pytorch_utils import Conv1D

from hf_division.registry import TrainingCache, register

from .common import DECODER_DEFAULTS, encoder_patcher

apply_division_to_gpt2 = register("gpt2", defaults=DECODER_DEFAULTS, training_cache=TrainingCache.DECODER)(encoder_patcher(conv1d_types=(Conv1D,)))
