"""``hf-division`` console command: ``hf-division run SCRIPT.py [ARGS]`` | ``hf-division demo [ARGS]``."""
from __future__ import annotations

import sys

USAGE = """usage: hf-division run SCRIPT.py [ARGS]   run a Transformers script with --division available
       hf-division demo [ARGS]            fine-tune real MiniLM-L6 on bundled SST-2 with division"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("run", "demo"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "run":
        from .run import main as run_main

        run_main(argv[1:])
    else:
        from .demo import main as demo_main

        demo_main(argv[1:])


if __name__ == "__main__":
    main()
