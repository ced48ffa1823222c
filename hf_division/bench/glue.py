"""GLUE tasks from the original TSV layout (``glue_data/<TASK>/{train,dev}.tsv``), their metrics, and
the pieces ``scripts/run_glue.py`` (Trainer) and ``scripts/train_accelerate.py`` (custom Accelerate
loop) are built from: their arguments, data preparation and reports. The files are read without CSV
quoting (sentences contain bare ``"``) and with ``utf-8-sig`` (MRPC's header starts with a BOM);
CoLA has no header. Metrics are computed locally with scikit-learn / SciPy, under the names
Transformers' ``run_glue`` reports (``accuracy``, ``f1``, ``matthews_correlation``, ``pearson``,
``spearmanr``).
"""
from __future__ import annotations

import csv
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import peft
import torch
from datasets import Dataset, load_dataset
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
    default_data_collator,
)

from hf_division.analysis.measure import measure_activation_memory
from hf_division.integrations.trainer import TrainingArguments, with_division


@dataclass(frozen=True)
class GlueTask:
    folder: str  # directory under the GLUE root
    text_columns: tuple  # 0-based columns of text_a (and text_b)
    label_column: int
    labels: tuple | None  # label strings in id order; None = regression (float score)
    header: bool = True

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.labels is None


TASKS = {
    "cola": GlueTask("CoLA", (3,), 1, ("0", "1"), header=False),
    "sst2": GlueTask("SST-2", (0,), 1, ("0", "1")),
    "mrpc": GlueTask("MRPC", (3, 4), 0, ("0", "1")),
    "stsb": GlueTask("STS-B", (7, 8), 9, None),
    "qnli": GlueTask("QNLI", (1, 2), 3, ("entailment", "not_entailment")),
    "rte": GlueTask("RTE", (1, 2), 3, ("entailment", "not_entailment")),
    "wnli": GlueTask("WNLI", (1, 2), 3, ("0", "1")),
    # in GLUE but not shipped in ../shared/data/glue: read if the user has the files
    "mnli": GlueTask("MNLI", (8, 9), -1, ("contradiction", "entailment", "neutral")),
    "qqp": GlueTask("QQP", (3, 4), 5, ("0", "1")),
}
_ALIASES = {"sst-2": "sst2", "sts-b": "stsb"}


def get_task(name: str) -> GlueTask:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in TASKS:
        raise ValueError(f"task_name {name!r} is not a GLUE task; choose one of {', '.join(TASKS)}")
    return TASKS[key]


def task_key(name: str) -> str:
    get_task(name)
    return _ALIASES.get(name.lower(), name.lower())


def read_split(glue_dir: str, task_name: str, split: str) -> dict:
    """Columns ``sentence1`` (, ``sentence2``) and ``label`` (int id, or float for STS-B) of one split.

    ``split``: ``train``, ``dev`` or ``test`` (the file name without ``.tsv``; MNLI: ``dev_matched``).
    """
    task = get_task(task_name)
    path = os.path.join(glue_dir, task.folder, f"{split}.tsv")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GLUE task {task_name!r}: no {split} file at {path}")
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if task.header:
        rows = rows[1:]
    rows = [r for r in rows if r]
    out = {f"sentence{i + 1}": [] for i in range(len(task.text_columns))}
    out["label"] = []
    need = max(max(task.text_columns), task.label_column) + 1
    for line, row in enumerate(rows, start=2 if task.header else 1):
        if len(row) < need:
            raise ValueError(f"{path}, line {line}: expected at least {need} tab-separated columns, got {len(row)}")
        for i, col in enumerate(task.text_columns):
            out[f"sentence{i + 1}"].append(row[col])
        out["label"].append(_label(task, row[task.label_column], path, line))
    return out


def _label(task: GlueTask, value: str, path: str, line: int):
    if task.is_regression:
        return float(value)
    try:
        return task.labels.index(value)
    except ValueError:
        raise ValueError(f"{path}, line {line}: label {value!r} is not one of {task.labels}") from None


def compute_metrics(task_name: str, predictions: np.ndarray, labels: np.ndarray) -> dict:
    """GLUE metrics of ``predictions`` (logits ``(N, num_labels)``, or ``(N,)``/``(N, 1)`` scores
    for STS-B) against ``labels`` ``(N,)``."""
    key = task_key(task_name)
    predictions = np.asarray(predictions)
    if TASKS[key].is_regression:
        scores = predictions.reshape(-1)
        pearson, spearman = float(pearsonr(scores, labels)[0]), float(spearmanr(scores, labels)[0])
        return {"pearson": pearson, "spearmanr": spearman, "combined_score": (pearson + spearman) / 2}
    preds = predictions.argmax(-1) if predictions.ndim > 1 else predictions
    if key == "cola":
        return {"matthews_correlation": float(matthews_corrcoef(labels, preds))}
    out = {"accuracy": float(accuracy_score(labels, preds))}
    if key in ("mrpc", "qqp"):
        out["f1"] = float(f1_score(labels, preds))
        out["combined_score"] = (out["accuracy"] + out["f1"]) / 2
    return out


#: the headline metric per task (what docs/RESULTS.md compares)
MAIN_METRIC = {"cola": "matthews_correlation", "stsb": "pearson", "mrpc": "f1"}


def main_metric(task_name: str) -> str:
    return MAIN_METRIC.get(task_key(task_name), "accuracy")


# ----------------------------------------------------------------------------- scripts/run_glue.py
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
        for name in ("max_seq_length", "max_train_samples", "max_eval_samples", "max_predict_samples"):
            positive(name, getattr(self, name))


def positive(name: str, value) -> None:
    """ValueError naming ``--name`` unless ``value`` is None (unset) or >= 1 (a run over no
    examples or epochs would fail later with a traceback that names neither)."""
    if value is not None and value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")


@dataclass
class LoraArguments:
    use_lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter (PEFT) instead of all weights."})
    lora_r: int = field(default=8)
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.1)
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "Module names (PEFT's default per model type if unset)."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA (weight-decomposed LoRA)."})


def parse_args(argv=None) -> tuple:
    """``(ModelArguments, DataTrainingArguments, TrainingArguments, LoraArguments)`` from the command
    line, or from one JSON file when that is the only argument (the Transformers example convention)."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, LoraArguments))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(args=argv)


def load_raw(data_args: DataTrainingArguments, training_args) -> tuple[dict, int, bool]:
    """``({split: Dataset}, number of labels, is_regression)`` for the splits ``training_args`` asks for."""
    if data_args.glue_dir is not None:
        if data_args.task_name is None:
            raise ValueError("--glue_dir needs --task_name")
        task = get_task(data_args.task_name)
        wanted = {"train": training_args.do_train, "validation": training_args.do_eval, "test": training_args.do_predict}
        mnli = data_args.task_name == "mnli"
        files = {"train": "train", "validation": "dev_matched" if mnli else "dev", "test": "test_matched" if mnli else "test"}
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


def text_columns(ds) -> tuple[str, str | None]:
    """The one or two text columns of a dataset: ``sentence1``/``sentence2``, else the first columns
    that are not ``label`` or ``idx``."""
    cols = [c for c in ds.column_names if c not in ("label", "idx")]
    if "sentence1" in cols and "sentence2" in cols:
        return "sentence1", "sentence2"
    if len(cols) >= 2:
        return cols[0], cols[1]
    return cols[0], None


def tokenize_splits(raw: dict, tokenizer, data_args: DataTrainingArguments) -> tuple[dict, object]:
    """``({split: tokenized Dataset}, data collator)``, each split cut to its ``max_*_samples``."""
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
    return data, collator


def build_model(model_args: ModelArguments, num_labels: int, regression: bool, lora_args: LoraArguments):
    """The sequence classifier of ``model_args``, wrapped in a LoRA adapter if ``lora_args`` asks."""
    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path, num_labels=num_labels,
                                        problem_type="regression" if regression else None,
                                        trust_remote_code=model_args.trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, config=config, trust_remote_code=model_args.trust_remote_code,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes, revision=model_args.model_revision,
        cache_dir=model_args.cache_dir)
    if lora_args.use_lora:
        lora = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha,
                               lora_dropout=lora_args.lora_dropout, target_modules=lora_args.lora_target_modules,
                               use_dora=lora_args.use_dora)
        model = peft.get_peft_model(model, lora)
        model.print_trainable_parameters()
    return model


def metrics_for(task_name: str | None, regression: bool):
    """``compute_metrics`` for a Trainer: the GLUE metrics of ``task_name``, else accuracy (or mse)."""

    def metrics(pred):
        if task_name is not None:
            return compute_metrics(task_name, pred.predictions, pred.label_ids)
        if regression:
            return {"mse": float(((np.squeeze(pred.predictions) - pred.label_ids) ** 2).mean())}
        return {"accuracy": float((np.argmax(pred.predictions, axis=-1) == pred.label_ids).mean())}

    return metrics


def activation_report(model, batch: dict, config) -> dict:
    """Exact bytes held for backward on ``batch``, baseline vs division, as JSON-ready numbers."""
    mem = measure_activation_memory(model, batch, config)
    return {"baseline_bytes": mem.baseline_bytes, "division_bytes": mem.division_bytes, "ratio": mem.ratio,
            "by_kind": {k: {"baseline": b, "division": d} for k, (b, d) in mem.by_kind.items()}}


def summarize(report: dict) -> None:
    """Print a run's activation bytes, peak memory, train time and eval metrics."""
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


# ----------------------------------------------------------------------------- scripts/train_accelerate.py
MIXED = ("no", "bf16", "fp16")


@dataclass
class LoopArguments:
    output_dir: str = field(metadata={"help": "Where results.json goes."})
    glue_dir: str = field(default="../shared/data/glue", metadata={"help": "GLUE TSV root (<TASK>/train.tsv)."})
    task_name: str = field(default="sst2", metadata={"help": "cola, sst2, mrpc, stsb, rte, wnli, ..."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Default: the bundled MiniLM-L6."})
    max_seq_length: int = 128
    per_device_train_batch_size: int = 16
    per_device_eval_batch_size: int = 64
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    num_train_epochs: float = 1.0
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; overrides num_train_epochs if > 0."})
    gradient_accumulation_steps: int = 1
    mixed_precision: str | None = field(default=None, metadata={"help": "no, bf16 or fp16 (default: the launcher's)."})
    seed: int = 42
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    do_eval: bool = True
    logging_steps: int = 10

    def __post_init__(self):
        self.task_name = task_key(self.task_name)  # ValueError naming the task
        if self.mixed_precision is not None and self.mixed_precision not in MIXED:
            raise ValueError(f"--mixed_precision must be one of {MIXED}, got {self.mixed_precision!r}")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_seq_length",
                     "max_train_samples", "max_eval_samples"):
            positive(name, getattr(self, name))
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError(f"--num_train_epochs must be > 0 (or --max_steps >= 1), got {self.num_train_epochs}")


def parse_loop_args(argv=None):
    """:class:`LoopArguments` plus the ``--division``/``--division_<field>`` options, from the command line."""
    (args,) = HfArgumentParser(with_division(LoopArguments)).parse_args_into_dataclasses(args=argv)
    return args


def tokenized_examples(args: LoopArguments, tokenizer) -> tuple[dict, GlueTask]:
    """``({"train": [...], "dev": [...]}, task)``: each split a list of example dicts (tensors padded
    to ``max_seq_length``, ``labels`` float for regression), cut to its ``max_*_samples``."""
    task = get_task(args.task_name)
    out = {}
    for split, limit in (("train", args.max_train_samples), ("dev", args.max_eval_samples)):
        cols = read_split(args.glue_dir, args.task_name, split)
        n = len(cols["label"]) if limit is None else min(limit, len(cols["label"]))
        texts = [cols[f"sentence{i + 1}"][:n] for i in range(len(task.text_columns))]
        enc = tokenizer(*texts, padding="max_length", truncation=True, max_length=args.max_seq_length, return_tensors="pt")
        labels = torch.tensor(cols["label"][:n], dtype=torch.float32 if task.is_regression else torch.long)
        out[split] = [{**{k: v[i] for k, v in enc.items()}, "labels": labels[i]} for i in range(n)]
    return out, task


def collated_batches(glue_dir: str, task_name: str, tokenizer, batch: int, max_length: int, count: int,
                     seed: int = 0) -> list[dict]:
    """``count`` training batches of ``task_name``'s train split as the Trainer feeds them with
    ``--pad_to_max_length false``: shuffled with ``seed``, truncated to ``max_length`` tokens and
    padded to each batch's longest sequence (``DataCollatorWithPadding``), so that the shapes vary
    from batch to batch (cycling through the split if it holds fewer than ``count * batch`` rows)."""
    task = get_task(task_name)
    cols = read_split(glue_dir, task_name, "train")
    texts = [cols[f"sentence{i + 1}"] for i in range(len(task.text_columns))]
    enc = tokenizer(*texts, truncation=True, max_length=max_length)
    order = torch.randperm(len(cols["label"]), generator=torch.Generator().manual_seed(seed)).tolist()
    collate = DataCollatorWithPadding(tokenizer, return_tensors="pt")
    out = []
    for b in range(count):
        rows = [order[(b * batch + i) % len(order)] for i in range(batch)]
        out.append(collate([{**{k: v[j] for k, v in enc.items()}, "labels": cols["label"][j]} for j in rows]))
    return out
