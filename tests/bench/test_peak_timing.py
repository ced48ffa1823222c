"""The measuring helpers: peak memory (``hf_division.bench.peak``), interleaved step times
(``hf_division.analysis.timing``) and the suites built on them (``step-time``, ``memory``)."""
import json
import os
import re
import time

import pytest
import torch

from hf_division.kernels import compiled as fused, native, switches
from hf_division.autograd import rms_norm
from hf_division.bench import suites
from hf_division.bench.malloc_env import MALLOC_ENV
from hf_division.bench.peak import forked, run_clean, step_peak
from hf_division.analysis.timing import interleaved_medians, quartile_ratios, round_ratios, timed, timed_host


def test_interleaved_medians_rotate_and_drop_the_warm_up_round():
    calls, cost = [], {"a": [9, 1, 2, 3], "b": [9, 5, 6, 7], "c": [9, 4, 4, 4]}

    def seconds(name):
        calls.append(name)
        return cost[name][sum(c == name for c in calls) - 1]

    assert interleaved_medians(["a", "b", "c"], seconds, rounds=3) == {"a": 2, "b": 6, "c": 4}
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    log = []  # before_round runs once per round, before that round's first step
    interleaved_medians(["a", "b"], lambda name: log.append(name) or 1.0, 1, before_round=log.append)
    assert log == [0, "a", "b", 1, "b", "a"]
    assert 0 <= timed(lambda: None) < 1


def test_timed_host_splits_the_hosts_seconds_from_the_synchronized_step(monkeypatch):
    """The host's seconds end when the step's Python returns, the step's after the device's work:
    a stand-in synchronize that waits 50 ms counts in the second only."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: time.sleep(0.05))
    host, step = timed_host(lambda: time.sleep(0.02), "cuda")
    assert 0.02 <= host < 0.05 and step >= host + 0.05, (host, step)
    host, step = timed_host(lambda: time.sleep(0.02))  # the CPU: nothing to wait for
    assert 0.02 <= host <= step < host + 0.01, (host, step)


def test_round_ratios_compare_steps_of_the_same_round():
    # the machine slows down in rounds 3-4: both methods' steps grow, their ratio does not
    times = {"base": [1.0, 1.0, 2.0, 2.0, 1.0], "div": [1.1, 1.2, 2.2, 2.4, 1.0]}
    out = round_ratios(times, "base")
    assert out["base"] == (1.0, 1.0, 1.0)
    med, q1, q3 = out["div"]
    assert med == pytest.approx(1.1) and q1 <= med <= q3 and q3 == pytest.approx(1.2)


def test_quartile_ratios_take_the_faster_steps():
    # one round of "div" hit by other load: the median ratio moves with it, the first quartiles do not
    times = {"base": [1.0, 1.0, 1.0, 1.0, 1.0], "div": [1.1, 1.1, 1.1, 5.0, 5.0]}
    out = quartile_ratios(times, "base")
    assert out["base"] == 1.0 and out["div"] == pytest.approx(1.1)
    assert quartile_ratios({"base": [2.0], "div": [3.0]}, "base")["div"] == 1.5  # one round: its own times


def test_step_peak_sees_a_step_s_transient_allocation():
    keep = torch.ones(2**22)  # held across the step: not part of its peak

    def step():
        t = torch.ones(2**24)  # 64 MiB, freed when the step returns
        return t.sum()

    peak, how = step_peak(step)
    assert 60 * 2**20 <= peak < 100 * 2**20, (peak, how)
    assert how.startswith(("RSS", "ru_maxrss")) and keep.numel() == 2**22


def test_forked_runs_each_job_in_a_child_and_reports_failures():
    assert forked(lambda x: {"pid": os.getpid(), "x": x * 2}, [1, 2])[1]["x"] == 4
    assert all(r["pid"] != os.getpid() for r in forked(lambda x: {"pid": os.getpid()}, [0]))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        forked(lambda x: 1 / x, [1, 0])


def test_run_clean_sets_glibc_mmap_threshold():
    code = "import json, os; print('noise'); print(json.dumps({k: os.environ.get(k) for k in %r}))" % list(MALLOC_ENV)
    assert run_clean(["-c", code], "env check") == MALLOC_ENV
    with pytest.raises(RuntimeError, match="failing run failed"):
        run_clean(["-c", "raise SystemExit(3)"], "failing run")


def test_memory_suite(capsys):
    """(``--rss`` runs the same forward in fresh processes through ``run_clean`` and ``forked``,
    tested above and by the benchmark's end-to-end run; here it would compile the kernels twice more.)"""
    suites.run("memory", ["--config", "bert-base-2l", "--batch", "4", "--seq", "64", "--division_linear_bits", "4"])
    out = capsys.readouterr().out
    assert "linear_bits=4" in out.splitlines()[0]
    total = re.search(r"^total\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    base, div, ratio = (float(x) for x in total.groups())
    assert div < base / 4 and ratio == pytest.approx(base / div, rel=0.05), out


GLUE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "glue")


@pytest.mark.parametrize("extra", [[], ["--profile", "--top", "3"], ["--token-chunks", "4096"],
                                   ["--glue-dir", GLUE, "--task", "mrpc"], ["--model", "tiny-llama"],
                                   ["--aten-draws", "--control", "--nearest", "--also-set", '{{"linear_bits": 8}}'], ["--model", "tiny-llama", "--generic-norm", "--rebuilt-gated"],
                                   ["--split", "--rounds", "2", "--json", "{tmp}/times.json"]])
def test_step_time_suite(extra, capsys, tmp_path):
    chunk = fused.TOKEN_CHUNK
    extra = [a.format(tmp=tmp_path) for a in extra]
    suites.run("step-time", ["--batch", "2", "--seq", "16", "--rounds", "1", "--threads", "1",
                             "--division_block_size", "8", *extra])
    out = capsys.readouterr().out
    if "--json" in extra:  # every timed round's seconds, per arm; the forward shorter than its step
        saved = json.loads((tmp_path / "times.json").read_text())
        assert saved["command"][0] == "step-time" and "--split" in saved["command"]
        assert set(saved["step_seconds"]) == {"baseline", "division", "checkpointing"}
        for arm, steps in saved["step_seconds"].items():
            assert len(steps) == 2 and all(0 < f < s for f, s in zip(saved["forward_seconds"][arm], steps))
    if "--profile" in extra:
        assert "self CPU ms of one step" in out and len(out.strip().splitlines()) == 3 + 3
        store = re.search(r"^division's store: compress [\d.]+ ms over (\d+) tensors; rebuild [\d.]+ ms over (\d+) "
                          r"tensors$", out, re.M)
        assert store and int(store.group(1)) > 0 and int(store.group(2)) > 0, out
    else:
        if "--split" in extra:  # the forward and the backward apart, after the whole step
            out, parts = _split_parts(out)
            assert all(set(p) == {"baseline", "division", "checkpointing"} and p["baseline"][1] == 1.0
                       for p in parts.values()), parts
            for arm in ("baseline", "division", "checkpointing"):  # a step is its forward and its backward
                step = float(re.search(rf"^{arm}\s+([\d.]+)", out, re.M).group(1))
                assert 0 < parts["forward"][arm][0] < step and 0 < parts["backward"][arm][0] < step
        rows = {line.split()[0]: float(line.split()[2]) for line in out.splitlines()[2:]}
        chunked = {"division@4096"} if "--token-chunks" in extra else set()
        if "--control" in extra:  # an unpatched copy, and division drawing dropout with ATen's bernoulli_
            chunked |= {"baseline-copy", "division-aten-draws", "division-nearest", "division-set"}
            assert native.draws_apply(torch.empty(4), 0.5) == native.draws_match_aten()  # native draws back on
        if "--generic-norm" in extra:  # division with RMSNorm recomputed under autograd, switched back after
            chunked |= {"division-generic-norm", "division-rebuilt-gated"}
            assert rms_norm.takes(1e-6)
            assert switches().gated_from_codes and switches().rms_norm_backward  # and the kernels back on
        if "--task" in extra:  # a new MRPC batch per round, padded to its longest row (at most --seq)
            assert re.search(r"mrpc train batches of 2, padded per batch to \d+-16 tokens", out), out
        assert fused.TOKEN_CHUNK == chunk  # restored after the run
        assert set(rows) == {"baseline", "division", "checkpointing"} | chunked and rows["baseline"] == 1.0
        assert ("tiny Llama" if "--model" in extra else "all-MiniLM-L6-v2") in out.splitlines()[0]
        assert re.search(r"^division\s+[\d.]+\s+[\d.]+\s+[\d.]+ \[[\d.]+-[\d.]+\]\s+[\d.]+$", out, re.M), out
        assert re.search(r"^baseline\s+[\d.]+\s+1\.00\s+1\.000 \[1\.000-1\.000\]\s+1\.000$", out, re.M), out


def _split_parts(out: str) -> tuple[str, dict]:
    """The whole-step report, and ``{part: {arm: (median s, ratio)}}`` of the parts after it."""
    head, _, rest = out.partition("forward only:\n")
    fwd, _, bwd = rest.partition("backward only:\n")
    parts = {}
    for name, text in (("forward", fwd), ("backward", bwd)):
        rows = [line.split() for line in text.splitlines()[1:] if line.strip()]
        parts[name] = {r[0]: (float(r[1]), float(r[2])) for r in rows}
    return head, parts


def test_step_time_also_set_names_a_field_the_config_lacks(capsys):
    with pytest.raises(SystemExit):
        suites.run("step-time", ["--rounds", "1", "--also-set", '{"late_layer": 0}'])
    err = capsys.readouterr().err
    assert "--also-set" in err and "late_layer" in err, err


def test_step_time_suite_real_batches_vary_and_bad_task_is_named():
    from hf_division.bench.glue import collated_batches
    from hf_division.bench.zoo import minilm_tokenizer

    batches = collated_batches(GLUE, "sst2", minilm_tokenizer(), 4, 64, 3)
    lengths = [b["input_ids"].shape[1] for b in batches]
    assert len(set(lengths)) > 1 and max(lengths) <= 64, lengths  # padded per batch, not to 64
    assert all(b["labels"].shape == (4,) and b["attention_mask"].shape == b["input_ids"].shape for b in batches)
    with pytest.raises(SystemExit):
        suites.run("step-time", ["--glue-dir", GLUE, "--task", "stsb", "--rounds", "1"])


def test_median_time_is_the_median_after_a_warm_up():
    from hf_division.analysis.timing import median_time

    calls, waits = [], iter([0.05, 0.0, 0.04, 0.0, 0.0, 0.04])  # the warm-up call, then 5 timed ones
    def fn():
        calls.append(1)
        time.sleep(next(waits))

    t = median_time(fn, rounds=5)
    assert len(calls) == 6 and t < 0.01  # the median of 0 .04 0 0 .04 (their mean: .016; with the warm-up: .02)


@pytest.mark.parametrize("model", [
    ["--shape", "tiny", "--layers", "1", "--size", "2x64", "--head", "cls"],
    ["--shape", "whisper-tiny", "--layers", "1", "--size", "2x16"],
], ids=["llama-cls", "whisper"])
def test_cache_peak_script_reports_the_cache_division_holds(model):
    """``scripts/cache_peak.py`` (docs/DESIGN.md, "The training KV cache") on one layer, with LoRA:
    a Llama classifier of the tiny shape, and Whisper (its cache an ``EncoderDecoderCache``,
    cross-attention's half over all 1,500 encoder tokens). The unpatched step's cache and
    division's with ``use_cache=True`` hold the same bytes, division's own none; each arm's peak
    is measured."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [sys.executable, os.path.join(root, "scripts", "cache_peak.py"), *model, "--lora"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(("none ", "division "))]
    cache = {(r[0], " ".join(r[1:-2])): float(r[-2]) for r in rows}
    assert cache[("none", "not passed")] > 0 and cache[("division", "True")] == cache[("none", "not passed")]
    assert cache[("division", "not passed")] == 0
    assert all(float(r[-1]) > 0 for r in rows) and len(rows) == 3
