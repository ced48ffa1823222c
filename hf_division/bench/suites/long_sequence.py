"""Bytes held for backward and gradient cosine vs sequence length, Llama-shaped model.

python -m hf_division.bench long-sequence [--lengths 128 512 2048] [--attn eager sdpa] [--seeds 0 1]

Config: hidden 576, 9 heads / 3 KV heads, intermediate 1536, 4 layers, vocab 49152 (the shape of
SmolLM-135M), random init, fp32, sequence-classification head (so the vocabulary-sized logits
of a causal-LM head, which no activation compressor touches, do not dominate the figures).
Batch 4 at <= 512 tokens, 1 above.
"""
from __future__ import annotations


from hf_division.config import DivisionConfig
from hf_division.bench.textdata import random_tokens
from hf_division.bench.zoo import LLAMA_SHAPE, build_classifier
from hf_division.bench.suites.common import measure_config, set_threads, suite_parser


def main(argv=None):
    ap = suite_parser("long-sequence", __doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--attn", nargs="+", default=["eager", "sdpa"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv)
    set_threads(2)
    vocab = LLAMA_SHAPE["vocab_size"]
    print(f"{'attn':<6} {'tokens':>6} {'batch':>5} {'baseline MiB':>13} {'division MiB':>13} {'ratio':>6} {'cos min':>8}")
    for attn in args.attn:
        model = build_classifier("llama-4l", attn, vocab_size=vocab)
        for t in args.lengths:
            b = 4 if t <= 512 else 1
            m = measure_config(model, random_tokens(vocab, b, t, seed=t), DivisionConfig(), args.seeds, memory_first=True)
            print(f"{attn:<6} {t:>6} {b:>5} {m.memory.baseline_bytes / 2**20:>13.1f} "
                  f"{m.memory.division_bytes / 2**20:>13.1f} {m.memory.ratio:>6.1f} {m.cos_min:>8.4f}", flush=True)
