/* hf-division's CPU kernels: DIVISION's token-group compressor, written out in C.
 *
 * Why C: the same math compiled by torch.compile ran at about 1.5 ns per element with about
 * 0.1 ms of Python and guard overhead per call, several calls per saved tensor; this file runs it
 * in one call per tensor, several times faster (docs/DESIGN.md, "Native CPU kernels"). It is the
 * element-by-element form of hf_division/quant.py (token_stats, quantize_tokens, pack_tokens,
 * decode_tokens, hash_uniform, bf16_directed, round_lfc) and produces the same bytes: the tests
 * compare the two. Compiled with -ffp-contract=off, so every product and sum is rounded on its own
 * as in the tensor code. Built and loaded by hf_division/native.py; OpenMP is the runtime PyTorch
 * already loaded (libgomp.so.1), with PyTorch's thread count passed in.
 *
 * Layout (hf_division/compressor.py): the tensor is M sequences of T tokens of C float32 channels,
 * each sequence padded to Tp = ceil(T / block) * block tokens by repeating its last token; the
 * padded tokens are numbered tt = 0 .. M*Tp-1 and cut into groups of G tokens, the last one
 * possibly shorter. Per group and channel: lo and scale (bf16 bits), codes packed along tokens;
 * per block of `block` tokens and channel: the LFC (bf16 bits or float32; none when block == 1).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 128 /* channels per encode work item: a group's tile (G x TILE floats) stays in L2 between the passes */
#define DECODE_TILE 256 /* channels per decode work item: one pass, longer rows per loop */
#define PREFETCH_AHEAD 4 /* tokens: pass 1 asks for a row this far ahead (docs/DESIGN.md, "Native CPU kernels") */
#define LFC_BLOCKS 32 /* blocks of one group whose LFC pass 2 converts once, not once per token */

enum { LFC_NONE = 0, LFC_BF16 = 1, LFC_F32 = 2 };

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }

/* quant.bf16_directed: the nearest bf16 value toward -inf (down) or +inf, as float32 */
static inline float bf16_directed(float v, int down) {
    uint32_t i = bits_of(v);
    uint32_t away = (i & 0xFFFFu) != 0 && (down ? v < 0.0f : v > 0.0f);
    return float_of((i & 0xFFFF0000u) + away * 0x10000u);
}

/* quant.round_lfc for bf16: round to nearest even on the bits (NaN kept) */
static inline uint32_t round_bf16(float v) {
    uint32_t i = bits_of(v);
    return v != v ? i : (i + 0x7FFFu + ((i >> 16) & 1u)) & 0xFFFF0000u;
}

/* quant.hash_uniform: U(0, 1) from a 32-bit integer hash of (index + seed) mod 2**32 */
static inline float hash_uniform(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x5BD1E995u;
    x ^= x >> 16;
    return ((float)(x >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

/* quant.code_layout: a group of g tokens is `rows` rows of C words (uint32 if its codes fill
 * whole words, else bytes); word (u, j) holds the codes of tokens u, u + rows, ... of channel j */
typedef struct { int word32; int64_t rows; int per; } Codes;

static Codes code_layout(int64_t g, int bits) {
    Codes c;
    c.word32 = g * bits % 32 == 0;
    c.rows = c.word32 ? g * bits / 32 : (g * bits + 7) / 8;
    c.per = (c.word32 ? 32 : 8) / bits;
    return c;
}

/* The tensor as the kernels see it: n padded tokens of c channels, and its compression parameters. */
typedef struct {
    int64_t n, c, block, group;
    int bits, lfc_kind, block_shift; /* block_shift: log2(block) where block is a power of 2, else -1 */
    const int64_t *row; /* padded token -> row of the (M*T, C) tensor (-1: a padding token); NULL: itself */
    const float *row_scale; /* per row of the tensor: what is compressed is x / scale, rebuilt times it; NULL: none */
} Shape;

static inline int64_t row_of(const Shape *s, int64_t tt) { return s->row ? s->row[tt] : tt; }
static inline int64_t block_of(const Shape *s, int64_t tt) { return s->block_shift >= 0 ? tt >> s->block_shift : tt / s->block; }

/* Padded token tt's values over a tile, as compressed: the row itself, or divided by its row
 * scale into `buf` (store._keep_row_scaled: each token relative to its own RMS) */
static inline const float *token_row(const Shape *s, const float *x, int64_t tt, int64_t j0, int64_t tj, float *buf) {
    int64_t r = row_of(s, tt);
    const float *row = x + r * s->c + j0;
    if (s->row_scale == NULL) return row;
    float d = s->row_scale[r];
    for (int64_t j = 0; j < tj; j++) buf[j] = row[j] / d;
    return buf;
}

/* Ask for padded token tt's row over a tile before it is read: a tile reads a few cache lines of each
 * token, one row apart, which the hardware prefetcher does not follow (docs/DESIGN.md, "Native CPU kernels"). */
static inline void prefetch_row(const Shape *s, const float *x, int64_t tt, int64_t j0, int64_t tj) {
    const char *row = (const char *)(x + row_of(s, tt) * s->c + j0);
    for (int64_t k = 0; k < tj * (int64_t)sizeof(float); k += 64) __builtin_prefetch(row + k);
}

/* Test hook (tests/kernels/test_native.py): the next `count` allocations fail, so that each caller's
 * failure path can be run; 0 outside tests. Set and read between calls, never inside a parallel region. */
static int failing_allocs = 0;
void hfd_fail_next_allocs(int count) { failing_allocs = count; }

static void *alloc(size_t bytes) {
    if (failing_allocs > 0) {
        failing_allocs--;
        return NULL;
    }
    return malloc(bytes);
}

/* The shape of M sequences of T tokens padded to whole blocks into *s, and its row map where padding
 * applies (*row_map, to free): encoding reads a padding token from its sequence's last token,
 * decoding skips it. Computed once per call: a division per token and tile cost more than the kernel.
 * Returns 0, or -1 where the row map could not be allocated: without it padded tokens would be read
 * and written past the tensor's rows. */
static int make_shape(int64_t m, int64_t t, int64_t c, int64_t block, int64_t group, int bits, int lfc_kind,
                      int for_decode, const float *row_scale, int64_t **row_map, Shape *s) {
    int64_t tp = (t + block - 1) / block * block;
    *s = (Shape){m * tp, c, block, group, bits, lfc_kind, -1, NULL, row_scale};
    for (int k = 0; k < 62; k++)
        if ((int64_t)1 << k == block) s->block_shift = k;
    *row_map = NULL;
    if (tp == t || s->n == 0) return 0;
    if ((uint64_t)s->n > SIZE_MAX / sizeof(int64_t) || (*row_map = alloc(sizeof(int64_t) * (size_t)s->n)) == NULL)
        return -1;
    for (int64_t tt = 0, seq = 0; seq < m; seq++)
        for (int64_t k = 0; k < tp; k++, tt++)
            (*row_map)[tt] = k < t ? seq * t + k : for_decode ? -1 : seq * t + t - 1;
    s->row = *row_map;
    return 0;
}

/* ----------------------------------------------------------------------------- encode */
/* min / max over one row of a tile of x - LFC; `nan` marks the channels that met a NaN (torch.amin /
 * amax return NaN there: a flag is cheaper than NaN-propagating comparisons) */
static inline void tile_minmax(const float *row, const float *lf, int64_t tj, float *mn, float *mx, int32_t *nan) {
    for (int64_t j = 0; j < tj; j++) {
        float h = row[j] - lf[j];
        mn[j] = h < mn[j] ? h : mn[j];
        mx[j] = h > mx[j] ? h : mx[j];
        nan[j] |= h != h;
    }
}

/* The mean of one block's rows over a tile, rounded to the LFC dtype and written out (quant.round_lfc). */
static void block_mean(const Shape *s, const float *x, int64_t b0, int64_t j0, int64_t tj, void *lfc, float *lf) {
    float acc[TILE] = {0}, buf[TILE];
    for (int64_t tt = b0; tt < b0 + s->block; tt++) {
        if (tt + PREFETCH_AHEAD < s->n) prefetch_row(s, x, tt + PREFETCH_AHEAD, j0, tj);
        const float *row = token_row(s, x, tt, j0, tj, buf);
        for (int64_t j = 0; j < tj; j++) acc[j] += row[j];
    }
    const float inv_block = (float)(1.0 / (double)s->block);
    int64_t at = block_of(s, b0) * s->c + j0;
    for (int64_t j = 0; j < tj; j++) {
        float mean = acc[j] * inv_block;
        if (s->lfc_kind == LFC_F32) {
            lf[j] = mean;
            ((float *)lfc)[at + j] = mean;
        } else {
            uint32_t r = round_bf16(mean);
            lf[j] = float_of(r);
            ((uint16_t *)lfc)[at + j] = (uint16_t)(r >> 16);
        }
    }
}

/* max |x| over n floats, NaN where one is NaN (quant.token_absmax's score over one token's channels) */
static inline float row_absmax(const float *row, int64_t n) {
    float m = 0.0f;
    int32_t nan = 0;
    /* simd: a max reduction is not vectorized otherwise (its order matters for NaN, flagged apart) */
    #pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t j = 0; j < n; j++) {
        float a = fabsf(row[j]);
        m = a > m ? a : m;
        nan |= a != a;
    }
    return nan ? NAN : m;
}

/* Pass 1 for one group's tile: the LFC of its blocks (written out) and min / max of x - LFC; where
 * `absmax` is given, also each token's max |x| over the tile (of x, not divided by a row scale), at
 * absmax[row * tiles + tile]: the outlier search's score read in this pass instead of one of its own
 * (compressor._encode_then_split). A padding token writes its row's value again, from the same item. */
static void tile_ranges(const Shape *s, const float *x, int64_t t0, int64_t gt, int64_t j0, int64_t tj,
                        void *lfc, float *mn, float *mx, float *absmax, int64_t tiles) {
    float lf[TILE] = {0}, buf[TILE];
    int32_t nan[TILE] = {0};
    for (int64_t j = 0; j < tj; j++) { mn[j] = INFINITY; mx[j] = -INFINITY; }
    for (int64_t b0 = t0; b0 < t0 + gt; b0 += s->block) {
        if (s->lfc_kind != LFC_NONE) block_mean(s, x, b0, j0, tj, lfc, lf);
        for (int64_t tt = b0; tt < b0 + s->block; tt++) {
            if (s->lfc_kind == LFC_NONE && tt + PREFETCH_AHEAD < t0 + gt) prefetch_row(s, x, tt + PREFETCH_AHEAD, j0, tj);
            tile_minmax(token_row(s, x, tt, j0, tj, buf), lf, tj, mn, mx, nan);
            if (absmax != NULL) absmax[row_of(s, tt) * tiles + j0 / TILE] = row_absmax(x + row_of(s, tt) * s->c + j0, tj);
        }
    }
    for (int64_t j = 0; j < tj; j++)
        if (nan[j]) mn[j] = mx[j] = NAN;
}

/* The LFC of padded token tt over a tile, as float32 (0 without an LFC: x - 0 is x, -0 and NaN included). */
static inline void tile_lfc(const Shape *s, const void *lfc, int64_t tt, int64_t j0, int64_t tj, float *lf) {
    if (s->lfc_kind == LFC_NONE) {
        for (int64_t j = 0; j < tj; j++) lf[j] = 0.0f;
        return;
    }
    int64_t at = block_of(s, tt) * s->c + j0;
    if (s->lfc_kind == LFC_F32)
        for (int64_t j = 0; j < tj; j++) lf[j] = ((const float *)lfc)[at + j];
    else
        for (int64_t j = 0; j < tj; j++) lf[j] = float_of((uint32_t)((const uint16_t *)lfc)[at + j] << 16);
}

/* One token's codes over a tile, OR-ed into the words at `shift` (quant.quantize_tokens): y >= 0
 * by construction, so truncation is the floor; the clamps guard the top code and send NaN to 0
 * (its group's lo is NaN, so it rebuilds NaN anyway). One loop per case (LFC or not, noise or
 * not): a test inside the loop kept it from being vectorized as well. */
#define TOKEN_CODES(H, NOISE)                                                   \
    for (int64_t j = 0; j < tj; j++) {                                          \
        float y = ((H) - lo[j]) * inv[j] + (NOISE);                             \
        y = y > 0.0f ? y : 0.0f;                                                \
        w[j] |= (uint32_t)(int32_t)(y < levels ? y : levels) << shift;          \
    }
static inline void token_codes(const float *row, const float *lf, const float *lo, const float *inv, int64_t tj,
                               float levels, int stochastic, uint32_t e, int shift, uint32_t *w) {
    if (lf == NULL && stochastic) TOKEN_CODES(row[j], hash_uniform(e + (uint32_t)j))
    else if (lf == NULL) TOKEN_CODES(row[j], 0.5f)
    else if (stochastic) TOKEN_CODES(row[j] - lf[j], hash_uniform(e + (uint32_t)j))
    else TOKEN_CODES(row[j] - lf[j], 0.5f)
}

/* Pass 2 for one group's tile: quantize x - LFC with stochastic (or nearest) rounding and pack. */
static void tile_codes(const Shape *s, const float *x, int64_t t0, int64_t gt, int64_t j0, int64_t tj,
                       const void *lfc, const float *lo, const float *inv, void *codes, int stochastic,
                       uint32_t seed) {
    Codes layout = code_layout(gt, s->bits);
    const float levels = (float)((1 << s->bits) - 1);
    /* the tokens of one word lie in different blocks: their LFC is converted once per block here */
    float held[LFC_BLOCKS * TILE];
    int64_t blocks = (gt + s->block - 1) / s->block;
    int is_held = s->lfc_kind != LFC_NONE && blocks <= LFC_BLOCKS;
    for (int64_t b = 0; is_held && b < blocks; b++) tile_lfc(s, lfc, t0 + b * s->block, j0, tj, held + b * TILE);
    for (int64_t u = 0; u < layout.rows; u++) {
        uint32_t w[TILE] = {0};
        float own[TILE], buf[TILE];
        for (int i = 0; i < layout.per && u + i * layout.rows < gt; i++) {
            int64_t tt = t0 + u + i * layout.rows;
            float *lf = is_held ? held + block_of(s, tt - t0) * TILE : own;
            if (!is_held && s->lfc_kind != LFC_NONE) tile_lfc(s, lfc, tt, j0, tj, lf);
            uint32_t e = (uint32_t)(tt * s->c + j0) + seed; /* element index + seed, modulo 2**32 */
            token_codes(token_row(s, x, tt, j0, tj, buf), s->lfc_kind == LFC_NONE ? NULL : lf, lo, inv, tj, levels,
                        stochastic, e, i * s->bits, w);
        }
        if (layout.word32) {
            uint32_t *out = (uint32_t *)codes + u * s->c + j0;
            for (int64_t j = 0; j < tj; j++) out[j] = w[j];
        } else {
            uint8_t *out = (uint8_t *)codes + u * s->c + j0;
            for (int64_t j = 0; j < tj; j++) out[j] = (uint8_t)w[j];
        }
    }
}

/* The first byte of group g's codes: the full groups come first, each `rows` rows of C words. */
static inline int64_t group_offset(const Shape *s, int64_t g) {
    Codes full = code_layout(s->group, s->bits);
    return g * full.rows * s->c * (full.word32 ? 4 : 1);
}

static void encode_tile(const Shape *s, const float *x, int64_t g, int64_t j0, void *lfc, uint16_t *lo_bits,
                        uint16_t *scale_bits, uint8_t *codes, int stochastic, uint32_t seed, float *absmax,
                        int64_t tiles) {
    int64_t t0 = g * s->group, gt = s->n - t0 < s->group ? s->n - t0 : s->group;
    int64_t tj = s->c - j0 < TILE ? s->c - j0 : TILE;
    float mn[TILE], mx[TILE], lo[TILE], inv[TILE];
    tile_ranges(s, x, t0, gt, j0, tj, lfc, mn, mx, absmax, tiles);
    const float per_level = (float)(1.0 / (double)((1 << s->bits) - 1));
    for (int64_t j = 0; j < tj; j++) { /* quant.token_stats: every value lies in [lo, lo + levels * scale] */
        float l = bf16_directed(mn[j], 1);
        float step = bf16_directed((mx[j] - l) * per_level, 0);
        lo[j] = l;
        inv[j] = step > 0.0f ? 1.0f / step : 0.0f;
        lo_bits[g * s->c + j0 + j] = (uint16_t)(bits_of(l) >> 16);
        scale_bits[g * s->c + j0 + j] = (uint16_t)(bits_of(step) >> 16);
    }
    tile_codes(s, x, t0, gt, j0, tj, lfc, lo, inv, codes + group_offset(s, g), stochastic, seed);
}

/* Channels per encode work item: the width of each token's partial max |x| (hfd_encode_tokens' absmax). */
int64_t hfd_encode_tile(void) { return TILE; }

/* x: (M*T, C) float32; lfc: (M*Tp / block, C) or NULL; lo, scale: (groups, C) bf16 bits; codes:
 * the full groups' then the last group's words (quant.packed.code_bytes); row_scale: (M*T,) or NULL;
 * absmax: (M*T, ceil(C / TILE)) float32, each token's max |x| per tile of channels, or NULL.
 * Returns 0, or -1 where the row map could not be allocated (nothing written). */
int hfd_encode_tokens(const float *x, int64_t m, int64_t t, int64_t c, int64_t block, int64_t group, int bits,
                      int lfc_kind, void *lfc, uint16_t *lo, uint16_t *scale, uint8_t *codes, int stochastic,
                      uint32_t seed, const float *row_scale, float *absmax, int threads) {
    int64_t *row_map;
    Shape s;
    if (make_shape(m, t, c, block, group, bits, lfc_kind, 0, row_scale, &row_map, &s)) return -1;
    int64_t groups = (s.n + group - 1) / group, tiles = (c + TILE - 1) / TILE;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < groups * tiles; item++)
        encode_tile(&s, x, item / tiles, item % tiles * TILE, lfc, lo, scale, codes, stochastic, seed, absmax, tiles);
    free(row_map);
    return 0;
}

/* ----------------------------------------------------------------------------- decode */
/* Rebuilds group g's tokens over the channels j0 .. j0 + DECODE_TILE: row r, channel j of the tensor
 * go to out[(r - r0) * ld + j - j0] (the whole tensor: ld = C, r0 = 0; one tile: its own buffer). */
static void decode_tile(const Shape *s, float *out, int64_t ld, int64_t r0, int64_t g, int64_t j0, const void *lfc,
                        const uint16_t *lo_bits, const uint16_t *scale_bits, const uint8_t *codes) {
    int64_t t0 = g * s->group, gt = s->n - t0 < s->group ? s->n - t0 : s->group, C = s->c;
    int64_t tj = C - j0 < DECODE_TILE ? C - j0 : DECODE_TILE;
    Codes layout = code_layout(gt, s->bits);
    const uint8_t *group_codes = codes + group_offset(s, g);
    uint32_t mask = (1u << s->bits) - 1;
    float lo[DECODE_TILE], step[DECODE_TILE], lf[DECODE_TILE];
    for (int64_t j = 0; j < tj; j++) {
        lo[j] = float_of((uint32_t)lo_bits[g * C + j0 + j] << 16);
        step[j] = float_of((uint32_t)scale_bits[g * C + j0 + j] << 16);
    }
    for (int64_t u = 0; u < layout.rows; u++) {
        uint32_t w[DECODE_TILE];
        if (layout.word32)
            for (int64_t j = 0; j < tj; j++) w[j] = ((const uint32_t *)group_codes)[u * C + j0 + j];
        else
            for (int64_t j = 0; j < tj; j++) w[j] = group_codes[u * C + j0 + j];
        for (int i = 0; i < layout.per && u + i * layout.rows < gt; i++) {
            int64_t tt = t0 + u + i * layout.rows, r = row_of(s, tt);
            if (r < 0) continue; /* a padding token: not part of the tensor */
            float *row = out + (r - r0) * ld;
            int shift = i * s->bits;
            /* quant.decode_tokens: (lo + LFC) + code * scale; the product is exact (<= 16 bits) */
            if (s->lfc_kind == LFC_NONE) {
                for (int64_t j = 0; j < tj; j++) row[j] = lo[j] + (float)((w[j] >> shift) & mask) * step[j];
            } else {
                tile_lfc(s, lfc, tt, j0, tj, lf);
                for (int64_t j = 0; j < tj; j++) row[j] = (lo[j] + lf[j]) + (float)((w[j] >> shift) & mask) * step[j];
            }
            if (s->row_scale != NULL) { /* rounded once more, as r * scale after the decode */
                float m = s->row_scale[r];
                for (int64_t j = 0; j < tj; j++) row[j] = row[j] * m;
            }
        }
    }
}

/* out: (M*T, C) float32, the padding tokens left out; the other arguments and the result as hfd_encode_tokens'. */
int hfd_decode_tokens(float *out, int64_t m, int64_t t, int64_t c, int64_t block, int64_t group, int bits,
                      int lfc_kind, const void *lfc, const uint16_t *lo, const uint16_t *scale,
                      const uint8_t *codes, const float *row_scale, int threads) {
    int64_t *row_map;
    Shape s;
    if (make_shape(m, t, c, block, group, bits, lfc_kind, 1, row_scale, &row_map, &s)) return -1;
    int64_t groups = (s.n + group - 1) / group, tiles = (c + DECODE_TILE - 1) / DECODE_TILE;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < groups * tiles; item++)
        decode_tile(&s, out + item % tiles * DECODE_TILE, c, 0, item / tiles, item % tiles * DECODE_TILE, lfc, lo,
                    scale, codes);
    free(row_map);
    return 0;
}

/* ----------------------------------------------------------------------------- SiLU-gated product */
/* e^x in float32 (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5
 * polynomial for e^r), in plain arithmetic so the loops below vectorize (libm's expf does not
 * without -ffast-math). 2^n is applied as two factors so that n in [-150, 128] stays normal in each;
 * inf above 88.73, 0 below -104, NaN kept; tests/test_gated.py bounds what the kernel computes with it. */
static inline float exp_f32(float x) {
    float xc = x > 88.75f ? 88.75f : (x < -104.0f ? -104.0f : x);
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    int32_t k = (int32_t)n, k1 = k / 2, k2 = k - k1;
    y = y * float_of((uint32_t)(k1 + 127) << 23) * float_of((uint32_t)(k2 + 127) << 23);
    y = x > 88.7228394f ? INFINITY : y;
    y = x < -103.9720840f ? 0.0f : y;
    return x != x ? x : y;
}

/* One operand of the gated product as compressed (compressor.Packed, token groups, block 1): codes,
 * lo, scale, bits, and its outlier tokens: slot[r] the row of `rows` (C floats) holding token r exactly, -1 none */
typedef struct { const uint8_t *codes; const uint16_t *lo, *scale; int bits; const int32_t *slot; const float *rows; } Operand;

/* Operand `o`'s group g over channels j0 .. j0 + tj into buf (rows of DECODE_TILE floats), exact rows put back */
static void operand_tile(const Shape *s, const Operand *o, int64_t g, int64_t j0, int64_t tj, float *buf) {
    Shape so = *s;
    so.bits = o->bits;
    int64_t t0 = g * s->group, gt = s->n - t0 < s->group ? s->n - t0 : s->group;
    decode_tile(&so, buf, DECODE_TILE, t0, g, j0, NULL, o->lo, o->scale, o->codes);
    if (o->slot == NULL) return;
    for (int64_t i = 0; i < gt; i++)
        if (o->slot[t0 + i] >= 0) memcpy(buf + i * DECODE_TILE, o->rows + o->slot[t0 + i] * s->c + j0, tj * sizeof(float));
}

/* silu(gate) * up and its gradients from gate and up as compressed, without writing either out
 * (ops.GatedFn; docs/DESIGN.md, "Gated MLP"). ATen's formulas: silu(x) = x / (1 + e^-x); with
 * s = 1 / (1 + e^-x), silu'(x) dy = dy * s * (1 + x * (1 - s)). grad NULL: h = silu(gate) * up into
 * out_h (the down projection's input); else d_gate = silu'(gate) * (grad * up) and d_up = grad * silu(gate).
 * Tensors (n, c) float32, tokens in groups of `group` (block 1: no LFC, no padding). Returns 0, or -1
 * where its buffers could not be allocated (nothing written). */
int hfd_silu_gated(int64_t n, int64_t c, int64_t group, const uint8_t *g_codes, const uint16_t *g_lo,
                    const uint16_t *g_scale, int g_bits, const int32_t *g_slot, const float *g_rows,
                    const uint8_t *u_codes, const uint16_t *u_lo, const uint16_t *u_scale, int u_bits,
                    const int32_t *u_slot, const float *u_rows, const float *grad, float *out_h, float *out_dg,
                    float *out_du, int threads) {
    Shape s = {n, c, 1, group, g_bits, LFC_NONE, 0, NULL, NULL};
    Operand gate = {g_codes, g_lo, g_scale, g_bits, g_slot, g_rows}, up = {u_codes, u_lo, u_scale, u_bits, u_slot, u_rows};
    int64_t groups = (n + group - 1) / group, tiles = (c + DECODE_TILE - 1) / DECODE_TILE;
    float *bufs = alloc(sizeof(float) * 2 * group * DECODE_TILE * threads);
    if (bufs == NULL) return -1;
    #pragma omp parallel num_threads(threads)
    {
        float *gbuf = bufs + 2 * group * DECODE_TILE * omp_get_thread_num(), *ubuf = gbuf + group * DECODE_TILE;
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < groups * tiles; item++) {
            int64_t g = item / tiles, j0 = item % tiles * DECODE_TILE, t0 = g * group;
            int64_t gt = n - t0 < group ? n - t0 : group, tj = c - j0 < DECODE_TILE ? c - j0 : DECODE_TILE;
            operand_tile(&s, &gate, g, j0, tj, gbuf);
            operand_tile(&s, &up, g, j0, tj, ubuf);
            for (int64_t i = 0; i < gt; i++) {
                const float *x = gbuf + i * DECODE_TILE, *u = ubuf + i * DECODE_TILE;
                int64_t at = (t0 + i) * c + j0;
                if (grad == NULL) {
                    for (int64_t j = 0; j < tj; j++) out_h[at + j] = x[j] / (1.0f + exp_f32(-x[j])) * u[j];
                    continue;
                }
                for (int64_t j = 0; j < tj; j++) {
                    float e = 1.0f + exp_f32(-x[j]), sg = 1.0f / e, dy = grad[at + j];
                    out_du[at + j] = dy * (x[j] / e);
                    out_dg[at + j] = (dy * u[j]) * sg * (1.0f + x[j] * (1.0f - sg));
                }
            }
        }
    }
    free(bufs);
    return 0;
}

/* ----------------------------------------------------------------------------- rotary embedding */
/* Transformers' apply_rotary_pos_emb on one tensor, x * cos + rotate_half(x) * sin with
 * rotate_half(x) = cat(-x2, x1) (x1, x2 the halves of the last axis), and its gradient, the transposed
 * map: dx = g * cos + cat(g2 * s2, -(g1 * s1)). Each product and the one sum are rounded on their own,
 * as ATen's mul, mul and add round them, so the values are ATen's (a + (-b) is a - b in IEEE
 * arithmetic); the gradient adds no zero-filled slices (hf_division/rotary.py). x, out: (b, h, t, e)
 * with strides xs / os for the first three axes and 1 for the last; cos, sin: (b or 1, t, e) with
 * strides cs (batch, token) and 1, broadcast over h. */
void hfd_rotary(const float *x, int64_t xs_b, int64_t xs_h, int64_t xs_t, const float *cs, const float *sn,
                int64_t cs_b, int64_t cs_t, float *out, int64_t os_b, int64_t os_h, int64_t os_t, int64_t b,
                int64_t h, int64_t t, int64_t e, int backward, int threads) {
    const int64_t half = e / 2;
    #pragma omp parallel for num_threads(threads) collapse(3) schedule(static)
    for (int64_t i = 0; i < b; i++)
        for (int64_t k = 0; k < h; k++)
            for (int64_t r = 0; r < t; r++) {
                const float *restrict v = x + i * xs_b + k * xs_h + r * xs_t;
                const float *restrict c = cs + i * cs_b + r * cs_t, *restrict s = sn + i * cs_b + r * cs_t;
                float *restrict o = out + i * os_b + k * os_h + r * os_t;
                if (backward) {
                    for (int64_t j = 0; j < half; j++) o[j] = v[j] * c[j] + v[j + half] * s[j + half];
                    for (int64_t j = 0; j < half; j++) o[j + half] = v[j + half] * c[j + half] - v[j] * s[j];
                } else {
                    for (int64_t j = 0; j < half; j++) o[j] = v[j] * c[j] - v[j + half] * s[j];
                    for (int64_t j = 0; j < half; j++) o[j + half] = v[j + half] * c[j + half] + v[j] * s[j + half];
                }
            }
}

/* ----------------------------------------------------------------------------- outlier search */
/* quant.outlier_candidates' score: per token of n tokens of c channels, max |x| (NaN where the token
 * has a NaN, as torch.maximum(amax, -amin) gives it). One pass: ATen's amax and amin over a short
 * channel axis (64 for an attention head) cost two passes and more than the encode itself. */
void hfd_token_absmax(const float *x, int64_t n, int64_t c, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t tt = 0; tt < n; tt++) out[tt] = row_absmax(x + tt * c, c);
}

/* ----------------------------------------------------------------------------- mask bits */
/* quant.pack_mask: bit k of byte b (least significant first) says whether element 8b + k has any
 * bit set (a float 0/1 draw, a dropout noise tensor, a bool mask), for n elements of `size` bytes. */
#define PACK_NONZERO(T)                                                                   \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                     \
    for (int64_t b = 0; b < full; b++) {                                                  \
        const T *e = (const T *)src + 8 * b;                                              \
        uint32_t byte = 0;                                                                \
        for (int k = 0; k < 8; k++) byte |= (uint32_t)(e[k] != 0) << k;                   \
        bits[b] = (uint8_t)byte;                                                          \
    }

void hfd_pack_nonzero(const void *src, int64_t n, int size, uint8_t *bits, int threads) {
    int64_t full = n / 8;
    if (size == 1) { PACK_NONZERO(uint8_t) }
    else if (size == 2) { PACK_NONZERO(uint16_t) }
    else if (size == 4) { PACK_NONZERO(uint32_t) }
    else { PACK_NONZERO(uint64_t) }
    if (n % 8) {
        uint32_t byte = 0;
        for (int64_t i = full * 8; i < n; i++) {
            const uint8_t *e = (const uint8_t *)src + i * size;
            int set = 0;
            for (int k = 0; k < size; k++) set |= e[k] != 0;
            byte |= (uint32_t)set << (i - full * 8);
        }
        bits[full] = (uint8_t)byte;
    }
}

/* out = grad * keep, keep being `value` where the bit is set and 0 elsewhere, in float32: the
 * backward of dropout (grad times the forward's noise tensor), the same products as the tensor code */
void hfd_masked_scale(const float *grad, const uint8_t *bits, float value, float *out, int64_t n, int threads) {
    int64_t full = n / 8;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < full; b++) {
        uint32_t byte = bits[b];
        for (int k = 0; k < 8; k++) out[8 * b + k] = grad[8 * b + k] * ((byte >> k) & 1u ? value : 0.0f);
    }
    for (int64_t i = full * 8; i < n; i++) out[i] = grad[i] * ((bits[full] >> (i - full * 8)) & 1u ? value : 0.0f);
}

/* ---- dropout's Bernoulli draws, as bits --------------------------------------------------------
 * torch.Tensor.bernoulli_(p) with a float p on the CPU (dropout's mask) draws one element at a time
 * from the default generator, a mt19937 engine, under its lock: about 8 ns per element on one core
 * whatever the thread count (docs/DESIGN.md, "Dropout draws"). This is the same draw written out:
 * per element two 32-bit words (high, low), their 53 low bits r, kept where r * 2^-53 < p, i.e.
 * r < ceil(p * 2^53); the engine's state is read from and written back to the generator's
 * serialized state (torch.get_rng_state's layout), so the masks and the stream after them are
 * ATen's own. hf_division/native.py checks the equality against ATen once per process. */
#define MT_N 624
#define MT_M 397

static inline uint32_t mt_twist1(uint32_t u, uint32_t v) {
    return ((((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u));
}

static void mt_next_state(uint32_t *s) {
    for (int i = 0; i < MT_N - MT_M; i++) s[i] = s[i + MT_M] ^ mt_twist1(s[i], s[i + 1]);
    for (int i = MT_N - MT_M; i < MT_N - 1; i++) s[i] = s[i + MT_M - MT_N] ^ mt_twist1(s[i], s[i + 1]);
    s[MT_N - 1] = s[MT_M - 1] ^ mt_twist1(s[MT_N - 1], s[0]);
}

static inline uint32_t mt_temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

typedef struct { uint32_t s[MT_N]; int32_t left; uint32_t next; } mt_engine;

/* the engine's next `count` outputs, as ATen's operator() gives them one by one: a call that
 * brings `left` to 0 regenerates the state and returns its first word, leaving left = N */
static void mt_words(mt_engine *e, uint32_t *out, int64_t count) {
    while (count > 0) {
        if (e->left <= 1) {
            mt_next_state(e->s);
            e->left = MT_N;
            e->next = 0;
            *out++ = mt_temper(e->s[e->next++]);
            count--;
            continue;
        }
        int64_t take = e->left - 1 < count ? e->left - 1 : count;
        for (int64_t j = 0; j < take; j++) out[j] = mt_temper(e->s[e->next + j]);
        e->next += (uint32_t)take;
        e->left -= (int32_t)take;
        out += take;
        count -= take;
    }
}

/* state: the generator's 624 state words (uint64 each, as serialized), left (int32) and next
 * (uint64), updated in place; bits: ceil(n / 8) bytes, element i in bit i % 8 of byte i / 8 */
void hfd_bernoulli_bits(uint64_t *state, int32_t *left, uint64_t *next, double p, int64_t n, uint8_t *bits) {
    mt_engine e;
    for (int i = 0; i < MT_N; i++) e.s[i] = (uint32_t)state[i];
    e.left = *left;
    e.next = (uint32_t)*next;
    const uint64_t threshold = (uint64_t)ceil(p * 9007199254740992.0); /* p * 2^53 */
    const uint64_t low53 = (UINT64_C(1) << 53) - 1;
    uint32_t w[2 * 512];
    for (int64_t start = 0; start < n; start += 512) {
        int64_t count = n - start < 512 ? n - start : 512;
        mt_words(&e, w, 2 * count);
        for (int64_t b = 0; b < (count + 7) / 8; b++) {
            uint32_t byte = 0;
            for (int k = 0; k < 8 && 8 * b + k < count; k++) {
                uint64_t r = (((uint64_t)w[2 * (8 * b + k)] << 32) | w[2 * (8 * b + k) + 1]) & low53;
                byte |= (uint32_t)(r < threshold) << k;
            }
            bits[start / 8 + b] = (uint8_t)byte;
        }
    }
    for (int i = 0; i < MT_N; i++) state[i] = e.s[i];
    *left = e.left;
    *next = e.next;
}
