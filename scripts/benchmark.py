"""Side-by-side benchmark: memory, peak, speed and fidelity of every way to save activation memory.

python scripts/benchmark.py [--models minilm bert-base-4l llama-4l] [--sizes 8x128 16x128 32x128 64x128]
    [--methods none division ...] [--rounds 5] [--threads 2] [--data ../shared/data/glue/SST-2/dev.tsv]
    [--device cpu|cuda] [--dtype fp32|bf16] [--fit-mib N] [--out docs/benchmarks] [--quick]

Models: real MiniLM-L6 (``minilm``), a BERT-base-shaped encoder (``bert-base-4l``: hidden 768, 12
heads, 4 layers, random init) and a Llama-shaped decoder (``llama-4l``: hidden 576, 9 heads / 3 KV
heads, intermediate 1536, 4 layers, random init), all as sequence classifiers on real SST-2 text
(tokenized with MiniLM's tokenizer) so that the loss head is the same small one everywhere.

Methods (``METHODS``): ``none``; ``division`` (default DivisionConfig); ``division-aggr``
(the most aggressive DIVISION setting kept: no LFC, and the fewest bits (2, 4 or 8) per layer and
kind whose predicted gradient cosine is >= 0.95, from ``hf_division.auto_precision`` with one
2-bit probe per unit, calibrated per model on
other SST-2 rows, ``--calib`` tokens); ``actnn``; ``ckpt`` (Transformers'
``activation_checkpointing_enable()``, non-reentrant); ``save_on_cpu``
(``torch.autograd.graph.save_on_cpu``, pinned only on CUDA: on a CPU-only machine it moves
nothing, the row shows what its hooks cost); ``division+ckpt``.

Per model, method and (batch, seq):

* ``held``: exact bytes held for backward after one training forward (distinct storages reached
  from saved-tensor hooks, the hf-division store, and what checkpointing keeps outside hooks:
  layer inputs, keyword tensors, RNG state). ``offloaded``: bytes save_on_cpu put in host memory
  (CUDA only; on CPU host memory is the device memory, so they count as ``held``).
* ``peak``: peak memory of one training step (forward + backward) above the memory before it,
  in a subprocess per model and method (sizes in increasing order, each measured from a reset
  high-water mark): CPU: process RSS high-water mark (``/proc/self/clear_refs`` reset, the value
  ``getrusage`` reports as ``ru_maxrss``) with glibc told to serve allocations over 64 KiB by mmap,
  so freed memory leaves the process; CUDA: ``torch.cuda.max_memory_allocated``.
* ``step``: median seconds of one training step, all methods interleaved round-robin in one
  process (start rotated each round, first round discarded), and its ratio to ``none``.
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
import resource
import statistics
import subprocess
import sys
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
from transformers.modeling_layers import GradientCheckpointingLayer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_division import DivisionConfig, apply_division, remove_division, store  # noqa: E402
from hf_division.zoo import minilm_path  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED = os.path.join(os.path.dirname(HERE), "hf_division", "data", "sst2_dev_sample.tsv")

# ----------------------------------------------------------------------------- models
SHAPES = {
    "bert-base-4l": ("bert", dict(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072)),
    "llama-4l": ("llama", dict(hidden_size=576, num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3,
                               intermediate_size=1536, max_position_embeddings=4096, pad_token_id=0)),
    "tiny-bert": ("bert", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)),
    "tiny-llama": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, max_position_embeddings=512, pad_token_id=0)),
}
DESCRIPTION = {
    "minilm": "real all-MiniLM-L6-v2 (6 layers, hidden 384), BertForSequenceClassification",
    "bert-base-4l": "BERT-base shape (hidden 768, 12 heads, FFN 3072), 4 layers, random init",
    "llama-4l": "Llama shape (hidden 576, 9 heads / 3 KV heads, FFN 1536), 4 layers, random init, LlamaForSequenceClassification",
    "tiny-bert": "tiny BERT (hidden 64, 2 layers), random init",
    "tiny-llama": "tiny Llama (hidden 64, 4 heads / 2 KV heads, 2 layers), random init",
}


def build_model(name: str, attn: str, device: str, dtype: torch.dtype):
    if name == "minilm":
        model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2, attn_implementation=attn)
    elif name in SHAPES:
        model_type, sizes = SHAPES[name]
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(model_type, vocab_size=30522, num_labels=2, **sizes)
        model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation=attn)
    else:
        raise ValueError(f"--models: unknown model {name!r}; known: minilm, {', '.join(SHAPES)}")
    return model.to(device=device, dtype=dtype).train()


def sst2_rows(path: str) -> list[tuple[str, int]]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()[1:]
    return [(s, int(y)) for s, y in (line.rsplit("\t", 1) for line in lines if line.strip())]


def make_batch(tokenizer, rows, batch: int, seq: int, device: str, offset: int = 0) -> dict:
    """``batch`` SST-2 rows from ``offset`` (cycling if the file is shorter), padded to ``seq`` tokens."""
    picked = [rows[(offset + i) % len(rows)] for i in range(batch)]
    enc = tokenizer([s for s, _ in picked], padding="max_length", max_length=seq, truncation=True, return_tensors="pt")
    out = dict(enc, labels=torch.tensor([y for _, y in picked]))
    out.pop("token_type_ids", None)  # Llama takes none; BERT's are all zero anyway
    return {k: v.to(device) for k, v in out.items()}


# ----------------------------------------------------------------------------- methods
# The most aggressive DIVISION setting kept in the benchmark: no LFC (on token sequences the LFC
# costs about as much as one more bit buys, docs/POLICY.md) and, per model, the fewest bits per
# layer and kind whose predicted gradient cosine is >= 0.95 (docs/BENCHMARKS.md, "Choosing the
# aggressive setting"). "auto_bits": B instead would fix the average at B bits.
METHODS = {
    "none": {},
    "division": {"division": {}},
    "division-aggr": {"division": {"block_size": 1}, "auto_cosine": 0.95},
    "actnn": {"division": {"method": "actnn"}},
    "ckpt": {"ckpt": True},
    "save_on_cpu": {"offload": True},
    "division+ckpt": {"division": {}, "ckpt": True},
}


#: DivisionConfig keyword arguments per method for the model being measured (auto-precision
#: methods get their ``module_bits`` here, from :func:`resolve_configs`)
RESOLVED: dict = {}
AUTO_INFO: dict = {}  # method -> average bits and predicted cosine of its auto-precision result


def resolve_configs(model, batch, methods) -> dict:
    """``{method: DivisionConfig kwargs}``; runs auto-precision for methods that ask for it."""
    from hf_division.auto_precision import auto_precision

    out = {}
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
            AUTO_INFO[method] = dict(average_bits=result.average_bits, predicted_cosine=result.predicted_cosine)
            print(f"[auto-precision] {method}: {len(result.units)} units, average {result.average_bits:.2f} bits, "
                  f"predicted cosine {result.predicted_cosine:.4f}, {time.perf_counter() - t0:.0f} s", flush=True)
        out[method] = kwargs
    return out


def setup(model, method: str):
    """Put ``model`` in ``method``'s state; return a context manager factory for its step."""
    spec = METHODS[method]
    remove_division(model)
    if model.is_activation_checkpointing:
        model.activation_checkpointing_disable()
    if spec.get("ckpt"):
        model.activation_checkpointing_enable()
    if "division" in spec:
        apply_division(model, DivisionConfig(**RESOLVED.get(method, spec["division"])))
    if spec.get("offload"):
        pin = next(model.parameters()).is_cuda
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)
    return contextlib.nullcontext


def train_step(model, batch, ctx, autocast: bool):
    amp = torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx(), amp:
        loss = model(**batch).loss
    loss.backward()


# ----------------------------------------------------------------------------- exact bytes held
def held_bytes(model, batch, method: str, autocast: bool = False) -> tuple[int, int]:
    """(bytes held for backward on the compute device, bytes save_on_cpu moved to host memory).

    Counts distinct storages: every non-parameter tensor that autograd saves (through a
    saved-tensors hook; under ``save_on_cpu`` what its pack function returns), the hf-division
    store's entries, and, for checkpointed layers, what the checkpoint keeps outside hooks (the
    layer's positional and keyword tensors, its RNG state).
    """
    setup(model, method)  # not its step context: under save_on_cpu our pack calls its packer itself
    found: list[torch.Tensor] = []
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    offloader = torch.autograd.graph.save_on_cpu(pin_memory=next(model.parameters()).is_cuda) \
        if METHODS[method].get("offload") else None

    def pack(t):
        kept = offloader.pack_hook(t)[1] if offloader is not None else t
        if kept.untyped_storage().data_ptr() not in params:
            found.append(kept)
        return None  # never unpacked: the graph must not keep what we count (see measure.py)

    def on_layer(module, args, kwargs):
        if not (module.gradient_checkpointing and module.training):
            return
        tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        if "forward" not in module.__dict__:  # Transformers' checkpoint keeps its args whole and an RNG state
            tensors += [a for a in args if isinstance(a, torch.Tensor)] + [torch.get_rng_state()]
        else:  # division's CheckpointFn: floating inputs compressed (counted by the store), others whole
            tensors += [a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()]
        found.extend(t for t in tensors if t.untyped_storage().data_ptr() not in params)

    handles = [m.register_forward_pre_hook(on_layer, with_kwargs=True)
               for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    store.start_accounting()
    try:
        torch.manual_seed(0)
        amp = torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None), amp:
            out = model(**batch)
        found.extend(t for t, _ in store.stop_accounting())
    finally:
        store.stop_accounting()
        for h in handles:
            h.remove()
    del out
    seen, device_bytes, host_bytes = set(), 0, 0
    compute_device = next(model.parameters()).device
    for t in found:
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        if t.device == compute_device:
            device_bytes += s.nbytes()
        else:
            host_bytes += s.nbytes()
    found.clear()
    return device_bytes, host_bytes


# ----------------------------------------------------------------------------- gradient, time
def flat_grad(model, batch, method: str, seed: int, autocast: bool) -> torch.Tensor:
    ctx = setup(model, method)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    train_step(model, batch, ctx, autocast)
    grad = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grad


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """In float64: in float32 the sums over millions of parameters can put an exact match above 1."""
    return (a @ b / (a.norm() * b.norm())).item()


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def time_methods(model, batch, methods, rounds: int, autocast: bool, device: str) -> dict:
    """Median step seconds per method, methods interleaved round-robin (round 0 discarded)."""
    times = {m: [] for m in methods}
    for r in range(rounds + 1):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for method in order:
            ctx = setup(model, method)
            sync(device)
            t0 = time.perf_counter()
            train_step(model, batch, ctx, autocast)
            sync(device)
            dt = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            if r:
                times[method].append(dt)
    return {m: statistics.median(v) for m, v in times.items()}


# ----------------------------------------------------------------------------- peak (subprocess)
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _malloc_trim():
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_child(job: dict) -> dict:
    """Peak bytes above the pre-step memory of one training step, per size (see module doc)."""
    device, autocast = job["device"], job["autocast"]
    torch.set_num_threads(job["threads"])
    RESOLVED.update(job["configs"])
    model = build_model(job["model"], job["attn"], device, getattr(torch, job["dtype"]))
    tok = AutoTokenizer.from_pretrained(minilm_path())
    rows = sst2_rows(job["data"])
    ctx = setup(model, job["method"])
    warm = make_batch(tok, rows, 2, min(s for _, s in job["sizes"]), device)
    for _ in range(2):  # compile, lazy init, allocator pools
        train_step(model, warm, ctx, autocast)
        model.zero_grad(set_to_none=True)
    out = {"peaks": {}, "how": None}
    for batch_size, seq in sorted(job["sizes"], key=lambda s: s[0] * s[1]):
        batch = make_batch(tok, rows, batch_size, seq, device)
        gc.collect()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            train_step(model, batch, ctx, autocast)
            torch.cuda.synchronize()
            peak, out["how"] = torch.cuda.max_memory_allocated() - before, "torch.cuda.max_memory_allocated"
        else:
            _malloc_trim()
            reset = _reset_hwm()
            before = _rss()
            train_step(model, batch, ctx, autocast)
            peak = _hwm() - before
            out["how"] = "RSS high-water (clear_refs reset)" if reset else "ru_maxrss (no reset; sizes ascending)"
        model.zero_grad(set_to_none=True)
        out["peaks"][f"{batch_size}x{seq}"] = peak
    if job.get("fit_mib") and device == "cuda":
        out["fit"] = largest_batch(model, tok, rows, ctx, job, max(s for _, s in job["sizes"]))
    return out


def largest_batch(model, tok, rows, ctx, job, seq: int) -> int:
    """Largest batch whose step keeps all CUDA memory allocated (weights included) under fit_mib."""
    budget = job["fit_mib"] * 2**20

    def fits(b):
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            train_step(model, make_batch(tok, rows, b, seq, "cuda"), ctx, job["autocast"])
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
    """``{method: peak_child result}``: each method measured in a process of its own, forked from
    this one, which has imported the libraries but run nothing (so the fork is cheap and clean)."""
    results = {}
    for method in job["methods"]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            os.close(read)
            code = 0
            try:
                result = peak_child(dict(job, method=method))
            except BaseException as err:  # report it to the launcher, never fall back into its loop
                result, code = {"error": f"{type(err).__name__}: {err}"}, 1
            with os.fdopen(write, "w") as f:
                json.dump(result, f)
            os._exit(code)
        os.close(write)
        with os.fdopen(read) as f:
            text = f.read()
        os.waitpid(pid, 0)
        results[method] = json.loads(text) if text else {"error": "child died"}
    return results


def run_peak(job: dict) -> dict:
    """Run :func:`peak_launcher` in a fresh interpreter with glibc's mmap threshold set low."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--peak-child", json.dumps(job)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"peak subprocess for {job['model']} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    failed = {m: r["error"] for m, r in out.items() if "error" in r}
    if failed:
        raise RuntimeError(f"peak measurement failed for {job['model']}: {failed}")
    return out


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


def acceptance(records, model="minilm", size=(32, 128)) -> list[str]:
    """Issue 5's acceptance checks on MiniLM-L6 at 32 x 128, if that point was measured."""
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
    lines = [f"Acceptance checks (issue 5), {model} at batch {size[0]} x {size[1]}:", ""]
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
    lines += acceptance(records)
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


def main(argv=None):
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
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "docs", "benchmarks"))
    ap.add_argument("--tag", default=None, help="file name suffix (default: '' on CPU, '-cuda' on CUDA)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny models and sizes, 2 rounds")
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--calib", default="16x128", help="BATCHxSEQ of the auto-precision calibration batch (other rows)")
    ap.add_argument("--peak-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peak_child:
        print(json.dumps(peak_launcher(json.loads(args.peak_child))))
        return
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        if "--models" not in given:
            args.models = ["tiny-bert", "tiny-llama"]
        if "--sizes" not in given:
            args.sizes = ["2x32", "4x32"]
        if "--rounds" not in given:
            args.rounds = 2
        if "--threads" not in given:
            args.threads = 1
        if "--calib" not in given:
            args.calib = "4x32"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device available")
    sizes = parse_sizes(args.sizes)
    (calib,) = parse_sizes([args.calib], "--calib")
    data = args.data or next((p for p in (os.path.join(os.path.dirname(HERE), "..", "shared", "data", "glue", "SST-2", "dev.tsv"),)
                              if os.path.exists(p)), BUNDLED)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    tag = args.tag if args.tag is not None else ("-cuda" if args.device == "cuda" else "")
    torch.set_num_threads(args.threads)
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "python scripts/benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.machine()})",
        "threads": args.threads, "dtype": args.dtype, "autocast": args.autocast, "attn": args.attn,
        "rounds": args.rounds, "seed": args.seed, "data": os.path.relpath(data), "methods": args.methods,
        "torch": torch.__version__, "transformers": transformers.__version__, "peak_how": None,
        "fit_mib": args.fit_mib, "fit_seq": max(s for _, s in sizes), "calib": args.calib,
        "calib_rows": f"{max(b for b, _ in sizes)}..{max(b for b, _ in sizes) + calib[0] - 1}", "configs": {},
    }
    tok = AutoTokenizer.from_pretrained(minilm_path())
    rows = sst2_rows(data)
    records, fits = [], {}
    for model_name in args.models:
        model = build_model(model_name, args.attn, args.device, dtype)
        calib_batch = make_batch(tok, rows, calib[0], calib[1], args.device, offset=max(b for b, _ in sizes))
        RESOLVED.clear()
        AUTO_INFO.clear()
        RESOLVED.update(resolve_configs(model, calib_batch, args.methods))
        meta["configs"][model_name] = dict(RESOLVED)
        for method, info in AUTO_INFO.items():
            meta.setdefault("auto", {}).setdefault(method, {})[model_name] = info
        del model, calib_batch
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the peak processes share the device
        peaks = {}
        if not args.no_peak:
            job = dict(model=model_name, methods=args.methods, sizes=sizes, device=args.device, dtype=str(dtype).split(".")[1],
                       autocast=args.autocast, threads=args.threads, attn=args.attn, data=data, fit_mib=args.fit_mib,
                       configs=RESOLVED)
            for method, res in run_peak(job).items():
                peaks[method], meta["peak_how"] = res["peaks"], res["how"]
                if "fit" in res:
                    fits.setdefault(model_name, {})[method] = res["fit"]
                print(f"[peak] {model_name} {method}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in res["peaks"].items()),
                      flush=True)
        model = build_model(model_name, args.attn, args.device, dtype)
        for batch_size, seq in sizes:
            batch = make_batch(tok, rows, batch_size, seq, args.device)
            held = {m: held_bytes(model, batch, m, args.autocast) for m in args.methods}
            exact = flat_grad(model, batch, "none", args.seed, args.autocast)
            cos = {m: 1.0 if m == "none" else cosine(exact, flat_grad(model, batch, m, args.seed, args.autocast))
                   for m in args.methods}
            del exact
            step = time_methods(model, batch, args.methods, args.rounds, args.autocast, args.device)
            base = held.get("none", (None,))[0]
            for m in args.methods:
                rec = dict(model=model_name, method=m, batch=batch_size, seq=seq, held_bytes=held[m][0],
                           offloaded_bytes=held[m][1], held_ratio=(base / max(held[m][0], 1)) if base else float("nan"),
                           peak_bytes=peaks.get(m, {}).get(f"{batch_size}x{seq}"), step_s=step[m],
                           step_ratio=step[m] / step["none"] if "none" in step else float("nan"), cosine=cos[m])
                records.append(rec)
                print(f"{model_name:<13} {batch_size:>3}x{seq:<4} {m:<16} held {mib(rec['held_bytes']):>8} MiB "
                      f"({rec['held_ratio']:5.1f}x) peak {mib(rec['peak_bytes']):>8} MiB step {rec['step_s']:.3f}s "
                      f"({rec['step_ratio']:.2f}x) cos {rec['cosine']:.4f}", flush=True)
        setup(model, "none")
        del model
        gc.collect()
    if args.no_peak:
        for r in records:
            r["peak_bytes"] = r["peak_bytes"] or 0
        meta["peak_how"] = "not measured (--no-peak)"
    for path in write_outputs(meta, records, fits, args.out, tag):
        print("wrote", path)


if __name__ == "__main__":
    main()
