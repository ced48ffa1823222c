"""Per-architecture patchers: one module per family, each registering its model types in
``hf_division.registry`` (``model_type -> patcher + default policy``) when imported.

Nothing here is imported up front: :data:`FAMILIES` says which module registers which model types,
and the registry imports a module the first time one of its types is patched or asked about, so a
run loads the modeling file of the architecture it trains and no other (docs/DESIGN.md,
"Patching, registry and families").

Adding an architecture = one small module here that calls ``register(model_type, defaults=...)``
on its patcher (``training_cache=`` the kind of KV cache its models build in training, where they
build one: the conformance test says where), plus its row below; it is supported once it passes
``tests/model_patches/test_conformance.py`` (parametrized over the registry), and
``tests/model_patches/test_registry.py`` checks that the module registers exactly its row.
"""

#: module of this package -> the model types it registers (``generic`` registers the fallback)
FAMILIES = {
    "bart": ("bart", "mbart"),
    "bert": ("bert", "camembert", "electra", "roberta", "xlm-roberta"),
    "clip": ("clip", "siglip"),
    "deberta_v2": ("deberta-v2",),
    "distilbert": ("distilbert",),
    "falcon": ("falcon",),
    "gemma": ("gemma",),
    "gemma2": ("gemma2",),
    "gemma3": ("gemma3_text",),
    "generic": (),
    "gpt2": ("gpt2",),
    "gpt_neox": ("gpt_neox",),
    "led": ("led",),
    "llama": ("llama",),
    "longformer": ("longformer",),
    "longt5": ("longt5",),
    "mistral": ("mistral",),
    "mixtral": ("mixtral",),
    "modernbert": ("modernbert",),
    "opt": ("opt",),
    "phi": ("phi",),
    "phi3": ("phi3",),
    "qwen2": ("qwen2",),
    "qwen2_moe": ("qwen2_moe",),
    "qwen3": ("qwen3",),
    "qwen3_moe": ("qwen3_moe",),
    "t5": ("t5", "mt5", "umt5"),
    "vit": ("vit",),
    "whisper": ("whisper",),
}
