"""The architecture table: every registered model type at the conformance shape.

python -m hf_division.bench architectures [--types bert llama ...] [--generic] [--seeds 0 1]
    [--json docs/results/architectures.json] [--markdown]

Each type's tiny random-init model (:mod:`hf_division.bench.tiny_models`: hidden 64, 2 layers, fp32; token
batches of 128, ViT/CLIP/SigLIP 48x48 images in 4x4 patches, Whisper 128 encoder tokens) with
eager and, where Transformers offers it, sdpa attention: bytes held baseline/division at batch 4
and 2 (``measure_activation_memory``) and the minimum gradient cosine over ``--seeds`` at batch
4, with the default policy. ``--generic``: the generic fallback instead of the type's own patcher
(hidden from the registry for the run). ``--markdown``: the docs/ARCHITECTURES.md table.
"""
from __future__ import annotations

import contextlib
import warnings

from hf_division.config import DivisionConfig
from hf_division.registry import supported_model_types, unregistered
from hf_division.bench.tiny_models import has_impl, tiny_batch, tiny_model
from hf_division.bench.suites.common import measure_config, set_threads, suite_parser, write_json

IMPLS = ("eager", "sdpa")
#: real pretrained weights measured for the type (docs/RESULTS.md)
REAL = {"bert": "MiniLM-L6", "llama": "SmolLM2-135M"}


def measure_type(model_type: str, impl: str, seeds, generic: bool) -> dict | None:
    """One row: ratios at batch 4 and 2 and the minimum cosine, or None if ``impl`` is unavailable."""
    try:
        model = tiny_model(model_type, impl)
    except ValueError as err:
        if has_impl(err):
            raise
        return None
    config = DivisionConfig(generic_fallback=True) if generic else None
    hidden = unregistered(model_type) if generic else contextlib.nullcontext()
    with hidden, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic fallback's warning, once per measurement
        four = measure_config(model, tiny_batch(batch=4, seq=128, model_type=model_type), config, seeds)
        two = measure_config(model, tiny_batch(batch=2, seq=128, model_type=model_type), config, seeds[:1])
    return {"type": model_type, "impl": impl, "ratio_4x128": round(four.memory.ratio, 2),
            "ratio_2x128": round(two.memory.ratio, 2), "cos_min": round(four.cos_min, 4),
            "real_weights": REAL.get(model_type, "")}


def markdown(rows: list[dict]) -> str:
    """The rows as one line per type: impls, then each impl's ratio (4x128) and cosine."""
    out = ["| model_type | attention | bytes held 4x128 (2x128) | gradient cosine | real weights measured |",
           "|---|---|---|---|---|"]
    by_type: dict = {}
    for row in rows:
        by_type.setdefault(row["type"], []).append(row)
    for model_type, found in by_type.items():
        impls = ", ".join(r["impl"] for r in found)
        ratios = " / ".join(f"{r['ratio_4x128']:.1f}x ({r['ratio_2x128']:.1f}x)" for r in found)
        cosines = " / ".join(f"{r['cos_min']:.4f}" for r in found)
        out.append(f"| {model_type} | {impls} | {ratios} | {cosines} | {found[0]['real_weights'] or 'no'} |")
    return "\n".join(out)


def main(argv=None):
    ap = suite_parser("architectures", __doc__)
    ap.add_argument("--types", nargs="+", default=None, help="model types (default: every registered one)")
    ap.add_argument("--generic", action="store_true", help="measure the generic fallback instead")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--markdown", action="store_true", help="print the docs table at the end")
    args = ap.parse_args(argv)
    set_threads()
    types = args.types or supported_model_types()
    unknown = [t for t in types if t not in supported_model_types()]
    if unknown:
        raise ValueError(f"--types: no patcher for {unknown}; registered: {supported_model_types()}")
    rows = []
    print(f"{'model_type':<13} {'impl':<6} {'4x128':>7} {'2x128':>7} {'cos min':>8}")
    for model_type in types:
        for impl in IMPLS:
            row = measure_type(model_type, impl, tuple(args.seeds), args.generic)
            if row is not None:
                rows.append(row)
                print(f"{model_type:<13} {impl:<6} {row['ratio_4x128']:>7.2f} {row['ratio_2x128']:>7.2f} "
                      f"{row['cos_min']:>8.4f}", flush=True)
    write_json(args.json, rows)
    if args.markdown:
        print(markdown(rows))
    return rows
