"""Where a step's time goes on a GPU, per arm: launch-bound or kernel-bound, and which kernels.

OUT=dir python scripts/cuda_profile.py                 (PROBE_DEV=cpu: a tiny model on the CPU, to check the script)
OUT=dir ARMS="none division" SHAPE=llama-1b SIZE=4x2048 python scripts/cuda_profile.py
    (arms: none, division, division-triton: division with every Triton launch through Triton's dispatch,
    the triton_launch switch off; division-unplanned: every launch through the launcher's key, the
    planned_launch switch off; division-unfused: the RMSNorms' rebuild and gradient, the gated MLPs'
    product and gradients and the rotary embedding in torch ops, the triton_rms_norm, triton_gated and
    triton_rotary switches off; checkpointing,
    division+checkpointing)

A random-init model of ``SHAPE``'s shape (``hf_division.bench.suites.cuda.build``; default SmolLM2-135M's,
8 x 1024 random tokens), bf16 autocast, the compressor's default kernels (Triton's on a GPU). For each arm:
the median warm step (5 steps after 2 warm-up), then one step under the torch profiler: its kernel launches,
the GPU's kernel time summed, that time's share of the step (near 1: the GPU is busy, the kernels decide;
well below 1: the GPU waits for the host's launches), its aten calls, and its 15 costliest kernels. Prints
and writes ``$OUT/profile.json``; the profiler's tables go to ``$OUT/profile_<arm>.txt``. What it is for:
docs/GUIDE.md, "On a GPU" (``scripts/gpu_session.sh`` runs it after the table).
"""
import os
import statistics

import torch
from torch.autograd import DeviceType

from hf_division.analysis.timing import timed
from hf_division.bench.suites.common import write_json
from hf_division.bench.suites.cuda import build, parse_size, set_arm, step_fn
from hf_division.bench.textdata import random_tokens
from hf_division.kernels import configured, switches

OUT = os.environ["OUT"]
DEV = os.environ.get("PROBE_DEV", "cuda")
SHAPE = os.environ.get("SHAPE", "smollm2" if DEV == "cuda" else "tiny")
B, T = parse_size(os.environ.get("SIZE", "8x1024" if DEV == "cuda" else "2x64"))
ARMS = os.environ.get("ARMS", "none division division-triton division-unfused division+checkpointing").split()
#: arms that are division with fast paths off: the switches they turn off
SWITCHED = {"division-triton": {"triton_launch": False}, "division-unplanned": {"planned_launch": False},
            "division-unfused": {"triton_rms_norm": False, "triton_gated": False, "triton_rotary": False}}
#: the fast paths' switches each arm's profile records as it ran
RECORDED = ("triton_launch", "planned_launch", "triton_rms_norm", "triton_gated", "triton_rotary")


def profiled(step) -> dict:
    """One step under the profiler: launches, kernel time and aten calls, and the costliest kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if DEV == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if DEV == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:15]
    return {
        "launches": sum(e.count for e in kernels),
        "kernel_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "aten_calls": sum(e.count for e in events if e.key.startswith("aten::")),
        "top": [{"kernel": e.key[:120], "count": e.count, "ms": round(e.self_device_time_total / 1e3, 3)} for e in top],
        "table": events.table(sort_by="self_device_time_total" if DEV == "cuda" else "self_cpu_time_total", row_limit=40),
    }


def main() -> dict:
    model = build(SHAPE, DEV)
    batch = {k: v.to(DEV) for k, v in random_tokens(model.config.vocab_size, B, T, 0).items()}
    batch["labels"] = batch["input_ids"]
    step = step_fn(model, batch, torch.bfloat16, DEV)
    res = {"shape": SHAPE, "size": [B, T], "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
           "torch": torch.__version__, "arms": {}}
    for arm in ARMS:
        set_arm(model, "division" if arm in SWITCHED else arm)
        with configured(**SWITCHED.get(arm, {})):
            step(), step()
            step_s = statistics.median(timed(step, DEV) for _ in range(5))
            prof = profiled(step)
            prof["switches"] = {name: getattr(switches(), name) for name in RECORDED}
        with open(os.path.join(OUT, f"profile_{arm.replace('+', '_')}.txt"), "w") as f:
            f.write(prof.pop("table"))
        prof["step_ms"] = step_s * 1e3
        prof["gpu_busy"] = prof["kernel_ms"] / prof["step_ms"]
        res["arms"][arm] = prof
        print(f"{arm}: step {prof['step_ms']:.1f} ms, {prof['launches']} launches, kernels {prof['kernel_ms']:.1f} ms "
              f"(busy {prof['gpu_busy']:.2f}), {prof['aten_calls']} aten calls", flush=True)
        for row in prof["top"][:8]:
            print(f"    {row['ms']:8.2f} ms  x{row['count']:<5} {row['kernel']}", flush=True)
    write_json(os.path.join(OUT, "profile.json"), res)
    return res


if __name__ == "__main__":
    main()
