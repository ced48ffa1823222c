"""The compressor's Triton kernels, jit code only (launched by :mod:`.triton_codec`, which imports
this module with ``TRITON_INTERPRET=1`` where no CUDA device is present); a decoder layer's own ops
are :mod:`.triton_layers`'. The math of each is named in its docstring; why they are shaped so is
docs/DESIGN.md, "On a GPU"."""
import triton
import triton.language as tl


@triton.jit
def hash_uniform(idx, seed):
    """:func:`hf_division.quant.rounding.hash_uniform` on integer indices (>= 0) and a seed in
    [0, 2**32): the same 32-bit hash in uint32 arithmetic (sums and products wrap modulo 2**32,
    shifts are logical), so a GPU keeps one register per value where int64 took two."""
    x = idx.to(tl.uint32) + seed.to(tl.uint32)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    x = x ^ (x >> 16)
    return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216)


@triton.jit
def bf16_directed(v, DOWN: tl.constexpr):
    """:func:`hf_division.quant.rounding.bf16_directed`: float32 -> the next bf16 value toward
    -inf (DOWN) or +inf, on the bits."""
    i = v.to(tl.int32, bitcast=True)
    inexact = (i & 0xFFFF) != 0
    if DOWN:
        away = inexact & (v < 0)
    else:
        away = inexact & (v > 0)
    return ((i & -65536) + away.to(tl.int32) * 65536).to(tl.float32, bitcast=True)


@triton.jit
def round_lfc(v, LFC: tl.constexpr):
    """:func:`hf_division.quant.rounding.round_lfc`'s float32 value: nearest-even bf16 on the
    bits (NaN kept), fp16 through a cast, float32 as it is."""
    if LFC == 1:
        i = v.to(tl.int32, bitcast=True)
        r = ((i + 0x7FFF + ((i >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(v == v, r, v)
    elif LFC == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def group_words(codes_ptr, g, split, C, R_FULL: tl.constexpr, FULL32: tl.constexpr, LAST32: tl.constexpr,
                FULL: tl.constexpr):
    """Where group ``g``'s words start in the codes (one uint8 buffer: the full groups' words,
    then from byte ``split`` the last group's), as a pointer of their type (int32 or uint8): the
    launchers pass the buffer as it is, with no typed views made per tensor on the host."""
    if FULL:
        if FULL32:
            return (codes_ptr + g.to(tl.int64) * (R_FULL * 4) * C).to(tl.pointer_type(tl.int32))
        else:
            return codes_ptr + g.to(tl.int64) * R_FULL * C
    else:
        if LAST32:
            return (codes_ptr + split).to(tl.pointer_type(tl.int32))
        else:
            return codes_ptr + split


@triton.jit
def token_rows(p, T, Tp, sm, st):
    """Padded token ``p`` of the ``(M*Tp)`` run -> (its element offset, in int64: a tensor may span
    2**31 elements and more; its token among the ``M*T``; whether it is a real token): a padded
    token repeats its row's last."""
    m = p // Tp
    t = p - m * Tp
    real = t < T
    t = tl.minimum(t, T - 1)
    return m.to(tl.int64) * sm + t.to(tl.int64) * st, m * T + t, real


@triton.jit
def load_tokens(x_ptr, p, ok, ch, cmask, T, Tp, sm, st, sc, slot_ptr, rs_ptr, HAS_SLOT: tl.constexpr,
                ROW_SCALE: tl.constexpr):
    """``(tokens p x channels ch)`` float32 (divided by their row's scale, ROW_SCALE), the exact
    tokens zeroed; and their slots."""
    off, tok, real = token_rows(p, T, Tp, sm, st)
    mask = ok[:, None] & cmask[None, :]
    v = tl.load(x_ptr + off[:, None] + ch.to(tl.int64)[None, :] * sc, mask=mask, other=0.0).to(tl.float32)
    if ROW_SCALE:  # correctly rounded, as torch divides
        s = tl.load(rs_ptr + tok, mask=ok, other=1.0)
        v = tl.math.div_rn(v, tl.zeros_like(v) + s[:, None])
    slot = tl.full(p.shape, -1, tl.int32)
    if HAS_SLOT:
        slot = tl.load(slot_ptr + tok, mask=ok, other=-1)
        v = tl.where(((slot >= 0) & ((slot & 1) == 1))[:, None], 0.0, v)
    return v, slot, real


@triton.jit
def block_means(x_ptr, p0, glen, ch, cmask, T, Tp, sm, st, sc, slot_ptr, rs_ptr, lfc_ptr, lfc0, C,
                BLOCK: tl.constexpr, NBT: tl.constexpr, LFC: tl.constexpr, HAS_SLOT: tl.constexpr,
                ROW_SCALE: tl.constexpr):
    """Store the group's block means (summed in token order from +0, as ``block_sum``)."""
    b = tl.arange(0, NBT)
    ok = b < glen // BLOCK
    acc = tl.full((NBT, ch.shape[0]), 0, tl.float32)
    for j in range(BLOCK):
        v, _, _ = load_tokens(x_ptr, p0 + b * BLOCK + j, ok, ch, cmask, T, Tp, sm, st, sc, slot_ptr, rs_ptr,
                              HAS_SLOT, ROW_SCALE)
        acc = acc + v
    mean = round_lfc(acc * (1.0 / BLOCK), LFC)
    where = lfc_ptr + (lfc0 + b).to(tl.int64)[:, None] * C + ch[None, :]
    tl.store(where, mean.to(lfc_ptr.dtype.element_ty), mask=ok[:, None] & cmask[None, :])


@triton.jit
def residual(x_ptr, p0, r, ok, ch, cmask, T, Tp, sm, st, sc, slot_ptr, rs_ptr, lfc_ptr, lfc0, C,
             BLOCK: tl.constexpr, LFC: tl.constexpr, HAS_SLOT: tl.constexpr, ROW_SCALE: tl.constexpr):
    """The HFC of tokens ``p0 + r``: x minus its block's stored mean; slots; real."""
    v, slot, real = load_tokens(x_ptr, p0 + r, ok, ch, cmask, T, Tp, sm, st, sc, slot_ptr, rs_ptr, HAS_SLOT,
                                ROW_SCALE)
    h = v
    if LFC != 0:
        where = lfc_ptr + (lfc0 + r // BLOCK).to(tl.int64)[:, None] * C + ch[None, :]
        h = v - tl.load(where, mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    return h, slot, real


@triton.jit
def encode_group(x_ptr, p0, glen, R, word_ptr, g, ch, cmask, T, Tp, C, sm, st, sc, seed, slot_ptr, rows_ptr,
                 rs_ptr, top, lfc_ptr, lo_ptr, scale_ptr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                 NBT: tl.constexpr, PER: tl.constexpr, RT: tl.constexpr, RCH: tl.constexpr, WORD32: tl.constexpr,
                 LFC: tl.constexpr, HAS_SEED: tl.constexpr, HAS_SLOT: tl.constexpr, ROW_SCALE: tl.constexpr,
                 ROWS_BF16: tl.constexpr):
    """One group of ``glen`` tokens x the channels ``ch``: block means, range, codes. ROW_SCALE:
    the tokens divided by their row's scale are encoded, and an exact token's row is held as
    dividing then multiplying rebuilds it (clamped to ``top``, in the rows' dtype). The ``R`` rows
    of words are taken ``RCH`` at a time, in loops the compiler keeps as loops: a tile of the
    whole group, or an unrolled loop, would hold more values than a GPU thread has registers
    (docs/DESIGN.md, "On a GPU": registers)."""
    lfc0 = p0 // BLOCK
    if LFC != 0:
        block_means(x_ptr, p0, glen, ch, cmask, T, Tp, sm, st, sc, slot_ptr, rs_ptr, lfc_ptr, lfc0, C,
                    BLOCK, NBT, LFC, HAS_SLOT, ROW_SCALE)
        tl.debug_barrier()  # the means are read back below by other threads of this program
    lo = tl.full((ch.shape[0],), float("inf"), tl.float32)
    hi = tl.full((ch.shape[0],), float("-inf"), tl.float32)
    for u0 in range(0, RT, RCH):
        u = u0 + tl.arange(0, RCH)
        for i in range(PER):
            r = u + i * R
            ok = (u < R) & (r < glen)
            h, _, _ = residual(x_ptr, p0, r, ok, ch, cmask, T, Tp, sm, st, sc, slot_ptr, rs_ptr, lfc_ptr, lfc0, C,
                               BLOCK, LFC, HAS_SLOT, ROW_SCALE)
            lo = tl.minimum(lo, tl.min(tl.where(ok[:, None], h, float("inf")), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(ok[:, None], h, float("-inf")), axis=0))
    levels = (1 << BITS) - 1
    lo = bf16_directed(lo, True)
    scale = bf16_directed((hi - lo) * (1.0 / levels), False)
    inv = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)), 0.0)
    tl.store(lo_ptr + g * C + ch, lo.to(tl.bfloat16), mask=cmask)
    tl.store(scale_ptr + g * C + ch, scale.to(tl.bfloat16), mask=cmask)
    for u0 in range(0, RT, RCH):
        u = u0 + tl.arange(0, RCH)
        word = tl.full((RCH, ch.shape[0]), 0, tl.int32)
        for i in range(PER):
            r = u + i * R
            ok = (u < R) & (r < glen)
            h, slot, real = residual(x_ptr, p0, r, ok, ch, cmask, T, Tp, sm, st, sc, slot_ptr, rs_ptr, lfc_ptr,
                                     lfc0, C, BLOCK, LFC, HAS_SLOT, ROW_SCALE)
            y = (h - lo[None, :]) * inv[None, :]
            if HAS_SEED:
                y = y + hash_uniform((p0 + r).to(tl.uint32)[:, None] * C + ch[None, :], seed)
            else:
                y = y + 0.5
            q = tl.minimum(tl.maximum(y, 0.0), levels * 1.0).to(tl.int32)
            word = word | (tl.where(ok[:, None], q, 0) << (BITS * i))
            if HAS_SLOT:  # the exact tokens' rows, as held (once: not from a padded copy)
                held = ok & real & (slot >= 0)
                off, tok, _ = token_rows(p0 + r, T, Tp, sm, st)
                v = tl.load(x_ptr + off[:, None] + ch.to(tl.int64)[None, :] * sc, mask=held[:, None] & cmask[None, :])
                if ROW_SCALE:
                    s = tl.load(rs_ptr + tok, mask=held, other=1.0)[:, None] + tl.zeros((RCH, ch.shape[0]), tl.float32)
                    w = tl.math.div_rn(v.to(tl.float32), s) * s
                    w = tl.where(top > 0, tl.minimum(tl.maximum(w, -top), top), w)  # top 0: float32, not clamped
                    if ROWS_BF16:  # to nearest even on the bits, as for the rebuild
                        w = round_lfc(w, 1)
                    v = w.to(rows_ptr.dtype.element_ty)
                tl.store(rows_ptr + (slot >> 1).to(tl.int64)[:, None] * C + ch[None, :], v,
                         mask=held[:, None] & cmask[None, :])
        where = u[:, None] * C + ch[None, :]
        mask = (u < R)[:, None] & cmask[None, :]
        if WORD32:
            tl.store(word_ptr + where, word, mask=mask)
        else:
            tl.store(word_ptr + where, word.to(tl.uint8), mask=mask)


@triton.jit
def encode_kernel(x_ptr, sm, st, sc, T, Tp, C, n_full, rest, r_last, seed_ptr, slot_ptr, rows_ptr, rs_ptr, top,
                  codes_ptr, split, lfc_ptr, lo_ptr, scale_ptr,
                  BITS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, BC: tl.constexpr,
                  R_FULL: tl.constexpr, FULL32: tl.constexpr, LAST32: tl.constexpr,
                  RT_FULL: tl.constexpr, RT_LAST: tl.constexpr, RCH_FULL: tl.constexpr, RCH_LAST: tl.constexpr,
                  NBT: tl.constexpr, LFC: tl.constexpr, HAS_SEED: tl.constexpr, HAS_SLOT: tl.constexpr,
                  ROW_SCALE: tl.constexpr, ROWS_BF16: tl.constexpr):
    """Grid (groups, channel blocks): the full groups, then the last, partial one."""
    g = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = ch < C
    seed = 0
    if HAS_SEED:
        seed = tl.load(seed_ptr).to(tl.int64)
    p0 = g * GROUP
    if g < n_full:
        encode_group(x_ptr, p0, GROUP, R_FULL, group_words(codes_ptr, g, split, C, R_FULL, FULL32, LAST32, True),
                     g, ch, cmask, T, Tp, C,
                     sm, st, sc, seed, slot_ptr, rows_ptr, rs_ptr, top, lfc_ptr, lo_ptr, scale_ptr, BITS, BLOCK,
                     NBT, 32 // BITS if FULL32 else 8 // BITS, RT_FULL, RCH_FULL, FULL32, LFC, HAS_SEED, HAS_SLOT,
                     ROW_SCALE, ROWS_BF16)
    else:
        encode_group(x_ptr, p0, rest, r_last, group_words(codes_ptr, g, split, C, R_FULL, FULL32, LAST32, False),
                     g, ch, cmask, T, Tp, C,
                     sm, st, sc, seed, slot_ptr, rows_ptr, rs_ptr, top, lfc_ptr, lo_ptr, scale_ptr, BITS, BLOCK,
                     NBT, 32 // BITS if LAST32 else 8 // BITS, RT_LAST, RCH_LAST, LAST32, LFC, HAS_SEED,
                     HAS_SLOT, ROW_SCALE, ROWS_BF16)


@triton.jit
def decode_group(out_ptr, p0, glen, R, word_ptr, g, ch, cmask, T, Tp, C, lfc_ptr, lo_ptr, scale_ptr, rs_ptr, top,
                 BITS: tl.constexpr, BLOCK: tl.constexpr, PER: tl.constexpr, RT: tl.constexpr, RCH: tl.constexpr,
                 HAS_LFC: tl.constexpr, CLAMP: tl.constexpr, OUT_BF16: tl.constexpr, ROW_SCALE: tl.constexpr):
    """One group's real tokens rebuilt into ``out`` (``(M*T, C)``, its dtype), times their row's
    scale (ROW_SCALE) before the clamp; ``RCH`` rows of words at a time, as :func:`encode_group`."""
    lo = tl.load(lo_ptr + g * C + ch, mask=cmask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + g * C + ch, mask=cmask, other=0.0).to(tl.float32)
    for u0 in range(0, RT, RCH):
        u = u0 + tl.arange(0, RCH)
        mask = (u < R)[:, None] & cmask[None, :]
        word = tl.load(word_ptr + u[:, None] * C + ch[None, :], mask=mask, other=0).to(tl.int32)
        for i in range(PER):
            r = u + i * R
            ok = (u < R) & (r < glen)
            _, tok, real = token_rows(p0 + r, T, Tp, 0, 0)
            q = ((word >> (BITS * i)) & ((1 << BITS) - 1)).to(tl.float32)
            base = tl.full((RCH, ch.shape[0]), 0, tl.float32) + lo[None, :]
            if HAS_LFC:
                where = lfc_ptr + ((p0 + r) // BLOCK).to(tl.int64)[:, None] * C + ch[None, :]
                base = base + tl.load(where, mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            v = base + q * scale[None, :]
            if ROW_SCALE:
                v = v * tl.load(rs_ptr + tok, mask=ok & real, other=1.0)[:, None]
            if CLAMP:
                v = tl.minimum(tl.maximum(v, -top), top)
            if OUT_BF16:  # to nearest even on the bits: the interpreter's own cast truncates
                v = round_lfc(v, 1)
            keep = (ok & real)[:, None] & cmask[None, :]
            tl.store(out_ptr + tok.to(tl.int64)[:, None] * C + ch[None, :], v.to(out_ptr.dtype.element_ty),
                     mask=keep)


@triton.jit
def decode_kernel(out_ptr, T, Tp, C, n_full, rest, r_last, codes_ptr, split, lfc_ptr, lo_ptr, scale_ptr, rs_ptr,
                  top, BITS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, BC: tl.constexpr,
                  R_FULL: tl.constexpr, FULL32: tl.constexpr, LAST32: tl.constexpr, RT_FULL: tl.constexpr,
                  RT_LAST: tl.constexpr, RCH_FULL: tl.constexpr, RCH_LAST: tl.constexpr, HAS_LFC: tl.constexpr,
                  CLAMP: tl.constexpr, OUT_BF16: tl.constexpr, ROW_SCALE: tl.constexpr):
    g = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = ch < C
    p0 = g * GROUP
    if g < n_full:
        decode_group(out_ptr, p0, GROUP, R_FULL, group_words(codes_ptr, g, split, C, R_FULL, FULL32, LAST32, True),
                     g, ch, cmask, T, Tp, C,
                     lfc_ptr, lo_ptr, scale_ptr, rs_ptr, top, BITS, BLOCK, 32 // BITS if FULL32 else 8 // BITS,
                     RT_FULL, RCH_FULL, HAS_LFC, CLAMP, OUT_BF16, ROW_SCALE)
    else:
        decode_group(out_ptr, p0, rest, r_last, group_words(codes_ptr, g, split, C, R_FULL, FULL32, LAST32, False),
                     g, ch, cmask, T, Tp, C, lfc_ptr, lo_ptr, scale_ptr,
                     rs_ptr, top, BITS, BLOCK, 32 // BITS if LAST32 else 8 // BITS, RT_LAST, RCH_LAST, HAS_LFC,
                     CLAMP, OUT_BF16, ROW_SCALE)


@triton.jit
def put_rows_kernel(out_ptr, rows_ptr, index_ptr, keep_ptr, C, HAS_KEEP: tl.constexpr, BC: tl.constexpr):
    """The exact rows back in their places (those marked kept)."""
    k = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = ch < C
    if HAS_KEEP:
        ok = ok & (tl.load(keep_ptr + k + 0 * ch) != 0)  # the flag as a vector: a scalar mask is not broadcast
    v = tl.load(rows_ptr + k.to(tl.int64) * C + ch, mask=ok)
    tl.store(out_ptr + tl.load(index_ptr + k) * C + ch, v, mask=ok)


@triton.jit
def work_parts(work_ptr, n):
    """The outlier search's one int32 work buffer of ``2n + 1``: the slots, the scores (float32),
    the counter (one allocation on the host where there were three)."""
    return work_ptr, (work_ptr + n).to(tl.pointer_type(tl.float32)), work_ptr + 2 * n


@triton.jit
def score_kernel(x_ptr, sm, st, sc, T, C: tl.constexpr, n, work_ptr, index_ptr, keep_ptr, k, rs_ptr,
                 BT: tl.constexpr, BC: tl.constexpr, ROW_SCALE: tl.constexpr):
    """Max |x| per token (float32; the outlier search's score; divided by the row's scale,
    ROW_SCALE: max |x / s| to the bit, division by s > 0 keeping the order), and the exact rows' bookkeeping
    cleared: no slot taken, none kept. ``C`` is a compile-time constant (one compile per width):
    Triton 3.6's interpreter cannot loop to a runtime bound with NumPy 2.4."""
    _, score_ptr, count_ptr = work_parts(work_ptr, n)
    pid = tl.program_id(0)
    tok = pid * BT + tl.arange(0, BT)
    ok = tok < n
    m = tok // T
    off = m.to(tl.int64) * sm + (tok - m * T).to(tl.int64) * st  # as token_rows: int64
    best = tl.full((BT,), 0, tl.float32)
    for c0 in range(0, C, BC):
        ch = c0 + tl.arange(0, BC)
        v = tl.load(x_ptr + off[:, None] + ch.to(tl.int64)[None, :] * sc, mask=ok[:, None] & (ch < C)[None, :],
                    other=0.0)
        best = tl.maximum(best, tl.max(tl.abs(v.to(tl.float32)), axis=1))
    if ROW_SCALE:
        best = tl.math.div_rn(best, tl.load(rs_ptr + tok, mask=ok, other=1.0))
    tl.store(score_ptr + tok, best, mask=ok)
    clear = tok < k
    tl.store(index_ptr + tok, tl.full((BT,), 0, tl.int64), mask=clear)
    tl.store(keep_ptr + tok, tl.full((BT,), 0, tl.int8), mask=clear)
    if pid == 0:
        tl.store(count_ptr, 0)


@triton.jit
def select_kernel(work_ptr, n, stride, k, ratio, index_ptr, keep_ptr, SAMPLE: tl.constexpr, BT: tl.constexpr):
    """Tokens whose score exceeds ``ratio`` times the median of the scores of every ``stride``-th
    token (at most ``SAMPLE`` of them, spread over all ``n``; all when ``n <= SAMPLE``): a slot
    each, up to ``k``. Each program finds the sample's lower median itself (bit by bit: scores are
    >= 0, so their bits order as int32), then takes slots for its tokens from one counter."""
    slot_ptr, score_ptr, count_ptr = work_parts(work_ptr, n)
    j = tl.arange(0, SAMPLE)
    size = (n + stride - 1) // stride
    s_ok = j < size
    bits = tl.load(score_ptr + (j * stride).to(tl.int64), mask=s_ok, other=0.0).to(tl.int32, bitcast=True)
    want = (size - 1) // 2
    # two bits a step, highest first (bits 30 to 1, then bit 0 alone; bit 31, the sign, is 0): 16
    # reductions the program waits for one after another, where one bit a step took 31. The counts
    # below a candidate grow with it, so the step's digit is how many of its 4 keep <= want, less 1
    digit = tl.arange(0, 4)
    med = 0
    for sh in tl.static_range(29, 0, -2):
        trial = med | (digit << sh)
        below = tl.sum((s_ok[:, None] & (bits[:, None] < trial[None, :])).to(tl.int32), axis=0)
        med = med | ((tl.sum((below <= want).to(tl.int32), axis=0) - 1) << sh)
    below = tl.sum((s_ok & (bits < (med | 1))).to(tl.int32), axis=0)
    med = tl.where(below <= want, med | 1, med)
    threshold = ratio * med.to(tl.float32, bitcast=True)
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = tok < n
    take = ok & (tl.load(score_ptr + tok, mask=ok, other=0.0) > threshold)
    count = tl.sum(take.to(tl.int32), axis=0)
    first = tl.atomic_add(count_ptr, count)
    slot = first + tl.cumsum(take.to(tl.int32), axis=0) - 1
    take = take & (slot < k)
    tl.store(slot_ptr + tok, tl.where(take, slot * 2 + 1, -1), mask=ok)
    tl.store(index_ptr + slot, tok.to(tl.int64), mask=take)
    tl.store(keep_ptr + slot, tl.full((BT,), 1, tl.int8), mask=take)
