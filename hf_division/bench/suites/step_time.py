"""Training step time: baseline vs division vs activation checkpointing, interleaved, medians.

python -m hf_division.bench step-time [--batch 32 --seq 128 --rounds 7] [--attn sdpa] [--division_<field> V ...]
python -m hf_division.bench step-time --model bert-base-4l   # or llama-4l: the random-init shapes of hf_division.bench.zoo
python -m hf_division.bench step-time --profile [--top 25]   # where the time goes: torch.profiler, per op
python -m hf_division.bench step-time --token-chunks 1048576 4194304   # one division arm per compiled chunk size
python -m hf_division.bench step-time --glue-dir ../shared/data/glue --task mrpc   # real batches, padded per batch
python -m hf_division.bench step-time --aten-draws   # also division with ATen's dropout draws, not the native ones
python -m hf_division.bench step-time --model llama-4l --generic-norm   # also division with RMSNorm recomputed under autograd
python -m hf_division.bench step-time --model llama-4l --rebuilt-gated   # also division rebuilding gate and up (no fused SiLU kernel)
python -m hf_division.bench step-time --model llama-4l --plain-rotary   # also division with the rotary embedding under autograd
python -m hf_division.bench step-time --nearest   # also division rounding to nearest: the floor of any noise generator
python -m hf_division.bench step-time --also-set '{"late_layers": 0}'   # also division with these config fields changed
python -m hf_division.bench step-time --control   # also a second unpatched copy of the model: the A/A spread of this run
python -m hf_division.bench step-time --split   # also the forward (up to the loss) and the backward apart
python -m hf_division.bench step-time --json docs/results/step_time/NAME.json   # also every round's seconds, per arm

Real MiniLM-L6 by default. Each round times one step (forward + backward) of every method in
turn, so machine noise hits all methods alike; the report gives each method's median, its ratio
to the baseline's median, and the median (and quartiles) of the ratio to the baseline's step of
the same round, which load drifting over minutes moves less. The batch is ``--batch`` random tokens x ``--seq``, or, with ``--task``,
a new batch of that GLUE task's training rows each round, padded to its longest sequence (at most
``--seq``) as the Trainer's collator pads them: shapes vary from step to step, as in a real run.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time

import torch
from transformers import HfArgumentParser

from hf_division.config import DivisionConfig
from hf_division.kernels import compiled as fused, configured
from hf_division.bench.glue import collated_batches, get_task
from hf_division.api import apply_division
from hf_division.autograd.store import COMPRESS_LABEL, REBUILD_LABEL
from hf_division.analysis.timing import interleaved_times, quartile_ratios, round_ratios, timed
from hf_division.bench.zoo import DESCRIPTION, SHAPES, build_classifier, minilm_tokenizer
from hf_division.bench.suites.common import suite_parser, write_json


def step(model, batch, forward_seconds: list | None = None) -> None:
    """One training step; the forward's seconds (up to the loss) appended to ``forward_seconds``."""
    t0 = time.perf_counter()
    loss = model(**batch).loss
    if forward_seconds is not None:
        forward_seconds.append(time.perf_counter() - t0)
    loss.backward()


def parser() -> argparse.ArgumentParser:
    ap = suite_parser("step-time", __doc__)
    ap.add_argument("--model", default="minilm", choices=["minilm", *SHAPES], help="real MiniLM or a random-init shape")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="profile one step of baseline and division instead")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--split", action="store_true",
                    help="also report the forward (up to the loss) and the backward of each step apart")
    ap.add_argument("--token-chunks", type=int, nargs="*", default=[],
                    help="also time division at these compiled chunk sizes (elements; hf_division.kernels.compiled.TOKEN_CHUNK)")
    for flag, (switch, what) in SWITCHED_OFF.items():
        ap.add_argument(f"--{flag}", action="store_true",
                        help=f"also time division with {what} (the {switch} switch off: hf_division.kernels.configure)")
    ap.add_argument("--nearest", action="store_true",
                    help="also time division rounding its codes to nearest (division_rounding nearest): "
                         "the step a rounding-noise generator that cost nothing would leave")
    ap.add_argument("--also-set", type=json.loads, metavar="JSON",
                    help="also time division with these DivisionConfig fields changed (arm division-set), "
                         "e.g. '{\"late_layers\": 0}': what a policy costs, in the same rounds")
    ap.add_argument("--control", action="store_true",
                    help="also time an unpatched copy of the model (same work as the baseline): what two identical "
                         "arms read in this run")
    ap.add_argument("--json", help="also write every timed round's seconds (step and forward) per arm here")
    ap.add_argument("--glue-dir", help="GLUE folder (with --task)")
    ap.add_argument("--task", help="time real batches of this two-label GLUE task's train split (needs --glue-dir)")
    return ap


#: flag -> (the fast path it times division without: its switch, what runs instead); arm ``division-<flag>``
SWITCHED_OFF = {
    "aten-draws": ("native_draws", "dropout masks drawn by ATen's bernoulli_"),
    "generic-norm": ("rms_norm_backward", "Llama-form RMSNorms on the generic recomputation"),
    "rebuilt-gated": ("gated_from_codes", "the SiLU-gated MLP's gate and up rebuilt as tensors in backward"),
    "plain-rotary": ("rotary", "the model's rotary embedding run under autograd, not one native pass each way"),
}


def build_methods(args, dc: DivisionConfig, also: DivisionConfig | None = None) -> tuple[dict, dict]:
    """``{arm: model}`` (the variants of division share its model) and ``{arm: compiled chunk size}``;
    ``also``: the config of the ``division-set`` arm (``--also-set``), if any."""
    base = build_classifier(args.model, args.attn)
    methods = {"baseline": base, "division": apply_division(copy.deepcopy(base), dc)}
    ckpt = copy.deepcopy(base)
    ckpt.activation_checkpointing_enable()
    methods["checkpointing"] = ckpt
    if args.control:
        methods["baseline-copy"] = copy.deepcopy(base)
    if args.nearest:
        methods["division-nearest"] = apply_division(copy.deepcopy(base), dataclasses.replace(dc, rounding="nearest"))
    if also is not None:
        methods["division-set"] = apply_division(copy.deepcopy(base), also)
    for flag in SWITCHED_OFF:
        if getattr(args, flag.replace("-", "_")):
            methods[f"division-{flag}"] = methods["division"]
    chunks = {"division": fused.TOKEN_CHUNK}
    for size in args.token_chunks:
        chunks[f"division@{size}"] = size
        methods[f"division@{size}"] = methods["division"]
    return methods, chunks


def main(argv=None):
    ap = parser()
    args, rest = ap.parse_known_args(argv)
    if args.task and (not args.glue_dir or get_task(args.task).num_labels != 2):
        ap.error(f"--task {args.task}: needs --glue-dir and a two-label task (the classifier has two labels)")
    (dc,) = HfArgumentParser(DivisionConfig).parse_args_into_dataclasses([a.replace("--division_", "--") for a in rest])
    also = None
    if args.also_set:
        try:
            also = dataclasses.replace(dc, **args.also_set)
        except (TypeError, ValueError) as err:  # an unknown field, or a value the config refuses
            ap.error(f"--also-set: {err}")
    torch.set_num_threads(args.threads)
    methods, chunks = build_methods(args, dc, also)
    batches = real_batches(args) if args.task else [random_batch(args.batch, args.seq)]
    if args.profile:
        return profile(methods, batches[0], args.top)
    current, forward = {"batch": batches[0]}, {name: [] for name in methods}

    def seconds(name):
        model, batch = methods[name], current["batch"]
        fused.TOKEN_CHUNK = chunks.get(name, chunks["division"])
        with configured(**{switch: name != f"division-{flag}" for flag, (switch, _) in SWITCHED_OFF.items()}):
            dt = timed(lambda: step(model, batch, forward[name]))
        model.zero_grad(set_to_none=True)
        return dt

    try:
        times = interleaved_times(list(methods), seconds, args.rounds,
                                  before_round=lambda r: current.update(batch=batches[r % len(batches)]))
    finally:
        fused.TOKEN_CHUNK = chunks["division"]
    setting = f"{DESCRIPTION[args.model]}, {describe(args, batches)}, attn {args.attn}"
    print(f"{setting}, {args.rounds} interleaved rounds, {args.threads} threads")
    report(times)
    parts = split_times(times, forward)
    write_json(args.json, {"command": ["step-time", *(argv or [])], "setting": f"{setting}, {args.threads} threads",
                           "step_seconds": times, "forward_seconds": parts["forward"]})
    if args.split:
        for part, part_times in parts.items():
            print(f"{part} only:")
            report(part_times)


def split_times(times: dict, forward: dict) -> dict:
    """``{"forward": {arm: seconds}, "backward": ...}`` of the timed rounds; ``forward[arm]`` also
    holds the warm-up round, first."""
    fwd = {k: forward[k][len(forward[k]) - len(v):] for k, v in times.items()}
    return {"forward": fwd, "backward": {k: [t - f for t, f in zip(v, fwd[k])] for k, v in times.items()}}


def report(times: dict) -> None:
    """One row per method: median seconds, ratio of medians, per-round ratio median [quartiles],
    ratio of first quartiles (the faster steps, least touched by other load on the machine)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    per_round = round_ratios(times, "baseline")
    fast = quartile_ratios(times, "baseline")
    print(f"{'method':<22} {'median s':>9} {'ratio':>6}  {'per-round ratio [quartiles]':>28}  {'q1 ratio':>8}")
    for k, v in med.items():
        r, q1, q3 = per_round[k]
        print(f"{k:<22} {v:>9.3f} {v / med['baseline']:>6.2f}  {r:>10.3f} [{q1:.3f}-{q3:.3f}]  {fast[k]:>8.3f}")


def random_batch(batch: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(batch, dtype=torch.long)}


def real_batches(args) -> list[dict]:
    """One batch per round (the warm-up round included) of ``args.task``'s training rows."""
    return collated_batches(args.glue_dir, args.task, minilm_tokenizer(), args.batch, args.seq, args.rounds + 1)


def describe(args, batches) -> str:
    if not args.task:
        return f"batch {args.batch} x {args.seq}"
    lengths = sorted(b["input_ids"].shape[1] for b in batches[1:] or batches)
    return (f"{args.task} train batches of {args.batch}, padded per batch to {lengths[0]}-{lengths[-1]} tokens "
            f"(median {lengths[len(lengths) // 2]}, at most {args.seq})")


def store_line(events) -> str:
    """Division's store in a profiled step: the CPU time inside its compress and rebuild ranges
    (the ops they run included; kernels that read the codes in place, such as the gated MLP's
    backward, count under their own Function)."""
    spans = {e.key: e for e in events if e.key in (COMPRESS_LABEL, REBUILD_LABEL)}
    parts = [f"{what} {spans[key].cpu_time_total / 1e3:.1f} ms over {spans[key].count} tensors"
             for what, key in (("compress", COMPRESS_LABEL), ("rebuild", REBUILD_LABEL)) if key in spans]
    return "division's store: " + ("; ".join(parts) or "no compress or rebuild ranges")


def profile(methods, batch, top):
    """Self CPU time per op of one warm step, baseline vs division, largest differences first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    per, events = {}, {}
    for name in ("baseline", "division"):
        model = methods[name]
        for _ in range(2):  # warm up (torch.compile of the compressor kernels)
            step(model, batch)
        model.zero_grad(set_to_none=True)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step(model, batch)
        events[name] = prof.key_averages()
        per[name] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in events[name]}
    total = {k: sum(ms for ms, _ in v.values()) for k, v in per.items()}
    print(f"self CPU ms of one step (profiler overhead included): baseline {total['baseline']:.0f}, "
          f"division {total['division']:.0f}")
    print(store_line(events["division"]))
    keys = set(per["baseline"]) | set(per["division"])
    diff = sorted(keys, key=lambda k: -(per["division"].get(k, (0, 0))[0] - per["baseline"].get(k, (0, 0))[0]))
    print(f"{'op':<58} {'baseline ms':>11} {'division ms':>11} {'calls b/d':>10}")
    for k in diff[:top]:
        b, d = per["baseline"].get(k, (0.0, 0)), per["division"].get(k, (0.0, 0))
        print(f"{k[:58]:<58} {b[0]:>11.1f} {d[0]:>11.1f} {b[1]:>4}/{d[1]:<5}")
