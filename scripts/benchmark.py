"""Side-by-side benchmark: memory, peak, speed and fidelity of every way to save activation memory.

python scripts/benchmark.py [--models minilm bert-base-4l llama-4l] [--sizes 8x128 16x128 32x128 64x128]
    [--methods none division ...] [--rounds 5] [--threads 2] [--data ../shared/data/glue/SST-2/dev.tsv]
    [--device cpu|cuda] [--dtype fp32|bf16] [--fit-mib N] [--out docs/results] [--quick]

Models (``hf_division.bench.zoo``): real MiniLM-L6 (``minilm``), a BERT-base-shaped encoder
(``bert-base-4l``: hidden 768, 12 heads, 4 layers, random init) and a Llama-shaped decoder
(``llama-4l``: hidden 576, 9 heads / 3 KV heads, intermediate 1536, 4 layers, random init), all as
sequence classifiers on real SST-2 text (tokenized with MiniLM's tokenizer) so that the loss head
is the same small one everywhere.

Methods (``METHODS``): ``none``; ``division`` (default DivisionConfig); ``division-aggr``
(the most aggressive DIVISION setting kept: no LFC, and the fewest bits (2, 4 or 8) per layer and
kind whose predicted gradient cosine is >= 0.95, from ``hf_division.analysis.auto_precision`` with one
2-bit probe per unit, calibrated per model on other SST-2 rows, ``--calib`` tokens); ``actnn``
(ActNN's own scope: Linear inputs at 2 bits, dropout masks as bits); ``actnn-all`` (every kind at 2 bits);
``ckpt`` (Transformers' ``activation_checkpointing_enable()``, non-reentrant); ``save_on_cpu``
(``torch.autograd.graph.save_on_cpu``, pinned only on CUDA: on a CPU-only machine it moves
nothing, the row shows what its hooks cost); ``division+ckpt``.

Per model, method and (batch, seq):

* ``held``: exact bytes held for backward after one training forward (``hf_division.analysis.measure``:
  distinct storages reached from saved-tensor hooks, the hf-division store, and what checkpointing
  keeps outside hooks). ``offloaded``: bytes save_on_cpu put in host memory (CUDA only; on CPU
  host memory is the device memory, so they count as ``held``).
* ``peak``: peak memory of one training step (forward + backward) above the memory before it
  (``hf_division.bench.peak``), in a process per model and method (sizes in increasing order): CPU:
  process RSS high-water mark; CUDA: ``torch.cuda.max_memory_allocated``.
* ``step``: median seconds of one training step, all methods interleaved round-robin in one
  process (``hf_division.analysis.timing``), and its ratio to ``none``.
* ``cosine``: cosine of the gradient of all parameters to ``none``'s (same seed, same dropout).

Writes ``benchmark<tag>.json``/``.csv``, ``tables<tag>.md`` and the plots ``peak_vs_batch<tag>.png``,
``time_vs_peak<tag>.png`` into ``--out`` (tag: empty on CPU, ``-cuda`` on CUDA, or ``--tag``).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch
import transformers

from hf_division import DivisionConfig, apply_division, remove_division
from hf_division.analysis.auto_precision import auto_precision
from hf_division.analysis.fidelity import cosine, flat_grad
from hf_division.analysis.measure import account
from hf_division.bench.peak import forked, run_clean, step_peak
from hf_division.bench.textdata import BUNDLED_SST2_DEV, classification_batch, sst2_rows
from hf_division.analysis.timing import interleaved_medians, timed
from hf_division.bench.zoo import DESCRIPTION, build_classifier, minilm_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUE_SST2_DEV = os.path.join(ROOT, "..", "shared", "data", "glue", "SST-2", "dev.tsv")

# The most aggressive DIVISION setting kept in the benchmark: no LFC (on token sequences the LFC
# costs about as much as one more bit buys: docs/RESULTS.md, "Precision policy on MiniLM") and, per
# model, the fewest bits per layer and kind whose predicted gradient cosine reaches the target
# (docs/DESIGN.md, "Auto-precision"). "auto_bits": B instead would fix the average at B bits.
METHODS = {
    "none": {},
    "division": {"division": {}},
    "division-aggr": {"division": {"block_size": 1}, "auto_cosine": 0.95},
    "actnn": {"division": {"method": "actnn"}},  # ActNN's scope: Linear inputs at 2 bits, dropout masks as bits
    "actnn-all": {"division": {"method": "actnn-all"}},  # ablation: every kind at ActNN's 2 bits
    "ckpt": {"ckpt": True},
    "save_on_cpu": {"offload": True},
    "division+ckpt": {"division": {}, "ckpt": True},
}


def resolve_configs(model, batch, methods) -> tuple[dict, dict]:
    """``({method: DivisionConfig kwargs}, {method: average bits and predicted cosine})``; runs
    auto-precision for the methods that ask for it."""
    configs, auto = {}, {}
    for method in methods:
        spec = METHODS[method]
        if "division" not in spec:
            continue
        kwargs = dict(spec["division"])
        if "auto_bits" in spec or "auto_cosine" in spec:
            t0 = time.perf_counter()
            result = auto_precision(model, batch, spec.get("auto_bits"), DivisionConfig(**kwargs), probe_bits=(2,),
                                    target_cosine=spec.get("auto_cosine"))
            kwargs["module_bits"] = result.config.module_bits
            auto[method] = dict(average_bits=result.average_bits, predicted_cosine=result.predicted_cosine)
            print(f"[auto-precision] {method}: {len(result.units)} units, average {result.average_bits:.2f} bits, "
                  f"predicted cosine {result.predicted_cosine:.4f}, {time.perf_counter() - t0:.0f} s", flush=True)
        configs[method] = kwargs
    return configs, auto


def setup(model, method: str, configs: dict):
    """Put ``model`` in ``method``'s state (``configs``: from :func:`resolve_configs`); return a
    context manager factory for its step."""
    spec = METHODS[method]
    remove_division(model)
    if model.is_activation_checkpointing:
        model.activation_checkpointing_disable()
    if spec.get("ckpt"):
        model.activation_checkpointing_enable()
    if "division" in spec:
        apply_division(model, DivisionConfig(**configs.get(method, spec["division"])))
    if spec.get("offload"):
        pin = next(model.parameters()).is_cuda
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)
    return contextlib.nullcontext


def train_step(model, batch, ctx, autocast: torch.dtype | None):
    amp = torch.autocast(batch["input_ids"].device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with ctx(), amp:
        loss = model(**batch).loss
    loss.backward()


# ----------------------------------------------------------------------------- held, cosine, time
def held_bytes(model, batch, method: str, configs: dict, autocast) -> tuple[int, int]:
    """(bytes held for backward on the compute device, bytes save_on_cpu moved to host memory)."""
    setup(model, method, configs)  # not its step context: the accounting packs through save_on_cpu itself
    # bytes do not depend on the seed; seeding restarts the rounding noise, so the cosines measured
    # after this do not depend on what ran before (docs/DESIGN.md, Bit-identical forward)
    torch.manual_seed(0)
    held = account(model, batch, autocast=autocast, offload=bool(METHODS[method].get("offload")))
    return held.device_bytes, held.host_bytes


def method_grad(model, batch, method: str, configs: dict, seed: int, autocast) -> torch.Tensor:
    ctx = setup(model, method, configs)
    with ctx():
        return flat_grad(model, batch, seed, autocast)


def time_methods(model, batch, methods, configs: dict, rounds: int, autocast, device: str) -> dict:
    """Median step seconds per method, methods interleaved round-robin."""

    def seconds(method):
        ctx = setup(model, method, configs)
        dt = timed(lambda: train_step(model, batch, ctx, autocast), device)
        model.zero_grad(set_to_none=True)
        return dt

    return interleaved_medians(list(methods), seconds, rounds)


# ----------------------------------------------------------------------------- peak (own processes)
def peak_child(job: dict) -> dict:
    """Peak bytes above the pre-step memory of one training step, per size (see module doc)."""
    device, autocast = job["device"], getattr(torch, job["autocast"]) if job["autocast"] else None
    torch.set_num_threads(job["threads"])
    model = build_classifier(job["model"], job["attn"], device, getattr(torch, job["dtype"]))
    tok = minilm_tokenizer()
    rows = sst2_rows(job["data"])
    ctx = setup(model, job["method"], job["configs"])

    def batch_of(b, s):
        return classification_batch(tok, rows, b, s, device, token_type_ids=False)

    warm = batch_of(2, min(s for _, s in job["sizes"]))
    for _ in range(2):  # compile, lazy init, allocator pools
        train_step(model, warm, ctx, autocast)
        model.zero_grad(set_to_none=True)
    out = {"peaks": {}, "how": None}
    for batch_size, seq in sorted(job["sizes"], key=lambda s: s[0] * s[1]):
        batch = batch_of(batch_size, seq)
        peak, out["how"] = step_peak(lambda: train_step(model, batch, ctx, autocast), device)
        model.zero_grad(set_to_none=True)
        out["peaks"][f"{batch_size}x{seq}"] = peak
    if job.get("fit_mib") and device == "cuda":
        seq = max(s for _, s in job["sizes"])
        out["fit"] = largest_batch(lambda b: train_step(model, batch_of(b, seq), ctx, autocast), model, job["fit_mib"])
    return out


def largest_batch(step, model, fit_mib: int) -> int:
    """Largest batch ``b`` whose ``step(b)`` keeps all CUDA memory allocated (weights included) under ``fit_mib``."""
    budget = fit_mib * 2**20

    def fits(b):
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            step(b)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() <= budget
        except torch.OutOfMemoryError:
            return False
        finally:
            model.zero_grad(set_to_none=True)

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 16:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def peak_launcher(job: dict) -> dict:
    """``{method: peak_child result}``, each method in a child forked from this process."""
    return dict(zip(job["methods"], forked(lambda m: peak_child(dict(job, method=m)), job["methods"])))


def run_peak(job: dict) -> dict:
    """:func:`peak_launcher` in a fresh interpreter (``hf_division.bench.peak.run_clean``)."""
    return run_clean([os.path.abspath(__file__), "--peak-child", json.dumps(job)], f"peak subprocess for {job['model']}")


# ----------------------------------------------------------------------------- output
COLUMNS = ["model", "method", "batch", "seq", "held_bytes", "offloaded_bytes", "held_ratio", "peak_bytes",
           "step_s", "step_ratio", "cosine"]


def mib(x):
    return "" if x is None else f"{x / 2**20:.1f}"


def write_outputs(meta: dict, records: list[dict], fits: dict, out: str, tag: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    names = {"json": "benchmark{}.json", "csv": "benchmark{}.csv", "tables": "tables{}.md",
             "peak_vs_batch": "peak_vs_batch{}.png", "time_vs_peak": "time_vs_peak{}.png"}
    paths = {k: os.path.join(out, v.format(tag)) for k, v in names.items()}
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "records": records, "fit": fits}, f, indent=1)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: r.get(k) for k in COLUMNS} for r in records)
    plot(records, paths["peak_vs_batch"], paths["time_vs_peak"], meta)
    with open(paths["tables"], "w") as f:
        f.write(tables_md(meta, records, fits, os.path.basename(paths["peak_vs_batch"]),
                          os.path.basename(paths["time_vs_peak"])))
    return list(paths.values())


def targets(records, model="minilm", size=(32, 128)) -> list[str]:
    """The project's targets, checked on MiniLM-L6 at 32 x 128 if that point was measured."""
    r = {x["method"]: x for x in records if x["model"] == model and (x["batch"], x["seq"]) == size}
    if not {"none", "division", "ckpt"} <= set(r):
        return []
    d, c = r["division"], r["ckpt"]
    checks = [
        (f"division step time <= 1.15x none ({d['step_ratio']:.2f}x)", d["step_ratio"] <= 1.15),
        (f"division step time below ckpt's ({d['step_s']:.3f} s vs {c['step_s']:.3f} s)", d["step_s"] < c["step_s"]),
        (f"division peak below ckpt's ({mib(d['peak_bytes'])} vs {mib(c['peak_bytes'])} MiB)",
         bool(d["peak_bytes"]) and d["peak_bytes"] < c["peak_bytes"]),
        (f"division holds >= 8x fewer bytes than none ({d['held_ratio']:.1f}x)", d["held_ratio"] >= 8),
        (f"division gradient cosine >= 0.98 ({d['cosine']:.4f})", d["cosine"] >= 0.98),
    ]
    if "division+ckpt" in r:
        dc = r["division+ckpt"]
        checks.append((f"division+ckpt holds fewer bytes than ckpt ({mib(dc['held_bytes'])} vs {mib(c['held_bytes'])} MiB)",
                       dc["held_bytes"] < c["held_bytes"]))
    lines = [f"Targets, {model} at batch {size[0]} x {size[1]}:", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {text}" for text, ok in checks]
    return lines + [""]


def tables_md(meta, records, fits, peak_png, time_png) -> str:
    lines = [
        "<!-- generated by scripts/benchmark.py: do not edit, rerun the command -->",
        f"Measured {meta['date']} with `{meta['command']}`",
        f"({meta['device_name']}, {meta['threads']} threads, {meta['dtype']}{', bf16 autocast' if meta['autocast'] else ''},"
        f" attention {meta['attn']}, torch {meta['torch']}, transformers {meta['transformers']}; step time: median of"
        f" {meta['rounds']} interleaved rounds; peak: {meta['peak_how']}).",
        "",
        "held = bytes kept for backward after the forward (x: fewer than none); peak = memory of one training step "
        "above the memory before it; step = seconds per forward+backward (x: ratio to none); cosine = gradient "
        "cosine to none's.",
        "",
    ]
    for m in meta["methods"]:
        spec = METHODS[m]
        if "auto_bits" in spec or "auto_cosine" in spec:
            goal = (f"{spec['auto_bits']} bits per element on average" if "auto_bits" in spec
                    else f"the fewest bits whose predicted gradient cosine is >= {spec['auto_cosine']}")
            avg = ", ".join(f"{model} {info['average_bits']:.2f} bits (predicted cosine {info['predicted_cosine']:.3f})"
                            for model, info in meta.get("auto", {}).get(m, {}).items())
            lines += [f"`{m}`: DivisionConfig(" + ", ".join(f"{k}={v}" for k, v in spec["division"].items())
                      + f") with bits per layer and kind from auto-precision at {goal}, calibrated per model on rows "
                      f"{meta['calib_rows']} of `{meta['data']}` ({meta['calib']} tokens): {avg}; the assignments are in "
                      "the JSON (`meta.configs`).", ""]
    for model in dict.fromkeys(r["model"] for r in records):
        lines += [f"### {model}: {DESCRIPTION.get(model, model)}", ""]
        for size in dict.fromkeys((r["batch"], r["seq"]) for r in records if r["model"] == model):
            lines += [f"batch {size[0]} x {size[1]} tokens", "",
                      "| method | held MiB | held x | offloaded MiB | peak MiB | step s | step x | cosine |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for r in records:
                if r["model"] == model and (r["batch"], r["seq"]) == size:
                    lines.append(
                        f"| {r['method']} | {mib(r['held_bytes'])} | {r['held_ratio']:.1f} | {mib(r['offloaded_bytes'])} "
                        f"| {mib(r['peak_bytes'])} | {r['step_s']:.3f} | {r['step_ratio']:.2f} | {r['cosine']:.4f} |")
            lines.append("")
    if fits:
        lines += [f"Largest batch whose step fits {meta['fit_mib']} MiB of CUDA memory (weights included), "
                  f"seq {meta['fit_seq']}:", "", "| model | " + " | ".join(meta["methods"]) + " |",
                  "|---|" + "---:|" * len(meta["methods"])]
        for model, per in fits.items():
            lines.append(f"| {model} | " + " | ".join(str(per.get(m, "")) for m in meta["methods"]) + " |")
        lines.append("")
    lines += targets(records)
    lines += [f"![peak step memory vs batch size]({peak_png})", "", f"![step-time ratio vs peak memory]({time_png})", ""]
    return "\n".join(lines)


def plain_ticks(axis):
    """Log axes labelled 200, 300, ... instead of 2x10^2."""
    from matplotlib.ticker import LogLocator, ScalarFormatter

    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(ScalarFormatter())
    axis.set_minor_locator(LogLocator(subs=(2, 3, 5)))


def plot(records, peak_path, time_path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    methods = list(dict.fromkeys(r["method"] for r in records))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    markers = {m: "osD^vPX*"[i % 8] for i, m in enumerate(methods)}
    dashes = {m: "-" if i % 2 == 0 else "--" for i, m in enumerate(methods)}  # lines that coincide stay visible
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = [r for r in records if r["model"] == model]
        seq = statistics.mode(r["seq"] for r in rs)  # the sequence length the batch sweep uses
        for method in methods:
            pts = sorted((r["batch"], r["peak_bytes"] / 2**20) for r in rs if r["method"] == method and r["seq"] == seq)
            if pts:
                ax.plot(*zip(*pts), marker=markers[method], linestyle=dashes[method], label=method, color=colors[method],
                        alpha=0.85)
        ax.set(title=f"{model}, seq {seq}", xlabel="batch size", ylabel="peak step memory (MiB, log)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain_ticks(ax.yaxis)
        ax.set_xticks(sorted({r["batch"] for r in rs if r["seq"] == seq}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Peak memory of one training step ({meta['device_name']}, {meta['dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(peak_path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = [r for r in records if r["model"] == model]
        ref = max(((r["batch"], r["seq"]) for r in rs), key=lambda s: s[0] * s[1])
        for r in rs:
            if (r["batch"], r["seq"]) == ref:
                ax.scatter(r["peak_bytes"] / 2**20, r["step_ratio"], color=colors[r["method"]], marker=markers[r["method"]],
                           s=50, label=r["method"])
        ax.set(title=f"{model}, batch {ref[0]} x {ref[1]}", xlabel="peak step memory (MiB, log)", ylabel="step time / none")
        ax.set_xscale("log")
        plain_ticks(ax.xaxis)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Step-time ratio vs peak memory (lower left is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(time_path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def parse_sizes(values, option: str = "--sizes") -> list[tuple[int, int]]:
    out = []
    for v in values:
        try:
            b, s = (int(x) for x in v.lower().split("x"))
        except ValueError:
            raise ValueError(f"{option}: expected BATCHxSEQ like 32x128, got {v!r}") from None
        if b < 1 or s < 1:
            raise ValueError(f"{option}: batch and seq must be positive, got {v!r}")
        out.append((b, s))
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["minilm", "bert-base-4l", "llama-4l"])
    ap.add_argument("--sizes", nargs="+", default=["8x128", "16x128", "32x128", "64x128"], help="BATCHxSEQ")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    ap.add_argument("--data", default=None, help="SST-2 TSV (default ../shared/data/glue/SST-2/dev.tsv, else the bundled sample)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="model weights dtype")
    ap.add_argument("--autocast", action="store_true", help="bf16 autocast around the forward")
    ap.add_argument("--fit-mib", type=int, default=0, help="CUDA: also find the largest batch fitting this budget")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results"))
    ap.add_argument("--tag", default=None, help="file name suffix (default: '' on CPU, '-cuda' on CUDA)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny models and sizes, 2 rounds")
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--calib", default="16x128", help="BATCHxSEQ of the auto-precision calibration batch (other rows)")
    ap.add_argument("--peak-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        given = set(argv)
        for option, value in (("--models", ["tiny-bert", "tiny-llama"]), ("--sizes", ["2x32", "4x32"]),
                              ("--rounds", 2), ("--threads", 1), ("--calib", "4x32")):
            if option not in given:
                setattr(args, option[2:], value)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device available")
    return args


class Run:
    """One benchmark run: its settings, the text it reads and what it has measured so far."""

    def __init__(self, args, argv):
        self.args = args
        self.sizes = parse_sizes(args.sizes)
        (self.calib,) = parse_sizes([args.calib], "--calib")
        self.data = args.data or (GLUE_SST2_DEV if os.path.exists(GLUE_SST2_DEV) else BUNDLED_SST2_DEV)
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        self.autocast = torch.bfloat16 if args.autocast else None
        self.tok = minilm_tokenizer()
        self.rows = sst2_rows(self.data)
        self.records, self.fits = [], {}
        largest = max(b for b, _ in self.sizes)
        self.meta = {
            "date": datetime.date.today().isoformat(),
            "command": "python scripts/benchmark.py " + " ".join(argv),
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.machine()})",
            "threads": args.threads, "dtype": args.dtype, "autocast": args.autocast, "attn": args.attn,
            "rounds": args.rounds, "seed": args.seed, "data": os.path.relpath(self.data), "methods": args.methods,
            "torch": torch.__version__, "transformers": transformers.__version__, "peak_how": None,
            "fit_mib": args.fit_mib, "fit_seq": max(s for _, s in self.sizes), "calib": args.calib,
            "calib_rows": f"{largest}..{largest + self.calib[0] - 1}", "configs": {},
        }

    def batch(self, size: int, seq: int, offset: int = 0) -> dict:
        return classification_batch(self.tok, self.rows, size, seq, self.args.device, offset, token_type_ids=False)

    def model(self, name: str):
        return build_classifier(name, self.args.attn, self.args.device, self.dtype)

    def calibrate(self, name: str) -> dict:
        """DivisionConfig kwargs per method for model ``name`` (auto-precision on other rows)."""
        model = self.model(name)
        calib_batch = self.batch(*self.calib, offset=max(b for b, _ in self.sizes))
        configs, auto = resolve_configs(model, calib_batch, self.args.methods)
        self.meta["configs"][name] = configs
        for method, info in auto.items():
            self.meta.setdefault("auto", {}).setdefault(method, {})[name] = info
        del model, calib_batch
        gc.collect()
        if self.args.device == "cuda":
            torch.cuda.empty_cache()  # the peak processes share the device
        return configs

    def peaks(self, name: str, configs: dict) -> dict:
        """``{method: {"BxS": bytes}}`` from the peak processes; ``{}`` with ``--no-peak``."""
        a = self.args
        if a.no_peak:
            return {}
        job = dict(model=name, methods=a.methods, sizes=self.sizes, device=a.device, dtype=str(self.dtype).split(".")[1],
                   autocast="bfloat16" if a.autocast else None, threads=a.threads, attn=a.attn, data=self.data,
                   fit_mib=a.fit_mib, configs=configs)
        peaks = {}
        for method, res in run_peak(job).items():
            peaks[method], self.meta["peak_how"] = res["peaks"], res["how"]
            if "fit" in res:
                self.fits.setdefault(name, {})[method] = res["fit"]
            print(f"[peak] {name} {method}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in res["peaks"].items()),
                  flush=True)
        return peaks

    def measure(self, name: str, model, configs: dict, peaks: dict, batch_size: int, seq: int) -> None:
        """Held bytes, gradient cosine and step time of every method at one size."""
        a, methods = self.args, self.args.methods
        batch = self.batch(batch_size, seq)
        held = {m: held_bytes(model, batch, m, configs, self.autocast) for m in methods}
        exact = method_grad(model, batch, "none", configs, a.seed, self.autocast)
        cos = {m: 1.0 if m == "none" else cosine(exact, method_grad(model, batch, m, configs, a.seed, self.autocast))
               for m in methods}
        del exact
        step = time_methods(model, batch, methods, configs, a.rounds, self.autocast, a.device)
        base = held.get("none", (None,))[0]
        for m in methods:
            rec = dict(model=name, method=m, batch=batch_size, seq=seq, held_bytes=held[m][0],
                       offloaded_bytes=held[m][1], held_ratio=(base / max(held[m][0], 1)) if base else float("nan"),
                       peak_bytes=peaks.get(m, {}).get(f"{batch_size}x{seq}"), step_s=step[m],
                       step_ratio=step[m] / step["none"] if "none" in step else float("nan"), cosine=cos[m])
            self.records.append(rec)
            print(f"{name:<13} {batch_size:>3}x{seq:<4} {m:<16} held {mib(rec['held_bytes']):>8} MiB "
                  f"({rec['held_ratio']:5.1f}x) peak {mib(rec['peak_bytes']):>8} MiB step {rec['step_s']:.3f}s "
                  f"({rec['step_ratio']:.2f}x) cos {rec['cosine']:.4f}", flush=True)

    def run_model(self, name: str) -> None:
        configs = self.calibrate(name)
        peaks = self.peaks(name, configs)
        model = self.model(name)
        for batch_size, seq in self.sizes:
            self.measure(name, model, configs, peaks, batch_size, seq)
        setup(model, "none", configs)
        del model
        gc.collect()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.peak_child:  # before any torch work: the forked children start clean
        print(json.dumps(peak_launcher(json.loads(args.peak_child))))
        return
    torch.set_num_threads(args.threads)
    run = Run(args, argv)
    for name in args.models:
        run.run_model(name)
    if args.no_peak:
        for r in run.records:
            r["peak_bytes"] = r["peak_bytes"] or 0
        run.meta["peak_how"] = "not measured (--no-peak)"
    for path in write_outputs(run.meta, run.records, run.fits, args.out, args.tag if args.tag is not None else
                              ("-cuda" if args.device == "cuda" else "")):
        print("wrote", path)


if __name__ == "__main__":
    main()
