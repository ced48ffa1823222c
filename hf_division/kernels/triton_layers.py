"""Triton kernels of a decoder layer's own ops, where division replaces autograd's chain of torch ops
with one pass each way, jit code only: Llama's RMSNorm rebuilt and differentiated (launched by
:mod:`.triton_norm`), a SiLU-gated MLP's product and gradients (:mod:`.triton_gated`) and the rotary
position embedding of q and k (:mod:`.triton_rotary`). Each rounds where torch's ops round
(:func:`~.triton_kernels.round_lfc`); why they are shaped so is docs/DESIGN.md, "On a GPU"."""
import triton
import triton.language as tl

from hf_division.kernels.triton_kernels import round_lfc


@triton.jit
def rms_rebuild_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, C, eps, XD: tl.constexpr, YD: tl.constexpr,
                       ROWS: tl.constexpr, BC: tl.constexpr):
    """Llama's RMSNorm on ``ROWS`` whole rows of ``(N, C)`` (``BC >= C``): ``rstd = 1/sqrt(mean(x^2)
    + eps)`` (float32, stored) and ``y = w * (x * rstd)``, ``x * rstd`` rounded to x's dtype first
    as the module rounds it. ``XD``, ``YD``: x's and y's dtypes as :func:`round_lfc` codes, each
    rounding to nearest even as torch's casts do (Triton's interpreter truncates on its own)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ch = tl.arange(0, BC)
    ok = rows < N
    m = ok[:, None] & (ch < C)[None, :]
    at = rows.to(tl.int64)[:, None] * C + ch[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / C + eps)
    tl.store(rstd_ptr + rows, rstd, mask=ok)
    w = tl.load(w_ptr + ch, mask=ch < C, other=0.0).to(tl.float32)
    tl.store(y_ptr + at, round_lfc(w[None, :] * round_lfc(x32 * rstd[:, None], XD), YD), mask=m)


@triton.jit
def rms_grad_kernel(g_ptr, x_ptr, rstd_ptr, w_ptr, dx_ptr, dw_ptr, N, C, NEED_X: tl.constexpr, NEED_W: tl.constexpr,
                    DXD: tl.constexpr, ITERS: tl.constexpr, ROWS: tl.constexpr, BC: tl.constexpr):
    """The RMSNorm's gradient over ``ITERS`` blocks of ``ROWS`` whole rows, from the output's
    gradient ``g``, the input ``x`` and :func:`rms_rebuild_kernel`'s ``rstd``: ``dx = rstd * (g*w -
    x_n * mean(g*w * x_n))`` in dx's dtype (NEED_X), and this program's row of ``dw``'s partial
    sums, ``g * x_n`` summed over its rows in order (NEED_W; the launcher sums the programs' rows).
    ``DXD``: dx's dtype as a :func:`round_lfc` code."""
    pid = tl.program_id(0)
    ch = tl.arange(0, BC)
    cm = ch < C
    w = tl.load(w_ptr + ch, mask=cm, other=0.0).to(tl.float32)
    acc = tl.zeros((BC,), tl.float32)
    for i in range(ITERS):
        rows = (pid * ITERS + i) * ROWS + tl.arange(0, ROWS)
        ok = rows < N
        m = ok[:, None] & cm[None, :]
        at = rows.to(tl.int64)[:, None] * C + ch[None, :]
        rstd = tl.load(rstd_ptr + rows, mask=ok, other=0.0)
        g = tl.load(g_ptr + at, mask=m, other=0.0).to(tl.float32)
        xn = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32) * rstd[:, None]
        if NEED_X:
            gy = g * w[None, :]
            mean = tl.sum(gy * xn, axis=1) / C
            tl.store(dx_ptr + at, round_lfc((gy - xn * mean[:, None]) * rstd[:, None], DXD), mask=m)
        if NEED_W:
            acc += tl.sum(g * xn, axis=0)
    if NEED_W:
        tl.store(dw_ptr + pid.to(tl.int64) * C + ch, acc, mask=cm)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, h_ptr, n, D: tl.constexpr, BLOCK: tl.constexpr):
    """``h = silu(g) * u`` elementwise, rounded where torch's two ops round: ``silu(g)`` and the
    product to the tensors' one dtype (``D``, a :func:`round_lfc` code)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0)
    g32 = g.to(tl.float32)
    a = round_lfc(g32 / (1.0 + tl.exp(-g32)), D)
    tl.store(h_ptr + i, round_lfc(a * tl.load(u_ptr + i, mask=ok, other=0.0).to(tl.float32), D), mask=ok)


@triton.jit
def silu_mul_grad_kernel(d_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, NEED_G: tl.constexpr, NEED_U: tl.constexpr,
                         D: tl.constexpr, BLOCK: tl.constexpr):
    """The gradients of ``h = silu(g) * u`` for ``d = dL/dh``, rounded as torch's ops round them
    to the tensors' one dtype (``D``): ``du = d * silu(g)`` and ``dg = silu_backward(d * u, g)``."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    d = tl.load(d_ptr + i, mask=ok, other=0.0)
    g = tl.load(g_ptr + i, mask=ok, other=0.0)
    d32, g32 = d.to(tl.float32), g.to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g32))
    if NEED_U:
        tl.store(du_ptr + i, round_lfc(d32 * round_lfc(g32 * s, D), D), mask=ok)
    if NEED_G:
        t = round_lfc(d32 * tl.load(u_ptr + i, mask=ok, other=0.0).to(tl.float32), D)
        tl.store(dg_ptr + i, round_lfc(t * s * (1.0 + g32 * (1.0 - s)), D), mask=ok)


@triton.jit
def rotary_rows(x_ptr, o_ptr, c_ptr, s_ptr, r0, R, H, T, HALF, sb, sh, st, ob, oh, ot, cb, ct,
                BACKWARD: tl.constexpr, XD: tl.constexpr, OD: tl.constexpr, ROWS: tl.constexpr, BH: tl.constexpr):
    """Rows ``r0 ..`` of the ``R`` rows (``b, h, t`` in that order; ``H`` heads, ``T`` tokens) of one
    ``(b, h, t, 2*HALF)`` tensor: Transformers' ``x*cos + rotate_half(x)*sin``, or with ``BACKWARD``
    its gradient, ``x`` then being the output's gradient and ``o`` the input's. Rounded where
    autograd's ops round: forward, each product and the sum to the output's dtype ``OD``; backward,
    each product to ``OD``, then to the input's ``XD`` (autograd's cast), the sum in ``XD``. ``cos``
    and ``sin`` share strides: ``cb`` per batch (0 when shared), ``ct`` per token."""
    rows = r0 + tl.arange(0, ROWS)
    ok = rows < R
    t = rows % T
    bh = rows // T
    h = (bh % H).to(tl.int64)
    b = (bh // H).to(tl.int64)
    t = t.to(tl.int64)
    j = tl.arange(0, BH)
    m = ok[:, None] & (j < HALF)[None, :]
    xa = (b * sb + h * sh + t * st)[:, None] + j[None, :]
    oa = (b * ob + h * oh + t * ot)[:, None] + j[None, :]
    ca = (b * cb + t * ct)[:, None] + j[None, :]
    x1 = tl.load(x_ptr + xa, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + xa + HALF, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr + ca, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + ca + HALF, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + ca, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + ca + HALF, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = round_lfc(round_lfc(round_lfc(x1 * c1, OD), XD) + round_lfc(round_lfc(x2 * s2, OD), XD), XD)
        y2 = round_lfc(round_lfc(round_lfc(x2 * c2, OD), XD) - round_lfc(round_lfc(x1 * s1, OD), XD), XD)
    else:
        y1 = round_lfc(round_lfc(x1 * c1, OD) + round_lfc(-x2 * s1, OD), OD)
        y2 = round_lfc(round_lfc(x2 * c2, OD) + round_lfc(x1 * s2, OD), OD)
    tl.store(o_ptr + oa, y1, mask=m)
    tl.store(o_ptr + oa + HALF, y2, mask=m)


@triton.jit
def rotary_kernel(q_ptr, qo_ptr, k_ptr, ko_ptr, c_ptr, s_ptr, RQ, RK, HQ, HK, T, HALF, PQ,
                  qsb, qsh, qst, qob, qoh, qot, ksb, ksh, kst, kob, koh, kot, cb, ct,
                  BACKWARD: tl.constexpr, QD: tl.constexpr, QOD: tl.constexpr, KD: tl.constexpr, KOD: tl.constexpr,
                  ROWS: tl.constexpr, BH: tl.constexpr):
    """:func:`rotary_rows` over q's rows in the first ``PQ`` programs and k's in the rest: both
    tensors of one attention in one launch. ``QD``/``QOD``, ``KD``/``KOD``: the dtypes (as
    :func:`round_lfc` codes) of q's and k's inputs and outputs in the forward's sense."""
    pid = tl.program_id(0)
    if pid < PQ:
        rotary_rows(q_ptr, qo_ptr, c_ptr, s_ptr, pid * ROWS, RQ, HQ, T, HALF, qsb, qsh, qst, qob, qoh, qot, cb, ct,
                    BACKWARD, QD, QOD, ROWS, BH)
    else:
        rotary_rows(k_ptr, ko_ptr, c_ptr, s_ptr, (pid - PQ) * ROWS, RK, HK, T, HALF, ksb, ksh, kst, kob, koh, kot,
                    cb, ct, BACKWARD, KD, KOD, ROWS, BH)
