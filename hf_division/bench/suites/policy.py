"""Measure gradient cosine and bytes held for candidate precision policies (docs/RESULTS.md, "Precision policy on MiniLM").

python -m hf_division.bench policy --data ../shared/data/glue/SST-2/dev.tsv [--attn eager] [--seeds 0 1 2]
Real MiniLM-L6 on the first 32 rows of the TSV padded to 128 tokens. Each row: one DivisionConfig
(fields not named keep their defaults); cosine = min and mean over seeds (20 seeds for the minimum
the fidelity target means); tensor min = the lowest per-tensor cosine over the seeds (tensors with
>= 1% of the gradient's norm); ``--variance B``: division's added variance against the sampling
variance of B batches of 32 rows (docs/GUIDE.md, "Gradient fidelity").
"""
from __future__ import annotations

import argparse
import json

from hf_division.config import DivisionConfig
from hf_division.bench.textdata import classification_batch, sst2_rows
from hf_division.bench.zoo import build_classifier, minilm_tokenizer
from hf_division.bench.suites.common import measure_config, read_json, set_threads, write_json

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
    "actnn-all": dict(method="actnn-all"),
}


def candidates(only, extra) -> dict:
    """The candidates to run: ``only`` (names; None: all) of :data:`CANDIDATES`, then every
    ``NAME=JSON`` of ``extra`` (run whatever ``only`` says)."""
    cands, extra_names = dict(CANDIDATES), set()
    for e in extra:
        name, js = e.split("=", 1)
        cands[name] = json.loads(js)
        extra_names.add(name)
    return {name: kw for name, kw in cands.items() if only is None or name in only or name in extra_names}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m hf_division.bench policy", description=__doc__)
    ap.add_argument("--data", required=True, help="SST-2 dev.tsv")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="*", help="names of candidates to run")
    ap.add_argument("--extra", action="append", default=[], help="NAME=JSON config to add")
    ap.add_argument("--variance", type=int, default=0, metavar="B", help="added variance over B batches of 32 rows")
    ap.add_argument("--json", help="write rows here")
    ap.add_argument("--render", help="print a Markdown table of a JSON written by --json, and exit")
    args = ap.parse_args(argv)
    if args.render:
        return render(args.render)
    set_threads()
    tok = minilm_tokenizer()
    model = build_classifier("minilm", args.attn)
    rows_in = sst2_rows(args.data)
    batch = classification_batch(tok, rows_in, 32, 128)
    spread = [classification_batch(tok, rows_in, 32, 128, offset=32 * i) for i in range(args.variance)] or None
    rows = []
    print(f"{'policy':<30} {'MiB held':>9} {'ratio':>6} {'cos min':>8} {'cos mean':>8} {'tensor min':>10} {'added var':>9}")
    for name, kw in candidates(args.only, args.extra).items():
        m = measure_config(model, batch, DivisionConfig(**kw), args.seeds, variance_batches=spread)
        mem = m.memory
        rows.append(dict(policy=name, config=kw, division_bytes=mem.division_bytes, baseline_bytes=mem.baseline_bytes,
                         ratio=mem.ratio, cos_min=m.cos_min, cos_mean=m.cos_mean, tensor_min=m.tensor_min,
                         added_variance=m.added_variance, by_kind=mem.by_kind))
        added = "" if m.added_variance is None else f"{m.added_variance:.1%}"
        print(f"{name:<30} {mem.division_bytes / 2**20:>9.1f} {mem.ratio:>6.1f} {m.cos_min:>8.4f} {m.cos_mean:>8.4f} "
              f"{m.tensor_min:>10.4f} {added:>9}", flush=True)
    write_json(args.json, rows)


def render(path):
    rows = read_json(path)
    print("| policy: changes from the default config | kinds changed, MiB baseline->division | total MiB baseline "
          "| total MiB division | ratio | cos min | cos mean |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        kinds = [k for k, (b, d) in r["by_kind"].items() if d < b]
        detail = ", ".join(f"{k} {r['by_kind'][k][0] / 2**20:.0f}->{r['by_kind'][k][1] / 2**20:.1f}" for k in kinds) or "-"
        cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items()) or "(default)"
        print(f"| {r['policy']}: `{cfg}` | {detail} | {r['baseline_bytes'] / 2**20:.0f} "
              f"| {r['division_bytes'] / 2**20:.1f} | {r['ratio']:.1f} | {r['cos_min']:.4f} | {r['cos_mean']:.4f} |")
