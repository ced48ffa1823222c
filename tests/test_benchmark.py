"""scripts/benchmark.py: its saved-tensor accounting, and a --quick run end to end."""
import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from hf_division.measure import held_bytes as measure_held

from conftest import tiny_batch, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "benchmark.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accounting_matches_measure_and_reentrant_checkpoint(bench):
    model, batch = tiny_model("bert"), tiny_batch(4, 64, pad_from=[64, 40, 20, 50])  # padded: a mask per layer
    for method in ("none", "division", "actnn"):
        bench.setup(model, method)
        assert bench.held_bytes(model, batch, method) == (measure_held(model.train(), batch)[0], 0)
    # Transformers' (non-reentrant) checkpoint keeps layer inputs outside saved-tensor hooks; the
    # reentrant one saves them through the hooks, plus an RNG state per layer that we count too
    ckpt, _ = bench.held_bytes(model, batch, "ckpt")
    bench.setup(model, "none")
    model.activation_checkpointing_enable({"use_reentrant": True})
    layers = model.config.num_hidden_layers
    assert ckpt == measure_held(model.train(), batch)[0] + layers * torch.get_rng_state().nbytes
    bench.setup(model, "none")
    # save_on_cpu on a CPU model moves nothing: everything stays held where it was
    assert bench.held_bytes(model, batch, "save_on_cpu") == bench.held_bytes(model, batch, "none")


def test_bad_sizes_name_the_option(bench):
    with pytest.raises(ValueError, match="--sizes"):
        bench.parse_sizes(["32"])
    with pytest.raises(ValueError, match="--models"):
        bench.build_model("gpt5", "sdpa", "cpu", torch.float32)


def test_quick_run_writes_sane_outputs(tmp_path):
    out = tmp_path / "bench"
    res = subprocess.run([sys.executable, SCRIPT, "--quick", "--models", "tiny-bert", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("benchmark.json", "benchmark.csv", "tables.md", "peak_vs_batch.png", "time_vs_peak.png"):
        assert (out / name).stat().st_size > 0, name
    for png in ("peak_vs_batch.png", "time_vs_peak.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "benchmark.json").read_text())
    recs = {(r["method"], r["batch"], r["seq"]): r for r in data["records"]}
    methods = ["none", "division", "division-aggr", "actnn", "ckpt", "save_on_cpu", "division+ckpt"]
    sizes = [(2, 32), (4, 32)]
    assert set(recs) == {(m, b, s) for m in methods for b, s in sizes}
    with open(out / "benchmark.csv") as f:
        assert len(list(csv.DictReader(f))) == len(recs)
    for b, s in sizes:
        held = {m: recs[m, b, s]["held_bytes"] for m in methods}
        assert held["division"] < held["none"] and held["actnn"] < held["none"]
        assert held["division-aggr"] < held["division"]
        assert held["ckpt"] < held["none"]
        assert held["division+ckpt"] < held["ckpt"]
        assert held["save_on_cpu"] == held["none"] and recs["save_on_cpu", b, s]["offloaded_bytes"] == 0
        for m in methods:
            r = recs[m, b, s]
            assert r["peak_bytes"] > 0 and r["step_s"] > 0, (m, r)
            assert r["held_ratio"] == pytest.approx(held["none"] / held[m])
            assert 0.8 < r["cosine"] <= 1 + 1e-9, (m, r["cosine"])
        for m in ("ckpt", "save_on_cpu"):  # exact methods
            assert recs[m, b, s]["cosine"] > 1 - 1e-6
        assert recs["none", b, s]["step_ratio"] == 1
    assert recs["none", 4, 32]["held_bytes"] > recs["none", 2, 32]["held_bytes"]
    tables = (out / "tables.md").read_text()
    assert all(f"| {m} |" in tables for m in methods)
    assert "peak_vs_batch.png" in tables and "time_vs_peak.png" in tables and data["meta"]["date"] in tables
