"""LongT5's block-sparse encoder attention three ways: unpatched (``none``), with what autograd saves
inside it compressed where it is saved (``division``, what hf-division does: ``patch_saved``), and
recomputed in backward from its compressed input (``division-recompute``: ``patch_recomputed``). Per arm: bytes held for backward (the model's and the attention kind's), the
gradient against the unpatched model's (float64 cosine, minimum over draws, and the lowest per-tensor
cosine among tensors with >= 1% of the norm), and the median step time over interleaved rounds.

python scripts/longt5_attention.py [--shape tiny|base] [--attention local transient-global]
                                   [--batch B] [--tokens T] [--rounds R] [--draws D]

``tiny``: the conformance model (hf_division.bench.tiny_models: hidden 64, blocks of 9 tokens),
rows padded 5, 17 and 30 tokens short as in tests/model_patches/test_t5_vit.py; ``base``: LongT5-base's
attention (8 heads of 64, ``local_radius`` 127, ``global_block_size`` 16) at hidden 512, 2 + 2 layers,
unpadded rows, 64 label tokens (docs/RESULTS.md, "LongT5").
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LongT5Config, LongT5ForConditionalGeneration

import hf_division as hd
from hf_division.api import STATE_ATTR
from hf_division.analysis.fidelity import cosine, named_grads
from hf_division.analysis.measure import account
from hf_division.bench.tiny_models import tiny_batch, tiny_config
from hf_division.patching.checkpointing import patch_recomputed
from hf_division.patching.wrappers import restore_forward, unwrap
from model_patches import longt5

BASE = dict(vocab_size=512, d_model=512, d_ff=1024, num_layers=2, num_decoder_layers=2, num_heads=8, d_kv=64,
            local_radius=127, global_block_size=16, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0)


def build(shape: str, attention: str) -> LongT5ForConditionalGeneration:
    torch.manual_seed(0)
    if shape == "tiny":
        config = tiny_config("longt5", "eager", encoder_attention_type=attention)
    else:
        config = LongT5Config(**BASE, encoder_attention_type=attention)
    return LongT5ForConditionalGeneration(config).train()


def batch_for(shape: str, batch: int, tokens: int) -> dict:
    if shape == "tiny":
        ends = [max(2, tokens - d) for d in (0, 5, 17, 30, 42, 55, 67, 80)[:batch]]
        return tiny_batch(batch=batch, seq=tokens, pad_from=ends, model_type="longt5")
    g = torch.Generator().manual_seed(0)
    return dict(input_ids=torch.randint(5, BASE["vocab_size"], (batch, tokens), generator=g),
                attention_mask=torch.ones(batch, tokens, dtype=torch.long),
                labels=torch.randint(5, BASE["vocab_size"], (batch, 64), generator=g))


def recomputing(model) -> None:
    """Division on ``model``, then its sparse attentions run as checkpoints of their own instead of
    keeping their saves compressed."""
    hd.apply_division(model)
    state = getattr(unwrap(model), STATE_ATTR)
    for module, previous in [(m, p) for m, p in state.modules if isinstance(m, longt5.SPARSE_ATTENTION)]:
        restore_forward(module, previous)
        state.modules.remove((module, previous))
        patch_recomputed(state, module)


def fidelity(exact: dict, model, data: dict, draws: int) -> tuple:
    """``(whole cosine, (name, cosine) of the lowest tensor holding >= 1% of the exact norm))``,
    minima over ``draws`` rounding-noise draws, the dropout masks the exact step's."""
    norm = torch.cat(list(exact.values())).norm()
    carrying = [n for n, g in exact.items() if g.norm() >= 0.01 * norm]
    whole, worst = 1.0, ("", 1.0)
    for draw in range(draws):
        got = named_grads(model, data, 0, noise_seed=1000 + draw)
        whole = min(whole, cosine(torch.cat([exact[n] for n in exact]), torch.cat([got[n] for n in exact])))
        worst = min([worst] + [(n, cosine(exact[n], got[n])) for n in carrying], key=lambda item: item[1])
    return whole, worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", "base"), default="tiny")
    parser.add_argument("--attention", nargs="+", default=["local", "transient-global"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--draws", type=int, default=3)
    args = parser.parse_args(argv)
    for attention in args.attention:
        data = batch_for(args.shape, args.batch, args.tokens)
        models = {arm: build(args.shape, attention) for arm in ("none", "division", "division-recompute")}
        hd.apply_division(models["division"])
        recomputing(models["division-recompute"])
        held = {arm: account(m, data) for arm, m in models.items()}
        exact = named_grads(models["none"], data, 0)
        found = {arm: fidelity(exact, m, data, args.draws) for arm, m in models.items() if arm != "none"}
        times = {arm: [] for arm in models}
        for r in range(args.rounds + 1):  # the first round warms up; arms alternate their order
            for arm in (list(models) if r % 2 else list(models)[::-1]):
                start = time.perf_counter()
                models[arm](**data).loss.backward()
                models[arm].zero_grad(set_to_none=True)
                if r:
                    times[arm].append(time.perf_counter() - start)
        base_s, base_b = statistics.median(times["none"]), held["none"]
        print(f"{attention}, {args.shape}, {args.batch} x {args.tokens} tokens, {args.rounds} rounds:")
        for arm, m in models.items():
            step = statistics.median(times[arm])
            kind = held[arm].by_kind.get("attention", 0)
            line = (f"  {arm:18s} held {held[arm].total / 2**20:8.2f} MiB ({base_b.total / held[arm].total:5.1f}x fewer), "
                    f"attention kind {kind / 2**20:7.2f} MiB ({base_b.by_kind['attention'] / max(kind, 1):5.1f}x), "
                    f"step {step:6.3f} s ({step / base_s:.2f}x)")
            if arm in found:
                whole, (name, cos) = found[arm]
                line += f", cosine min {whole:.4f}, per tensor {cos:.4f} ({name})"
            print(line)


if __name__ == "__main__":
    main()
