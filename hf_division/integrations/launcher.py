"""Run an unmodified Transformers example script with division available.

    hf-division run SCRIPT.py [ARGS]        (console entry point)
    python -m hf_division.integrations.launcher SCRIPT.py [ARGS]
    accelerate launch -m hf_division.integrations.launcher SCRIPT.py [ARGS]

Before the script runs, :func:`hf_division.enable` does what it does in a Python session: every
``TrainingArguments`` class (Transformers', TRL's, sentence-transformers', the script's own) takes
``division`` and every ``division_<field>``, so the script's own ``HfArgumentParser`` accepts
``--division --division_block_size 16 ...``, and :class:`~hf_division.integrations.trainer.DivisionCallback`
joins Transformers' default callbacks, so any ``Trainer`` the script builds applies division when
training begins. The script then runs as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``.
"""
from __future__ import annotations

import os
import runpy
import sys

import transformers.trainer as hf_trainer

from hf_division.integrations.step_log import StepLog
from hf_division.integrations.trainer import enable

#: environment variable: a path to which every Trainer the script builds logs each step (:class:`StepLog`)
STEP_LOG_ENV = "HF_DIVISION_STEP_LOG"

_INSTALLED = False


def install() -> None:
    """:func:`hf_division.enable`, and the step log if :data:`STEP_LOG_ENV` names a file. Idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    enable()
    if os.environ.get(STEP_LOG_ENV):
        hf_trainer.DEFAULT_CALLBACKS.append(StepLog(os.environ[STEP_LOG_ENV]))
    _INSTALLED = True


def run_script(script: str, args: list[str]) -> None:
    if not os.path.isfile(script):
        raise SystemExit(f"hf-division run: no such script: {script}")
    install()
    sys.argv = [script, *args]
    # what ``python SCRIPT`` does: the script's own folder first, so its sibling modules import
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    run_script(argv[0], argv[1:])


if __name__ == "__main__":
    main()
