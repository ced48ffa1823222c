"""Budget mode: which combination of division, checkpointing and offload fits a memory budget
fastest, measured on one model and batch shape.

python -m hf_division.bench budget [--model minilm|bert-base-4l|llama-4l|tiny-bert|...]
    [--batch 32 --seq 128] --budget-mib N [--rounds 3] [--data TSV]

Real SST-2 sentences when ``--data`` names the TSV (default: the bundled sample), tokenized with
MiniLM's tokenizer to ``--batch`` x ``--seq``. Prints every option's bytes held for backward and,
for those within the budget, the median step time (interleaved rounds), and the option chosen
(:func:`hf_division.analysis.budget.suggest`).
"""
from __future__ import annotations


from hf_division.analysis.budget import suggest
from hf_division.bench.textdata import BUNDLED_SST2_DEV, classification_batch, sst2_rows
from hf_division.bench.zoo import build_classifier, minilm_tokenizer
from hf_division.bench.suites.common import set_threads, suite_parser


def main(argv=None):
    ap = suite_parser("budget", __doc__)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget-mib", type=float, required=True, help="bytes held for backward allowed, MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=BUNDLED_SST2_DEV, help="SST-2 TSV")
    args = ap.parse_args(argv)
    if args.budget_mib <= 0:
        ap.error("--budget-mib must be positive")
    set_threads()
    model = build_classifier(args.model)
    batch = classification_batch(minilm_tokenizer(), sst2_rows(args.data), args.batch, args.seq)
    found = suggest(model, batch, int(args.budget_mib * 2**20), rounds=args.rounds)
    print(found.table())
    print(f"chosen: {found.chosen.option.name}" if found.chosen else "chosen: none fits; raise the budget or shorten the batch")
    return found
