"""``hf-division`` console command: ``run``, ``demo`` and ``measure`` subcommands."""
from __future__ import annotations

import importlib
import sys

#: subcommand -> module whose ``main(argv)`` runs it; imported on use, so ``hf-division run`` does
#: not pay for what only the demo or the measurement suites need (datasets, scikit-learn, PEFT)
COMMANDS = {"run": "hf_division.integrations.launcher", "demo": "hf_division.bench.demo", "measure": "hf_division.bench.suites"}

USAGE = """usage: hf-division run SCRIPT.py [ARGS]   run a Transformers script with --division available
       hf-division demo [ARGS]            fine-tune real MiniLM-L6 on bundled SST-2 with division
       hf-division measure SUITE [ARGS]   run a measurement suite (python -m hf_division.bench --help)"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
