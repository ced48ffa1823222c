"""Measure gradient cosine and bytes held for candidate precision policies (docs/POLICY.md).

python scripts/policy_search.py --data ../shared/data/glue/SST-2/dev.tsv [--attn eager] [--seeds 0 1 2]
Each row: one DivisionConfig (fields not named keep their defaults); cosine = min over seeds.
"""
import argparse
import json
import sys

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hf_division import DivisionConfig, measure_activation_memory
from hf_division.fidelity import gradient_cosine
from hf_division.minilm import minilm_path, sst2_batch

OFF = dict(linear_bits=0, attention_bits=0, activation_bits=0, norm_bits=0, dropout_bits=False)
CANDIDATES = {
    # one kind at a time, the others uncompressed
    **{f"{kind} {b}b": {**OFF, f"{kind}_bits": b} for kind in ("linear", "attention", "activation", "norm") for b in (2, 4)},
    "norm 8b": {**OFF, "norm_bits": 8},
    "dropout bits": {**OFF, "dropout_bits": True},
    # grouping / LFC variants on the hardest kind at 2 bits
    "linear 2b group 64": {**OFF, "linear_bits": 2, "group_size": 64},
    "linear 2b block 4": {**OFF, "linear_bits": 2, "block_size": 4},
    "linear 2b block 16": {**OFF, "linear_bits": 2, "block_size": 16},
    "linear 2b no LFC (block 1)": {**OFF, "linear_bits": 2, "block_size": 1},
    "linear 2b lfc fp16": {**OFF, "linear_bits": 2, "lfc_dtype": "float16"},
    # whole policies
    "all 2b": dict(linear_bits=2, attention_bits=2, activation_bits=2, norm_bits=2),
    "all 4b": dict(linear_bits=4, attention_bits=4, activation_bits=4, norm_bits=4),
    "default": {},
    "actnn": dict(method="actnn"),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", required=True, help="SST-2 dev.tsv")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="*", help="names of candidates to run")
    ap.add_argument("--extra", action="append", default=[], help="NAME=JSON config to add")
    ap.add_argument("--json", help="write rows here")
    ap.add_argument("--render", help="print a Markdown table of a JSON written by --json, and exit")
    args = ap.parse_args(argv)
    if args.render:
        return render(args.render)
    torch.set_num_threads(2)
    path = minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, attn_implementation=args.attn)
    batch = sst2_batch(tok, args.data)
    cands, extra_names = dict(CANDIDATES), set()
    for e in args.extra:
        name, js = e.split("=", 1)
        cands[name] = json.loads(js)
        extra_names.add(name)
    rows = []
    print(f"{'policy':<30} {'MiB held':>9} {'ratio':>6} {'cos min':>8} {'cos mean':>8}")
    for name, kw in cands.items():
        if args.only is not None and name not in args.only and name not in extra_names:
            continue
        cfg = DivisionConfig(**kw)
        cos = gradient_cosine(model, batch, cfg, seeds=args.seeds)
        mem = measure_activation_memory(model, batch, cfg)
        row = dict(policy=name, config=kw, division_bytes=mem.division_bytes, baseline_bytes=mem.baseline_bytes,
                   ratio=mem.ratio, cos_min=min(cos), cos_mean=sum(cos) / len(cos), by_kind=mem.by_kind)
        rows.append(row)
        print(f"{name:<30} {mem.division_bytes / 2**20:>9.1f} {mem.ratio:>6.1f} {min(cos):>8.4f} {row['cos_mean']:>8.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def render(path):
    with open(path) as f:
        rows = json.load(f)
    print("| policy: changes from the default config | kinds changed, MiB baseline->division | total MiB baseline | total MiB division | ratio | cos min | cos mean |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        kinds = [k for k, (b, d) in r["by_kind"].items() if d < b]
        detail = ", ".join(f"{k} {r['by_kind'][k][0] / 2**20:.0f}->{r['by_kind'][k][1] / 2**20:.1f}" for k in kinds) or "-"
        cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items()) or "(default)"
        print(f"| {r['policy']}: `{cfg}` | {detail} | {r['baseline_bytes'] / 2**20:.0f} "
              f"| {r['division_bytes'] / 2**20:.1f} | {r['ratio']:.1f} | {r['cos_min']:.4f} | {r['cos_mean']:.4f} |")


if __name__ == "__main__":
    sys.exit(main())
