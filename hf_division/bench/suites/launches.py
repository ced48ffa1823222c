"""Kernel launches per training step on the GPU's path, counted on a CPU machine: the unpatched
model against division (docs/DESIGN.md, "On a GPU").

TRITON_INTERPRET=1 python -m hf_division.bench launches [--shape smollm2] [--layers N] [--size 1x32]
    [--autocast bf16] [--host-rounds 20] [--out launches.json]

A Llama-shaped model of ``--shape`` (:data:`hf_division.bench.suites.cuda.SHAPES`, random weights;
``--layers`` overrides the depth) trains one step on random token ids; the step runs as on a GPU
(:func:`hf_division.analysis.launches.gpu_path`: the Triton kernels under Triton's interpreter, the
CPU-only fast paths off) and every op that would launch a kernel is counted
(:class:`~hf_division.analysis.launches.KernelCounter`). Arms: ``none``; ``division``;
``division-torch``, division with the compressor's torch kernels run eagerly instead of Triton's
(the GPU path before them). Counts do not depend on the batch's size once every saved tensor holds
at least ``min_numel`` elements (SmolLM2's shape at 1 x 32), so a small batch serves. Printed: torch kernels, Triton kernels, their sum and its ratio to the
unpatched step's, the ops that read back on the host (none but the unpatched model's own), and
the ops division adds most of. Also the host's time per saved tensor of the shape's hidden size
outside the kernels (``--host-tokens`` tokens; the launches counted but not run): what the host
adds per tensor on a GPU besides the launches themselves; and the host's time per training step,
unpatched and with division, the launches counted but not run (:func:`host_steps`).
"""
from __future__ import annotations

import gc
import os
import sys
import time

import torch

from hf_division.analysis.launches import gpu_path, step_counts, train_step
from hf_division.api import apply_division
from hf_division.config import DivisionConfig
from hf_division.bench.suites import cuda as cuda_suite
from hf_division.bench.suites.common import set_threads, suite_parser, write_json
from hf_division.bench.textdata import random_tokens
from hf_division.compress.pipeline import compress, decompress
from hf_division.kernels import configured, triton_codec


def count(shape: str, layers: int | None, size: tuple[int, int], autocast) -> dict:
    """``{arm: counts}`` for one step of ``shape``, the arms of the module doc."""
    model = cuda_suite.build(shape, "cpu", layers=layers).train()
    batch = random_tokens(model.config.vocab_size, *size, seed=0)
    batch["labels"] = batch["input_ids"]
    out = {}
    with gpu_path():
        for arm in ("none", "division", "division-torch"):
            if arm == "division":
                apply_division(model)
            with configured(triton=arm != "division-torch", compile=False):
                c = step_counts(model, batch, autocast)
            out[arm] = {"torch": sum(c.ops.values()), "triton": c.triton, "readbacks": sorted(c.readbacks),
                        "ops": dict(c.ops)}
    return out


#: the narrow stand-in of a shape whose host time is measured: the shape's depth and layer
#: structure at this width, so that its tiny kernels leave the host's own work to be timed
HOST_WIDTH = dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
#: the stand-in's ``min_numel``: at hidden 64 and 1 x 32 tokens k and v hold 1024 elements, below
#: the default 4096, and every saved tensor is compressed as at the shape's own width
HOST_MIN_NUMEL = 256


def host_steps(shape: str, layers: int | None, size: tuple[int, int], rounds: int, autocast) -> dict:
    """Host milliseconds of one training step (forward, backward, ``zero_grad``) per arm, ``none``
    and ``division``, on the GPU's path with the Triton kernels counted but not run
    (:func:`~hf_division.kernels.triton_codec.not_run`, the launches per step too): what the host
    must keep up with per step on a GPU, the launches aside (a GPU whose kernels take less time
    than this waits for the host). The shape's depth and layers at :data:`HOST_WIDTH` on ``size``
    (batch, tokens; 1 x 32: CPU kernels that cost about what launching a GPU's does); arms
    interleaved, ``rounds`` steps each, then as many after ``gc.freeze()``. Per arm: ``launches``
    per step (to check against :func:`count`'s of the shape itself), ``forward_objects``
    (:func:`forward_objects`), and :func:`interleaved`'s figures, those after the freeze suffixed
    ``_frozen``."""
    models = {arm: cuda_suite.build(shape, "cpu", layers=layers, **HOST_WIDTH).train() for arm in ("none", "division")}
    apply_division(models["division"], DivisionConfig(min_numel=HOST_MIN_NUMEL))
    batch = random_tokens(HOST_WIDTH["vocab_size"], *size, seed=0)
    batch["labels"] = batch["input_ids"]
    out = {}
    # the kernels counted, not run, here too: the GPU's path reads nothing back, so what their
    # outputs hold decides no launch (the interpreter would take most of the suite's time)
    with gpu_path(), triton_codec.not_run():
        for arm, model in models.items():
            c = step_counts(model, batch, autocast)
            out[arm] = {"launches": sum(c.ops.values()) + c.triton}
        for arm, model in models.items():
            out[arm]["forward_objects"] = forward_objects(model, batch, autocast)
        for frozen in (False, True):
            timed = interleaved(models, batch, autocast, rounds, frozen)
            for arm, r in timed.items():
                out[arm].update({f"{k}_frozen" if frozen else k: v for k, v in r.items()})
    return out


def interleaved(models: dict, batch: dict, autocast, rounds: int, frozen: bool, switched: dict | None = None) -> dict:
    """:func:`host_steps`' timing: ``rounds`` steps per arm, interleaved; per arm the min and
    median milliseconds, the median of the forward's alone (until its loss), and the garbage
    collector's collections and milliseconds per step, by generation. ``frozen``: after
    ``gc.freeze()`` (undone after), the objects made so far left out of every collection
    (docs/GUIDE.md, "On a GPU"). ``switched``: an arm's switches
    (:func:`~hf_division.kernels.configured`) during its steps (arms may share a model)."""
    times = {arm: [] for arm in models}
    forwards = {arm: [] for arm in models}
    collections = {arm: {} for arm in models}
    current, started = [None], [0.0]

    def watch(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        elif current[0] is not None:
            n, ms = collections[current[0]].get(info["generation"], (0, 0.0))
            collections[current[0]][info["generation"]] = (n + 1, ms + 1e3 * (time.perf_counter() - started[0]))

    gc.callbacks.append(watch)
    if frozen:
        gc.freeze()
    try:
        for r in range(rounds):
            for arm in (list(models) if r % 2 == 0 else list(models)[::-1]):
                current[0] = arm
                with configured(**(switched or {}).get(arm, {})):
                    t0 = time.perf_counter()
                    forwards[arm].append(1e3 * train_step(models[arm], batch, autocast))
                    times[arm].append(1e3 * (time.perf_counter() - t0))
                current[0] = None
    finally:
        gc.callbacks.remove(watch)
        if frozen:
            gc.unfreeze()
    out = {}
    for arm, ts in times.items():
        ts.sort()
        gcs = {str(g): {"per_step": n / rounds, "ms_per_step": ms / rounds} for g, (n, ms) in sorted(collections[arm].items())}
        out[arm] = {"min": ts[0], "median": ts[len(ts) // 2], "mean": sum(ts) / len(ts),
                    "forward_median": sorted(forwards[arm])[len(ts) // 2], "gc": gcs}
    return out


def forward_objects(model, batch: dict, autocast) -> int:
    """How many objects the garbage collector tracks that one training forward leaves alive until
    its backward (the collector off meanwhile): what each of its collections until then walks,
    and what promotes to its oldest generation, whose full collections walk every object of the
    process."""
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(**batch).loss
        held = len(gc.get_objects()) - before
        loss.backward()
        model.zero_grad(set_to_none=True)
    finally:
        gc.enable()
    return held


def saved_tensor(hidden: int, tokens: int) -> tuple[torch.Tensor, dict]:
    """One bf16 ``(1, tokens, hidden)`` tensor and the arguments that compress it as the defaults do
    (a seeded generator): what the suites' host time per saved tensor is measured on."""
    kw = dict(bits=4, block_size=16, group_size=256, outlier_ratio=16.0, generator=torch.Generator().manual_seed(0))
    return torch.randn(1, tokens, hidden).bfloat16(), kw


def stand_in_arguments(ap) -> None:
    """The command-line options of the model a suite's step stands for: ``--shape``, ``--layers``,
    ``--size``, ``--autocast`` and ``--host-tokens`` (of the saved tensor timed alone)."""
    ap.add_argument("--shape", default="smollm2", choices=list(cuda_suite.SHAPES))
    ap.add_argument("--layers", type=int, help="override the shape's depth")
    ap.add_argument("--size", type=cuda_suite.parse_size, default=(1, 32))
    ap.add_argument("--autocast", default="bf16", choices=["none", "bf16"])
    ap.add_argument("--host-tokens", type=int, default=8192)


def host_us(hidden: int, tokens: int, rounds: int = 200) -> tuple[float, float]:
    """Microseconds of host time to compress and to rebuild one bf16 ``(tokens, hidden)`` tensor with
    the defaults, the kernels counted but not run (median of ``rounds``)."""
    x, kw = saved_tensor(hidden, tokens)
    with gpu_path():
        p = compress(x, **kw)
        times = {"compress": [], "rebuild": []}
        with triton_codec.not_run():
            for _ in range(rounds):
                t0 = time.perf_counter()
                compress(x, **kw)
                t1 = time.perf_counter()
                decompress(p)
                times["compress"].append(t1 - t0)
                times["rebuild"].append(time.perf_counter() - t1)
    return tuple(1e6 * sorted(v)[len(v) // 2] for v in times.values())


def report(shape: str, res: dict) -> str:
    base = res["none"]["torch"] + res["none"]["triton"]
    lines = [f"{shape}: arm | torch kernels | triton kernels | total (x none) | readbacks"]
    for arm, r in res.items():
        total = r["torch"] + r["triton"]
        lines.append(f"  {arm:10s} {r['torch']:7d} {r['triton']:7d} {total:7d} ({total / base:.2f}x) "
                     f"{len(r['readbacks'])}")
    added = {op: n - res["none"]["ops"].get(op, 0) for op, n in res["division"]["ops"].items()}
    top = sorted(((n, op) for op, n in added.items() if n > 0), reverse=True)[:8]
    lines.append("  division adds most: " + ", ".join(f"{op} +{n}" for n, op in top))
    return "\n".join(lines)


def host_report(steps: dict, size: tuple[int, int], rounds: int) -> str:
    none, div = steps["none"], steps["division"]
    lines = [f"  host per step at hidden {HOST_WIDTH['hidden_size']}, {size[0]}x{size[1]} tokens, kernels not run ({rounds} steps "
             f"each): none min {none['min']:.1f} ms, division min {div['min']:.1f} ms ({div['min'] / none['min']:.2f}x); "
             f"means {none['mean']:.1f} and {div['mean']:.1f} ms"]
    for arm, r in steps.items():
        gcs = ", ".join(f"gen {g}: {c['per_step']:.2f}/step {c['ms_per_step']:.2f} ms" for g, c in r["gc"].items())
        frozen = ", ".join(f"gen {g}: {c['ms_per_step']:.2f} ms" for g, c in r["gc_frozen"].items())
        lines.append(f"    {arm}: {r['launches']} launches, {r['forward_objects']} objects held by a forward; "
                     f"collections {gcs or 'none'}; after gc.freeze(): mean {r['mean_frozen']:.1f} ms, {frozen or 'none'}")
    return "\n".join(lines)


def main(argv=None):
    ap = suite_parser("launches", __doc__)
    stand_in_arguments(ap)
    ap.add_argument("--host-rounds", type=int, default=20, help="timed steps per arm of the host time per step")
    ap.add_argument("--out")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    set_threads()  # HF_DIVISION_THREADS, else 2: the recorded runs' (docs/RESULTS.md, "Kernel launches")
    if not triton_codec.available():
        raise SystemExit("hf-division launches suite: needs Triton (pip install triton)")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("hf-division launches suite: run it with TRITON_INTERPRET=1 on a machine without CUDA")
    amp = torch.bfloat16 if args.autocast == "bf16" else None
    res = count(args.shape, args.layers, args.size, amp)
    print(report(args.shape, res), flush=True)
    hidden = cuda_suite.SHAPES[args.shape]["hidden_size"]
    compress_us, rebuild_us = host_us(hidden, args.host_tokens)
    print(f"  host per saved {args.host_tokens}x{hidden} bf16 tensor, kernels not run: compress {compress_us:.0f} us, "
          f"rebuild {rebuild_us:.0f} us", flush=True)
    steps = host_steps(args.shape, args.layers, args.size, args.host_rounds, amp)
    print(host_report(steps, args.size, args.host_rounds), flush=True)
    write_json(args.out, {"argv": argv, "shape": args.shape, "layers": args.layers, "size": args.size, "arms": res,
                          "host_us": {"compress": compress_us, "rebuild": rebuild_us}, "host_step_ms": steps})
    return res
