"""Run by ``tests/kernels/test_launcher.py`` in a process started without ``TRITON_INTERPRET`` (the
kernels compile for a simulated sm_90 device: :mod:`hf_division.analysis.simulated_cuda`). Each case
compresses and rebuilds one tensor twice with the same seed, once through Triton's dispatch and once
through :mod:`hf_division.kernels.launcher` (after a first launch that keeps the kernels), and prints
one JSON line per case: whether the launcher received the same launches, and how many launches went
through Triton's dispatch, and how many built the launcher's key, on the launcher's second pass (none:
each launch's plan keeps its kernel, :class:`hf_division.kernels.triton_codec.Launch`)."""
import json
import sys

import torch
import triton.runtime.jit as jit
from triton import knobs

from hf_division.analysis.launches import gpu_path
from hf_division.analysis.simulated_cuda import simulated_cuda
from hf_division.compress.pipeline import compress, compress_row_scaled, decompress
from hf_division.kernels import configured, launcher, triton_gated, triton_norm, triton_rotary

dispatched = [0]
_run = jit.JITFunction.run
keyed = [0]
_key = launcher.key


def counted_key(*args, **kwargs):
    keyed[0] += 1
    return _key(*args, **kwargs)


launcher.key = counted_key


def counted_run(self, *args, **kwargs):
    dispatched[0] += 1
    return _run(self, *args, **kwargs)


jit.JITFunction.run = counted_run


def described(value):
    """A launch argument as what the kernel sees of it: a tensor by dtype, shape, strides and
    offset (each pass allocates its own buffers), anything else by type and value."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape), list(value.stride()), value.data_ptr() % 16,
                value.data_ptr() == WATCHED[0]]
    if hasattr(value, "get") and callable(value.get):  # Triton's launch metadata (a LazyDict)
        got = value.get()
        return ["metadata", sorted((k, v if isinstance(v, (int, float, str)) else type(v).__name__) for k, v in got.items())]
    return [type(value).__name__, value if isinstance(value, (int, float, str, bool, type(None))) else id(value)]


WATCHED = [0]


def hooks(enter, exit_, metadata):
    """What the launcher does with its hooks: none to call (None, or a chain with none in it, as
    Triton's default), or these with this metadata."""
    if not getattr(enter, "calls", enter) and not getattr(exit_, "calls", exit_):
        return None
    return [id(enter), id(exit_), described(metadata)]


def launches_of(record, start):
    return [[name, list(grid), stream, id(function), list(meta), hooks(enter, exit_, lmeta),
             [described(a) for a in args]] for name, grid, stream, function, meta, lmeta, enter, exit_, args in record[start:]]


def one_pass(record, x, row_scale, kw):
    start = len(record)
    g = torch.Generator().manual_seed(5)
    p = compress_row_scaled(x, row_scale, generator=g, **kw) if row_scale is not None else compress(x, generator=g, **kw)
    assert p is not None
    decompress(p)
    return launches_of(record, start)


def cases():
    """The specializations the key must tell apart: a pointer off 16 bytes, an integer argument of 1
    (a constant to Triton), the row-scaled variants; each compiles its own kernels (seconds each)."""
    g = torch.Generator().manual_seed(0)
    base = dict(bits=4, block_size=16, group_size=256, lfc_dtype=torch.bfloat16, outlier_ratio=16.0)
    flat = torch.randn(2 * 40 * 64 + 8, generator=g).bfloat16()
    yield "bf16 2x40x64", flat[:5120].view(2, 40, 64), None, base
    yield "the same 2 bytes on", flat[1:5121].view(2, 40, 64), None, base  # only the alignment differs
    yield "one token", torch.randn(1, 1, 64, generator=g).bfloat16(), None, base
    x = torch.randn(2, 24, 64, generator=g).bfloat16()
    rs = x.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt().reciprocal().contiguous()
    yield "row-scaled", x, rs, base


def layer_pass(record, backward_too=True):
    """The layer ops' kernels once each (the RMSNorm's rebuild and gradient, the gated product and
    its gradient, the rotary embedding both ways) on fixed tensors: their launches."""
    start = len(record)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 24, 64, generator=g).bfloat16(), torch.randn(64, generator=g)
    y, rstd = triton_norm.rebuild(x, w, 1e-6)
    triton_norm.gradients(torch.randn(y.shape, generator=g), x, rstd, w, torch.bfloat16, True, True)
    gate, up = torch.randn(2, 24, 96, generator=g).bfloat16(), torch.randn(2, 24, 96, generator=g).bfloat16()
    h = triton_gated.product(gate, up)
    triton_gated.gradients(torch.randn(h.shape, generator=g).bfloat16(), gate, up, True, True)
    q, k = torch.randn(2, 4, 24, 16, generator=g).bfloat16(), torch.randn(2, 2, 24, 16, generator=g).bfloat16()
    cos, sin = torch.randn(1, 24, 16, generator=g), torch.randn(1, 24, 16, generator=g)
    qo, ko = triton_rotary.rotate([(q, None), (k, None)], cos, sin, False)
    triton_rotary.rotate([(qo, torch.bfloat16), (ko, torch.bfloat16)], cos, sin, True)
    return launches_of(record, start)


def main():
    hooked = []
    with gpu_path(), simulated_cuda() as record:
        WATCHED[0] = 0
        with configured(triton_launch=False):
            triton_way = layer_pass(record)
        with configured(triton_launch=True):
            layer_pass(record)
            before, keys = dispatched[0], keyed[0]
            direct = layer_pass(record)
            through_triton, keys = dispatched[0] - before, keyed[0] - keys
        print(json.dumps({"case": "layer ops", "launches": len(direct), "same": direct == triton_way,
                          "dispatched": through_triton, "keyed": keys,
                          "first_difference": next(([a, b] for a, b in zip(triton_way, direct) if a != b), None)}))
        for name, x, rs, kw in cases():
            WATCHED[0] = x.data_ptr()
            with configured(triton_launch=False):
                triton_way = one_pass(record, x, rs, kw)
            with configured(triton_launch=True):
                one_pass(record, x, rs, kw)  # keeps the kernels (its launches through Triton)
                before, keys = dispatched[0], keyed[0]
                direct = one_pass(record, x, rs, kw)
                through_triton, keys = dispatched[0] - before, keyed[0] - keys
            print(json.dumps({"case": name, "launches": len(direct), "same": direct == triton_way,
                              "dispatched": through_triton, "keyed": keys,
                              "first_difference": next(([a, b] for a, b in zip(triton_way, direct) if a != b), None)}))
        # a launch hook added after the kernels were kept is called, with the launch's metadata, as
        # through Triton's dispatch
        knobs.runtime.launch_enter_hook.add(lambda metadata: hooked.append(metadata.get()["name"]))
        x = torch.randn(2, 40, 64).bfloat16()
        kw = dict(bits=4, block_size=16, group_size=256, lfc_dtype=torch.bfloat16, outlier_ratio=16.0)
        with configured(triton_launch=False):
            triton_way = one_pass(record, x, None, kw)
        with configured(triton_launch=True):
            direct = one_pass(record, x, None, kw)
    print(json.dumps({"hooked": hooked, "same": direct == triton_way}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
