#!/usr/bin/env python
"""Bytes held for backward and gradient cosine with PEFT adapters, on real MiniLM-L6 and real SST-2.

    python scripts/peft_memory.py --data ../shared/data/glue/SST-2/dev.tsv [--batch 32 --seq 128]

Rows: LoRA (r=8 on query/value), DoRA (same), IA3 (key/value/output.dense), each without and
with division (default policy). Cosines to the exact gradient, min over seeds 0-2: of all trainable
parameters (adapters + classifier head, which dominates the norm) and of the adapter parameters
alone. LoRA's B matrices start at zero, which would make A's gradient zero: they are drawn from
N(0, 0.02) first, as a model some steps into training has them.
"""
import argparse

import peft
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import hf_division as hd
from hf_division.fidelity import gradient_cosine
from hf_division.minilm import minilm_path, sst2_batch

METHODS = {
    "LoRA r=8 (query, value)": lambda: peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"], task_type="SEQ_CLS"),
    "DoRA r=8 (query, value)": lambda: peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"], task_type="SEQ_CLS", use_dora=True),
    "IA3 (key, value, output.dense)": lambda: peft.IA3Config(target_modules=["key", "value", "output.dense"], feedforward_modules=["output.dense"], task_type="SEQ_CLS"),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="SST-2 TSV (sentence<TAB>label)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(minilm_path())
    batch = sst2_batch(tok, args.data, args.batch, args.seq)
    print(f"real MiniLM-L6, SST-2 batch {args.batch} x {args.seq}, division default policy")
    print("| adapter | held MiB (adapter alone) | held MiB (+ division) | ratio | cosine, all trainable | cosine, adapters only |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, make in METHODS.items():
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
        wrapped = peft.get_peft_model(model, make())
        with torch.no_grad():
            for n, p in wrapped.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        mem = hd.measure_activation_memory(wrapped, batch)
        cos = min(gradient_cosine(wrapped, batch, seeds=(0, 1, 2)))
        adapter = min(adapter_cosine(wrapped, batch, seed) for seed in (0, 1, 2))
        print(f"| {name} | {mem.baseline_bytes / 2**20:.1f} | {mem.division_bytes / 2**20:.1f} | {mem.ratio:.1f}x | "
              f"{cos:.4f} | {adapter:.4f} |", flush=True)


def adapter_cosine(model, batch, seed: int) -> float:
    """Cosine of the adapter parameters' gradient with division to the exact one."""
    def grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        model(**batch).loss.backward()
        return torch.cat([p.grad.flatten() for n, p in model.named_parameters()
                          if p.grad is not None and ("lora_" in n or "ia3_" in n)])

    model.train()
    hd.remove_division(model)
    exact = grads()
    hd.apply_division(model)
    approx = grads()
    hd.remove_division(model)
    return torch.nn.functional.cosine_similarity(exact.double(), approx.double(), dim=0).item()


if __name__ == "__main__":
    main()
