"""The sparse attentions of the long-input families (LongT5's blocks, Longformer's and LED's sliding
windows), computed inline, three ways: unpatched (``none``); with what autograd saves inside them kept
compressed where it is saved (``division``, what hf-division does: ``patch_saved``); and recomputed in
backward from their compressed input (``division-recompute``: ``recompute_inline_attention=True``). Per arm: bytes
held for backward (the model's and the attention kind's), the gradient against the unpatched model's
(float64 cosine, minimum over draws, and the lowest per-tensor cosine among tensors with >= 1% of the
norm), and the median step time over interleaved rounds.

python scripts/sparse_attention.py [--model longt5|longformer|led] [--shape tiny|base]
                                   [--variants ...] [--batch B] [--tokens T] [--rounds R] [--draws D]

``tiny``: the conformance model (hf_division.bench.tiny_models: hidden 64; LongT5 in blocks of 9
tokens, the others in windows of 16), rows padded 5, 17 and 30 tokens short as in
tests/model_patches/test_t5_vit.py; ``base``: the published base model's attention (heads of 64,
LongT5's ``local_radius`` 127 and ``global_block_size`` 16, Longformer's and LED's windows of 512) at
hidden 512 with 8 heads, 2 layers (2 + 2 for the encoder-decoders), unpadded rows, 64 label tokens for
the encoder-decoders (docs/RESULTS.md, "Long-input attentions"). ``--variants``: LongT5's
``encoder_attention_type``s (local, transient-global); the others have one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers as tf

import hf_division as hd
from hf_division.analysis.fidelity import cosine, named_grads
from hf_division.analysis.measure import account
from hf_division.bench.tiny_models import case, tiny_batch, tiny_config

VOCAB = 512
#: per model: its base config's fields, and the config field its variants set and their values
MODELS = {
    "longt5": dict(variant=("encoder_attention_type", ["local", "transient-global"]),
                   base=dict(d_model=512, d_ff=1024, num_layers=2, num_decoder_layers=2, num_heads=8, d_kv=64,
                             local_radius=127, global_block_size=16, feed_forward_proj="gated-gelu", pad_token_id=0,
                             eos_token_id=1, decoder_start_token_id=0)),
    "longformer": dict(variant=None,
                       base=dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, intermediate_size=2048,
                                 attention_window=512, num_labels=3, pad_token_id=1)),
    "led": dict(variant=None,
                base=dict(d_model=512, encoder_layers=2, decoder_layers=2, encoder_attention_heads=8,
                          decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, attention_window=512,
                          max_decoder_position_embeddings=1024, pad_token_id=1, eos_token_id=2,
                          decoder_start_token_id=2)),
}


def build(model: str, shape: str, tokens: int, variant: str | None):
    torch.manual_seed(0)
    spec = MODELS[model]
    fields = {spec["variant"][0]: variant} if variant else {}
    if shape == "tiny":
        config = tiny_config(model, "eager", **fields)
    else:
        # positions for the encoder's tokens (Longformer counts from its padding index + 1)
        positions = {"longformer": dict(max_position_embeddings=tokens + 2),
                     "led": dict(max_encoder_position_embeddings=tokens)}.get(model, {})
        config = tf.AutoConfig.for_model(model, vocab_size=VOCAB, **spec["base"], **positions, **fields)
    return case(model).auto.from_config(config, attn_implementation="eager").train()


def batch_for(model: str, shape: str, batch: int, tokens: int) -> dict:
    if shape == "tiny":
        ends = [max(2, tokens - d) for d in (0, 5, 17, 30, 42, 55, 67, 80)[:batch]]
        return tiny_batch(batch=batch, seq=tokens, pad_from=ends, model_type=model)
    g = torch.Generator().manual_seed(0)
    generates = case(model).auto is tf.AutoModelForSeq2SeqLM  # labels are tokens, else a class
    labels = (torch.randint(5, VOCAB, (batch, 64), generator=g) if generates
              else torch.randint(0, 3, (batch,), generator=g))
    return dict(input_ids=torch.randint(5, VOCAB, (batch, tokens), generator=g),
                attention_mask=torch.ones(batch, tokens, dtype=torch.long), labels=labels)


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


def compare(model: str, shape: str, variant: str | None, batch: int, tokens: int, rounds: int, draws: int) -> None:
    data = batch_for(model, shape, batch, tokens)
    models = {arm: build(model, shape, tokens, variant) for arm in ("none", "division", "division-recompute")}
    hd.apply_division(models["division"])
    hd.apply_division(models["division-recompute"], hd.DivisionConfig(recompute_inline_attention=True))
    held = {arm: account(m, data) for arm, m in models.items()}
    exact = named_grads(models["none"], data, 0)
    found = {arm: fidelity(exact, m, data, draws) for arm, m in models.items() if arm != "none"}
    times = {arm: [] for arm in models}
    for r in range(rounds + 1):  # the first round warms up; arms alternate their order
        for arm in (list(models) if r % 2 else list(models)[::-1]):
            start = time.perf_counter()
            models[arm](**data).loss.backward()
            models[arm].zero_grad(set_to_none=True)
            if r:
                times[arm].append(time.perf_counter() - start)
    base_s, base = statistics.median(times["none"]), held["none"]
    print(f"{model}{' ' + variant if variant else ''}, {shape}, {batch} x {tokens} tokens, {rounds} rounds:")
    for arm in models:
        step, kind = statistics.median(times[arm]), held[arm].by_kind.get("attention", 0)
        fewer = f"{base.by_kind['attention'] / kind:5.1f}x" if kind else "none held"
        line = (f"  {arm:18s} held {held[arm].total / 2**20:8.2f} MiB ({base.total / held[arm].total:5.1f}x fewer), "
                f"attention kind {kind / 2**20:7.2f} MiB ({fewer}), step {step:6.3f} s ({step / base_s:.2f}x)")
        if arm in found:
            whole, (name, cos) = found[arm]
            line += f", cosine min {whole:.4f}, per tensor {cos:.4f} ({name})"
        print(line, flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="longt5")
    parser.add_argument("--shape", choices=("tiny", "base"), default="tiny")
    parser.add_argument("--variants", nargs="+", default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--draws", type=int, default=3)
    args = parser.parse_args(argv)
    for variant in args.variants or (MODELS[args.model]["variant"] or (None, [None]))[1]:
        compare(args.model, args.shape, variant, args.batch, args.tokens, args.rounds, args.draws)


if __name__ == "__main__":
    main()
