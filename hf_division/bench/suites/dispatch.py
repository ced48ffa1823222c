"""The host's time per training step and per launch with Triton's launch path included, on a CPU
machine (docs/DESIGN.md, "On a GPU": host time).

python -m hf_division.bench dispatch [--shape smollm2] [--layers N] [--size 1x32] [--autocast bf16]
    [--rounds 30] [--host-tokens 8192] [--components] [--out dispatch.json]

Run it without ``TRITON_INTERPRET``: the kernels compile for a simulated sm_90 device and each launch
goes through Triton's launch path, ``CompiledKernel.run`` included, to a stand-in of the driver's call
that runs nothing (:mod:`hf_division.analysis.simulated_cuda`). The ``launches`` suite's host times
leave that path out (its kernels are counted, not launched).

The shape's depth and layers at the ``launches`` suite's narrow width
(:data:`~hf_division.bench.suites.launches.HOST_WIDTH`, its ``min_numel``), one training step per
round, arms interleaved: ``none``; ``division``, its kernels launched again through
:mod:`hf_division.kernels.launcher`, each planned per shape (``triton_codec.Launch``);
``division-unplanned``, each through the launcher's key (the ``planned_launch`` switch off);
``division-triton``, every launch through Triton's dispatch (the ``triton_launch`` switch off); ``division-unfused``, the norms' rebuild and gradient, the
gated MLPs' product and gradients and the rotary embedding in torch ops instead of
:mod:`hf_division.kernels.triton_norm`'s, :mod:`hf_division.kernels.triton_gated`'s and
:mod:`hf_division.kernels.triton_rotary`'s kernels (the ``triton_rms_norm``, ``triton_gated`` and
``triton_rotary`` switches off); ``division-mode``, every training forward under the patched
forward's ``TorchFunctionMode`` (the ``lazy_forward_mode`` switch off); ``division-kept``,
division with every saved tensor held as it is (no tensor reaches its ``min_numel``): division's
Functions and store without the compressor; with ``--components``, :data:`COMPONENT_ARMS`, each
division without one of its parts; ``checkpointing`` and ``division+checkpointing``, the cuda
suite's arms of those names (Transformers' gradient checkpointing, its recomputation unpatched). Also the host's microseconds
to compress and rebuild one bf16 tensor of ``--host-tokens`` x the shape's hidden size, planned,
through the launcher's key and through Triton's dispatch, and per launch.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from hf_division.analysis.launches import gpu_path
from hf_division.analysis.simulated_cuda import simulated_cuda
from hf_division.analysis.timing import interleaved_medians
from hf_division.api import apply_division
from hf_division.bench.suites import cuda as cuda_suite
from hf_division.bench.suites.common import set_threads, suite_parser, write_json
from hf_division.bench.suites.launches import HOST_MIN_NUMEL, HOST_WIDTH, interleaved, saved_tensor, stand_in_arguments
from hf_division.bench.textdata import random_tokens
from hf_division.compress.pipeline import compress, decompress
from hf_division.config import DivisionConfig
from hf_division.kernels import configured, triton_codec

#: the division arms' switches
WAYS = {"division": dict(triton_launch=True), "division-triton": dict(triton_launch=False),
        "division-unplanned": dict(planned_launch=False),
        "division-unfused": dict(triton_rms_norm=False, triton_gated=False, triton_rotary=False),
        "division-mode": dict(lazy_forward_mode=False)}
#: the arms with Transformers' gradient checkpointing (the cuda suite's, on the stand-in)
CHECKPOINTED = ("checkpointing", "division+checkpointing")
#: ``division-kept``'s ``min_numel``: no saved tensor is that large, so each is held as it is
KEPT_MIN_NUMEL = 2**62
#: arms of their own model, by the config fields division's differ in: ``division-kept`` always;
#: with ``--components`` the parts of division's host time, each left out in turn (the outlier-token
#: search; the norm inputs' row scales; the attention's Function, q, k and v held and recomputed;
#: the Linear inputs compressed)
CONFIG_ARMS = {"division-kept": dict(min_numel=KEPT_MIN_NUMEL)}
COMPONENT_ARMS = {"division-no-outliers": dict(outlier_ratio=0.0), "division-no-row-scale": dict(norm_row_scale=False),
                  "division-exact-attention": dict(attention_bits=0), "division-exact-linear": dict(linear_bits=0)}
#: the ways a saved tensor's compress and rebuild are timed (the fused kernels' switches do not reach them)
LAUNCH_WAYS = ("division", "division-unplanned", "division-triton")


def per_tensor(hidden: int, tokens: int, rounds: int) -> dict:
    """Per way: host microseconds to compress and rebuild one bf16 ``(tokens, hidden)`` tensor with the
    defaults (median over ``rounds // 100`` blocks of 100, the ways' blocks interleaved), its
    launches, and microseconds per launch."""
    x, kw = saved_tensor(hidden, tokens)
    launches = {}
    with gpu_path(), simulated_cuda(keep=False) as launched:
        p = compress(x, **kw)
        decompress(p)
        for way in LAUNCH_WAYS:  # each way's launches (and its kernels kept)
            with configured(**WAYS[way]):
                n0 = launched.n
                compress(x, **kw)
                decompress(p)
                launches[way] = launched.n - n0

        def block(way: str) -> float:
            with configured(**WAYS[way]):
                start = time.perf_counter()
                for _ in range(100):
                    compress(x, **kw)
                    decompress(p)
                return time.perf_counter() - start

        medians = interleaved_medians(list(LAUNCH_WAYS), block, rounds // 100)
    return {way: {"us": 1e4 * medians[way], "launches": launches[way],
                  "us_per_launch_all": 1e4 * medians[way] / launches[way]} for way in LAUNCH_WAYS}


def steps(shape: str, layers: int | None, size: tuple[int, int], rounds: int, autocast,
          components: bool = False) -> dict:
    """Per arm (the module doc's), :func:`~hf_division.bench.suites.launches.interleaved`'s figures."""
    none = cuda_suite.build(shape, "cpu", layers=layers, **HOST_WIDTH).train()
    div = cuda_suite.build(shape, "cpu", layers=layers, **HOST_WIDTH).train()
    apply_division(div, DivisionConfig(min_numel=HOST_MIN_NUMEL))
    configs = {}
    for arm, fields in {**CONFIG_ARMS, **(COMPONENT_ARMS if components else {})}.items():
        configs[arm] = cuda_suite.build(shape, "cpu", layers=layers, **HOST_WIDTH).train()
        apply_division(configs[arm], DivisionConfig(**{"min_numel": HOST_MIN_NUMEL, **fields}))
    checkpointed = {}
    for arm in CHECKPOINTED:
        checkpointed[arm] = cuda_suite.build(shape, "cpu", layers=layers, **HOST_WIDTH).train()
        cuda_suite.set_arm(checkpointed[arm], arm, DivisionConfig(min_numel=HOST_MIN_NUMEL))
    models = {"none": none, **{arm: div for arm in WAYS}, **configs, **checkpointed}
    batch = random_tokens(HOST_WIDTH["vocab_size"], *size, seed=0)
    batch["labels"] = batch["input_ids"]
    with gpu_path(), simulated_cuda(keep=False) as launched:
        warm = interleaved(models, batch, autocast, 2, False, WAYS)  # compiles (or loads) the kernels
        timed = interleaved(models, batch, autocast, rounds, False, WAYS)
        per_step = {}
        for arm in WAYS:  # the Triton kernels one step of each way reaches the driver with
            n0 = launched.n
            interleaved({arm: models[arm]}, batch, autocast, 1, False, WAYS)
            per_step[arm] = launched.n - n0
    out = {arm: {k: v for k, v in r.items() if k != "gc"} for arm, r in timed.items()}
    for arm in WAYS:
        out[arm]["triton_launches"] = per_step[arm]
    out["warm_ms"] = {arm: r["median"] for arm, r in warm.items()}
    return out


def report(res: dict, size: tuple[int, int], rounds: int) -> str:
    s = res["steps"]
    base = s["none"]["median"]
    lines = [f"host per step at hidden {HOST_WIDTH['hidden_size']}, {size[0]}x{size[1]} tokens, Triton's launch path "
             f"simulated ({rounds} steps each, median):"]
    for arm in ("none", *WAYS, *CONFIG_ARMS, *[a for a in COMPONENT_ARMS if a in s], *CHECKPOINTED):
        lines.append(f"  {arm:24s} {s[arm]['median']:7.1f} ms ({s[arm]['median'] / base:.2f}x none; min {s[arm]['min']:.1f}; "
                     f"forward {s[arm]['forward_median']:.1f})")
    lines.append("  Triton launches a step: " + ", ".join(f"{arm} {s[arm]['triton_launches']}" for arm in WAYS))
    t = res["tensor"]
    lines.append(f"host per saved {res['tensor_shape']} bf16 tensor, compress + rebuild ({t['division']['launches']} launches): "
                 + ", ".join(f"{way} {t[way]['us']:.0f} us" for way in LAUNCH_WAYS)
                 + f"; {(t['division-triton']['us'] - t['division']['us']) / t['division']['launches']:.1f} us saved a launch"
                 f" ({(t['division-unplanned']['us'] - t['division']['us']) / t['division']['launches']:.1f} by the plans)")
    return "\n".join(lines)


def main(argv=None):
    ap = suite_parser("dispatch", __doc__)
    stand_in_arguments(ap)
    ap.add_argument("--rounds", type=int, default=30, help="timed steps per arm")
    ap.add_argument("--components", action="store_true",
                    help="also the arms that each leave one part of division out (COMPONENT_ARMS)")
    ap.add_argument("--out")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    set_threads()  # HF_DIVISION_THREADS, else 2: the recorded runs' (docs/RESULTS.md, "Kernel launches")
    if not triton_codec.available():
        raise SystemExit("hf-division dispatch suite: needs Triton (pip install triton)")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("hf-division dispatch suite: run it on a machine without CUDA and without TRITON_INTERPRET "
                         "(the kernels compile for a simulated device; on a GPU, the cuda suite times the real thing)")
    amp = torch.bfloat16 if args.autocast == "bf16" else None
    hidden = cuda_suite.SHAPES[args.shape]["hidden_size"]
    res = {"argv": argv, "shape": args.shape, "layers": args.layers, "size": args.size,
           "tensor_shape": f"{args.host_tokens}x{hidden}",
           "tensor": per_tensor(hidden, args.host_tokens, 2000),
           "steps": steps(args.shape, args.layers, args.size, args.rounds, amp, args.components)}
    print(report(res, args.size, args.rounds), flush=True)
    write_json(args.out, res)
    return res
