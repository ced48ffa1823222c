"""Every Triton kernel of the package compiled ahead for a GPU that is not here: the variants a
training step's settings give, compiled for sm_90 on a CPU machine (docs/DESIGN.md, "On a GPU":
registers). What the interpreter cannot check (types, layouts, register allocation), and what
:mod:`hf_division.analysis.gpu_resources` reads the compiled kernels' resources from."""
from __future__ import annotations

from hf_division.kernels.triton_codec import SAMPLE, group_launch, jit_function, options, score_launch, triton


def compile_all(arch: int = 90) -> dict:
    """Compile every kernel for CUDA compute capability ``arch`` (90: H100/H200) without a GPU, in
    the variants the defaults and the other settings give (:data:`COMPILED_VARIANTS`): ``{variant:
    its PTX}``. What the interpreter cannot check (types, layouts, register allocation); raises
    what a GPU's first launch would. Run in a process without ``TRITON_INTERPRET``."""
    return {variant: kernel.asm["ptx"] for variant, kernel in compile_variants(arch).items()}


def compile_variants(arch: int = 90) -> dict:
    """:func:`compile_all`'s compiled kernels, ``{variant: triton CompiledKernel}`` (its ``asm``:
    the PTX and the cubin; read by :mod:`hf_division.analysis.gpu_resources`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for variant, (name, types, constants) in COMPILED_VARIANTS.items():
        fn = jit_function(name, compile_only=True)
        signature = {a: "constexpr" if a in constants else types.get(a, "i32") for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
        out[variant] = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options(name))
    return out


def _encode_types(x: str, lfc: str) -> dict:
    return {"x_ptr": x, "seed_ptr": "*i64", "slot_ptr": "*i32", "rows_ptr": x, "rs_ptr": "*fp32", "top": "fp32",
            "codes_ptr": "*u8", "split": "i32", "lfc_ptr": lfc, "lo_ptr": "*bf16", "scale_ptr": "*bf16"}


def _decode_types(out: str, lfc: str) -> dict:
    return {"out_ptr": out, "codes_ptr": "*u8", "split": "i32", "lfc_ptr": lfc, "lo_ptr": "*bf16",
            "scale_ptr": "*bf16", "rs_ptr": "*fp32", "top": "fp32"}


def _score_types(x: str) -> dict:
    return {"x_ptr": x, "work_ptr": "*i32", "index_ptr": "*i64", "keep_ptr": "*i8", "rs_ptr": "*fp32"}


#: no row scale (the encode's rows kept as they are)
_NO_RS = dict(ROW_SCALE=False, ROWS_BF16=False)


def _groups(bits: int, block: int, group: int, rest: int, c: int = 576) -> dict:
    """The constants an encode or decode launch over groups of ``group`` tokens and a last one of
    ``rest`` takes at width ``c`` (the SmolLM2 shape's), as the launchers compute them."""
    return group_launch(c, 1, rest, group, bits, block)[3]


#: the defaults' 4-bit groups of 256 tokens with an LFC of 16-token blocks, a ragged last group (bytes)
_G4 = _groups(4, 16, 256, 250)
#: gated decoders' activation inputs: 32-token groups, no LFC, at 8 bits
_G8 = _groups(8, 1, 32, 30)
#: 1 and 2 bits, whole last groups
_G1 = _groups(1, 16, 256, 224)
_G2 = _groups(2, 8, 256, 240)
_SCORE = score_launch(8192, 576)[1]

_RMS_REBUILD = {"x_ptr": "*bf16", "w_ptr": "*fp32", "y_ptr": "*fp32", "rstd_ptr": "*fp32", "eps": "fp32"}
_RMS_GRAD = {"g_ptr": "*fp32", "x_ptr": "*bf16", "rstd_ptr": "*fp32", "w_ptr": "*fp32", "dx_ptr": "*bf16",
             "dw_ptr": "*fp32"}

_ROTARY = {"q_ptr": "*bf16", "qo_ptr": "*fp32", "k_ptr": "*bf16", "ko_ptr": "*fp32", "c_ptr": "*fp32", "s_ptr": "*fp32"}
#: backward: the embedding's float32 gradients in, bf16 gradients of q and k out
_ROTARY_BACK = dict(_ROTARY, q_ptr="*fp32", qo_ptr="*bf16", k_ptr="*fp32", ko_ptr="*bf16")

#: variant -> (kernel, argument types, constants): what :func:`compile_all` compiles
COMPILED_VARIANTS = {
    "encode": ("encode", _encode_types("*bf16", "*bf16"), dict(_G4, NBT=16, LFC=1, HAS_SEED=True, HAS_SLOT=True, **_NO_RS)),
    "encode row-scaled": ("encode", _encode_types("*bf16", "*bf16"),
                          dict(_G4, NBT=16, LFC=1, HAS_SEED=True, HAS_SLOT=True, ROW_SCALE=True, ROWS_BF16=True)),
    "encode 8-bit no LFC fp32": ("encode", _encode_types("*fp32", "*bf16"),
                                 dict(_G8, NBT=32, LFC=0, HAS_SEED=True, HAS_SLOT=False, **_NO_RS)),
    "encode 2-bit fp16 LFC nearest": ("encode", _encode_types("*fp16", "*fp16"),
                                      dict(_G2, NBT=32, LFC=2, HAS_SEED=False, HAS_SLOT=True, **_NO_RS)),
    "encode 1-bit fp32 LFC": ("encode", _encode_types("*fp32", "*fp32"),
                              dict(_G1, NBT=16, LFC=3, HAS_SEED=True, HAS_SLOT=False, **_NO_RS)),
    "decode": ("decode", _decode_types("*bf16", "*bf16"),
               dict(_G4, HAS_LFC=True, CLAMP=True, OUT_BF16=True, ROW_SCALE=False)),
    "decode row-scaled": ("decode", _decode_types("*bf16", "*bf16"),
                          dict(_G4, HAS_LFC=True, CLAMP=True, OUT_BF16=True, ROW_SCALE=True)),
    "decode 8-bit no LFC fp32": ("decode", _decode_types("*fp32", "*bf16"),
                                 dict(_G8, HAS_LFC=False, CLAMP=False, OUT_BF16=False, ROW_SCALE=False)),
    "decode 2-bit fp16": ("decode", _decode_types("*fp16", "*fp16"),
                          dict(_G2, HAS_LFC=True, CLAMP=True, OUT_BF16=False, ROW_SCALE=False)),
    "put_rows": ("put_rows", {"out_ptr": "*bf16", "rows_ptr": "*bf16", "index_ptr": "*i64", "keep_ptr": "*i8"},
                 dict(HAS_KEEP=True, BC=64)),
    "put_rows all kept": ("put_rows", {"out_ptr": "*fp32", "rows_ptr": "*fp32", "index_ptr": "*i64", "keep_ptr": "*i64"},
                          dict(HAS_KEEP=False, BC=64)),
    "score": ("score", _score_types("*bf16"), dict(_SCORE, C=576, ROW_SCALE=False)),
    "score row-scaled": ("score", _score_types("*fp32"), dict(_SCORE, C=576, ROW_SCALE=True)),
    "select": ("select", {"work_ptr": "*i32", "index_ptr": "*i64", "keep_ptr": "*i8", "ratio": "fp32"},
               dict(SAMPLE=SAMPLE, BT=1024)),
    # kernels/triton_norm.py's, at the SmolLM2 shape's width (576: rows of 1024 values, 2 per program;
    # 8192 rows over 512 programs), and at its widest (rows of 8192, one per program)
    "rms_rebuild": ("rms_rebuild", _RMS_REBUILD, dict(XD=1, YD=3, ROWS=2, BC=1024)),
    "rms_rebuild widest": ("rms_rebuild", _RMS_REBUILD, dict(XD=1, YD=3, ROWS=1, BC=8192)),
    "rms_grad": ("rms_grad", _RMS_GRAD, dict(NEED_X=True, NEED_W=True, DXD=1, ITERS=8, ROWS=2, BC=1024)),
    "rms_grad widest": ("rms_grad", _RMS_GRAD, dict(NEED_X=True, NEED_W=True, DXD=1, ITERS=8, ROWS=1, BC=8192)),
    # kernels/triton_gated.py's, in bf16 (autocast)
    "silu_mul": ("silu_mul", {"g_ptr": "*bf16", "u_ptr": "*bf16", "h_ptr": "*bf16"}, dict(D=1, BLOCK=1024)),
    "silu_mul_grad": ("silu_mul_grad", {"d_ptr": "*bf16", "g_ptr": "*bf16", "u_ptr": "*bf16", "dg_ptr": "*bf16",
                                        "du_ptr": "*bf16"}, dict(NEED_G=True, NEED_U=True, D=1, BLOCK=1024)),
    # kernels/triton_rotary.py's under autocast: q and k bf16, cos and sin (and so the embedding) float32; 64-wide heads
    "rotary": ("rotary", _ROTARY, dict(BACKWARD=False, QD=1, QOD=3, KD=1, KOD=3, ROWS=32, BH=32)),
    "rotary backward": ("rotary", _ROTARY_BACK, dict(BACKWARD=True, QD=1, QOD=3, KD=1, KOD=3, ROWS=32, BH=32)),
}
