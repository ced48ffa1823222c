"""Bytes held for backward and gradient cosine with PEFT adapters, on real MiniLM-L6 and real SST-2.

    python -m hf_division.bench peft --data ../shared/data/glue/SST-2/dev.tsv [--batch 32 --seq 128]

Rows: LoRA (r=8 on query/value), DoRA (same), IA3 (key/value/output.dense), each without and
with division (default policy). Cosines to the exact gradient, min over seeds 0-2: of all trainable
parameters (adapters + classifier head, which dominates the norm) and of the adapter parameters
alone. LoRA's B matrices start at zero, which would make A's gradient zero: they are drawn from
N(0, 0.02) first, as a model some steps into training has them.
"""
from __future__ import annotations


import peft
import torch

from hf_division.analysis.fidelity import gradient_cosine
from hf_division.bench.textdata import classification_batch, sst2_rows
from hf_division.bench.zoo import build_classifier, minilm_tokenizer
from hf_division.bench.suites.common import measure_config, set_threads, suite_parser


def methods() -> dict:
    """Adapter name -> its PEFT config."""
    lora = dict(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"], task_type="SEQ_CLS")
    return {
        "LoRA r=8 (query, value)": peft.LoraConfig(**lora),
        "DoRA r=8 (query, value)": peft.LoraConfig(**lora, use_dora=True),
        "IA3 (key, value, output.dense)": peft.IA3Config(target_modules=["key", "value", "output.dense"],
                                                         feedforward_modules=["output.dense"], task_type="SEQ_CLS"),
    }


def is_adapter(name: str) -> bool:
    """A parameter of a LoRA/DoRA or IA3 adapter."""
    return "lora_" in name or "ia3_" in name


def main(argv=None):
    ap = suite_parser("peft", __doc__)
    ap.add_argument("--data", required=True, help="SST-2 TSV (sentence<TAB>label)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    set_threads(2)
    batch = classification_batch(minilm_tokenizer(), sst2_rows(args.data), args.batch, args.seq)
    print(f"real MiniLM-L6, SST-2 batch {args.batch} x {args.seq}, division default policy")
    print("| adapter | held MiB (adapter alone) | held MiB (+ division) | ratio | cosine, all trainable "
          "| cosine, adapters only |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, config in methods().items():
        torch.manual_seed(0)
        wrapped = peft.get_peft_model(build_classifier("minilm", attn=None), config)
        with torch.no_grad():
            for n, p in wrapped.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        m = measure_config(wrapped, batch, seeds=(0, 1, 2), memory_first=True)
        adapter = min(gradient_cosine(wrapped, batch, seeds=(0, 1, 2), select=is_adapter))
        print(f"| {name} | {m.memory.baseline_bytes / 2**20:.1f} | {m.memory.division_bytes / 2**20:.1f} "
              f"| {m.memory.ratio:.1f}x | {m.cos_min:.4f} | {adapter:.4f} |", flush=True)
