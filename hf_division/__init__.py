"""hf-division: DIVISION-compressed activations for Hugging Face training (one flag)."""
import importlib

from .config import DivisionConfig
from .measure import measure_activation_memory
from .api import apply_division, remove_division, supported_model_types
from .budget import suggest
from .store import exact

__all__ = [
    "DivisionConfig",
    "apply_division",
    "remove_division",
    "exact",
    "supported_model_types",
    "measure_activation_memory",
    "suggest",
    "TrainingArguments",
    "Trainer",
]


def __getattr__(name):
    # PEP 562 lazy attribute: ``transformers.Trainer`` pulls in much of transformers (and
    # accelerate), which ``apply_division`` alone does not need; loaded on first use only.
    if name in ("TrainingArguments", "Trainer"):
        return getattr(importlib.import_module(".trainer", __name__), name)
    raise AttributeError(name)
