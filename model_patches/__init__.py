"""Per-architecture patchers: ``model_type -> apply_division_to_<family>(model, state)``.

Adding an architecture = one small module here plus one line in ``PATCHERS``; it is supported
once it passes ``tests/test_conformance.py`` (parametrized over this registry).
"""
from .bert import apply_division_to_bert
from .distilbert import apply_division_to_distilbert
from .gemma import apply_division_to_gemma
from .gemma2 import apply_division_to_gemma2
from .gpt2 import apply_division_to_gpt2
from .llama import apply_division_to_llama
from .mistral import apply_division_to_mistral
from .opt import apply_division_to_opt
from .phi3 import apply_division_to_phi3
from .qwen2 import apply_division_to_qwen2
from .qwen3 import apply_division_to_qwen3
from .t5 import apply_division_to_t5
from .vit import apply_division_to_vit

PATCHERS = {
    "bert": apply_division_to_bert,
    "roberta": apply_division_to_bert,
    "xlm-roberta": apply_division_to_bert,
    "electra": apply_division_to_bert,
    "distilbert": apply_division_to_distilbert,
    "gpt2": apply_division_to_gpt2,
    "opt": apply_division_to_opt,
    "llama": apply_division_to_llama,
    "mistral": apply_division_to_mistral,
    "qwen2": apply_division_to_qwen2,
    "qwen3": apply_division_to_qwen3,
    "gemma": apply_division_to_gemma,
    "gemma2": apply_division_to_gemma2,
    "phi3": apply_division_to_phi3,
    "t5": apply_division_to_t5,
    "vit": apply_division_to_vit,
}
