"""Auto-precision vs uniform bits at equal bytes, on real MiniLM-L6 and real SST-2 text.

python scripts/auto_precision.py [--data ../shared/data/glue/SST-2/dev.tsv] [--methods division actnn]
    [--budgets 2 3 4] [--batch 32 --seq 128] [--seeds 0 1 2] [--attn eager] [--threads 2] [--json FILE]

Sensitivities are measured once per method on a calibration batch (rows ``batch..2*batch-1`` of
the file); the assignment for each budget is then evaluated on another batch (the first ``batch``
rows, the batch of docs/POLICY.md): bytes held for backward and the gradient cosine to the exact
gradient per seed. Each budget that is a bit width (1, 2, 4, 8) is compared with every kind at
that width (for ActNN its uniform 2 bits); other budgets with the uniform widths around them.
"""
import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_division import DivisionConfig, measure_activation_memory  # noqa: E402
from hf_division.auto_precision import assign, measure_sensitivity  # noqa: E402
from hf_division.config import KINDS  # noqa: E402
from hf_division.fidelity import gradient_cosine  # noqa: E402
from hf_division.minilm import minilm_path  # noqa: E402


def batch_from(tok, path, start, n, seq):
    with open(path, encoding="utf-8") as f:
        rows = [line.rsplit("\t", 1) for line in f.read().splitlines()[1:] if line.strip()]
    rows = rows[start : start + n]
    if len(rows) < n:
        raise ValueError(f"--data: {path} has fewer than {start + n} rows")
    out = dict(tok([r[0] for r in rows], padding="max_length", max_length=seq, truncation=True, return_tensors="pt"))
    out["labels"] = torch.tensor([int(r[1]) for r in rows])
    return out


def uniform(model, method: str, bits: int) -> DivisionConfig:
    """Every kind at ``bits``; for ActNN above its 2-bit cap through per-module overrides."""
    if method == "actnn" and bits > 2:
        return DivisionConfig(method=method, module_bits=json.dumps({n: bits for n, _ in model.named_children()}))
    return DivisionConfig(method=method, **{f"{k}_bits": bits for k in KINDS})


def neighbours(budget: float) -> list[int]:
    """The uniform widths to compare a budget with: itself, or the widths around it."""
    widths = (1, 2, 4, 8)
    if budget in widths:
        return [int(budget)]
    return [w for w in (max((w for w in widths if w < budget), default=None),
                        min((w for w in widths if w > budget), default=None)) if w is not None]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/glue/SST-2/dev.tsv")
    ap.add_argument("--methods", nargs="+", default=["division", "actnn"], choices=["division", "actnn"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[2.0, 3.0, 4.0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rows and assignments here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(minilm_path())
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2, attn_implementation=args.attn)
    calib = batch_from(tok, args.data, args.batch, args.batch, args.seq)
    evaluate = batch_from(tok, args.data, 0, args.batch, args.seq)

    rows, assignments = [], {}

    def row(method, budget, setting, avg_bits, config):
        report = measure_activation_memory(model, evaluate, config)
        cos = gradient_cosine(model, evaluate, config, seeds=args.seeds)
        rows.append(dict(method=method, budget=budget, setting=setting, avg_bits=avg_bits,
                         held_mib=report.division_bytes / 2**20, baseline_mib=report.baseline_bytes / 2**20,
                         ratio=report.ratio, cos_min=min(cos), cos_mean=sum(cos) / len(cos)))
        r = rows[-1]
        print(f"{method:<9} {budget:>6} {setting:<12} {avg_bits:>8.3f} {r['held_mib']:>9.2f} {r['ratio']:>6.1f} "
              f"{r['cos_min']:>8.4f} {r['cos_mean']:>8.4f}", flush=True)

    for method in args.methods:
        t0 = time.perf_counter()
        sens = measure_sensitivity(model, calib, DivisionConfig(method=method), seed=0)
        print(f"\n{method}: sensitivities of {len(sens.units)} units measured in {time.perf_counter() - t0:.0f} s "
              f"on rows {args.batch}..{2 * args.batch - 1} (calibration); evaluated on rows 0..{args.batch - 1}")
        print(f"{'method':<9} {'budget':>6} {'setting':<12} {'avg bits':>8} {'held MiB':>9} {'ratio':>6} {'cos min':>8} {'cos mean':>8}")
        done, results = set(), {}
        for budget in args.budgets:
            result = results[budget] = assign(sens, budget)
            assignments[f"{method} {budget}"] = json.loads(result.config.module_bits)
            for b in neighbours(budget):
                if b not in done:
                    done.add(b)
                    row(method, budget, f"uniform {b}b", float(b), uniform(model, method, b))
            row(method, budget, "auto", result.average_bits, result.config)
        print(f"\n{'unit':<24} {'kind':<10} {'elements':>9} {'err@2b':>9} {'err@4b':>9} "
              + " ".join(f"{f'b@{b:g}':>6}" for b in results))
        for i, u in enumerate(sens.units):
            print(f"{u.name:<24} {u.kind:<10} {u.numel:>9} {u.probes.get(2, 0):>9.2e} {u.probes.get(4, 0):>9.2e} "
                  + " ".join(f"{r.units[i].bits:>6}" for r in results.values()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "assignments": assignments}, f, indent=1)


if __name__ == "__main__":
    main()
