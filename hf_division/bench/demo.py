"""The main job on its embedded default: fine-tune real MiniLM-L6 on bundled SST-2 with division.

python -m hf_division.bench.demo [--epochs 2] [--max_length 64] [--output_dir /tmp/hf-division-demo]

Prints the activation memory held for backward (baseline vs division, exact accounting) on one
training batch, trains with ``TrainingArguments(division=True)``, and prints dev accuracy.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from hf_division.analysis.measure import measure_activation_memory
from hf_division.bench.textdata import BUNDLED_SST2_DEV, classification_batch, sst2_rows
from hf_division.integrations.trainer import Trainer, TrainingArguments
from hf_division.bench.zoo import minilm_path

DATA = os.path.join(os.path.dirname(__file__), "data")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--max_length", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--output_dir", default=os.path.join(tempfile.gettempdir(), "hf-division-demo"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    path = minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)

    def encode(rows):  # a list of features is a dataset to the Trainer: no datasets package needed
        enc = tok([s for s, _ in rows], truncation=True, max_length=args.max_length)
        return [{**{k: v[i] for k, v in enc.items()}, "label": y} for i, (_, y) in enumerate(rows)]

    train_rows = sst2_rows(os.path.join(DATA, "sst2_train_sample.tsv"))
    train, dev = encode(train_rows), encode(sst2_rows(BUNDLED_SST2_DEV))
    targs = TrainingArguments(
        output_dir=args.output_dir, division=True, num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64, learning_rate=5e-5,
        logging_steps=20, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
        dataloader_pin_memory=torch.cuda.is_available(),  # pinning has no use without an accelerator
    )
    # exact bytes held for backward on one full-length training batch
    sample = classification_batch(tok, train_rows, args.batch_size, args.max_length)
    mem = measure_activation_memory(model, sample, targs.division_config())
    print(f"\nActivation memory held for backward, batch {args.batch_size} x {args.max_length} tokens:")
    print(mem.table())

    def metrics(pred):
        return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}

    trainer = Trainer(model=model, args=targs, train_dataset=train, eval_dataset=dev,
                      data_collator=DataCollatorWithPadding(tok), compute_metrics=metrics)
    trainer.train()
    acc = trainer.evaluate()["eval_accuracy"]
    saved = 1 - mem.division_bytes / mem.baseline_bytes
    print(f"\nactivation memory saved: {saved:.1%} ({mem.baseline_bytes / 2**20:.1f} MiB -> "
          f"{mem.division_bytes / 2**20:.1f} MiB, {mem.ratio:.1f}x)")
    print(f"SST-2 dev-sample accuracy after {args.epochs:g} epochs with division: {acc:.3f} ({len(dev)} examples)")
    return acc


if __name__ == "__main__":
    main()
