"""Per-architecture patchers. Importing this package registers every family in
``hf_division.registry`` (``model_type -> patcher + default policy``).

Adding an architecture = one small module here that calls ``register(model_type, defaults=...)``
on its patcher, plus its import below; it is supported once it passes
``tests/model_patches/test_conformance.py`` (parametrized over the registry).
"""
from . import (bart, bert, clip, deberta_v2, distilbert, falcon, gemma, gemma2, gemma3, generic, gpt2, gpt_neox, llama,
               mistral, mixtral, modernbert, opt, phi, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, t5, vit, whisper)

__all__ = ["bart", "bert", "clip", "deberta_v2", "distilbert", "falcon", "gemma", "gemma2", "gemma3", "generic", "gpt2",
           "gpt_neox", "llama", "mistral", "mixtral", "modernbert", "opt", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3",
           "qwen3_moe", "t5", "vit", "whisper"]
