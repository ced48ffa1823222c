"""`DivisionConfig`: what is compressed how. Defaults are the measured policy (docs/POLICY.md)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

#: Kinds of saved activations that get their own precision (see docs/POLICY.md).
KINDS = ("linear", "attention", "activation", "norm")

_LFC_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_METHODS = ("division", "actnn")
_ROUNDING = ("stochastic", "nearest")


@dataclass
class DivisionConfig:
    """Precision policy for the activations a training forward keeps for backward.

    Every ``*_bits`` field is the HFC bit width for one kind of saved tensor: 1, 2, 4 or 8, or 0
    to keep that kind uncompressed.

    * ``linear_bits``: inputs of ``nn.Linear`` layers (weight gradient only).
    * ``attention_bits``: query/key/value kept by the attention core; the ``T x T`` probability
      maps are never stored, they are recomputed from these in backward.
    * ``activation_bits``: inputs of activation functions (GELU, ...); their outputs, which feed
      the next linear layer, are recomputed from the same copy.
    * ``norm_bits``: inputs of LayerNorm/RMSNorm (the residual stream); their outputs, which feed
      the next layers, are recomputed from the same copy.
    """

    method: str = "division"  # "division" (LFC + HFC) or "actnn" (per-group 2-bit, no LFC)
    block_size: int = 16  # tokens averaged into one LFC row
    lfc_dtype: str = "bfloat16"
    group_size: int = 256  # HFC elements sharing one min/scale pair
    rounding: str = "stochastic"
    channel_scale: bool = True  # normalize HFC channels before grouping (outlier channels)
    linear_bits: int = 4
    attention_bits: int = 4
    activation_bits: int = 4
    norm_bits: int = 4
    min_numel: int = 4096  # smaller saved tensors are kept as they are
    dropout_bits: bool = True  # store dropout masks as 1 bit per element
    generic_fallback: bool = False  # patch unregistered model types generically (with a warning)

    def __post_init__(self):
        if self.method not in _METHODS:
            raise ValueError(f"DivisionConfig.method must be one of {_METHODS}, got {self.method!r}")
        if self.lfc_dtype not in _LFC_DTYPES:
            raise ValueError(f"DivisionConfig.lfc_dtype must be one of {tuple(_LFC_DTYPES)}, got {self.lfc_dtype!r}")
        if self.rounding not in _ROUNDING:
            raise ValueError(f"DivisionConfig.rounding must be one of {_ROUNDING}, got {self.rounding!r}")
        for name in ("block_size", "group_size", "min_numel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "min_numel" else 1):
                raise ValueError(f"DivisionConfig.{name} must be a positive integer, got {value!r}")
        if self.group_size % 8:
            raise ValueError(f"DivisionConfig.group_size must be a multiple of 8, got {self.group_size}")
        for kind in KINDS:
            bits = getattr(self, f"{kind}_bits")
            if bits not in (0, 1, 2, 4, 8) or isinstance(bits, bool):
                raise ValueError(f"DivisionConfig.{kind}_bits must be 0, 1, 2, 4 or 8, got {bits!r}")

    # ------------------------------------------------------------------ derived settings
    def bits(self, kind: str) -> int:
        """HFC bits for a kind of saved tensor (ActNN: 2 everywhere a kind is compressed)."""
        bits = getattr(self, f"{kind}_bits")
        return min(bits, 2) if self.method == "actnn" and bits else bits

    @property
    def effective_block_size(self) -> int:
        return 1 if self.method == "actnn" else self.block_size

    @property
    def torch_lfc_dtype(self) -> torch.dtype:
        return _LFC_DTYPES[self.lfc_dtype]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
