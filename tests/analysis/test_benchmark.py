"""The benchmark's accounting (``hf_division.analysis.measure.account``) and ``scripts/benchmark.py --quick`` end to end."""
import csv
import json
import os
import subprocess
import sys

import pytest
import torch

import hf_division as hd
from hf_division.analysis.measure import account, held_bytes
from hf_division.bench.zoo import build_classifier

from conftest import CHILD_TIMEOUT_S, tiny_batch, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "benchmark.py")


def hooked_bytes(model, batch) -> int:
    """Distinct non-parameter storages that reach a saved-tensors hook in one training forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = (t, s.nbytes())  # the tensor keeps its storage (and address) alive

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        out = model(**batch)
    del out
    return sum(n for _, n in seen.values())


def test_accounting_counts_what_checkpointing_and_offloading_hold():
    model, batch = tiny_model("bert"), tiny_batch(4, 64, pad_from=[64, 40, 20, 50])  # padded: a mask per layer
    model.train()
    for config in (None, hd.DivisionConfig(), hd.DivisionConfig(method="actnn")):
        if config is not None:
            hd.apply_division(model, config)
        held = account(model, batch)
        assert held.host_bytes == 0 and held.total == sum(held.by_kind.values()) == held_bytes(model, batch)[0]
        hd.remove_division(model)
    # a reentrant checkpoint saves the layer inputs through the hooks and keeps an RNG state per
    # layer outside them; the non-reentrant one keeps both outside: the same bytes
    layers, rng = model.config.num_hidden_layers, torch.get_rng_state().nbytes
    model.activation_checkpointing_enable({"use_reentrant": True})
    reentrant = account(model, batch).total
    assert reentrant == hooked_bytes(model, batch) + layers * rng
    model.activation_checkpointing_disable()
    model.activation_checkpointing_enable()
    assert account(model, batch).total == reentrant
    model.activation_checkpointing_disable()
    # save_on_cpu on a CPU model moves nothing: everything stays held where it was
    plain = account(model, batch)
    assert account(model, batch, offload=True) == plain
    assert account(model, batch, autocast=torch.bfloat16).total < plain.total


def test_unknown_model_and_bad_sizes_name_the_option():
    with pytest.raises(ValueError, match="--models"):
        build_classifier("gpt5", "sdpa", "cpu", torch.float32)
    res = subprocess.run([sys.executable, SCRIPT, "--sizes", "32"], cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert res.returncode != 0 and "--sizes: expected BATCHxSEQ" in res.stderr, res.stderr[-3000:]


def test_quick_run_writes_sane_outputs(tmp_path):
    out = tmp_path / "bench"
    res = subprocess.run([sys.executable, SCRIPT, "--quick", "--models", "tiny-bert", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("benchmark.json", "benchmark.csv", "tables.md", "peak_vs_batch.png", "time_vs_peak.png"):
        assert (out / name).stat().st_size > 0, name
    for png in ("peak_vs_batch.png", "time_vs_peak.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "benchmark.json").read_text())
    recs = {(r["method"], r["batch"], r["seq"]): r for r in data["records"]}
    methods = ["none", "division", "division-aggr", "actnn", "actnn-all", "ckpt", "save_on_cpu", "division+ckpt"]
    sizes = [(2, 32), (4, 32)]
    assert set(recs) == {(m, b, s) for m in methods for b, s in sizes}
    with open(out / "benchmark.csv") as f:
        assert len(list(csv.DictReader(f))) == len(recs)
    for b, s in sizes:
        held = {m: recs[m, b, s]["held_bytes"] for m in methods}
        assert held["division"] < held["none"] and held["actnn-all"] < held["actnn"] < held["none"]
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
