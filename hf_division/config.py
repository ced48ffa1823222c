"""`DivisionConfig`: what is compressed how. Defaults are the measured policy (docs/RESULTS.md, "Precision policy on MiniLM").

Names no model type: a family whose measured defaults differ registers them beside its patcher
(``model_patches``, :mod:`hf_division.registry`), and :meth:`DivisionConfig.resolved` reads them.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields

import torch

from hf_division.registry import family_defaults

#: Kinds of saved activations that get their own precision (docs/DESIGN.md, "Policy").
KINDS = ("linear", "attention", "activation", "norm")

#: Values of the family-dependent fields (those left at None) where the model family does not say
#: otherwise: HFC bits per kind measured on MiniLM (docs/RESULTS.md, "Precision policy on MiniLM"), outlier tokens kept exact.
DEFAULTS = {"linear_bits": 4, "attention_bits": 4, "activation_bits": 4, "norm_bits": 4, "outlier_ratio": 16.0}
DEFAULT_BITS = {kind: DEFAULTS[f"{kind}_bits"] for kind in KINDS}
#: Kinds whose HFC group and LFC block can differ from ``group_size`` / ``block_size``
#: (``<kind>_group_size``, ``<kind>_block_size``; docs/DESIGN.md, "Policy").
PER_KIND_LAYOUT = ("linear", "attention", "activation", "norm")
DEFAULTS.update({f"{kind}_{what}": None for kind in PER_KIND_LAYOUT for what in ("group_size", "block_size")})
DEFAULTS["early_layers"] = 0.0
DEFAULTS["late_layers"] = 0.0
DEFAULTS["block_size"] = 16
DEFAULTS["exact_tokens"] = 0
#: bits of the activation inputs in the model's first ``early_layers`` and last ``late_layers``
#: (docs/DESIGN.md, "Policy")
EDGE_ACTIVATION_BITS = 8



class Choice(str, enum.Enum):
    """A config field's allowed values: each member equals, hashes and prints as its string, so a
    config built from ``"actnn"`` or from ``Method.ACTNN`` is the same config, and
    ``HfArgumentParser`` offers the values as the argument's choices."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value, where: str):
        """``value`` (a member or its string) as a member; ValueError naming ``where`` and the choices."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{where} must be one of {choices}, got {value!r}") from None


class Method(Choice):
    """Which scheme compresses the saved activations (docs/DESIGN.md, "Policy")."""

    DIVISION = "division"  # LFC + HFC, every kind
    ACTNN = "actnn"  # ActNN's scope: Linear inputs at 2 bits in flat groups, no LFC; other kinds kept
    ACTNN_ALL = "actnn-all"  # every kind at 2 bits in flat groups (an ablation)


class Rounding(Choice):
    """How HFC values round to their codes."""

    STOCHASTIC = "stochastic"  # unbiased: up with probability equal to the fraction
    NEAREST = "nearest"  # no noise; biased


class LfcDtype(Choice):
    """The dtype the LFC (block means) is stored in."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.value)



def _field(default, help_text: str):
    """A config field whose help text reaches ``--help`` (``HfArgumentParser`` reads the metadata)."""
    return field(default=default, metadata={"help": help_text})


@dataclass
class DivisionConfig:
    """Precision policy for the activations a training forward keeps for backward.

    Every ``*_bits`` field is the HFC bit width for one kind of saved tensor: 1, 2, 4 or 8, 0 to
    keep that kind uncompressed, or None (default) for the measured default of the model's family
    (registered beside its patcher in ``model_patches``, else ``DEFAULTS``: 4; decoder LLMs keep
    attention inputs at 8 bits, and activation inputs at 8, or for gated-MLP decoders at 4 in
    groups of 32 tokens without an LFC). :func:`hf_division.apply_division` fills the Nones in
    for the model it patches (:meth:`resolved`); ``outlier_ratio`` and the per-kind group and
    block sizes likewise.

    * ``linear_bits``: inputs of ``nn.Linear`` layers (weight gradient only).
    * ``attention_bits``: query/key/value kept by the attention core; the ``T x T`` probability
      maps are never stored, they are recomputed from these in backward.
    * ``activation_bits``: inputs of activation functions (GELU, ...); their outputs, which feed
      the next linear layer, are recomputed from the same copy.
    * ``norm_bits``: inputs of LayerNorm/RMSNorm (the residual stream); their outputs, which feed
      the next layers, are recomputed from the same copy.

    ``module_bits`` overrides these per module (e.g. as assigned by
    :func:`hf_division.analysis.auto_precision.auto_precision`): a JSON object, a path to a JSON file, or
    (in Python) a dict, mapping a module name (as in ``model.named_modules()`` of the unwrapped
    ``PreTrainedModel``) to bits for every kind, or to ``{kind: bits}``. A name also covers the
    modules below it; the longest name that sets a kind wins. Overrides are taken as given for
    either method (ActNN's 2-bit cap applies only to the ``*_bits`` fields). A tensor shared by
    several modules is compressed once, at the bits of the first module that keeps it.
    """

    method: Method = _field(
        Method.DIVISION, '"division" (LFC + HFC); "actnn" (ActNN\'s scope: Linear inputs at 2 bits in flat groups, no LFC, '
                    'dropout masks as bits, every other kind kept); "actnn-all" (every kind at 2 bits, an ablation).')
    block_size: int | None = _field(
        None, "Tokens averaged into one LFC row (DIVISION's block; 1: no LFC); unset: family default "
              "(BERT-family encoders: 1), else 16.")
    lfc_dtype: LfcDtype = _field(LfcDtype.BFLOAT16, "dtype of the LFC: bfloat16, float16 or float32.")
    group_size: int = _field(256, "HFC elements sharing one min/scale pair (DIVISION: tokens of one channel); a multiple of 8.")
    rounding: Rounding = _field(Rounding.STOCHASTIC, '"stochastic" (unbiased) or "nearest" rounding of the HFC.')
    linear_bits: int | None = _field(None, "HFC bits for inputs of Linear layers (1, 2, 4, 8; 0: keep; unset: family default).")
    attention_bits: int | None = _field(None, "HFC bits for the q/k/v kept by attention (0: keep; unset: family default).")
    activation_bits: int | None = _field(None, "HFC bits for inputs of activation functions (0: keep; unset: family default).")
    norm_bits: int | None = _field(None, "HFC bits for inputs of LayerNorm/RMSNorm (0: keep; unset: family default).")
    linear_group_size: int | None = _field(
        None, "Tokens per min/scale group for the linear kind (a multiple of 8); unset: family default, else group_size.")
    attention_group_size: int | None = _field(
        None, "Tokens per min/scale group for the attention kind (a multiple of 8); unset: family default, else group_size.")
    activation_group_size: int | None = _field(
        None, "Tokens per min/scale group for the activation kind (a multiple of 8); unset: family default, else group_size.")
    norm_group_size: int | None = _field(
        None, "Tokens per min/scale group for the norm kind (a multiple of 8); unset: family default, else group_size.")
    linear_block_size: int | None = _field(
        None, "LFC block for the linear kind (1: no LFC); unset: family default, else block_size.")
    attention_block_size: int | None = _field(
        None, "LFC block for the attention kind (1: no LFC); unset: family default, else block_size.")
    activation_block_size: int | None = _field(
        None, "LFC block for the activation kind (1: no LFC); unset: family default, else block_size.")
    norm_block_size: int | None = _field(
        None, "LFC block for the norm kind (1: no LFC); unset: family default, else block_size.")
    min_numel: int = _field(4096, "Saved tensors with fewer elements are kept as they are.")
    narrow_linear: int = _field(
        32, "Linear inputs with at most this many channels (LoRA's rank-r intermediate, lora_B's input) are kept as "
            "they are: a few bytes per token, and lora_B's gradient sums them against the output gradient with heavy "
            "cancellation, so their quantization noise dominated it (docs/DESIGN.md, \"Policy\"); 0: compress them too.")
    norm_row_scale: bool = _field(True, "Norm inputs: divide each token by its RMS (kept exact) before compressing.")
    checkpoint_bits: int = _field(
        8, "HFC bits of a checkpointed layer's inputs (division with activation checkpointing): backward recomputes "
           "the whole layer from them, so their error reaches every tensor of the layer (docs/DESIGN.md, \"Policy\"); "
           "never fewer than norm_bits; 0: kept as they are.")
    outlier_ratio: float | None = _field(
        None, "Keep tokens exact whose max |x| exceeds this many times the median token's; 0: off; unset: family default.")
    dropout_bits: bool = _field(True, "Store dropout masks as 1 bit per element.")
    generic_fallback: bool = _field(False, "Patch model types without a registered patcher generically (with a warning).")
    recompute_inline_attention: bool = _field(
        False, "The attention the long-input families compute inline, outside Transformers' attention interface "
               "(LongT5's, Longformer's and LED's), runs again in backward from its input instead of keeping "
               "what autograd saves inside it compressed: several times fewer bytes for a quarter more step time "
               "(docs/RESULTS.md, \"Long-input attentions\").")
    module_bits: str = _field("", "Per-module overrides of the *_bits fields: a JSON object or a path to a JSON file.")
    exact_tokens: int | None = _field(
        None, "Tokens at the start of every sequence kept exact in every compressed kind ([CLS]: a classifier's "
              "gradient flows through that one row; a decoder's first token: the attention sink, whose key and value "
              "gather every query's gradient); unset: family default (ViT: 1), else 0.")
    early_layers: float | None = _field(
        None, "Fraction (0 to 1) of the model's layers, counted from the input, whose activation inputs keep 8 bits "
              "(gated decoders: 0.4; unset: family default; 0: none). Layers that module_bits names keep what it says.")
    late_layers: float | None = _field(
        None, "Fraction (0 to 1) of the model's layers, counted from the output, whose activation inputs keep 8 bits "
              "(gated decoders: 0.05; unset: family default; 0: none). Layers that module_bits names keep what it says.")

    def __post_init__(self):
        self.method = Method.parse(self.method, "DivisionConfig.method")
        self.lfc_dtype = LfcDtype.parse(self.lfc_dtype, "DivisionConfig.lfc_dtype")
        self.rounding = Rounding.parse(self.rounding, "DivisionConfig.rounding")
        for name in ("block_size", "group_size", "min_numel", "narrow_linear"):
            value, least = getattr(self, name), 0 if name in ("min_numel", "narrow_linear") else 1
            if value is None and name == "block_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                what = "a non-negative" if least == 0 else "a positive"
                raise ValueError(f"DivisionConfig.{name} must be {what} integer, got {value!r}")
        for name in ("norm_row_scale", "dropout_bits", "generic_fallback", "recompute_inline_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DivisionConfig.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("group_size", *(f"{kind}_group_size" for kind in PER_KIND_LAYOUT)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 8 or value % 8):
                raise ValueError(f"DivisionConfig.{name} must be a positive multiple of 8, got {value!r}")
        for name in (f"{kind}_block_size" for kind in PER_KIND_LAYOUT):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"DivisionConfig.{name} must be a positive integer (1: no LFC), got {value!r}")
        ratio = self.outlier_ratio
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (ratio == 0 or ratio > 1)):
            raise ValueError(f"DivisionConfig.outlier_ratio must be 0 (off) or a number > 1, got {self.outlier_ratio!r}")
        for name in (*(f"{kind}_bits" for kind in KINDS), "checkpoint_bits"):
            bits = getattr(self, name)
            if bits is not None and (not isinstance(bits, int) or isinstance(bits, bool) or bits not in (0, 1, 2, 4, 8)):
                raise ValueError(f"DivisionConfig.{name} must be 0, 1, 2, 4, 8 or None, got {bits!r}")
        exact = self.exact_tokens
        if exact is not None and (isinstance(exact, bool) or not isinstance(exact, int) or exact < 0):
            raise ValueError(f"DivisionConfig.exact_tokens must be a non-negative integer, got {exact!r}")
        for name in ("early_layers", "late_layers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
                raise ValueError(f"DivisionConfig.{name} must be a fraction from 0 to 1, got {value!r}")
        self._overrides = _parse_module_bits(self.module_bits)
        self._resolved: dict = {}  # this module's overrides, set by for_module

    def __setattr__(self, name, value):
        # what the derived settings memoize (:meth:`bits`, :meth:`compressor_args`: asked for every
        # saved tensor, host time on a GPU, docs/DESIGN.md "On a GPU") is forgotten on any change
        object.__setattr__(self, name, value)
        self.__dict__["_memo"] = {}

    # ------------------------------------------------------------------ derived settings
    def bits(self, kind: str, name: str | None = None) -> int:
        """HFC bits for a kind of saved tensor (ActNN: 2 for Linear inputs, 0 for the rest; "actnn-all":
        2 everywhere a kind is compressed), in module
        ``name`` if given (else in the module this config was made for by :meth:`for_module`)."""
        if name is None:
            memo = self.__dict__["_memo"]
            bits = memo.get(("bits", kind))
            if bits is None:
                bits = memo[("bits", kind)] = self._bits(kind, None)
            return bits
        return self._bits(kind, name)

    def _bits(self, kind: str, name: str | None) -> int:
        override = self._resolved.get(kind) if name is None else self._override(kind, name)
        if override is not None:
            return override
        if self.method == Method.ACTNN and kind != "linear":
            return 0  # ActNN compresses the inputs of the layers it supports and keeps the rest
        bits = getattr(self, f"{kind}_bits")
        bits = DEFAULT_BITS[kind] if bits is None else bits
        return min(bits, 2) if self.is_actnn and bits else bits

    @property
    def is_actnn(self) -> bool:
        """ActNN's quantizer: 2-bit flat groups, no LFC, no outlier tokens (both ActNN methods)."""
        return self.method in (Method.ACTNN, Method.ACTNN_ALL)

    @property
    def effective_outlier_ratio(self) -> float:
        """``outlier_ratio`` (its default if unset); 0 for ActNN, whose scheme has no such step."""
        if self.is_actnn:
            return 0.0
        return DEFAULTS["outlier_ratio"] if self.outlier_ratio is None else float(self.outlier_ratio)

    def resolved(self, model_type: str | None, model_config=None) -> "DivisionConfig":
        """This config with every field left at None set to ``model_type``'s default (the
        defaults its family registered, for ``model_config``'s shape where given, else
        :data:`DEFAULTS`)."""
        family = family_defaults(model_type, model_config)
        unset = {k: family.get(k, v) for k, v in DEFAULTS.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **unset) if unset else self

    def with_edge_layers(self, layer_names: list[str]) -> "DivisionConfig":
        """This config with ``early_layers`` and ``late_layers`` spelled out as ``module_bits``
        entries: activation inputs at :data:`EDGE_ACTIVATION_BITS` in the first
        ``ceil(early_layers x n)`` and the last ``ceil(late_layers x n)`` of the model's ``n``
        layers (``layer_names``, in order), except layers ``module_bits`` already names, or names a
        module of. Only ever raises the bits: with activation inputs kept exact (0) or at 8 bits,
        nothing changes. Applying it again gives the same config."""
        if not 0 < self.bits("activation") < EDGE_ACTIVATION_BITS:
            return self  # kept exact, or already as precise: nothing to raise
        n = len(layer_names)
        first = math.ceil((self.early_layers or 0) * n - 1e-9)
        last = math.ceil((self.late_layers or 0) * n - 1e-9)
        chosen = layer_names[:first] + layer_names[max(first, n - last):]
        mine = self._overrides
        added = {name: {"activation": EDGE_ACTIVATION_BITS} for name in chosen
                 if not any(k == name or name.startswith(k + ".") or k.startswith(name + ".") for k in mine)}
        if not added:
            return self
        return dataclasses.replace(self, module_bits=json.dumps({**added, **mine}))

    def _override(self, kind: str, name: str) -> int | None:
        best = None
        for key, value in self._overrides.items():
            if (name == key or name.startswith(key + ".")) and (best is None or len(key) > len(best[0])):
                bits = value if isinstance(value, int) else value.get(kind)
                if bits is not None:
                    best = (key, bits)
        return None if best is None else best[1]

    def override_names(self) -> list[str]:
        """The module names ``module_bits`` refers to."""
        return list(self._overrides)

    def for_module(self, name: str) -> "DivisionConfig":
        """This config as module ``name`` sees it: ``bits(kind)`` answers with its overrides.
        Without overrides for ``name``, ``self`` itself."""
        resolved = {kind: b for kind in KINDS if (b := self._override(kind, name)) is not None}
        if not resolved:
            return self
        out = copy.copy(self)
        out._resolved = resolved
        return out

    def for_checkpoint(self) -> "DivisionConfig":
        """This config as a checkpointed layer's inputs see it: their kind (``norm``, the residual
        stream) at ``checkpoint_bits`` where that is more precise; kept exact where either is 0."""
        norm = self.bits("norm")
        bits = max(norm, self.checkpoint_bits) if norm and self.checkpoint_bits else 0
        if bits == norm:
            return self
        out = copy.copy(self)
        out._resolved = {**self._resolved, "norm": bits}
        return out

    def compressor_args(self, kind: str) -> dict:
        """Keyword arguments of :func:`hf_division.compress.pipeline.compress` for a tensor of ``kind``
        (a new dict: the caller may change it)."""
        memo = self.__dict__["_memo"]
        args = memo.get(("args", kind))
        if args is None:
            args = memo[("args", kind)] = self._compressor_args(kind)
        return dict(args)

    def _compressor_args(self, kind: str) -> dict:
        return dict(
            bits=self.bits(kind),
            block_size=self.kind_block_size(kind),
            group_size=self.kind_group_size(kind),
            lfc_dtype=self.torch_lfc_dtype,
            stochastic=self.rounding == Rounding.STOCHASTIC,
            outlier_ratio=self.effective_outlier_ratio,
            grouping="flat" if self.is_actnn else "tokens",
            exact_tokens=0 if self.is_actnn else (self.exact_tokens or 0),
        )

    def kind_group_size(self, kind: str) -> int:
        """Tokens per HFC group for ``kind``: its ``<kind>_group_size`` if set, else ``group_size``."""
        value = getattr(self, f"{kind}_group_size", None) if kind in PER_KIND_LAYOUT else None
        return self.group_size if value is None else value

    def kind_block_size(self, kind: str) -> int:
        """LFC block for ``kind`` (1: no LFC): its ``<kind>_block_size`` if set, else the global one."""
        value = getattr(self, f"{kind}_block_size", None) if kind in PER_KIND_LAYOUT else None
        return self.effective_block_size if value is None or self.is_actnn else value

    @property
    def effective_block_size(self) -> int:
        if self.is_actnn:
            return 1
        return DEFAULTS["block_size"] if self.block_size is None else self.block_size

    @property
    def torch_lfc_dtype(self) -> torch.dtype:
        return self.lfc_dtype.torch

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _parse_module_bits(value) -> dict:
    """``module_bits`` as ``{name: bits or {kind: bits}}``; ValueError naming the field if malformed."""
    where = "DivisionConfig.module_bits"
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        if not text.startswith("{"):
            if not os.path.isfile(text):
                raise ValueError(f"{where} must be a JSON object or a path to a JSON file, got {value!r}")
            with open(text, encoding="utf-8") as f:
                text = f.read()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must map module names to bits, got {type(value).__name__}")
    out = {}
    for name, spec in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: module names must be non-empty strings, got {name!r}")
        per_kind = spec if isinstance(spec, dict) else {kind: spec for kind in KINDS}
        for kind, bits in per_kind.items():
            if kind not in KINDS:
                raise ValueError(f"{where}[{name!r}]: unknown kind {kind!r}; kinds are {KINDS}")
            if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (0, 1, 2, 4, 8):
                raise ValueError(f"{where}[{name!r}][{kind!r}] must be 0, 1, 2, 4 or 8, got {bits!r}")
        out[name] = spec if isinstance(spec, int) else dict(spec)
    return out
