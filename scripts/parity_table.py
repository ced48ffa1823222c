#!/usr/bin/env python
"""Summarize ``scripts/glue_parity.sh`` runs: mean ± std of each task's GLUE metric per arm.

    python scripts/parity_table.py out/parity [--markdown docs/results/parity/TASKS.md]

Reads every ``OUT/<task>_<arm>_s<seed>/division_report.json``; arms are compared in pairs
(baseline vs division, lora-baseline vs lora-division). The parity bound is the project's
(docs/RESULTS.md, "GLUE accuracy parity"): |Δ mean| <= max(0.5 points, std of the reference arm).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics

from hf_division.bench.glue import main_metric

PAIRS = (("baseline", "division"), ("lora-baseline", "lora-division"))


def load(out: str) -> dict:
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "*", "division_report.json"))):
        m = re.fullmatch(r"(\w+?)_([\w-]+)_s(\d+)", os.path.basename(os.path.dirname(path)))
        if not m:
            continue
        task, arm, seed = m.group(1), m.group(2), int(m.group(3))
        with open(path) as f:
            runs.setdefault((task, arm), {})[seed] = json.load(f)
    return runs


def _stats(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table(runs: dict) -> str:
    lines = ["| task | metric | arm | seeds | score (mean ± std) | Δ vs ref | bound | within | act. held MiB | peak RSS MiB | train s (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    tasks = sorted({t for t, _ in runs})
    for task in tasks:
        metric = "eval_" + main_metric(task)
        for ref_arm, arm in PAIRS:
            if (task, ref_arm) not in runs or (task, arm) not in runs:
                continue
            ref = runs[(task, ref_arm)]
            ref_mean, ref_std = _stats([100 * r["metrics"][metric] for r in ref.values()])
            for name in (ref_arm, arm):
                rs = runs[(task, name)]
                mean, std = _stats([100 * r["metrics"][metric] for r in rs.values()])
                mem = next(iter(rs.values()))["activation_memory"]
                held = mem["division_bytes"] if rs[next(iter(rs))]["division"] else mem["baseline_bytes"]
                peak = statistics.mean(r["peak_memory_bytes"] for r in rs.values()) / 2**20
                secs = statistics.mean(r["train_runtime_s"] for r in rs.values())
                if name == ref_arm:
                    delta = bound = within = "—"
                else:
                    d = mean - ref_mean
                    b = max(0.5, ref_std)
                    delta, bound, within = f"{d:+.2f}", f"{b:.2f}", "yes" if abs(d) <= b else "no"
                seeds = ",".join(str(s) for s in sorted(rs))
                lines.append(f"| {task} | {metric[5:]} | {name} | {seeds} | {mean:.2f} ± {std:.2f} | {delta} | {bound} | "
                             f"{within} | {held / 2**20:.1f} | {peak:.0f} | {secs:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args(argv)
    runs = load(args.out)
    if not runs:
        raise SystemExit(f"no runs under {args.out}")
    text = table(runs)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
