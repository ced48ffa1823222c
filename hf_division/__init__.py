"""hf-division: DIVISION-compressed activations for Hugging Face training (one flag)."""
from .config import DivisionConfig
from .measure import measure_activation_memory
from .patching import apply_division, remove_division, supported_model_types

__all__ = [
    "DivisionConfig",
    "apply_division",
    "remove_division",
    "supported_model_types",
    "measure_activation_memory",
    "TrainingArguments",
    "Trainer",
]


def __getattr__(name):  # the Trainer pulls in much of transformers: import it on first use
    if name in ("TrainingArguments", "Trainer"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
