"""Gradient fidelity and bytes of random-init decoder shapes, with the GPU's math, on the CPU.

python -m hf_division.bench shapes [--shapes smollm2 llama-1b ...] [--layers N] [--vocab 8192]
    [--size 1x512] [--draws 3] [--autocast bf16] [--checkpointing] [--mlp-error]
    [--set JSON | --layout NAME=JSON ...] [--json out.json]

Llama-shaped causal LMs with random weights, as the cuda suite builds them (its ``SHAPES``: the
widths and depths of SmolLM2-135M and -360M, Qwen2.5-0.5B and -1.5B, Qwen3-0.6B and
Llama-3.2-1B), at their own depth (``--layers``: another) with a ``--vocab``-token vocabulary
(the real vocabularies' embeddings cost CPU memory and time and hold no saved activation but
the loss's), causal-LM loss
on random token ids, forward under ``--autocast``, with the CPU-only fast paths off
(:data:`~hf_division.analysis.launches.GPU_SWITCHES`): the compressor's torch kernels, whose codes
the GPU's Triton kernels equal to the bit. This is how a gradient cosine measured on a GPU is
reproduced on a CPU machine at a smaller batch (docs/RESULTS.md, "The Llama-1B shape's cosine").
The model, its gradient and two float32 copies of it must fit in memory: the Qwen2.5-1.5B shape
ran in 24 GiB, SmolLM2-1.7B's did not.

Per shape: bytes held for backward by the unpatched model and by division (loss included,
:func:`~hf_division.analysis.measure.account`), the activation inputs' bits division resolved for
it, the whole float64 gradient cosine to the unpatched model's over ``--draws`` rounding-noise
draws (min and median) and the lowest per-tensor cosine (tensors holding >= 1% of the norm).
``--layout``: division with each of these configs, a row each, instead of ``--set``'s one.
``--checkpointing``: both arms under Transformers' activation checkpointing. ``--mlp-error``:
also the expected share of each layer's MLP input gradient that 4-bit gate/up rounding would add
(:func:`~hf_division.analysis.gated_mlp.gate_up_error`, from the unpatched model), its range over
the layers.
"""
from __future__ import annotations

import json
import time

import torch

from hf_division.api import apply_division, division_config_of, remove_division
from hf_division.config import DivisionConfig
from hf_division.analysis.fidelity import gradient_fidelity
from hf_division.analysis.gated_mlp import gate_up_error
from hf_division.analysis.launches import GPU_SWITCHES
from hf_division.analysis.measure import account
from hf_division.bench.suites.common import AUTOCAST, set_threads, suite_parser, write_json
from hf_division.bench.suites.cuda import SHAPES, build, parse_size
from hf_division.bench.textdata import random_tokens
from hf_division.kernels import configured



def measure(shape: str, layers: int | None, vocab: int | None, size: tuple[int, int], draws: int, amp,
            config: DivisionConfig, checkpointing: bool = False, mlp_error: bool = False) -> dict:
    """The figures of the module doc for one shape."""
    model = build(shape, "cpu", layers=layers, vocab_size=vocab)
    if checkpointing:
        model.activation_checkpointing_enable()
    batch = random_tokens(model.config.vocab_size, *size, seed=0)
    batch["labels"] = batch["input_ids"]
    model.train()
    start = time.perf_counter()
    with configured(**GPU_SWITCHES, compile=False):
        none = account(model, batch, autocast=amp).total
        apply_division(model, config)
        held = account(model, batch, autocast=amp).total
        resolved = division_config_of(model)
        remove_division(model)
        # float32 between passes: two float64 copies of a 1B model's gradient do not fit beside it
        found = gradient_fidelity(model, batch, config, draws, autocast=amp, dtype=torch.float32)
        if mlp_error:
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                errors = [e.relative for e in gate_up_error(model, {**batch, "attention_mask": torch.ones_like(
                    batch["input_ids"])})]
    name, worst = found.worst_tensor
    fields = model.config
    return {"shape": shape, "layers": fields.num_hidden_layers, "hidden": fields.hidden_size,
            "intermediate": fields.intermediate_size, "vocab": fields.vocab_size, "batch": size[0], "seq": size[1],
            "checkpointing": checkpointing, "activation_bits": resolved.bits("activation"),
            "early_layers": resolved.early_layers, "none_mib": none / 2**20, "division_mib": held / 2**20,
            "fewer": none / held, "cosine_min": found.worst, "cosine_median": found.median, "whole": found.whole,
            "tensor_min": worst, "tensor": name, "seconds": time.perf_counter() - start,
            **({"mlp_error": [min(errors), max(errors)]} if mlp_error else {})}


def main(argv=None):
    ap = suite_parser("shapes", __doc__)
    ap.add_argument("--shapes", nargs="+", default=["smollm2", "llama-1b"], choices=list(SHAPES))
    ap.add_argument("--layers", type=int, help="another depth than the shape's")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size (0: the shape's own)")
    ap.add_argument("--size", type=parse_size, default=(1, 512), help="BATCHxSEQ")
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--autocast", default="bf16", choices=list(AUTOCAST))
    ap.add_argument("--checkpointing", action="store_true", help="both arms under activation checkpointing")
    ap.add_argument("--mlp-error", action="store_true", help="also 4-bit gate/up's expected error per layer")
    ap.add_argument("--set", type=json.loads, default={}, help="DivisionConfig fields as JSON")
    ap.add_argument("--layout", action="append", default=[], metavar="NAME=JSON",
                    help="measure division with these DivisionConfig fields too, as rows named NAME (repeatable); "
                         "given, it replaces --set")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.draws < 1:
        ap.error("--draws: at least 1")
    set_threads(args.threads)
    layouts = parse_layouts(ap, args.layout or [f"set={json.dumps(args.set)}"])
    rows = []
    print("shape | layout | layers | hidden | act bits | none MiB | division MiB (fewer) | cosine min / median | "
          "per-tensor min", flush=True)
    for shape, (name, fields) in ((s, lay) for s in args.shapes for lay in layouts.items()):
        row = measure(shape, args.layers, args.vocab or None, args.size, args.draws, AUTOCAST[args.autocast],
                      DivisionConfig(**fields), args.checkpointing, args.mlp_error)
        row.update(layout=name, fields=fields)
        rows.append(row)
        print(f"{shape} | {name} | {row['layers']} | {row['hidden']} | {row['activation_bits']} | {row['none_mib']:.1f} | "
              f"{row['division_mib']:.1f} ({row['fewer']:.1f}x) | {row['cosine_min']:.4f} / {row['cosine_median']:.4f} | "
              f"{row['tensor_min']:.4f} ({row['tensor']})"
              + (" | MLP error {:.3f}-{:.3f}".format(*row["mlp_error"]) if args.mlp_error else ""), flush=True)
        write_json(args.json, {"size": list(args.size), "layouts": layouts, "rows": rows})
    return rows


def parse_layouts(ap, specs: list[str]) -> dict[str, dict]:
    """``NAME=JSON`` strings -> ``{name: fields}``, each checked as a DivisionConfig (an error names
    the layout and the field)."""
    layouts = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        try:
            fields = json.loads(text) if sep else None
            if not isinstance(fields, dict):
                raise ValueError("expected NAME={JSON object}")
            DivisionConfig(**fields)
        except (ValueError, TypeError) as err:
            ap.error(f"--layout {spec!r}: {err}")
        layouts[name] = fields
    return layouts
