"""Whisper: encoder-decoder with LayerNorm, GELU MLP and attention through the attention
interface, behind a convolutional front (two ``Conv1d`` over the mel frames, each followed by a
functional GELU).

The front runs inline in the encoder's forward, outside any module the shared wiring patches, and
its four saved tensors (each conv output and GELU output, at up to twice the encoder's token
count) weigh as much as two encoder layers. The encoder's forward therefore keeps what autograd
saves compressed (:func:`~hf_division.patching.primitives.patch_saved`); its layers keep their own ops. The
first conv's input is the caller's ``input_features`` and stays as it is.

Its conditional-generation head builds a KV cache in a training forward, labels given or not: an
``EncoderDecoderCache`` whose cross-attention half holds every layer's keys and values over all
the audio frames (:class:`~hf_division.registry.TrainingCache`).
"""
import functools

from transformers.models.whisper.modeling_whisper import WhisperEncoder

from hf_division.patching.primitives import patch_saved
from hf_division.registry import TrainingCache, register

from .common import encoder_patcher, with_patches


apply_division_to_whisper = register("whisper", training_cache=TrainingCache.ENCODER_DECODER)(
    with_patches(encoder_patcher(), (WhisperEncoder, functools.partial(patch_saved, kind="activation")))
)
