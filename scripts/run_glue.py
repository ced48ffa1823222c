#!/usr/bin/env python
"""Fine-tune a sequence classifier on a GLUE task, Transformers ``run_glue`` style, with hf-division.

    python scripts/run_glue.py --model_name_or_path DIR --glue_dir ../shared/data/glue --task_name rte \
        --do_train --do_eval --division --output_dir out/rte
    python scripts/run_glue.py args.json          # all arguments from one JSON file

Data: ``--glue_dir DIR --task_name T`` reads the original GLUE TSV layout (``DIR/<TASK>/{train,dev}.tsv``,
see ``hf_division.glue``); or ``--train_file/--validation_file/--test_file`` (CSV or JSON; a ``label``
column and one or two text columns). ``--division`` and ``--division_<field>`` set the DivisionConfig;
``--use_lora`` (``--lora_r --lora_alpha --lora_dropout --lora_target_modules --use_dora``) trains a PEFT
adapter. At the end the script reports the metrics, the activation bytes held for backward on one
training batch (baseline vs division, exact accounting), the peak memory of the process (RSS high-water
on CPU, ``torch.cuda.max_memory_allocated`` on GPU) and the train time, and writes them to
``OUTPUT_DIR/all_results.json`` and ``OUTPUT_DIR/division_report.json``.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers
from datasets import Dataset, load_dataset
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hf_division import DivisionConfig, measure_activation_memory  # noqa: E402
from hf_division.glue import compute_metrics, get_task, read_split, task_key  # noqa: E402
from hf_division.trainer import Trainer, TrainingArguments  # noqa: E402

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Model folder (or hub id, if the hub is reachable)."})
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's."})
    cache_dir: str | None = field(default=None)
    use_fast_tokenizer: bool = field(default=True)
    model_revision: str = field(default="main")
    trust_remote_code: bool = field(default=False)
    ignore_mismatched_sizes: bool = field(default=False, metadata={"help": "Allow a head of another size."})


@dataclass
class DataTrainingArguments:
    task_name: str | None = field(default=None, metadata={"help": "GLUE task: cola, sst2, mrpc, stsb, qnli, rte, wnli, ..."})
    glue_dir: str | None = field(default=None, metadata={"help": "Root of the GLUE TSV files (glue_data/<TASK>/*.tsv)."})
    train_file: str | None = field(default=None, metadata={"help": "CSV or JSON training file."})
    validation_file: str | None = field(default=None, metadata={"help": "CSV or JSON validation file."})
    test_file: str | None = field(default=None, metadata={"help": "CSV or JSON test file (labels optional)."})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per example after truncation."})
    pad_to_max_length: bool = field(default=True, metadata={"help": "Pad to max_seq_length (else pad per batch)."})
    overwrite_cache: bool = field(default=False)
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    max_predict_samples: int | None = field(default=None)

    def __post_init__(self):
        if self.task_name is None and self.train_file is None and self.validation_file is None:
            raise ValueError("give --task_name (with --glue_dir) or --train_file/--validation_file")
        if self.task_name is not None:
            self.task_name = task_key(self.task_name)  # ValueError naming the task if unknown
        for name in ("train_file", "validation_file", "test_file"):
            path = getattr(self, name)
            if path is not None and path.rsplit(".", 1)[-1] not in ("csv", "json", "jsonl"):
                raise ValueError(f"--{name} must be a .csv or .json file, got {path}")


@dataclass
class LoraArguments:
    use_lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter (PEFT) instead of all weights."})
    lora_r: int = field(default=8)
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.1)
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "Module names (PEFT's default per model type if unset)."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA (weight-decomposed LoRA)."})


def parse_args(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, LoraArguments))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(args=argv)


# ----------------------------------------------------------------------------- data
def load_raw(data_args: DataTrainingArguments, training_args) -> tuple[dict, int, bool]:
    """``{split: Dataset}``, number of labels, is_regression."""
    if data_args.glue_dir is not None:
        if data_args.task_name is None:
            raise ValueError("--glue_dir needs --task_name")
        task = get_task(data_args.task_name)
        wanted = {"train": training_args.do_train, "validation": training_args.do_eval, "test": training_args.do_predict}
        dev = "dev_matched" if data_args.task_name == "mnli" else "dev"
        files = {"train": "train", "validation": dev, "test": "test_matched" if data_args.task_name == "mnli" else "test"}
        raw = {s: Dataset.from_dict(read_split(data_args.glue_dir, data_args.task_name, files[s])) for s, w in wanted.items() if w}
        return raw, task.num_labels, task.is_regression
    files = {s: f for s, f in (("train", data_args.train_file), ("validation", data_args.validation_file),
                               ("test", data_args.test_file)) if f is not None}
    ext = next(iter(files.values())).rsplit(".", 1)[-1]
    loaded = load_dataset("json" if ext.startswith("json") else "csv", data_files=files)
    ref = loaded["train" if "train" in loaded else "validation"]
    if "label" not in ref.column_names:
        raise ValueError(f"{files.get('train', files.get('validation'))}: no 'label' column (columns: {ref.column_names})")
    regression = ref.features["label"].dtype in ("float32", "float64")
    num_labels = 1 if regression else len(set(ref["label"]))
    return dict(loaded), num_labels, regression


def text_columns(ds: Dataset) -> tuple[str, str | None]:
    cols = [c for c in ds.column_names if c not in ("label", "idx")]
    if "sentence1" in cols and "sentence2" in cols:
        return "sentence1", "sentence2"
    if len(cols) >= 2:
        return cols[0], cols[1]
    return cols[0], None


# ----------------------------------------------------------------------------- memory
def peak_memory_bytes() -> int:
    """Peak memory of this process: CUDA allocator high-water on GPU, RSS high-water on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def activation_report(model, batch: dict, config: DivisionConfig) -> dict:
    mem = measure_activation_memory(model, batch, config)
    return {"baseline_bytes": mem.baseline_bytes, "division_bytes": mem.division_bytes, "ratio": mem.ratio,
            "by_kind": {k: {"baseline": b, "division": d} for k, (b, d) in mem.by_kind.items()}}


# ----------------------------------------------------------------------------- main
def build_model(model_args, num_labels: int, regression: bool, lora_args: LoraArguments):
    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path, num_labels=num_labels,
                                        problem_type="regression" if regression else None,
                                        trust_remote_code=model_args.trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, config=config, trust_remote_code=model_args.trust_remote_code,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes, revision=model_args.model_revision,
        cache_dir=model_args.cache_dir)
    if lora_args.use_lora:
        import peft

        lora = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha,
                               lora_dropout=lora_args.lora_dropout, target_modules=lora_args.lora_target_modules,
                               use_dora=lora_args.use_dora)
        model = peft.get_peft_model(model, lora)
        model.print_trainable_parameters()
    return model


def main(argv=None) -> dict:
    model_args, data_args, training_args, lora_args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity_warning()
    set_seed(training_args.seed)

    raw, num_labels, regression = load_raw(data_args, training_args)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path,
                                              use_fast=model_args.use_fast_tokenizer,
                                              trust_remote_code=model_args.trust_remote_code)
    model = build_model(model_args, num_labels, regression, lora_args)
    first, second = text_columns(next(iter(raw.values())))
    padding = "max_length" if data_args.pad_to_max_length else False

    def tokenize(batch):
        texts = (batch[first],) if second is None else (batch[first], batch[second])
        return tokenizer(*texts, padding=padding, max_length=data_args.max_seq_length, truncation=True)

    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
              "test": data_args.max_predict_samples}
    data = {}
    for split, ds in raw.items():
        if limits[split] is not None:
            ds = ds.select(range(min(limits[split], len(ds))))
        data[split] = ds.map(tokenize, batched=True, remove_columns=[c for c in ds.column_names if c != "label"],
                             load_from_cache_file=not data_args.overwrite_cache)
    collator = default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer)

    def metrics(pred):
        if data_args.task_name is not None:
            return compute_metrics(data_args.task_name, pred.predictions, pred.label_ids)
        preds = np.squeeze(pred.predictions) if regression else np.argmax(pred.predictions, axis=-1)
        if regression:
            return {"mse": float(((preds - pred.label_ids) ** 2).mean())}
        return {"accuracy": float((preds == pred.label_ids).mean())}

    trainer = Trainer(model=model, args=training_args, train_dataset=data.get("train"),
                      eval_dataset=data.get("validation"), processing_class=tokenizer, data_collator=collator,
                      compute_metrics=metrics)
    results, report = {}, {"division": training_args.division, "division_config": training_args.division_config().to_dict(),
                           "use_lora": lora_args.use_lora, "task_name": data_args.task_name}
    if training_args.do_train:
        # exact bytes held for backward on one training batch at the script's batch size
        sample = collator([data["train"][i] for i in range(min(training_args.per_device_train_batch_size, len(data["train"])))])
        sample = {k: v.to(training_args.device) for k, v in sample.items()}
        report["activation_memory"] = activation_report(model.to(training_args.device), sample, training_args.division_config())
        rss_before = peak_memory_bytes()
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        report["peak_memory_bytes"] = peak_memory_bytes()
        report["peak_memory_before_train_bytes"] = rss_before
        report["peak_memory_kind"] = "cuda_max_memory_allocated" if torch.cuda.is_available() else "process_rss_high_water"
        report["train_runtime_s"] = train_result.metrics["train_runtime"]
        trainer.save_model()
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        trainer.save_state()
        results.update(train_result.metrics)
    if training_args.do_eval:
        eval_metrics = trainer.evaluate()
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        results.update(eval_metrics)
    if training_args.do_predict and "test" in data:
        test = data["test"].remove_columns("label") if "label" in data["test"].column_names else data["test"]
        preds = trainer.predict(test).predictions
        preds = np.squeeze(preds) if regression else np.argmax(preds, axis=1)
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, f"predict_results_{data_args.task_name or 'test'}.txt"), "w") as f:
                f.write("index\tprediction\n")
                for i, p in enumerate(preds):
                    f.write(f"{i}\t{p}\n")
    report["metrics"] = results
    if "activation_memory" in report:
        mem = report["activation_memory"]
        trainer.save_metrics("memory", {
            "activation_baseline_bytes": mem["baseline_bytes"], "activation_division_bytes": mem["division_bytes"],
            "activation_ratio": mem["ratio"], "peak_memory_bytes": report["peak_memory_bytes"],
            "train_runtime_s": report["train_runtime_s"]})
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "division_report.json"), "w") as f:
            json.dump(report, f, indent=2)
        summarize(report)
    return report


def summarize(report: dict) -> None:
    mem = report.get("activation_memory")
    if mem:
        print(f"activation bytes held for backward: baseline {mem['baseline_bytes'] / 2**20:.1f} MiB, "
              f"division {mem['division_bytes'] / 2**20:.1f} MiB ({mem['ratio']:.1f}x); "
              f"this run: {'division' if report['division'] else 'baseline'}")
    if "peak_memory_bytes" in report:
        print(f"peak memory ({report['peak_memory_kind']}): {report['peak_memory_bytes'] / 2**20:.0f} MiB; "
              f"train time {report['train_runtime_s']:.1f} s")
    shown = {k: round(v, 4) for k, v in report["metrics"].items() if k.startswith("eval_") and isinstance(v, float)}
    print(f"metrics: {shown}")


if __name__ == "__main__":
    main()
