"""Per-architecture patchers: ``model_type -> apply_division_to_<family>(model, state)``.

Adding an architecture = one small module here plus one line in ``PATCHERS``; it is supported
once it passes ``tests/test_conformance.py`` (parametrized over this registry).
"""
from .bert import apply_division_to_bert
from .distilbert import apply_division_to_distilbert

PATCHERS = {
    "bert": apply_division_to_bert,
    "roberta": apply_division_to_bert,
    "xlm-roberta": apply_division_to_bert,
    "electra": apply_division_to_bert,
    "distilbert": apply_division_to_distilbert,
}
