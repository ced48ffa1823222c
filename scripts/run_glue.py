#!/usr/bin/env python
"""Fine-tune a sequence classifier on a GLUE task, Transformers ``run_glue`` style, with hf-division.

    python scripts/run_glue.py --model_name_or_path DIR --glue_dir ../shared/data/glue --task_name rte \
        --do_train --do_eval --division --output_dir out/rte
    python scripts/run_glue.py args.json          # all arguments from one JSON file

Data: ``--glue_dir DIR --task_name T`` reads the original GLUE TSV layout (``DIR/<TASK>/{train,dev}.tsv``,
see ``hf_division.bench.glue``); or ``--train_file/--validation_file/--test_file`` (CSV or JSON; a ``label``
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

import numpy as np
import transformers
from transformers import AutoTokenizer, set_seed

from hf_division.integrations.accelerate import keep_process_group_until_exit
from hf_division.bench.glue import (
    activation_report, build_model, load_raw, metrics_for, parse_args, summarize, tokenize_splits,
)
from hf_division.bench.peak import process_peak_bytes
from hf_division.integrations.trainer import Trainer


def train(trainer, data: dict, collator, training_args, report: dict) -> dict:
    """Train, after measuring the activation bytes of one training batch at the script's batch size."""
    size = min(training_args.per_device_train_batch_size, len(data["train"]))
    sample = {k: v.to(training_args.device) for k, v in collator([data["train"][i] for i in range(size)]).items()}
    model = trainer.model.to(training_args.device)
    report["activation_memory"] = activation_report(model, sample, training_args.division_config())
    report["peak_memory_before_train_bytes"] = process_peak_bytes()[0]
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    report["peak_memory_bytes"], report["peak_memory_kind"] = process_peak_bytes()
    report["train_runtime_s"] = result.metrics["train_runtime"]
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    return result.metrics


def predict(trainer, test, regression: bool, path: str) -> None:
    """Write the predictions on the test split, one ``index<TAB>prediction`` line per example."""
    test = test.remove_columns("label") if "label" in test.column_names else test
    preds = trainer.predict(test).predictions
    preds = np.squeeze(preds) if regression else np.argmax(preds, axis=1)
    if trainer.is_world_process_zero():
        with open(path, "w") as f:
            f.write("index\tprediction\n")
            for i, p in enumerate(preds):
                f.write(f"{i}\t{p}\n")


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
    data, collator = tokenize_splits(raw, tokenizer, data_args)
    trainer = Trainer(model=model, args=training_args, train_dataset=data.get("train"),
                      eval_dataset=data.get("validation"), processing_class=tokenizer, data_collator=collator,
                      compute_metrics=metrics_for(data_args.task_name, regression))
    results = {}
    report = {"division": training_args.division, "division_config": training_args.division_config().to_dict(),
              "use_lora": lora_args.use_lora, "task_name": data_args.task_name}
    if training_args.do_train:
        results.update(train(trainer, data, collator, training_args, report))
    if training_args.do_eval:
        eval_metrics = trainer.evaluate()
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        results.update(eval_metrics)
    if training_args.do_predict and "test" in data:
        predict(trainer, data["test"], regression,
                os.path.join(training_args.output_dir, f"predict_results_{data_args.task_name or 'test'}.txt"))
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
    keep_process_group_until_exit()  # a no-op in one process (hf_division.integrations.accelerate: a teardown that hung)
    return report


if __name__ == "__main__":
    main()
