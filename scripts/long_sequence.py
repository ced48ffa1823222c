"""Bytes held for backward and gradient cosine vs sequence length, Llama-shaped model.

python scripts/long_sequence.py [--lengths 128 512 2048] [--attn eager sdpa] [--seeds 0 1]

Config: hidden 576, 9 heads / 3 KV heads, intermediate 1536, 4 layers, vocab 49152 (the shape of
SmolLM-135M), random init, fp32, sequence-classification head (so the vocabulary-sized logits
of a causal-LM head, which no activation compressor touches, do not dominate the figures).
Batch 4 at <= 512 tokens, 1 above.
"""
import argparse

import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig

from hf_division import DivisionConfig, measure_activation_memory
from hf_division.fidelity import gradient_cosine


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--attn", nargs="+", default=["eager", "sdpa"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                      num_hidden_layers=4, vocab_size=49152, max_position_embeddings=4096, num_labels=2, pad_token_id=0)
    print(f"{'attn':<6} {'tokens':>6} {'batch':>5} {'baseline MiB':>13} {'division MiB':>13} {'ratio':>6} {'cos min':>8}")
    for attn in args.attn:
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation=attn)
        for t in args.lengths:
            b = 4 if t <= 512 else 1
            g = torch.Generator().manual_seed(t)
            ids = torch.randint(1, cfg.vocab_size, (b, t), generator=g)
            batch = {"input_ids": ids, "labels": torch.randint(0, 2, (b,), generator=g)}
            mem = measure_activation_memory(model, batch, DivisionConfig())
            cos = gradient_cosine(model, batch, DivisionConfig(), seeds=args.seeds)
            print(f"{attn:<6} {t:>6} {b:>5} {mem.baseline_bytes / 2**20:>13.1f} {mem.division_bytes / 2**20:>13.1f} "
                  f"{mem.ratio:>6.1f} {min(cos):>8.4f}", flush=True)


if __name__ == "__main__":
    main()
