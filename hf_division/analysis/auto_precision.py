"""Auto-precision: bits per layer and tensor kind from measured gradient sensitivity.

Given an average bit budget (e.g. 3.0 bits per compressed element), :func:`auto_precision`
(or :func:`assign` on measured sensitivities) assigns each *unit* — one kind of saved tensor
(``linear``, ``attention``, ``activation``, ``norm``) in one layer — a bit width from ``bits`` so that the gradient error is smallest, for
either method (``DivisionConfig.method``). The result is a :class:`DivisionConfig` whose
``module_bits`` holds the assignment.

Design (cheap, once, not every step):

1. **Units.** A layer is a module name up to its first numeric part (``bert.encoder.layer.3``);
   modules outside numbered layers (embedding norm, pooler, classifier) are units of their own.
   The model is patched with every unit at 8 bits (the *background*, close to exact), then once
   per layer with that layer at 4 bits: the drop in bytes per kind gives the number of elements
   each unit compresses (``n_u = 2 * drop``: 8 -> 4 bits saves half a byte per element).
   Units holding nothing (tensors below ``min_numel``, kinds set to 0) are left out.
2. **Sensitivity.** On a calibration batch (its own, not the one you evaluate on), the exact
   gradient ``g`` and, for each unit and each ``probe_bits`` width ``b``, the gradient ``g_ub``
   with that unit alone at ``b`` bits (background 8 bits elsewhere). The unit's error is
   ``e_u(b) = (|g_ub - g|^2 - |g_bg - g|^2) / |g|^2`` (the background's own error removed);
   unbiased stochastic rounding makes the errors of different units independent, so the error of
   a whole assignment is modelled as the sum of its units' errors. Cost: one forward per layer
   plus ``len(probe_bits)`` forward+backward passes per unit.
3. **Other widths.** The rounding error of a group is proportional to its step,
   ``range / (2^b - 1)``, so ``e_u(b)`` is extrapolated as ``e_u(b0) * ((2^b0 - 1) / (2^b - 1))^k``
   from the nearest probe ``b0``, with ``k`` fitted per unit between two probes (clipped to
   [1, 3]; 2 for a linear consumer of the error) or 2 with a single probe. Only *upwards*: widths
   below the narrowest probe are not offered, because below 2 bits the error grows much faster
   than the step (1-bit q/k/v or residual streams break the model, not just add noise; on MiniLM
   an assignment with 1-bit units extrapolated from 2-bit probes lost to uniform 2 bits). Hence
   the default probes (1, 2, 4): 1 bit is chosen only where it was measured harmless.
4. **Assignment.** Minimise ``sum_u e_u(b_u)`` subject to ``sum_u n_u b_u <= budget * sum_u n_u``:
   a multiple-choice knapsack, solved exactly by dynamic programming over the budget cut into
   ``resolution`` steps (costs rounded up, so the budget is never exceeded).
   Or, given a target gradient cosine instead (:func:`assign_for_cosine`), the smallest budget whose
   assignment's predicted cosine ``1 / sqrt(1 + sum_u e_u)`` reaches it (bisection).

Equal bytes: per-group minimum and step, the LFC and the outlier tokens kept exact do not depend
on the bits, so an assignment averaging ``budget`` bits holds the same bytes as every unit at
``budget`` bits, or fewer.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from hf_division.config import KINDS, DivisionConfig
from hf_division.analysis.fidelity import flat_grad
from hf_division.analysis.measure import held_bytes
from hf_division.api import apply_division, patched_modules, remove_division, restored_division, unwrap

BITS = (1, 2, 4, 8)


@dataclass
class Unit:
    """One kind of saved tensor in one layer: ``name`` (module name prefix) and ``kind``."""

    name: str
    kind: str
    numel: int  # elements it compresses on the calibration batch
    probes: dict = field(default_factory=dict)  # probe bits -> measured relative gradient error
    errors: dict = field(default_factory=dict)  # bits -> modelled relative gradient error
    bits: int = 0  # assigned


@dataclass
class AutoPrecision:
    """What :func:`auto_precision` found: the config to train with and the evidence."""

    config: DivisionConfig
    budget: float
    units: list
    background_error: float  # relative squared gradient error with every unit at 8 bits

    @property
    def average_bits(self) -> float:
        total = sum(u.numel for u in self.units)
        return sum(u.numel * u.bits for u in self.units) / max(total, 1)

    @property
    def predicted_error(self) -> float:
        """Modelled relative squared gradient error, ``|g' - g|^2 / |g|^2``, of the assignment."""
        return sum(u.errors[u.bits] for u in self.units)

    @property
    def predicted_cosine(self) -> float:
        """``1 / sqrt(1 + error)``: the cosine if the (unbiased) error is orthogonal to the gradient."""
        return (1 + self.predicted_error) ** -0.5

    def table(self) -> str:
        probe_bits = sorted({b for u in self.units for b in u.probes})
        head = f"{'unit':<40} {'kind':<10} {'elements':>10} " + " ".join(f"{f'err@{b}b':>9}" for b in probe_bits)
        rows = [head + f" {'bits':>4}"]
        for u in self.units:
            errs = " ".join(f"{u.probes[b]:>9.2e}" for b in probe_bits)
            rows.append(f"{u.name:<40} {u.kind:<10} {u.numel:>10} {errs} {u.bits:>4}")
        rows.append(f"average {self.average_bits:.3f} bits (budget {self.budget}), predicted relative error "
                    f"{self.predicted_error:.2e}, predicted cosine {self.predicted_cosine:.4f}")
        return "\n".join(rows)


def layer_of(name: str) -> str:
    """``bert.encoder.layer.3.attention.self`` -> ``bert.encoder.layer.3``; names outside numbered
    layers are their own unit."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _with(config: DivisionConfig, overrides: dict) -> DivisionConfig:
    return replace(config, module_bits=json.dumps(overrides))


def _by_kind(model, batch) -> dict:
    return held_bytes(model, batch)[1]


def model_error(probes: dict, bits) -> dict:
    """``{b: error}`` for every ``b`` in ``bits`` from measured ``probes`` (see module doc, step 3)."""
    pts = sorted(probes.items())
    k = 2.0
    if len(pts) >= 2 and pts[0][1] > 0 and pts[-1][1] > 0:
        (b0, e0), (b1, e1) = pts[0], pts[-1]
        k = min(3.0, max(1.0, math.log(e0 / e1) / math.log((2**b1 - 1) / (2**b0 - 1))))
    out = {}
    for b in bits:
        b0, e0 = min(pts, key=lambda p: abs(p[0] - b))
        out[b] = probes[b] if b in probes else max(e0, 0.0) * ((2**b0 - 1) / (2**b - 1)) ** k
    return out


def assign_bits(units: list, bits, budget: float, resolution: int) -> None:
    """Exact multiple-choice knapsack by DP over ``resolution`` budget steps; sets ``u.bits``."""
    total = sum(u.numel for u in units)
    # costs counted above the narrowest width, so that all-narrowest (cost 0) is always feasible
    capacity = (budget - bits[0]) * total
    if capacity <= 0:
        for u in units:
            u.bits = bits[0]
        return
    step = capacity / resolution
    inf = float("inf")
    best = [0.0] + [inf] * resolution  # best[c]: least error using at most c steps so far
    choices = []
    for u in units:
        costs = {b: math.ceil(u.numel * (b - bits[0]) / step - 1e-9) for b in bits}
        new, pick = [inf] * (resolution + 1), [None] * (resolution + 1)
        for c in range(resolution + 1):
            for b in bits:
                prev = c - costs[b]
                if prev >= 0 and best[prev] < inf and best[prev] + u.errors[b] < new[c]:
                    new[c], pick[c] = best[prev] + u.errors[b], (b, prev)
        best = new
        choices.append(pick)
    c = min(range(resolution + 1), key=lambda i: best[i])
    if best[c] == inf:
        raise ValueError(f"budget {budget} bits cannot be met with bits {tuple(bits)}")
    for u, pick in zip(reversed(units), reversed(choices)):
        u.bits, c = pick[c]


@dataclass
class Sensitivity:
    """Measured per-unit gradient errors (steps 1-3 of the module doc); budget-independent, so
    one measurement serves :func:`assign` at any number of budgets."""

    config: DivisionConfig
    bits: tuple
    units: list
    background_error: float


def measure_sensitivity(
    model, batch: dict, config: DivisionConfig | None = None, bits=BITS, probe_bits=(1, 2, 4), seed: int = 0
) -> Sensitivity:
    """Units, their sizes and modelled errors at every width in ``bits`` (module doc, steps 1-3).

    ``model``: a supported model (or wrapper); ``batch``: a calibration batch of keyword inputs
    with ``labels`` (its loss is differentiated); ``config``: the base policy (method, block and
    group sizes, ...; kinds set to 0 stay uncompressed); ``bits``: the widths to choose from;
    ``probe_bits``: widths measured per unit (widths in ``bits`` below the narrowest probe are
    not offered, see the module doc). The model is left patched as it was found.
    """
    config = config or DivisionConfig()
    bits = tuple(sorted(set(bits)))
    if not bits or any(b not in (1, 2, 4, 8) for b in bits):
        raise ValueError(f"auto_precision: bits must be drawn from (1, 2, 4, 8), got {bits}")
    if not probe_bits or any(b not in (1, 2, 4, 8) for b in probe_bits):
        raise ValueError(f"auto_precision: probe_bits must be drawn from (1, 2, 4, 8), got {tuple(probe_bits)}")
    bits = tuple(b for b in bits if b >= min(probe_bits))
    if not bits:
        raise ValueError(f"auto_precision: no width in bits is >= the narrowest of probe_bits {tuple(probe_bits)}")
    if config.module_bits:
        raise ValueError("auto_precision: config.module_bits must be empty (it is what auto_precision assigns)")
    kinds = [k for k in KINDS if config.bits(k)]
    if not kinds:
        raise ValueError("auto_precision: config compresses no kind (every *_bits field is 0)")
    base = unwrap(model)
    with restored_division(model):
        # background: every top-level child at 8 bits for every compressed kind
        background = {name: {k: 8 for k in kinds} for name, _ in base.named_children()}
        apply_division(model, _with(config, background))
        patched = {id(m) for m in patched_modules(base)}
        layers = sorted({layer_of(n) for n, m in base.named_modules() if n and id(m) in patched})
        model.train()
        bg_kinds = _by_kind(model, batch)
        units = []
        for layer in layers:
            apply_division(model, _with(config, {**background, layer: {k: 4 for k in kinds}}))
            probe_kinds = _by_kind(model, batch)
            for k in kinds:
                n = 2 * (bg_kinds.get(k, 0) - probe_kinds.get(k, 0))
                if n > 0:
                    units.append(Unit(layer, k, n))
        if not units:
            raise ValueError(f"auto_precision: {type(base).__name__} compresses nothing on this batch")
        remove_division(model)
        exact = flat_grad(model, batch, seed)
        norm2 = exact.pow(2).sum().item()

        def error(overrides):
            apply_division(model, _with(config, overrides))
            return (flat_grad(model, batch, seed) - exact).pow(2).sum().item() / norm2

        bg_error = error(background)
        floor = 1e-3 * bg_error + 1e-12  # a unit never counts as exactly free
        for u in units:
            for b in probe_bits:
                u.probes[b] = max(error({**background, u.name: {u.kind: b}}) - bg_error, floor)
            u.errors = model_error(u.probes, bits)
    return Sensitivity(config, bits, units, bg_error)


def assign(sensitivity: Sensitivity, budget: float, resolution: int = 2000) -> AutoPrecision:
    """The assignment with the least modelled error under ``budget`` average bits (step 4)."""
    bits = sensitivity.bits
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= bits[0]:
        raise ValueError(f"auto_precision: budget must be a number of bits >= {bits[0]}, got {budget!r}")
    units = [replace(u, probes=dict(u.probes), errors=dict(u.errors)) for u in sensitivity.units]
    if budget >= bits[-1]:
        for u in units:
            u.bits = bits[-1]
    else:
        assign_bits(units, bits, float(budget), resolution)
    assignment: dict = {}
    for u in units:
        assignment.setdefault(u.name, {})[u.kind] = u.bits
    return AutoPrecision(_with(sensitivity.config, assignment), float(budget), units, sensitivity.background_error)


def assign_for_cosine(sensitivity: Sensitivity, target: float, resolution: int = 2000) -> AutoPrecision:
    """The assignment with the fewest average bits whose predicted cosine is at least ``target``
    (bisection on the budget, to 1/64 bit); the most precise one if no budget reaches it."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1:
        raise ValueError(f"auto_precision: target_cosine must be a number in (0, 1), got {target!r}")
    lo, hi = float(sensitivity.bits[0]), float(sensitivity.bits[-1])
    best = assign(sensitivity, hi, resolution)
    if best.predicted_cosine < target:
        return best
    first = assign(sensitivity, lo, resolution)
    if first.predicted_cosine >= target:
        return first
    while hi - lo > 1 / 64:
        mid = (lo + hi) / 2
        result = assign(sensitivity, mid, resolution)
        if result.predicted_cosine >= target:
            hi, best = mid, result
        else:
            lo = mid
    return best


def auto_precision(model, batch: dict, budget: float | None = None, config: DivisionConfig | None = None, bits=BITS,
                   probe_bits=(1, 2, 4), seed: int = 0, target_cosine: float | None = None) -> AutoPrecision:
    """Bits per layer and kind under an average ``budget`` of bits per compressed element, or the
    fewest bits whose predicted gradient cosine is at least ``target_cosine`` (give one of the
    two): a config to train with (``result.config``) and the evidence (``result.table()``).
    Other arguments as in :func:`measure_sensitivity`."""
    if (budget is None) == (target_cosine is None):
        raise ValueError("auto_precision: give exactly one of budget and target_cosine")
    if target_cosine is not None:
        if isinstance(target_cosine, bool) or not isinstance(target_cosine, (int, float)) or not 0 < target_cosine < 1:
            raise ValueError(f"auto_precision: target_cosine must be a number in (0, 1), got {target_cosine!r}")
        return assign_for_cosine(measure_sensitivity(model, batch, config, bits, probe_bits, seed), target_cosine)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= min(bits, default=1):
        raise ValueError(f"auto_precision: budget must be a number of bits >= {min(bits, default=1)}, got {budget!r}")
    return assign(measure_sensitivity(model, batch, config, bits, probe_bits, seed), budget)
