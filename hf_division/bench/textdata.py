"""The text the project measures on: GLUE TSV files (SST-2 by default) turned into training batches."""
from __future__ import annotations

import csv
import os

import torch

#: 200 real SST-2 dev rows shipped with the package, for runs without the GLUE download
BUNDLED_SST2_DEV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sst2_dev_sample.tsv")


def read_tsv(path: str) -> list[list[str]]:
    """Every line of a GLUE TSV file split on tabs, header included; no quoting (GLUE's text
    holds bare quote characters)."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def sst2_rows(path: str) -> list[tuple[str, int]]:
    """``(sentence, label)`` per row of an SST-2 TSV file (``sentence<TAB>label`` after a header)."""
    return [(r[0], int(r[1])) for r in read_tsv(path)[1:] if r]


def classification_batch(tokenizer, rows, batch: int, seq: int, device="cpu", offset: int = 0,
                         token_type_ids: bool = True) -> dict:
    """``batch`` rows from ``offset`` (cycling if there are fewer), padded and truncated to ``seq``
    tokens, with ``labels``. ``token_type_ids=False`` drops them (Llama takes none; BERT's are all
    zero for single sentences)."""
    picked = [rows[(offset + i) % len(rows)] for i in range(batch)]
    enc = tokenizer([s for s, _ in picked], padding="max_length", max_length=seq, truncation=True, return_tensors="pt")
    out = dict(enc, labels=torch.tensor([y for _, y in picked]))
    if not token_type_ids:
        out.pop("token_type_ids", None)
    return {k: v.to(device) for k, v in out.items()}


def causal_lm_batch(tsv: str, tokenizer, batch: int = 4, seq: int = 128) -> dict:
    """``batch x seq`` token ids packed from the sentences of a GLUE TSV (first column, joined with
    the tokenizer's eos token, no padding); labels = ids (causal-LM loss). int64 tensors."""
    rows = read_tsv(tsv)
    if not rows or rows[0][0] != "sentence":
        raise ValueError(f"{tsv}: expected a GLUE TSV whose first column is 'sentence'")
    ids = tokenizer(tokenizer.eos_token.join(r[0].strip() for r in rows[1:]))["input_ids"]
    need = batch * seq
    if len(ids) < need:
        raise ValueError(f"{tsv}: {len(ids)} tokens, fewer than batch x seq = {need}")
    x = torch.tensor(ids[:need]).view(batch, seq)
    return {"input_ids": x, "labels": x.clone()}


def glue_sentences(tsv: str) -> list[str]:
    """The sentences of a GLUE TSV in file order: the ``sentence`` column (SST-2, CoLA), or both
    sentences of each row as separate texts (MRPC's ``#1 String`` and ``#2 String``)."""
    rows = read_tsv(tsv)
    header = rows[0] if rows else []
    columns = [header.index(c) for c in ("sentence", "#1 String", "#2 String") if c in header]
    if not columns:
        raise ValueError(f"{tsv}: expected a GLUE TSV with a 'sentence' or '#1 String'/'#2 String' column")
    return [r[c].strip() for r in rows[1:] if len(r) == len(header) for c in columns]


def sentence_batch(tokenizer, sentences: list[str], start: int, batch: int, pad: str | int = "longest") -> dict:
    """Sentences ``start .. start + batch - 1``, one per row, right-padded to the longest (``pad``
    ``"longest"``) or to ``pad`` tokens (truncating), with the attention mask; labels = ids with
    the padding at -100 (causal-LM loss on the real tokens)."""
    if start + batch > len(sentences):
        raise ValueError(f"sentences {start}..{start + batch - 1} asked, {len(sentences)} in the file")
    texts = sentences[start:start + batch]
    if pad == "longest":
        enc = tokenizer(texts, padding="longest", return_tensors="pt")
    else:
        enc = tokenizer(texts, padding="max_length", max_length=int(pad), truncation=True, return_tensors="pt")
    labels = enc["input_ids"].clone()
    labels[enc["attention_mask"] == 0] = -100
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def random_tokens(vocab_size: int, batch: int, seq: int, seed: int, num_labels: int = 2) -> dict:
    """``batch x seq`` random token ids in ``[1, vocab_size)`` and one label per row, drawn from a
    generator seeded with ``seed`` (torch's global RNG untouched)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": torch.randint(0, num_labels, (batch,), generator=g)}


def sft_texts(tsv: str, rows: int, seed: int = 0, sentences=(2, 7)) -> list[str]:
    """``rows`` training texts for a supervised fine-tuning run: runs of ``sentences`` (a range,
    drawn per row with a seeded generator) consecutive sentences of a GLUE TSV, so that lengths
    vary from row to row and a collator that pads to the longest row sees a new shape each batch."""
    found = [r[0].strip() for r in read_tsv(tsv)[1:] if r]
    g = torch.Generator().manual_seed(seed)
    out, start = [], 0
    for _ in range(rows):
        k = int(torch.randint(sentences[0], sentences[1] + 1, (), generator=g))
        if start + k > len(found):
            start = 0
        out.append(" ".join(found[start : start + k]))
        start += k
    return out
