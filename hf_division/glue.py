"""GLUE tasks from the original TSV layout (``glue_data/<TASK>/{train,dev}.tsv``) and their metrics.

Used by ``scripts/run_glue.py`` and ``scripts/train_accelerate.py``. The files are read without CSV
quoting (sentences contain bare ``"``) and with ``utf-8-sig`` (MRPC's header starts with a BOM);
CoLA has no header. Metrics are computed locally with scikit-learn / SciPy, under the names
Transformers' ``run_glue`` reports (``accuracy``, ``f1``, ``matthews_correlation``, ``pearson``,
``spearmanr``).
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass

import numpy as np


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
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

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
