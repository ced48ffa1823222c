"""Decoder training on a GPU: bytes held, step peak, step time and gradient cosine, five arms.

python -m hf_division.bench cuda [--shapes smollm2 llama-1b] [--sizes 8x1024 4x2048] [--autocast bf16]
    [--rounds 5] [--draws 3] [--quick] [--set JSON] [--compiled] [--budget-s 400] [--out results.json]

Llama-shaped causal LMs with random weights (the real checkpoints do not travel to a GPU machine
here): ``smollm2`` (SmolLM2-135M's shape: hidden 576, 9 / 3 heads, intermediate 1536, 30 layers,
vocabulary 49152) and ``llama-1b`` (Llama-3.2-1B's: hidden 2048, 32 / 8 heads, intermediate 8192,
16 layers, vocabulary 128256), float32 weights, sdpa attention, causal-LM loss on random token ids
(labels = inputs), forward under ``--autocast`` (as the Trainer's ``--bf16``).

Arms: ``none``; ``checkpointing`` (Transformers' activation checkpointing, non-reentrant);
``offload`` (checkpointing with the checkpoints in pinned host memory, Transformers'
``activation_checkpointing_enable(offload=True)``; left out where Transformers lacks it);
``division`` (the family defaults, the Triton kernels); ``division+checkpointing``. Per shape and size (``--sizes``
pairs with ``--shapes`` in order): bytes held for backward after one training forward
(:func:`~hf_division.analysis.measure.account`); the step peak above the memory before the step
(``torch.cuda.max_memory_allocated``, after one warm step); the first step's seconds (kernel
compilation); median warm step seconds, arms interleaved (:mod:`~hf_division.analysis.timing`), and the
median of the host's seconds in those steps until the step's Python returned (``host_s``: a step
that takes about as long waits for its host); the float64
gradient cosine to ``none``'s, the minimum over ``--draws`` noise draws; the Triton launches per step.
``--compiled``: where the Triton kernels do not apply (flat groups), the compressor's torch kernels
through ``torch.compile``; without it they run eagerly, which needs no compilation. ``--quick``:
one shape at its size, 3 rounds, 1 draw (under 3 minutes on an H200).
Then, unless ``--no-graphs``, ``none+graph`` and ``division+graph``: the step captured in a CUDA
graph and replayed (:func:`captured`), which takes the host's Python out of the step: where the
unpatched eager step waits for its host (a small model), these two say what the GPU itself spends,
their replays interleaved with each other (after the eager arms, whose memory is freed first).
``--budget-s``: skip what is left once the run has taken this long. Results are written to
``--out`` after every measurement, so a run stopped early keeps what it measured.
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

import torch

from hf_division.api import apply_division, remove_division
from hf_division.config import DivisionConfig
from hf_division.analysis.fidelity import cosine, flat_grad
from hf_division.kernels import configured, triton_codec
from hf_division.analysis.measure import account
from hf_division.bench.peak import step_peak
from hf_division.bench.textdata import random_tokens
from hf_division.analysis.timing import interleaved_medians, timed, timed_host
from hf_division.bench.suites.common import AUTOCAST, suite_parser, write_json

ARMS = ("none", "checkpointing", "offload", "division", "division+checkpointing")

#: Llama config fields of each shape (published configs of the two models)
SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    # more published shapes, for the shapes suite's widths
    "smollm2-360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                         num_key_value_heads=5, vocab_size=49152, rope_theta=100000.0),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=151936, rope_theta=1000000.0),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0),
}


def build(shape: str, device: str, seed: int = 0, layers: int | None = None, vocab_size: int | None = None,
          **widths):
    """A random-init ``LlamaForCausalLM`` of ``shape`` (tied embeddings, sdpa) on ``device``;
    ``layers``, ``vocab_size``: another depth or vocabulary than the shape's; ``widths``: other
    config fields (a narrow stand-in of the shape)."""
    import transformers

    torch.manual_seed(seed)
    fields = {**SHAPES[shape], **widths}
    fields.update({k: v for k, v in (("num_hidden_layers", layers), ("vocab_size", vocab_size)) if v is not None})
    config = transformers.LlamaConfig(**fields, tie_word_embeddings=True, max_position_embeddings=8192)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)


def set_arm(model, arm: str, config: DivisionConfig | None = None) -> None:
    """Put ``model`` in the state of ``arm`` (from any other arm); ``config``: division's."""
    remove_division(model)
    if arm == "offload":
        model.activation_checkpointing_enable(offload=True)
    elif "checkpointing" in arm:
        model.activation_checkpointing_enable()
    else:
        model.activation_checkpointing_disable()
    if "division" in arm:
        apply_division(model, config)


def step_fn(model, batch: dict, amp, device: str):
    def step():
        with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def arms(model, device: str) -> tuple[str, ...]:
    """The arms that apply: ``offload`` needs ``activation_checkpointing_enable(offload=)`` and a
    device to offload from (pinned host memory)."""
    takes = "offload" in inspect.signature(model.activation_checkpointing_enable).parameters and device != "cpu"
    return tuple(a for a in ARMS if a != "offload" or takes)


def measure(model, batch: dict, amp, rounds: int, device: str, draws: int = 1,
            config: DivisionConfig | None = None, graphs: bool = False) -> dict:
    """Every figure of the module doc for the arms on one batch; ``graphs``: and
    :func:`measure_graphs`' after them."""
    model.train()
    step = step_fn(model, batch, amp, device)
    names = arms(model, device)
    out = {arm: {} for arm in names}
    exact = None
    for arm in names:
        set_arm(model, arm, config)
        out[arm]["first_step_s"] = timed(step, device)
        out[arm]["held_mib"] = account(model, batch, autocast=amp).total / 2**20
        out[arm]["peak_mib"] = step_peak(step, device)[0] / 2**20
        before = triton_codec.launches()
        step()
        out[arm]["triton_launches"] = triton_codec.launches() - before
        if arm == "none":
            exact = flat_grad(model, batch, 0, amp)
        out[arm]["cosine"] = min(cosine(exact, flat_grad(model, batch, 0, amp, noise_seed=1000 + d))
                                 for d in range(draws if "division" in arm else 1))
    state = {"arm": None}
    host = {arm: [] for arm in names}

    def seconds(arm):
        if state["arm"] != arm:
            set_arm(model, arm, config)
            state["arm"] = arm
        h, s = timed_host(step, device)
        host[arm].append(h)
        return s

    for arm, s in interleaved_medians(list(names), seconds, rounds).items():
        out[arm]["step_s"] = s
        out[arm]["host_s"] = statistics.median(host[arm][1:])  # the warm-up round left out, as for step_s
    set_arm(model, "none")
    if graphs:
        out.update(measure_graphs(model, batch, amp, rounds, device, exact, config))
    return out


#: the arms also timed as a step captured in a CUDA graph and replayed
GRAPH_ARMS = ("none", "division")


def captured(model, batch: dict, amp, device: str):
    """``(replay, grads)``: one training step of ``model`` as it is patched now, captured in a CUDA
    graph (PyTorch's whole-network capture: warm-up steps on a side stream, autocast's cast cache
    off, division's noise generators registered so that each replay draws new noise: docs/GUIDE.md,
    "On a GPU"), and the gradients each replay writes, in ``named_parameters`` order."""
    from hf_division.compress.noise import generators

    params = [p for _, p in model.named_parameters() if p.requires_grad]

    def forward_backward():
        with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None, cache_enabled=False):
            loss = model(**batch).loss
        loss.backward()

    def step():
        for p in params:
            p.grad.zero_()
        forward_backward()

    model.zero_grad(set_to_none=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward_backward()  # the gradients allocated, the kernels compiled, the generators made
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for gen in generators(device):
        graph.register_generator_state(gen)
    with torch.cuda.graph(graph):
        step()
    return graph.replay, [p.grad for p in params]


def measure_graphs(model, batch: dict, amp, rounds: int, device: str, exact: torch.Tensor,
                   config: DivisionConfig | None = None) -> dict:
    """Per arm of :data:`GRAPH_ARMS`, as ``<arm>+graph``: the capture's seconds (warm-up steps
    included), the peak above the memory before it (the graph's pool), the gradient cosine of a
    replay to ``exact``, and the median replay seconds, the arms' replays interleaved (at least 10
    rounds). Where a capture fails, its error instead: the eager arms' figures stand."""
    out, replays = {}, {}
    torch.cuda.empty_cache()  # the eager arms' cached blocks: each graph takes a pool of its own
    for arm in GRAPH_ARMS:
        set_arm(model, arm, config)
        name = f"{arm}+graph"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before, t0 = torch.cuda.memory_allocated(), time.perf_counter()
        try:
            replay, grads = captured(model, batch, amp, device)
            replay()
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - any failure to capture is this arm's result, not the run's
            out[name] = {"error": f"{type(err).__name__}: {err}"[:1000]}
            continue
        got = torch.cat([g.flatten().double() for g in grads])
        out[name] = {"capture_s": time.perf_counter() - t0, "cosine": cosine(exact, got),
                     "peak_mib": (torch.cuda.max_memory_allocated() - before) / 2**20}
        replays[name] = replay
    for name, s in interleaved_medians(list(replays), lambda n: timed(replays[n], device), max(rounds, 10)).items():
        out[name]["step_s"] = s
    set_arm(model, "none")
    return out


def report(shape: str, size: tuple, res: dict) -> str:
    base = res["none"]
    lines = [f"{shape} {size[0]}x{size[1]}: arm | held MiB (fewer) | peak MiB | first step s | step s (x none) | "
             f"host s | cosine (min) | triton launches"]
    for arm, r in res.items():
        if "graph" in arm:
            lines.append(f"  {arm:24s} " + (r["error"] if "error" in r else
                         f"replay {r['step_s']:.4f} s ({r['step_s'] / base['step_s']:.2f}x none eager), capture "
                         f"{r['capture_s']:.2f} s, peak {r['peak_mib']:.0f} MiB, cosine {r['cosine']:.5f}"))
            continue
        lines.append(f"  {arm:24s} {r['held_mib']:9.0f} ({base['held_mib'] / r['held_mib']:.1f}x) "
                     f"{r['peak_mib']:9.0f} {r['first_step_s']:7.2f} {r['step_s']:.4f} "
                     f"({r['step_s'] / base['step_s']:.2f}x) {r.get('host_s', float('nan')):.4f} {r['cosine']:.5f} "
                     f"{r['triton_launches']}")
    return "\n".join(lines)


def parse_size(text: str) -> tuple[int, int]:
    try:
        b, s = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: expected BATCHxSEQ such as 8x1024, got {text!r}") from None
    return b, s


def main(argv=None):
    ap = suite_parser("cuda", __doc__)
    ap.add_argument("--shapes", nargs="+", default=["smollm2", "llama-1b"], choices=list(SHAPES))
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=[(8, 1024), (4, 2048)])
    ap.add_argument("--autocast", default="bf16", choices=list(AUTOCAST))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--draws", type=int, default=3, help="noise draws of division's cosine (the minimum is reported)")
    ap.add_argument("--quick", action="store_true", help="the first shape only, 3 rounds, 1 draw")
    ap.add_argument("--set", type=json.loads, default={},
                    help="DivisionConfig fields of the division arms as JSON, e.g. '{\"linear_group_size\": 32}'")
    ap.add_argument("--compiled", action="store_true", help="compressor kernels through torch.compile")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="leave out the arms captured in a CUDA graph (none+graph, division+graph)")
    ap.add_argument("--budget-s", type=float, default=float("inf"))
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the test's smoke run
    ap.add_argument("--out")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if len(args.sizes) != len(args.shapes):
        ap.error(f"--sizes: one per shape ({len(args.shapes)}), got {len(args.sizes)}")
    if args.quick:
        args.shapes, args.sizes, args.rounds, args.draws = args.shapes[:1], args.sizes[:1], 3, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("hf-division cuda suite: no CUDA device")
    with configured(compile=args.compiled):
        run(args, argv)


def run(args, argv) -> list[dict]:
    start, rows = time.perf_counter(), []
    meta = {"argv": argv, "torch": torch.__version__, "compiled": args.compiled,
            "triton": getattr(triton_codec.triton, "__version__", None), "config": args.set,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    for shape, size in zip(args.shapes, args.sizes):
        if time.perf_counter() - start > args.budget_s:
            print(f"{shape} {size}: skipped (--budget-s)", flush=True)
            continue
        model = build(shape, args.device)
        batch = {k: v.to(args.device) for k, v in random_tokens(model.config.vocab_size, *size, seed=0).items()}
        batch["labels"] = batch["input_ids"]
        res = measure(model, batch, AUTOCAST[args.autocast], args.rounds, args.device, args.draws,
                      DivisionConfig(**args.set), graphs=args.graphs and args.device == "cuda")
        rows.append({"shape": shape, "batch": size[0], "seq": size[1], "arms": res})
        print(report(shape, size, res), flush=True)
        if args.out:
            write_json(args.out, {**meta, "rows": rows})
        del model, batch
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows
