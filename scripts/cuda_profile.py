"""Where a division step's GPU time goes, and whether bigger compiled chunks help.

OUT=dir python scripts/cuda_profile.py      (PROBE_DEV=cpu: a tiny model on the CPU, to check the script)

SmolLM2-135M's shape (random init, ``hf_division.bench.suites.cuda.build``), 8 x 1024 random tokens,
bf16 autocast. Prints and writes ``$OUT/probe.json``: median warm step seconds of ``none`` and
``division`` (eager compressor), the kernel launches and aten calls of one division step (torch
profiler; the tables in ``$OUT/profile.txt``), and the compiled compressor's warm-up and step
time with token chunks of 2^20 (the default) and 2^24 elements. docs/RESULTS.md, "On a GPU".
"""
import json, os, sys, time
import torch
from hf_division.kernels import compiled as fused, configure
from hf_division.bench.suites.cuda import build, set_arm, step_fn
from hf_division.bench.textdata import random_tokens
from hf_division.analysis.timing import timed
import statistics

out = os.environ["OUT"]
DEV = os.environ.get("PROBE_DEV", "cuda")
SHAPE, (B, T) = ("smollm2", (8, 1024)) if DEV == "cuda" else ("tiny", (2, 64))
model = build(SHAPE, DEV)
b = {k: v.to(DEV) for k, v in random_tokens(model.config.vocab_size, B, T, 0).items()}
b["labels"] = b["input_ids"]
step = step_fn(model, b, torch.bfloat16, DEV)
res = {}

def med(n=5):
    return statistics.median(timed(step, DEV) for _ in range(n))

for arm in ["none", "division"]:
    configure(compile=False)
    set_arm(model, arm); step(); step()
    res[f"{arm} eager"] = med()
    if arm == "division":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if DEV == "cuda" else [])) as p:
            step()
        ka = p.key_averages()
        with open(f"{out}/profile.txt", "w") as f:
            f.write(ka.table(sort_by="cuda_time_total" if DEV == "cuda" else "cpu_time_total", row_limit=30))
            f.write("\n\nby count\n" + ka.table(sort_by="count", row_limit=20))
        res["kernels"] = sum(e.count for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
        res["aten_calls"] = sum(e.count for e in ka if e.key.startswith("aten::"))
    print(res, flush=True)

for chunk in [1 << 20, 1 << 24]:
    configure(compile=True)
    fused.TOKEN_CHUNK = chunk
    fused.compiled.cache_clear(); torch._dynamo.reset()
    set_arm(model, "division")
    t0 = time.perf_counter(); step(); step()
    res[f"division compiled chunk {chunk} warmup_s"] = time.perf_counter() - t0
    res[f"division compiled chunk {chunk}"] = med()
    print(res, flush=True)
json.dump(res, open(f"{out}/probe.json", "w"), indent=1)
