// bfloat16 GEMM: out[r, c] = sum_i x[r, i] * w[c, i] (+ bias[c]), x and w bfloat16, the sums
// float32, the result float32 or rounded to bfloat16 (to nearest even) once at the end.
// oneDNN's bfloat16 GEMM (through torch) rounds its output to bfloat16, 8 significant bits; the
// logits layer of a bfloat16 model runs here with float32 output instead, so near-tied logits
// keep their order (float32 output, as llama.cpp's matmuls give). On a CPU with AMX-BF16 every
// linear of a bfloat16 model runs here (models/layers/bf16_gemm_linear.py).
//
// Each row's sums come out of the same instructions in the same order whatever the row count:
// the path (AMX tiles or vector FMAs) depends on the CPU and k, never on the rows, and threads
// split output columns. So a row's result is the same bits in a GEMM of any size, and
// --batch-invariant needs no fixed-size slices for these layers.
//
// w is packed once (models/layers/bf16_gemm_linear.py pack) in AVX512-BF16's VDPBF16PS layout:
// blocks of 16 output columns, and in each block, for every pair of inputs (2i, 2i + 1), the 16
// columns' two weights side by side in one 32-bit lane (lower input in the low half). k is padded
// to even and n to a multiple of 16 with zeros. Each block (16 x k weights) serves every row while
// it is in cache; threads split the blocks. Without AVX512-BF16 the same layout is widened to
// float32 (a bfloat16 is the top half of a float32) and multiplied with FMAs.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "dtypes.h"
#include "parallel.h"
#include "simd.h"

typedef struct {
    const uint16_t *x;  // [rows][2 * k2]: k padded to even
    const uint16_t *tail;  // AMX: rows [tail_row, rows) padded with zero rows to 16 (or NULL)
    int64_t tail_row;
    const uint32_t *w;  // packed: [ceil(n / 16)][k2][16]
    const float *bias;  // [n] or NULL
    void *out;          // [rows][n] float32, or bfloat16 with out_bf16
    int64_t rows, n, k2, blocks;
    int parts, out_bf16;
    int amx;  // multiplied by AMX tiles (amx_blocks), else by vector FMAs (gemm_blocks)
} Bf16Gemm;

// The pair (x[2j], x[2j + 1]) of row r as one 32-bit lane.
SIMD_INLINE uint32_t x_pair(const Bf16Gemm *a, int64_t r, int64_t j) {
    uint32_t pair;
    memcpy(&pair, a->x + r * 2 * a->k2 + 2 * j, 4);
    return pair;
}

// Row r's sums for columns [c, c + count) (count <= 16): the bias added, stored as the output's type.
static void store_sums(const Bf16Gemm *a, int64_t r, int64_t c, const float *sums, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        const float v = sums[i] + (a->bias ? a->bias[c + i] : 0.f);
        if (a->out_bf16) ((uint16_t *)a->out)[r * a->n + c + i] = bf16_bits(v);
        else ((float *)a->out)[r * a->n + c + i] = v;
    }
}

// Columns a block; rows and blocks a micro-tile (its accumulators fit the vector registers:
// 24 of 32 zmm with AVX512-BF16, 16 with AVX-512's FMAs, 8 of 16 ymm with AVX2).
#if defined(__AVX512BF16__)
#define TILE_ROWS 6
enum { BF16_DOT = 1, CB = 16, RB = TILE_ROWS, BB = 4 };

// Row r's 16 sums for columns [c, c + 16) (fewer past n): store_sums in vector registers.
SIMD_INLINE void store16(const Bf16Gemm *a, int64_t r, int64_t c, __m512 v) {
    const __mmask16 m = c + CB <= a->n ? (__mmask16)0xffff : (__mmask16)((1u << (a->n - c)) - 1);
    if (a->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, a->bias + c));
    if (a->out_bf16)  // VCVTNEPS2BF16: to nearest even, as bf16_bits (denormals flushed)
        _mm256_mask_storeu_epi16((uint16_t *)a->out + r * a->n + c, m, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float *)a->out + r * a->n + c, m, v);
}
// R rows x B blocks of 16 columns: R * B accumulators of VDPBF16PS.
SIMD_INLINE void tile(const Bf16Gemm *a, int64_t r0, int R, int64_t b0, int B) {
    __m512 acc[RB][BB];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    const uint32_t *w = a->w + b0 * a->k2 * CB;
    for (int64_t j = 0; j < a->k2; j++) {
        __m512bh wv[BB];
        for (int b = 0; b < B; b++)
            wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * a->k2 + j) * CB);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x_pair(a, r0 + r, j));
            for (int b = 0; b < B; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) store16(a, r0 + r, (b0 + b) * CB, acc[r][b]);
}
#else
#define TILE_ROWS 4
enum { BF16_DOT = 0, CB = 16, RB = TILE_ROWS, BB = VW == 16 ? 4 : 1 };
enum { VB = CB / VW };  // vectors a block of 16 columns

// R rows x B blocks: widened weights, two FMAs per pair of inputs.
SIMD_INLINE void tile(const Bf16Gemm *a, int64_t r0, int R, int64_t b0, int B) {
    vf acc[RB][BB][VB];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            for (int v = 0; v < VB; v++) acc[r][b][v] = vzero();
    const uint32_t *w = a->w + b0 * a->k2 * CB;
    for (int64_t j = 0; j < a->k2; j++) {
        vf xlo[RB], xhi[RB];
        for (int r = 0; r < R; r++) {
            const uint32_t pair = x_pair(a, r0 + r, j);
            xlo[r] = vset1(pair_lo(pair));
            xhi[r] = vset1(pair_hi(pair));
        }
        for (int b = 0; b < B; b++)
            for (int v = 0; v < VB; v++) {
                const uint32_t *p = w + (b * a->k2 + j) * CB + v * VW;
                const vf wlo = vpair_lo(p), whi = vpair_hi(p);
                for (int r = 0; r < R; r++)
                    acc[r][b][v] = vfma(xhi[r], whi, vfma(xlo[r], wlo, acc[r][b][v]));
            }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            for (int v = 0; v < VB; v++) {
                const int64_t c = (b0 + b) * CB + v * VW;
                if (c >= a->n) continue;
                float tmp[VW];
                vstore(tmp, acc[r][b][v]);
                store_sums(a, r0 + r, c, tmp, c + VW <= a->n ? VW : a->n - c);
            }
}
#endif

// R rows of a group of BB blocks with R a constant (the accumulators stay in registers).
static void tile_rows(const Bf16Gemm *a, int64_t r, int R, int64_t b) {
    switch (R) {
        case 1: tile(a, r, 1, b, BB); break;
        case 2: tile(a, r, 2, b, BB); break;
        case 3: tile(a, r, 3, b, BB); break;
#if TILE_ROWS > 4
        case 4: tile(a, r, 4, b, BB); break;
        case 5: tile(a, r, 5, b, BB); break;
#endif
        default: tile(a, r, RB, b, BB); break;
    }
}

// Every row of blocks [b0, b1): a group of BB blocks at a time, all rows over it (RB at a time).
static void gemm_blocks(const Bf16Gemm *a, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += BB) {
        const int B = b1 - b < BB ? (int)(b1 - b) : BB;
        for (int64_t r = 0; r < a->rows; r += RB) {
            const int R = a->rows - r < RB ? (int)(a->rows - r) : RB;
            if (B == BB) tile_rows(a, r, R, b);
            else tile(a, r, R, b, B);  // a part's last blocks
        }
    }
}

#if HAS_AMX
// ---- AMX-BF16 tiles (TDPBF16PS: a 16 x 32 by 32 x 16 bfloat16 product into 16 x 16 float32) ---
//
// The packed layout is already AMX's B operand: for a block of 16 columns and 16 input pairs,
// 16 rows of 64 bytes (the pairs) of 16 columns' two weights, contiguous. x (rows of k2 pairs,
// the last rows past a multiple of 16 copied into 16 zero-padded ones) is the A operand straight
// from memory. Each call computes
// 32 rows x 32 columns in four accumulator tiles (tmm0-3) from two A tiles (tmm4-5) and two B
// tiles (tmm6-7): eight tiles, all the registers there are. Used wherever k is a multiple of 32,
// at any row count (a decode step's few rows are padded to 16: the weights' bandwidth, not the
// tiles, bounds it). Only the tail is copied: padding all of x (calloc of a few hundred KB, so
// fresh pages from mmap each call) made a 131-row step 0.78x oneDNN.

// Accumulator tile t (rows r, columns of block b) to out: straight when it lies inside, else
// through a buffer cut to the rows and columns there are.
#define AMX_STORE(t, r, b)                                                                      \
    do {                                                                                        \
        const int64_t c = (b) * CB;                                                             \
        if ((b) < a->blocks && (r) < a->rows) {                                                 \
            if ((r) + 16 <= a->rows && c + CB <= a->n && !a->bias && !a->out_bf16) {            \
                _tile_stored(t, (float *)a->out + (r) * a->n + c, a->n * 4);                    \
            } else {                                                                            \
                float buf[16 * 16];                                                             \
                _tile_stored(t, buf, 64);                                                       \
                for (int64_t i = 0; i < 16 && (r) + i < a->rows; i++)                           \
                    store16(a, (r) + i, c, _mm512_loadu_ps(buf + i * 16));                      \
            }                                                                                   \
        }                                                                                       \
    } while (0)

// Rows [r, r + 32) (the second 16 only if two_rows) by blocks b and b + 1 (b + 1 may be past the
// last block: its tiles then repeat block b's and are not stored).
static void amx_tile(const Bf16Gemm *a, int64_t r, int two_rows, int64_t b) {
    const int64_t xs = a->k2 * 4;  // bytes a row of x
    const char *x0 = r >= a->tail_row ? (const char *)a->tail : (const char *)a->x + r * xs;
    const char *x1 = r + 16 >= a->tail_row ? (const char *)a->tail : x0 + 16 * xs;
    const uint32_t *w0 = a->w + b * a->k2 * CB;
    const uint32_t *w1 = b + 1 < a->blocks ? w0 + a->k2 * CB : w0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < a->k2; j += 16) {
        _tile_loadd(4, x0 + j * 4, xs);
        _tile_loadd(6, w0 + j * CB, 64);
        _tile_loadd(7, w1 + j * CB, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two_rows) {
            _tile_loadd(5, x1 + j * 4, xs);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    AMX_STORE(0, r, b);
    AMX_STORE(1, r, b + 1);
    if (two_rows) {
        AMX_STORE(2, r + 16, b);
        AMX_STORE(3, r + 16, b + 1);
    }
}

// Blocks [b0, b1) of every row: the rows in equal chunks of at most 2 * AMX_CHUNK_ROWS (amx.h;
// bfloat16 rows are twice int8's bytes), and over a chunk a pair of blocks at a time, in strips of
// 32 rows.
static void amx_blocks(const Bf16Gemm *a, int64_t b0, int64_t b1) {
    amx_configure();
    const int64_t chunk = amx_chunk(a->rows, 2 * AMX_CHUNK_ROWS);
    for (int64_t r0 = 0; r0 < a->rows; r0 += chunk) {
        const int64_t r1 = r0 + chunk < a->rows ? r0 + chunk : a->rows;
        for (int64_t b = b0; b < b1; b += 2)
            for (int64_t r = r0; r < r1; r += 32) amx_tile(a, r, r + 16 < r1, b);
    }
    _tile_release();
}
#else
static void amx_blocks(const Bf16Gemm *a, int64_t b0, int64_t b1) { (void)a; (void)b0; (void)b1; }
#endif

// Whether bf16_gemm multiplies with AMX tiles here (built in, and allowed by the OS).
int bf16_gemm_amx(void) { return HAS_AMX && amx_permitted(); }

static void gemm_part(const void *arg, int i) {
    const Bf16Gemm *a = (const Bf16Gemm *)arg;
    if (a->amx) {  // parts split pairs of blocks, so each pair is one thread's
        const int64_t pairs = (a->blocks + 1) / 2;
        amx_blocks(a, 2 * (pairs * i / a->parts), 2 * (pairs * (i + 1) / a->parts));
    } else {
        gemm_blocks(a, a->blocks * i / a->parts, a->blocks * (i + 1) / a->parts);
    }
}

int bf16_gemm_dot(void) { return BF16_DOT; }

// out [rows, n] (float32, or bfloat16 with out_bf16) = x [rows, k] bfloat16 . w [n, k]^T + bias
// (float32 [n] or NULL), w packed by bf16_gemm_linear.pack.
void bf16_gemm(const uint16_t *x, const uint32_t *packed, const float *bias, void *out,
               int64_t rows, int64_t n, int64_t k, int out_bf16, int threads) {
    const int64_t k2 = (k + 1) / 2;
    // AMX reads x in strips of 16 rows and 32 inputs: rows padded to 16, k a multiple of 32. The
    // choice must not depend on the rows (the row-invariance above).
    const int amx = k % 32 == 0 && bf16_gemm_amx();
    const int64_t tail_row = amx ? rows / 16 * 16 : rows;
    uint16_t *padded = NULL, *tail = NULL;
    if (k % 2) {  // the vector path's rows with a zero after an odd k
        padded = (uint16_t *)calloc((size_t)(rows * 2 * k2), sizeof(uint16_t));
        for (int64_t r = 0; r < rows; r++) memcpy(padded + r * 2 * k2, x + r * k, k * sizeof(uint16_t));
        x = padded;
    }
    if (tail_row < rows) {  // AMX's last rows past a multiple of 16, zero rows after them
        tail = (uint16_t *)calloc((size_t)(16 * 2 * k2), sizeof(uint16_t));
        memcpy(tail, x + tail_row * k, (size_t)((rows - tail_row) * k) * sizeof(uint16_t));
    }
    Bf16Gemm a = {x, tail, tail_row, packed, bias, out, rows, n, k2, (n + CB - 1) / CB, threads,
                  out_bf16, amx};
    const int64_t units = amx ? (a.blocks + 1) / 2 : a.blocks;
    if (a.parts > units) a.parts = (int)units;
    if (rows * n * k < (1 << 18) || a.parts < 1) a.parts = 1;
    if (a.parts == 1) gemm_part(&a, 0);
    else parallel_tasks(gemm_part, &a, a.parts);
    free(padded);
    free(tail);
}
