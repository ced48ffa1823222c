"""``division_checkpointing``: what ``--division`` does when the Trainer has turned gradient
checkpointing on (docs/GUIDE.md, "Gradient accumulation and checkpointing"). ``auto`` and
``replace`` decide at the first training forward, from the bytes one example holds for backward."""
from __future__ import annotations

import dataclasses

import torch
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import logging

from hf_division.api import unwrap
from hf_division.autograd.held import held_by_forward
from hf_division.autograd.store import exact
from hf_division.compress.noise import untouched

logger = logging.get_logger(__name__)


def settle_checkpointing(model, mode: str) -> str:
    """Apply ``division_checkpointing`` to ``model`` once the Trainer has enabled checkpointing;
    returns what was done, for the log line at training start. ``replace`` and ``auto`` decide at
    the first training forward, from the bytes (:func:`decide_checkpointing`)."""
    base = unwrap(model)
    if not getattr(base, "is_activation_checkpointing", False):
        return "gradient checkpointing off"
    if mode == "combine":
        return "gradient checkpointing kept: layer inputs compressed, each layer recomputed in backward"
    handle = None

    def first_forward(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            handle.remove()
            decide_checkpointing(module, args, kwargs, forced=mode == "replace")

    handle = base.register_forward_pre_hook(first_forward, with_kwargs=True)
    if mode == "replace":
        return "gradient checkpointing: turned off at the first training step (replace)"
    return "gradient checkpointing: kept or turned off at the first training step, by the bytes each holds (auto)"


def _first_example(args: tuple, kwargs: dict) -> tuple[tuple, dict, int]:
    """The batch cut to its first example (every tensor whose first dimension is the batch's), and
    the batch's size."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not tensors:
        return args, kwargs, 1
    size = tensors[0].shape[0]

    def cut(v):
        return v[:1] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size else v

    return tuple(cut(v) for v in args), {k: cut(v) for k, v in kwargs.items()}, size


@dataclasses.dataclass(frozen=True)
class CheckpointingBytes:
    """Bytes one example of the first batch holds for backward (see :func:`held_per_example`)."""

    alone: int  # division, checkpointing off
    kept: int  # checkpointing alone, nothing compressed
    recomputing: int  # checkpointing alone while one layer is recomputed whole: its backward's peak
    batch: int  # examples in the batch

    def extra(self) -> int:
        """What replacing checkpointing adds to the batch's peak in backward (negative: saves)."""
        return (self.alone - self.recomputing) * self.batch


def held_per_example(module, args: tuple, kwargs: dict) -> CheckpointingBytes:
    """What one example of this batch holds for backward on ``module`` (patched, checkpointing
    on), measured without touching its RNG or rounding-noise streams, so that the step that
    follows draws what it would have drawn."""
    one_args, one_kwargs, batch = _first_example(args, kwargs)
    device = next(module.parameters()).device
    layers = [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]

    def held(open_layers) -> int:
        for layer in open_layers:
            layer.gradient_checkpointing = False
        try:
            return held_by_forward(module, lambda: module(*one_args, **one_kwargs)).total
        finally:
            for layer in open_layers:
                layer.gradient_checkpointing = True

    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"), untouched():
        with exact():  # the checkpointed run the user had, nothing compressed
            kept, recomputing = held([]), held(layers[:1])
        alone = held(layers)
    return CheckpointingBytes(alone, kept, recomputing, batch)


def free_bytes(module) -> int:
    """Memory still free for the step: the device's, less the gradients and Adam's two states that
    the first optimizer step allocates for the trainable parameters."""
    device = next(module.parameters()).device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil  # a dependency of Accelerate

        free = psutil.virtual_memory().available
    return free - 3 * sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


#: share of the free memory that replacing checkpointing may add to the peak: the rest is left to what
#: one example does not show (a longer batch later, the allocator's fragmentation)
HEADROOM = 0.5


def decide_checkpointing(module, args: tuple, kwargs: dict, forced: bool = False) -> bool:
    """Turn ``module``'s checkpointing off if division alone adds nothing to the peak that the
    checkpointed run had in backward (its layer inputs plus one layer recomputed whole), or adds
    less than :data:`HEADROOM` of the free memory; always if ``forced``. Says what was decided,
    with the bytes (docs/GUIDE.md, "Gradient accumulation and checkpointing"). Returns whether
    checkpointing was turned off."""
    held = held_per_example(module, args, kwargs)
    free = free_bytes(module)
    extra = held.extra()
    fits = extra <= 0 or extra <= HEADROOM * free
    mib = 2**20
    sizes = (f"one example holds {held.alone / mib:.2f} MiB for backward with division alone, {held.kept / mib:.2f} MiB "
             f"with checkpointing alone, {held.recomputing / mib:.2f} MiB while it recomputes a layer; the batch of "
             f"{held.batch} {'adds' if extra > 0 else 'saves'} {abs(extra) / mib:.1f} MiB, {max(free, 0) / mib:.0f} MiB free")
    if forced or fits:
        module.activation_checkpointing_disable()
        note = "" if fits else " (more than fits: --division_checkpointing auto would keep it)"
        logger.warning(f"hf-division: gradient checkpointing turned off, division replaces it: {sizes}{note}")
        return True
    logger.warning(f"hf-division: gradient checkpointing kept, layer inputs compressed: {sizes} "
                   "(--division_checkpointing replace turns it off for faster steps)")
    return False
