"""Per-architecture patchers. Importing this package registers every family in
``hf_division.registry`` (``model_type -> patcher + default policy``).

Adding an architecture = one small module here that calls ``register(model_type, defaults=...)``
on its patcher, plus its import below; it is supported once it passes
``tests/test_conformance.py`` (parametrized over the registry).
"""
from . import bert, distilbert, gemma, gemma2, generic, gpt2, llama, mistral, opt, phi3, qwen2, qwen3, t5, vit

__all__ = ["bert", "distilbert", "gemma", "gemma2", "generic", "gpt2", "llama", "mistral", "opt", "phi3", "qwen2",
           "qwen3", "t5", "vit"]
