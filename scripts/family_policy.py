"""Per-family precision: does the default policy (every kind 4-bit) hold a gradient cosine >= 0.98,
and do gated-MLP inputs (``activation``) or RMSNorm inputs (``norm``) need other bits?

python scripts/family_policy.py [--families llama t5 t5-gated vit] [--seeds 0 1] [--smollm2 ../shared/data/glue/SST-2/dev.tsv [--smollm2-batch 4]]

Families (random init, fp32, eager attention, batch 4 x 128 tokens; ViT 144 patches + [CLS]):
  llama     hidden 576, 9 heads / 3 KV heads, intermediate 1536, 4 layers (SmolLM-135M shape),
            sequence classification, random token ids
  t5        d_model 64, 4 heads, d_ff 128, 2+2 layers, ReLU feed-forward (the conformance model)
  t5-gated  the same with gated-GELU (T5 v1.1 / Flan-T5)
  vit       hidden 64, 4 heads, 2 layers, 48x48 images in 4x4 patches, random pixels
``--smollm2 TSV``: also the real SmolLM2-135M-Instruct (scripts/decoder_fidelity.py) on real text,
causal-LM loss, the policies of REAL_POLICIES, first seed only.
Each row: policy (changes from the default), min cosine over seeds, bytes ratio baseline/division.
"""
import argparse
import sys

import torch
from transformers import AutoConfig, AutoModelForImageClassification, AutoModelForSequenceClassification

from hf_division import DivisionConfig, measure_activation_memory
from hf_division.fidelity import gradient_cosine

ALL4 = dict(linear_bits=4, attention_bits=4, activation_bits=4, norm_bits=4)
POLICIES = {
    "default (family)": {},  # the family's defaults (hf_division.config.FAMILY_DEFAULTS)
    "default (all 4-bit)": ALL4,
    "norm_row_scale off": dict(ALL4, norm_row_scale=False),
    "no outlier tokens": dict(ALL4, outlier_ratio=0),
    **{f"{kind} 8-bit": {**ALL4, f"{kind}_bits": 8} for kind in ("linear", "attention", "activation", "norm")},
    **{f"{kind} 2-bit": {**ALL4, f"{kind}_bits": 2} for kind in ("linear", "attention", "activation", "norm")},
    "all 8-bit": dict(linear_bits=8, attention_bits=8, activation_bits=8, norm_bits=8),
    "attention+activation 8": dict(ALL4, attention_bits=8, activation_bits=8),  # decoders' and T5's default
    "no LFC (block 1)": dict(ALL4, block_size=1),
    # one kind compressed (4-bit), the others kept as they are: which kind carries the error
    **{f"only {kind}": {**{f"{k}_bits": 0 for k in ("linear", "attention", "activation", "norm")}, f"{kind}_bits": 4}
       for kind in ("linear", "attention", "activation", "norm")},
    "only linear, no outlier tokens": dict(linear_bits=4, attention_bits=0, activation_bits=0, norm_bits=0,
                                           outlier_ratio=0),
}
REAL_POLICIES = ["default (family)", "default (all 4-bit)", "no outlier tokens", "only linear",
                 "only linear, no outlier tokens", "only attention", "only activation", "only norm", "attention 8-bit",
                 "activation 8-bit", "attention+activation 8", "all 8-bit", "no LFC (block 1)"]

SIZES = {
    "llama": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                  num_hidden_layers=4, vocab_size=49152, pad_token_id=0),
    "t5": dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
               relative_attention_num_buckets=16, vocab_size=128, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=0),
    "vit": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=48,
                patch_size=4),
}


def family(name: str):
    """``(model, batch)`` for a family name (see the module docstring)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (4,), generator=g)
    if name == "vit":
        cfg = AutoConfig.for_model("vit", num_labels=3, **SIZES["vit"])
        model = AutoModelForImageClassification.from_config(cfg, attn_implementation="eager")
        return model, {"pixel_values": torch.randn(4, 3, 48, 48, generator=g), "labels": labels}
    model_type = "t5" if name.startswith("t5") else name
    extra = dict(feed_forward_proj="gated-gelu") if name == "t5-gated" else {}
    cfg = AutoConfig.for_model(model_type, num_labels=3, **SIZES[model_type], **extra)
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager")
    ids = torch.randint(5, cfg.vocab_size, (4, 128), generator=g)
    if model_type == "t5":
        ids[:, -1] = cfg.eos_token_id  # T5 classifies its eos token
    return model, {"input_ids": ids, "labels": labels}


def run(label, model, batch, names, seeds):
    for name in names:
        cfg = DivisionConfig(**POLICIES[name])
        cos = gradient_cosine(model, batch, cfg, seeds=seeds)
        mem = measure_activation_memory(model, batch, cfg)
        print(f"{label:<9} {name:<32} {min(cos):>8.4f} {mem.ratio:>6.1f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*", default=["llama", "t5", "t5-gated", "vit"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), help="names from POLICIES")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--smollm2", metavar="TSV", help="also run the real SmolLM2-135M on this GLUE TSV")
    ap.add_argument("--smollm2-batch", type=int, default=4, help="rows of 128 tokens for SmolLM2")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"--policies: unknown {unknown}; known: {list(POLICIES)}")
    print(f"{'family':<9} {'policy':<32} {'cos min':>8} {'ratio':>6}")
    for name in args.families:
        if name not in ("llama", "t5", "t5-gated", "vit"):
            raise ValueError(f"--families: unknown {name!r}")
        model, batch = family(name)
        run(name, model, batch, args.policies, tuple(args.seeds))
    if args.smollm2:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        import decoder_fidelity

        tok, model = decoder_fidelity.load("sdpa")
        batch = decoder_fidelity.text_batch(args.smollm2, tok, args.smollm2_batch, 128)
        run("smollm2", model, batch, [p for p in REAL_POLICIES if p in args.policies], tuple(args.seeds[:1]))


if __name__ == "__main__":
    main()
