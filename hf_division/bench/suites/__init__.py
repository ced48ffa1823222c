"""Measurement suites: ``python -m hf_division.bench SUITE [options]`` (``SUITE --help`` for its options).

Each suite is a module with ``main(argv)``, imported only when asked for, so that a suite whose
optional dependency is missing (``peft``, ``gguf``, ...) does not stop the others.
"""
from __future__ import annotations

import importlib
import sys

#: suite name -> module (relative to this package) holding its ``main(argv)``
SUITES = {
    "policy": ".policy",
    "family": ".family",
    "peft": ".peft",
    "precision": ".precision",
    "long-sequence": ".long_sequence",
    "decoder": ".decoder",
    "auto-precision": ".auto_precision",
    "compressor": ".compressor",
    "draws": ".draws",
    "step-time": ".step_time",
    "memory": ".memory",
    "trl-sft": ".sft",
    "long-context": ".long_context",
    "cuda": ".cuda",
    "launches": ".launches",
    "dispatch": ".dispatch",
    "architectures": ".architectures",
    "budget": ".budget",
    "attention-backward": ".attention_backward",
    "decoder-parity": ".decoder_parity",
    "shapes": ".shapes",
    "kernels": ".kernels",
}


def usage() -> str:
    return "usage: python -m hf_division.bench SUITE [options]\nsuites: " + ", ".join(SUITES)


def run(name: str, argv: list[str]):
    """Run suite ``name`` with command-line arguments ``argv``."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    return importlib.import_module(SUITES[name], __name__).main(argv)


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(2 if not argv else 0)
    if argv[0] not in SUITES:
        print(f"unknown suite {argv[0]!r}\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    return run(argv[0], argv[1:])
