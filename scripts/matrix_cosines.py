"""The gradient cosines of every case of the precision x padding x attention matrix and of the LoRA
sweep (tests/model_patches/test_matrix.py, test_matrix_lora.py), and their lowest: the evidence for
the bounds those tests hold (docs/GUIDE.md, "Gradient fidelity").

python scripts/matrix_cosines.py [--workers 2] [--json cosines.json] [-k EXPR]

Runs the two test files under pytest (one draw per case, as the tests do) with
``HF_DIVISION_MATRIX_COSINES`` set, so that each case appends its whole-gradient cosine and its
lowest per-tensor cosine (tensors with >= 1% of the norm) to a file; prints, per file, the cases
lowest in each and the bounds. Cases pytest skips or marks as expected failures record what they
reached too (an expected failure's figures are below the bounds, which is why it is one).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("tests/model_patches/test_matrix.py", "tests/model_patches/test_matrix_lora.py")
ENV = "HF_DIVISION_MATRIX_COSINES"  # tests/model_patches/test_matrix.py's COSINES_ENV


def run(workers: int, select: str | None) -> list[dict]:
    """Every case's record (``case``, ``whole``, ``tensor``, ``name``, ``bounds``), from one pytest run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cosines.jsonl")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES]
        cmd += ["-n", str(workers)] if workers > 1 else []
        cmd += ["-k", select] if select else []
        done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, ENV: out})
        if done.returncode not in (0, 1):  # 1: a case failed, whose figures are what this reports
            raise SystemExit(f"matrix_cosines: pytest exited with {done.returncode}")
        if not os.path.exists(out):
            raise SystemExit("matrix_cosines: no case recorded its cosines")
        with open(out) as f:
            return [json.loads(line) for line in f]


def report(rows: list[dict], lowest: int = 3) -> str:
    """Per test function (the sweep's, then each other test's, e.g. a known exception's expected
    failure), its cases' bounds and the ``lowest`` cases in each cosine."""
    lines = []
    tests = {r["case"].split("[", 1)[0]: None for r in rows}
    for test in tests:
        mine = [r for r in rows if r["case"].split("[", 1)[0] == test]
        bounds = sorted({tuple(r["bounds"]) for r in mine})
        lines.append(f"{test}: {len(mine)} cases, bounds (whole, per tensor) {', '.join(map(str, bounds))}")
        for key, label in (("whole", "whole gradient"), ("tensor", "per tensor")):
            for r in sorted(mine, key=lambda r: r[key])[:lowest]:
                case = r["case"].split("[", 1)[1].rstrip("]") if "[" in r["case"] else "-"
                lines.append(f"  lowest {label}: {r[key]:.4f}  {case}  (worst tensor {r['name']})")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (1: none)")
    ap.add_argument("--json", help="write every case's record here")
    ap.add_argument("-k", dest="select", help="pytest's -k expression: some cases only")
    args = ap.parse_args(argv)
    rows = run(args.workers, args.select)
    print(report(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
