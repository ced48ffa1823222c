import pytest
import torch

from hf_division import tiny
from hf_division.tiny import case, pixel_batch, tiny_batch, tiny_config  # noqa: F401  (the tests' shared helpers)

torch.set_num_threads(2)

ENCODER_TYPES = ["bert", "roberta", "xlm-roberta", "electra", "distilbert"]


def tiny_model(model_type: str, attn: str = "eager", seed: int = 0, **kw):
    """:func:`hf_division.tiny.tiny_model`; skips the test where Transformers lacks ``attn``."""
    try:
        return tiny.tiny_model(model_type, attn, seed, **kw)
    except ValueError as err:
        if not tiny.has_impl(err):
            pytest.skip(f"{model_type} has no {attn} attention in Transformers")
        raise


@pytest.fixture
def batch():
    return tiny_batch()
