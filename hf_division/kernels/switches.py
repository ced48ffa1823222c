"""Every optional fast path behind one switch board: ``configure(native=False, ...)``.

Each switch turns one fast path on or off; off, the same work runs through the plain path it
replaces, which gives the same values (to the bit or to float32 rounding, as each path's tests
state: docs/DESIGN.md, "Kernels and switches"). They exist to compare the two (the step-time
suite's arms, the tests that check a fast path against its reference) and as a way around a fast
path that misbehaves on some machine. All are on by default.

At import each switch reads ``HF_DIVISION_<NAME>`` from the environment (``0``/``1``, ``false``/
``true``, ``off``/``on``, ``no``/``yes``), e.g. ``HF_DIVISION_NATIVE=0``. The board is process-wide.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field

ENV_PREFIX = "HF_DIVISION_"
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _switch(help_text: str):
    return field(default=True, metadata={"help": help_text})


@dataclass
class Switches:
    """The fast paths, each on (True) or off."""

    native: bool = _switch(
        "The compressor's native CPU kernels (kernels/csrc/division_cpu.c, built with the C compiler on first use). "
        "Off: the torch kernels (compiled or eager, see `compile`).")
    native_draws: bool = _switch(
        "Dropout masks drawn by the native kernel as bits, ATen's draws and generator stream to the bit "
        "(where checked equal in this process). Off: ATen's bernoulli_.")
    compile: bool = _switch(
        "The compressor's torch kernels compiled with torch.compile over fixed-size chunks (where the native "
        "kernels do not apply). Off: eager. Turned off, with a warning, where compiling fails.")
    triton: bool = _switch(
        "The compressor's Triton kernels for token groups on CUDA devices (kernels/triton_kernels.py), where "
        "Triton is importable. Off: the torch kernels (compiled or eager, see `compile`).")
    triton_launch: bool = _switch(
        "A Triton kernel launched again through the compiled kernel its first launch returned, kept under a key "
        "that determines Triton's specialization (kernels/launcher.py). Off: Triton's dispatch at every launch.")
    planned_launch: bool = _switch(
        "Each call site of a Triton kernel keeps its launch per shape (grid, constexprs, the compiled kernel per "
        "device and pointer alignment) and launches it again without the launcher's key (kernels/triton_codec.py, "
        "Launch; with `triton_launch` on). Off: every launch through kernels/launcher.py's key.")
    triton_rms_norm: bool = _switch(
        "Llama-form RMSNorm's rebuild and gradient in two fused Triton kernels where the compressor's Triton "
        "kernels run (kernels/triton_norm.py). Off: the formula in torch ops, about twenty kernels per norm.")
    triton_gated: bool = _switch(
        "A SiLU-gated MLP's product and gradients in one Triton kernel each where the compressor's Triton kernels "
        "run (kernels/triton_gated.py). Off: torch's ops, five kernels and silu(gate) held between them.")
    gated_from_codes: bool = _switch(
        "A SiLU-gated MLP's product and gradients computed natively from the compressed gate and up codes, "
        "neither rebuilt as a tensor (CPU, float32). Off: both rebuilt, then ATen's ops.")
    shared_recomputation: bool = _switch(
        "A norm's or a gated activation's rebuilt output reused by its own backward, so it runs once in "
        "backward. Off: recomputed separately under autograd.")
    sdpa_backward: bool = _switch(
        "The attention backward written out in query blocks (autograd/sdpa_backward.py) when attention is "
        "recomputed on the CPU. Off: autograd through the recomputed sdpa.")
    rms_norm_backward: bool = _switch(
        "Llama-form RMSNorm's gradient from its formula, its 1/rms kept from the rebuild. Off: the norm rerun "
        "under autograd.")
    rotary: bool = _switch(
        "The rotary position embedding in one pass each way in a patched attention's training forward: native on "
        "the CPU in float32, Triton's kernel where the compressor's Triton kernels run (see `triton_rotary`). Off: "
        "Transformers' own apply_rotary_pos_emb under autograd.")
    triton_rotary: bool = _switch(
        "The rotary embedding of q and k in one Triton kernel each way where the compressor's Triton kernels run "
        "(kernels/triton_rotary.py; with `rotary` on). Off: Transformers' apply_rotary_pos_emb under autograd there, "
        "30 kernels a layer under autocast.")
    lazy_forward_mode: bool = _switch(
        "The patched forward's TorchFunctionMode (dropout kept as bits, a cast sharing its input's copy) left out of a "
        "training forward whose signature's first forward, and every 50th, ran under it with nothing to route "
        "(patching/primitives.py, patch_root). Off: every training forward runs under it.")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_environment(cls, environ=os.environ) -> "Switches":
        """The defaults, overridden by ``HF_DIVISION_<NAME>`` where set."""
        values = {}
        for name in cls.names():
            key = ENV_PREFIX + name.upper()
            raw = environ.get(key)
            if raw is None:
                continue
            if raw.strip().lower() not in _TRUE + _FALSE:
                raise ValueError(f"{key}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")
            values[name] = raw.strip().lower() in _TRUE
        return cls(**values)


_current = Switches.from_environment()


def switches() -> Switches:
    """The current switches (read them; change them with :func:`configure`)."""
    return _current


def configure(**changes: bool) -> dict[str, bool]:
    """Turn fast paths on or off, e.g. ``configure(native=False, compile=False)``; returns the former
    values of the switches named, so ``configure(**former)`` restores them (or use :func:`configured`)."""
    unknown = sorted(set(changes) - set(Switches.names()))
    if unknown:
        raise TypeError(f"hf_division.configure: unknown switch {', '.join(map(repr, unknown))}; "
                        f"the switches are {', '.join(Switches.names())}")
    for name, value in changes.items():
        if not isinstance(value, bool):
            raise TypeError(f"hf_division.configure: {name} must be True or False, got {value!r}")
    former = {name: getattr(_current, name) for name in changes}
    for name, value in changes.items():
        setattr(_current, name, value)
    return former


@contextlib.contextmanager
def configured(**changes: bool):
    """:func:`configure` for the duration of a ``with`` block, then the former values back."""
    former = configure(**changes)
    try:
        yield switches()
    finally:
        configure(**former)
