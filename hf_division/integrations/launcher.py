"""Run an unmodified Transformers example script with division available.

    hf-division run SCRIPT.py [ARGS]        (console entry point)
    python -m hf_division.integrations.launcher SCRIPT.py [ARGS]
    accelerate launch -m hf_division.integrations.launcher SCRIPT.py [ARGS]

Before the script runs, ``transformers.TrainingArguments`` / ``Seq2SeqTrainingArguments`` are
replaced by the hf-division subclasses (so the script's own ``HfArgumentParser`` accepts
``--division`` and every ``--division_<field>``), and :class:`~hf_division.integrations.trainer.DivisionCallback`
joins Transformers' default callbacks (so any ``Trainer`` the script builds applies division when
training begins). The script then runs as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``.
"""
from __future__ import annotations

import os
import runpy
import sys

import transformers.trainer as hf_trainer
import transformers.training_args as hf_training_args
import transformers.training_args_seq2seq as hf_seq2seq_args

from hf_division.integrations.step_log import StepLog
from hf_division.integrations.trainer import DivisionCallback, Seq2SeqTrainingArguments, TrainingArguments

#: environment variable: a path to which every Trainer the script builds logs each step (:class:`StepLog`)
STEP_LOG_ENV = "HF_DIVISION_STEP_LOG"

_INSTALLED = False


def install() -> None:
    """Make ``transformers`` hand out the division-aware argument classes and callback. Idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    # the module object as it is now: importing ``transformers.modeling_layers`` (as patching does)
    # puts a new ``transformers`` module in ``sys.modules``, which a user's script then imports
    transformers = sys.modules["transformers"]
    for module in (transformers, hf_training_args):
        module.TrainingArguments = TrainingArguments
    for module in (transformers, hf_seq2seq_args):
        module.Seq2SeqTrainingArguments = Seq2SeqTrainingArguments
    hf_trainer.DEFAULT_CALLBACKS.append(DivisionCallback)
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
