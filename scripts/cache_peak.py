"""A training step's peak memory with the KV cache a model builds in training held and not
(docs/DESIGN.md, "The training KV cache").

python scripts/cache_peak.py [--shape smollm2] [--layers 30] [--size 8x256] [--head lm|cls] [--lora]
python scripts/cache_peak.py --shape whisper-small [--layers 12] [--size 2x64] [--lora]
python scripts/cache_peak.py --shape flan-t5-base [--layers 12] [--size 8x64] [--source 512] [--lora]

A random-init Llama of the cuda suite's ``--shape`` (``--layers`` deep, a 4,096-word vocabulary)
with a causal-LM head or a two-label classification head; or, with a ``whisper-*`` shape, a
random-init Whisper of that published shape (``--layers`` encoder and decoder layers each) with
its conditional-generation head, on random mel features of the 30-second window and ``--size``'s
batch x label tokens; or, with a ``flan-t5-*`` shape, T5 likewise, on ``--source`` random input
tokens. Optionally PEFT LoRA (rank 8 on the query and value projections). One training step, its
peak above the memory before it (:func:`hf_division.bench.peak.step_peak`: the RSS high-water
mark, glibc set to return freed memory), the median of 3 steps after one, each arm in a child
forked from one clean process. Arms: ``none`` as Transformers runs it (its cache built from
``config.use_cache``); division with ``use_cache=True`` passed (a cache that holds every layer's
keys and values, as the unpatched model builds it); division as it runs (a cache that holds
nothing). Also the bytes the returned cache holds (both halves of Whisper's).
"""
from __future__ import annotations

import argparse

from hf_division.bench.malloc_env import reexec_under_malloc_env

if __name__ == "__main__":
    reexec_under_malloc_env()  # before torch's import, which the re-executed process would pay again

import torch  # noqa: E402
from transformers import EncoderDecoderCache  # noqa: E402

from hf_division.api import apply_division  # noqa: E402
from hf_division.bench.peak import forked, step_peak  # noqa: E402
from hf_division.bench.suites import cuda as cuda_suite  # noqa: E402
from hf_division.patching.training_cache import output_cache  # noqa: E402

#: (arm, use_cache passed: None for not passed)
ARMS = [("none", None), ("division", True), ("division", None)]
VOCAB = 4096
#: published Whisper shapes (openai/whisper-*: config.json), built with random weights
WHISPER = {
    "whisper-tiny": dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                         decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536),
    "whisper-small": dict(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
                          decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072),
}
#: published Flan-T5 shapes (google/flan-t5-*: config.json), built with random weights
T5 = {
    "flan-t5-small": dict(d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_decoder_layers=8, num_heads=6),
    "flan-t5-base": dict(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12, num_heads=12),
}
SEQ2SEQ = {**WHISPER, **T5}


def build(args):
    import transformers

    torch.manual_seed(0)
    if args.shape in WHISPER:
        fields = dict(WHISPER[args.shape], vocab_size=51865, num_mel_bins=80)
        if args.layers:
            fields.update(encoder_layers=args.layers, decoder_layers=args.layers)
        config = transformers.WhisperConfig(**fields)
        model = transformers.WhisperForConditionalGeneration._from_config(config, attn_implementation="sdpa").train()
        task, targets = None, ["q_proj", "v_proj"]
    elif args.shape in T5:
        fields = dict(T5[args.shape], vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                      decoder_start_token_id=0)
        if args.layers:
            fields.update(num_layers=args.layers, num_decoder_layers=args.layers)
        config = transformers.T5Config(**fields)
        model = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation="sdpa").train()
        task, targets = "SEQ_2_SEQ_LM", ["q", "v"]
    else:
        fields = dict(cuda_suite.SHAPES[args.shape], vocab_size=VOCAB)
        if args.layers:
            fields["num_hidden_layers"] = args.layers
        config = transformers.LlamaConfig(**fields, tie_word_embeddings=True, num_labels=2, pad_token_id=0)
        head = transformers.LlamaForSequenceClassification if args.head == "cls" else transformers.LlamaForCausalLM
        model = head._from_config(config, attn_implementation="sdpa").train()
        task, targets = "SEQ_CLS" if args.head == "cls" else "CAUSAL_LM", ["q_proj", "v_proj"]
    if args.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets, task_type=task))
    return model


def batch_of(args) -> dict:
    """Random tokens for a Llama; for Whisper, mel features of the 30-second window (3,000 frames)
    and ``--size``'s label tokens; for T5, ``--source`` input tokens and ``--size``'s labels."""
    batch_size, tokens = args.size
    g = torch.Generator().manual_seed(0)
    if args.shape in WHISPER:
        return {"input_features": torch.randn(batch_size, 80, 3000, generator=g),
                "labels": torch.randint(1, 51865, (batch_size, tokens), generator=g)}
    if args.shape in T5:
        ids = torch.randint(1, 32128, (batch_size, args.source), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.randint(1, 32128, (batch_size, tokens), generator=g)}
    ids = torch.randint(1, VOCAB, (batch_size, tokens), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.zeros(batch_size, dtype=torch.long) if args.head == "cls" else ids}


def held_bytes(cache) -> int:
    if cache is None:
        return 0
    if isinstance(cache, EncoderDecoderCache):
        return held_bytes(cache.self_attention_cache) + held_bytes(cache.cross_attention_cache)
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


def preload(args) -> None:
    """Import in the parent what every forked arm would import on its own: the model's modeling
    module and, with ``--lora``, PEFT's layer dispatch (which imports bitsandbytes where it is
    installed, seconds a process), by wrapping one small Linear."""
    import transformers

    getattr(transformers, "WhisperForConditionalGeneration" if args.shape in WHISPER else
            "T5ForConditionalGeneration" if args.shape in T5 else "LlamaForCausalLM")
    if args.lora:
        import peft

        peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), peft.LoraConfig(r=1, target_modules=["0"]))


def job(item: tuple) -> dict:
    (arm, use_cache), args = item
    torch.set_num_threads(2)
    model = build(args)
    batch = batch_of(args)
    if use_cache is not None:
        batch["use_cache"] = use_cache
    if arm == "division":
        apply_division(model)
    cache = [0]

    def step():
        out = model(**batch)
        cache[0] = held_bytes(output_cache(out))
        loss = out.loss
        del out
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    peaks = sorted(step_peak(step)[0] for _ in range(3))
    return {"arm": arm, "use_cache": use_cache, "peak_mib": peaks[1] / 2**20, "cache_mib": cache[0] / 2**20}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=sorted(cuda_suite.SHAPES) + sorted(SEQ2SEQ))
    ap.add_argument("--layers", type=int, help="the shape's depth (Whisper, T5: of the encoder and of the decoder)")
    ap.add_argument("--size", help="batch x tokens (Whisper, T5: x label tokens); default 8x256, Whisper 2x64, T5 8x64")
    ap.add_argument("--source", type=int, default=512, help="T5's input tokens")
    ap.add_argument("--head", default="lm", choices=["lm", "cls"], help="a Llama's head")
    ap.add_argument("--lora", action="store_true", help="PEFT LoRA, rank 8 on the query and value projections")
    args = ap.parse_args(argv)
    seq2seq = args.shape in SEQ2SEQ
    default = "2x64" if args.shape in WHISPER else "8x64" if seq2seq else "8x256"
    args.size = tuple(int(v) for v in (args.size or default).split("x"))
    shape = SEQ2SEQ[args.shape] if seq2seq else cuda_suite.SHAPES[args.shape]
    layers = args.layers or shape.get("decoder_layers") or shape.get("num_decoder_layers") or shape["num_hidden_layers"]
    head = "conditional-generation" if seq2seq else args.head
    print(f"{args.shape} shape, {layers} layers, {head} head{' with LoRA' if args.lora else ''}, "
          f"{args.size[0]} x {args.size[1]} {'label ' if seq2seq else ''}tokens, float32")
    print(f"{'arm':<10} {'use_cache passed':>16} {'cache MiB':>10} {'step peak MiB':>14}")
    preload(args)
    for r in forked(job, [(arm, args) for arm in ARMS]):
        passed = "not passed" if r["use_cache"] is None else str(r["use_cache"])
        print(f"{r['arm']:<10} {passed:>16} {r['cache_mib']:>10.2f} {r['peak_mib']:>14.1f}")


if __name__ == "__main__":
    main()
