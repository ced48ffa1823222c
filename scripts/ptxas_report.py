"""ptxas's own account of every Triton kernel variant for sm_90: registers a thread, stack frame and
spill stores (bytes), from the PTX ``hf_division.kernels.triton_variants.compile_all`` returns.

    python scripts/ptxas_report.py [--arch 90]

It needs only ``compile_all``, so it also runs in a worktree of an older commit (``git worktree add
../before COMMIT``, then ``PYTHONPATH=../before python scripts/ptxas_report.py`` from this
checkout): how RESULTS compares the kernels before and after a change ("Kernel resources").
``python -m hf_division.bench kernels`` reads the same from the compiled cubins, with warps and
occupancy. Run it without ``TRITON_INTERPRET``; ptxas is the one Triton ships (the newer of its two
where the older refuses the PTX's version).
"""
import argparse
import re
import subprocess
import tempfile

from triton import knobs


def ptxas_usage(ptx: str, arch: int) -> dict:
    """``{"registers", "stack", "spill_stores"}`` from ``ptxas -v`` on ``ptx``."""
    tools = [knobs.nvidia.ptxas.path] + [t.path for t in [getattr(knobs.nvidia, "ptxas_blackwell", None)] if t]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        for tool in tools:
            done = subprocess.run([tool, f"-arch=sm_{arch}a", "-v", f.name, "-o", "/dev/null"],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                break
        else:
            raise SystemExit(f"ptxas failed: {done.stderr[-500:]}")
    log = done.stderr
    grab = lambda pattern: int(re.search(pattern, log).group(1))  # noqa: E731
    return {"registers": grab(r"Used (\d+) registers"), "stack": grab(r"(\d+) bytes stack frame"),
            "spill_stores": grab(r"(\d+) bytes spill stores")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    try:
        from hf_division.kernels.triton_variants import compile_all
    except ImportError:  # commits before the variants had a module of their own
        from hf_division.kernels.triton_codec import compile_all

    print(f"{'variant':32s} {'registers':>9s} {'stack B':>8s} {'spill stores B':>14s}")
    for variant, ptx in compile_all(args.arch).items():
        u = ptxas_usage(ptx, args.arch)
        print(f"{variant:32s} {u['registers']:9d} {u['stack']:8d} {u['spill_stores']:14d}", flush=True)


if __name__ == "__main__":
    main()
