"""A KV cache that holds nothing, for a training forward with division.

Why: Transformers' decoders build a ``DynamicCache`` in every forward where ``config.use_cache``
is on and checkpointing is off, training included (an encoder-decoder's decoder an
``EncoderDecoderCache`` of two, the cross-attention's keys and values over every encoder token in
the second, where its head leaves ``use_cache`` on). In the unpatched model
the cache's keys and values are the tensors autograd keeps for the attention's backward, so the
cache costs nothing more; with division autograd keeps compressed copies, and the cache held
every layer's keys and values whole beside them until the output was dropped (docs/DESIGN.md,
"The training KV cache").

:class:`UnheldCache` is a ``DynamicCache`` in all the forward sees: the same layers (sliding-window
ones included), the same masks (built from it while it is empty, as from a fresh cache) and the same
keys and values from ``update`` (each layer's own ``update`` runs on a copy of its empty layer). It
drops each layer's tensors when that ``update`` returns. Once the forward has returned it is
closed: continuing from it raises, where a cache emptied in silence would have the next forward
attend to none of the past. A family declares the kind its forward builds
(:class:`~hf_division.registry.TrainingCache`).
"""
from __future__ import annotations

import contextlib
import copy
import inspect

from torch import nn
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_division.registry import TrainingCache

#: the cache's parameter in a model's forward and field in its output: ``cache`` from Transformers
#: 5.24 on (which still takes ``past_key_values`` as a deprecated keyword), ``past_key_values`` in 5.23
CACHE_PARAMETERS = ("cache", "past_key_values")


def output_cache(out):
    """The KV cache a model's output carries, None for none."""
    return next((out[k] for k in CACHE_PARAMETERS if k in out), None)


class UnheldCache(DynamicCache):
    """A ``DynamicCache`` whose layers hold nothing after ``update`` returns (module doc)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.closed = False

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.check_open()
        layers = self.layers
        empty = layers[layer_idx] if layer_idx < len(layers) else None
        if empty is not None:
            layers[layer_idx] = copy.copy(empty)
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        finally:  # the layer is empty again: the keys and values live on in autograd's copies only
            layers[layer_idx] = empty if empty is not None else self.layer_class_to_replicate()

    def get_seq_length(self, *args, **kwargs) -> int:
        self.check_open()
        return super().get_seq_length(*args, **kwargs)

    def get_mask_sizes(self, *args, **kwargs):
        self.check_open()
        return super().get_mask_sizes(*args, **kwargs)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                "hf-division: this cache comes from a training forward with division, which keeps no keys or "
                "values in it (they would sit whole beside division's compressed copies; docs/DESIGN.md, "
                "'The training KV cache'). Pass use_cache=True to the forward for a cache that holds them.")


def close(cache) -> None:
    """Close the :class:`UnheldCache` ``cache`` is, or the two an ``EncoderDecoderCache`` pairs."""
    for part in _parts(cache):
        part.closed = True


def _parts(cache) -> tuple:
    pair = isinstance(cache, EncoderDecoderCache)
    return (cache.self_attention_cache, cache.cross_attention_cache) if pair else (cache,)


def _unheld(cache) -> bool:
    return cache is not None and all(isinstance(part, UnheldCache) for part in _parts(cache))


def _drop_where_turned_off(module, args, kwargs):
    """A decoder's forward pre-hook: where its head turned ``use_cache`` off (BART's heads and T5's
    classification heads do when given labels), the unheld cache is not passed on, so that the
    decoder builds and returns none, as the unpatched one does."""
    if kwargs.get("use_cache") is False:
        for name in CACHE_PARAMETERS:
            if _unheld(kwargs.get(name)):
                kwargs[name] = None
        return args, kwargs
    return None


class CacheSlot:
    """Where a model's forward takes its cache and ``use_cache``: which keyword names the cache,
    and how many positional arguments (``self`` aside) come before either; and the ``kind`` of
    cache its family builds (not :attr:`~hf_division.registry.TrainingCache.NONE`)."""

    def __init__(self, model: nn.Module, kind: TrainingCache):
        self.kind = kind
        self.decoder = None  # an encoder-decoder's decoder, whose head decides whether it builds a cache
        if kind is TrainingCache.ENCODER_DECODER:
            get = getattr(model, "get_decoder", None)
            decoder = get() if callable(get) else None
            self.decoder = decoder if isinstance(decoder, nn.Module) and decoder is not model else None
        # what the decoder's caches are built from: its config with its depth as ``num_hidden_layers``,
        # as Whisper's decoder builds them (a config's ``num_hidden_layers`` may name the encoder's
        # depth: Whisper's and BART's do)
        self.decoder_config = None
        if self.decoder is not None:
            config = self.decoder.config
            self.decoder_config = copy.copy(config)
            self.decoder_config.num_hidden_layers = getattr(config, "decoder_layers", config.num_hidden_layers)
        # the module whose flag Transformers reads to build no cache under checkpointing
        # (``merge_with_config_defaults`` on the forward that builds it): an encoder-decoder's
        # decoder; else the base model, or where that has none, the first module below it that
        # has one (OPT's ``OPTDecoder``)
        base = getattr(model, "base_model", model)
        self.checkpointing = self.decoder if self.decoder is not None else next(
            (m for m in base.modules() if hasattr(m, "gradient_checkpointing") and not isinstance(m, GradientCheckpointingLayer)),
            base)
        try:
            names = list(inspect.signature(type(model).forward).parameters)[1:]
        except (TypeError, ValueError):
            names = []
        found = [n for n in CACHE_PARAMETERS if n in names]
        self.name = found[0] if found and "use_cache" in names else None
        self.before = min(names.index(self.name), names.index("use_cache")) if self.name else 0

    def unheld(self, model: nn.Module, args: tuple, kwargs: dict):
        """The cache to pass ``model``'s training forward called with ``args``, ``kwargs``: one of
        the kind the unpatched forward would build itself (``config.use_cache`` on, checkpointing
        off), made of :class:`UnheldCache`, where the caller asked for no cache; None where the
        caller passed ``use_cache`` or a cache, or none is built."""
        if self.name is None or len(args) > self.before or kwargs.get("use_cache") is not None:
            return None
        if any(kwargs.get(n) is not None for n in CACHE_PARAMETERS):
            return None
        config = model.config
        # one attribute read a forward, where ``is_activation_checkpointing`` walks every module
        # (host time: DESIGN.md, "On a GPU")
        if not getattr(config, "use_cache", False) or getattr(self.checkpointing, "gradient_checkpointing", False):
            return None
        if self.kind is TrainingCache.ENCODER_DECODER:
            if self.decoder is None:  # an encoder alone (T5EncoderModel) builds none
                return None
            return EncoderDecoderCache(UnheldCache(self.decoder_config), UnheldCache(self.decoder_config))
        if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
            return None  # a decoder in an encoder-decoder model: its cache pairs a second for cross-attention
        return UnheldCache(config)

    @contextlib.contextmanager
    def passing(self, cache):
        """While the forward that ``cache`` (:meth:`unheld`'s) is passed to runs: an
        encoder-decoder's decoder drops it where its head turned ``use_cache`` off; closed after."""
        hook = None if self.decoder is None else self.decoder.register_forward_pre_hook(
            _drop_where_turned_off, with_kwargs=True)
        try:
            yield
        finally:
            close(cache)
            if hook is not None:
                hook.remove()
