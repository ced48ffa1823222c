"""Per-family precision: does the default policy (every kind 4-bit) hold a gradient cosine >= 0.98,
and do gated-MLP inputs (``activation``) or RMSNorm inputs (``norm``) need other bits?

python -m hf_division.bench family [--families llama t5 t5-gated vit] [--seeds 0 1]
    [--smollm2 ../shared/data/glue/SST-2/dev.tsv [--smollm2-batch 4]]

Families (random init, fp32, eager attention, batch 4 x 128 tokens; ViT 144 patches + [CLS]):
  llama     hidden 576, 9 heads / 3 KV heads, intermediate 1536, 4 layers (SmolLM-135M shape),
            sequence classification, random token ids
  t5        d_model 64, 4 heads, d_ff 128, 2+2 layers, ReLU feed-forward (the conformance model)
  t5-gated  the same with gated-GELU (T5 v1.1 / Flan-T5)
  vit       hidden 64, 4 heads, 2 layers, 48x48 images in 4x4 patches, random pixels
  vit-257   the same on 64x64 images (256 patches + [CLS]); vit-257-h192: hidden 192, 3 heads
``--smollm2 TSV``: also the real SmolLM2-135M-Instruct (the decoder suite's model) on real text,
causal-LM loss, the policies of REAL_POLICIES, first seed only.
Each row: policy (changes from the default), min cosine over seeds, bytes ratio baseline/division,
the lowest per-tensor cosine over the seeds (tensors with >= 1% of the gradient's norm), and with
``--variance B`` division's added variance against the sampling variance of B batches drawn like
the family's from other seeds (docs/GUIDE.md, "Gradient fidelity").
"""
from __future__ import annotations

import statistics

from hf_division.config import DivisionConfig
from hf_division.bench.textdata import causal_lm_batch
from hf_division.bench.zoo import FAMILIES, family_model, load_smollm2
from hf_division.bench.suites.common import measure_config, set_threads, suite_parser

ALL4 = dict(linear_bits=4, attention_bits=4, activation_bits=4, norm_bits=4)
POLICIES = {
    "default (family)": {},  # the family's defaults (docs/DESIGN.md, "Policy")
    "default (all 4-bit)": ALL4,
    "norm_row_scale off": dict(ALL4, norm_row_scale=False),
    "no outlier tokens": dict(ALL4, outlier_ratio=0),
    **{f"{kind} 8-bit": {**ALL4, f"{kind}_bits": 8} for kind in ("linear", "attention", "activation", "norm")},
    **{f"{kind} 2-bit": {**ALL4, f"{kind}_bits": 2} for kind in ("linear", "attention", "activation", "norm")},
    "all 8-bit": dict(linear_bits=8, attention_bits=8, activation_bits=8, norm_bits=8),
    "attention+activation 8": dict(ALL4, attention_bits=8, activation_bits=8),  # decoders' and T5's default
    "no LFC (block 1)": dict(ALL4, block_size=1),
    "[CLS] compressed": dict(exact_tokens=0),  # ViT's default keeps it exact
    # one kind compressed (4-bit), the others kept as they are: which kind carries the error
    **{f"only {kind}": {**{f"{k}_bits": 0 for k in ("linear", "attention", "activation", "norm")}, f"{kind}_bits": 4}
       for kind in ("linear", "attention", "activation", "norm")},
    "only linear, no outlier tokens": dict(linear_bits=4, attention_bits=0, activation_bits=0, norm_bits=0,
                                           outlier_ratio=0),
}
REAL_POLICIES = ["default (family)", "default (all 4-bit)", "no outlier tokens", "only linear",
                 "only linear, no outlier tokens", "only attention", "only activation", "only norm", "attention 8-bit",
                 "activation 8-bit", "attention+activation 8", "all 8-bit", "no LFC (block 1)"]


def _row(label, name, m) -> str:
    added = "" if m.added_variance is None else f"{m.added_variance:.1%}"
    return f"{label:<9} {name:<32} {m.cos_min:>8.4f} {m.memory.ratio:>6.1f} {m.tensor_min:>10.4f} {added:>9}"


def run(label, model, batch, names, seeds, spread=None):
    for name in names:
        m = measure_config(model, batch, DivisionConfig(**POLICIES[name]), seeds, variance_batches=spread)
        print(_row(label, name, m), flush=True)


def run_seeds(family: str, model_seeds, names, seeds, variance=0):
    """Like :func:`run` over several random-init models: min and median cosine over all of them."""
    if len(model_seeds) == 1:
        model, batch = family_model(family, model_seeds[0])
        # batches drawn like the family's, from other seeds: the minibatch spread of random inputs
        spread = [family_model(family, model_seeds[0], batch_seed=1 + i)[1] for i in range(variance)] or None
        return run(family, model, batch, names, seeds, spread)
    built = [family_model(family, s) for s in model_seeds]
    for name in names:
        found = [measure_config(m, b, DivisionConfig(**POLICIES[name]), seeds) for m, b in built]
        cos = sorted(c for f in found for c in f.cosines)
        print(f"{family:<9} {name:<32} {cos[0]:>8.4f} {found[0].memory.ratio:>6.1f} {min(f.tensor_min for f in found):>10.4f}"
              f"  median {statistics.median(cos):.4f} over {len(model_seeds)} models x {len(seeds)} seeds", flush=True)


def main(argv=None):
    ap = suite_parser("family", __doc__)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), help="names from POLICIES")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--model-seeds", type=int, nargs="+", default=[0],
                    help="random-init weights per family; the row's min and median are over models x seeds")
    ap.add_argument("--smollm2", metavar="TSV", help="also run the real SmolLM2-135M on this GLUE TSV")
    ap.add_argument("--smollm2-batch", type=int, default=4, help="rows of 128 tokens for SmolLM2")
    ap.add_argument("--variance", type=int, default=0, metavar="B",
                    help="added variance over B batches drawn like the family's (one model seed)")
    args = ap.parse_args(argv)
    set_threads()
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"--policies: unknown {unknown}; known: {list(POLICIES)}")
    print(f"{'family':<9} {'policy':<32} {'cos min':>8} {'ratio':>6} {'tensor min':>10} {'added var':>9}")
    for name in args.families:
        run_seeds(name, args.model_seeds, args.policies, tuple(args.seeds), args.variance)
    if args.smollm2:
        tok, model = load_smollm2("sdpa")
        batch = causal_lm_batch(args.smollm2, tok, args.smollm2_batch, 128)
        run("smollm2", model, batch, [p for p in REAL_POLICIES if p in args.policies], tuple(args.seeds[:1]))
