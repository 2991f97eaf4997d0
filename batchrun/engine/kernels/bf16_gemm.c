// bfloat16 GEMM with float32 output: out[r, c] = sum_i x[r, i] * w[c, i], x and w bfloat16, the
// sums and the result float32. oneDNN's bfloat16 GEMM (through torch) rounds its result to
// bfloat16, 8 significant bits; the logits layer of a bfloat16 model runs here instead, so
// near-tied logits keep their order (float32 output, as llama.cpp's matmuls give).
//
// w is packed once (models/bf16_logits.py pack) in AVX512-BF16's VDPBF16PS layout: blocks of 16
// output columns, and in each block, for every pair of inputs (2i, 2i + 1), the 16 columns' two weights
// side by side in one 32-bit lane (lower input in the low half). k is padded to even and n to a
// multiple of 16 with zeros. Each block (16 x k weights) serves every row while it is in cache;
// threads split the blocks. Without AVX512-BF16 the same layout is widened to float32 (a bfloat16
// is the top half of a float32) and multiplied with FMAs.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "dtypes.h"
#include "parallel.h"
#include "simd.h"

typedef struct {
    const uint16_t *x;  // [rows][2 * k2]: k padded to even
    const uint32_t *w;  // packed: [ceil(n / 16)][k2][16]
    float *out;
    int64_t rows, n, k2, blocks;
    int parts;
    int amx;  // multiplied by AMX tiles (amx_blocks), else by vector FMAs (gemm_blocks)
} Bf16Gemm;

// The pair (x[2j], x[2j + 1]) of row r as one 32-bit lane.
SIMD_INLINE uint32_t x_pair(const Bf16Gemm *a, int64_t r, int64_t j) {
    uint32_t pair;
    memcpy(&pair, a->x + r * 2 * a->k2 + 2 * j, 4);
    return pair;
}

// Columns a block; rows and blocks a micro-tile (its accumulators fit the vector registers:
// 24 of 32 zmm with AVX512-BF16, 16 with AVX-512's FMAs, 8 of 16 ymm with AVX2).
#if defined(__AVX512BF16__)
#define TILE_ROWS 6
enum { BF16_DOT = 1, CB = 16, RB = TILE_ROWS, BB = 4 };
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
        for (int b = 0; b < B; b++) {
            const int64_t c = (b0 + b) * CB;
            float *o = a->out + (r0 + r) * a->n + c;
            if (c + CB <= a->n) {
                _mm512_storeu_ps(o, acc[r][b]);
            } else {
                const __mmask16 m = (__mmask16)((1u << (a->n - c)) - 1);
                _mm512_mask_storeu_ps(o, m, acc[r][b]);
            }
        }
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
                float *o = a->out + (r0 + r) * a->n + c;
                if (c + VW <= a->n) {
                    vstore(o, acc[r][b][v]);
                } else {
                    float tmp[VW];
                    vstore(tmp, acc[r][b][v]);
                    for (int64_t i = 0; c + i < a->n; i++) o[i] = tmp[i];
                }
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
// padded to a multiple of 16 rows) is the A operand straight from memory. Each call computes
// 32 rows x 32 columns in four accumulator tiles (tmm0-3) from two A tiles (tmm4-5) and two B
// tiles (tmm6-7): eight tiles, all the registers there are. Used where k is a multiple of 32 and
// there are 8 rows or more (fewer: the padding to 16 costs more than the tiles give).

// Accumulator tile t (rows r, columns of block b) to out: straight when it lies inside, else
// through a buffer cut to the rows and columns there are.
#define AMX_STORE(t, r, b)                                                                      \
    do {                                                                                        \
        const int64_t c = (b) * CB;                                                             \
        if ((b) < a->blocks && (r) < a->rows) {                                                 \
            if ((r) + 16 <= a->rows && c + CB <= a->n) {                                        \
                _tile_stored(t, a->out + (r) * a->n + c, a->n * 4);                             \
            } else {                                                                            \
                float buf[16 * 16];                                                             \
                _tile_stored(t, buf, 64);                                                       \
                for (int64_t i = 0; i < 16 && (r) + i < a->rows; i++)                           \
                    for (int64_t jj = 0; jj < CB && c + jj < a->n; jj++)                        \
                        a->out[((r) + i) * a->n + c + jj] = buf[i * 16 + jj];                  \
            }                                                                                   \
        }                                                                                       \
    } while (0)

// Rows [r, r + 32) (the second 16 only if two_rows) by blocks b and b + 1 (b + 1 may be past the
// last block: its tiles then repeat block b's and are not stored).
static void amx_tile(const Bf16Gemm *a, int64_t r, int two_rows, int64_t b) {
    const int64_t xs = a->k2 * 4;  // bytes a row of x
    const char *x0 = (const char *)a->x + r * xs, *x1 = x0 + 16 * xs;
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

// Blocks [b0, b1) of every row: AMX_CHUNK_ROWS rows at a time (amx.h), and over them a pair of
// blocks at a time, in strips of 32 rows (x's rows padded to 16).
static void amx_blocks(const Bf16Gemm *a, int64_t b0, int64_t b1) {
    amx_configure();
    for (int64_t r0 = 0; r0 < a->rows; r0 += AMX_CHUNK_ROWS) {
        const int64_t r1 = r0 + AMX_CHUNK_ROWS < a->rows ? r0 + AMX_CHUNK_ROWS : a->rows;
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

// out [rows, n] float32 = x [rows, k] bfloat16 . w [n, k]^T, w packed by bf16_logits.pack.
void bf16_gemm(const uint16_t *x, const uint32_t *packed, float *out, int64_t rows, int64_t n,
               int64_t k, int threads) {
    const int64_t k2 = (k + 1) / 2;
    // AMX reads x in strips of 16 rows and 32 inputs: rows padded to 16, k a multiple of 32.
    const int amx = k % 32 == 0 && rows >= 8 && bf16_gemm_amx();  // fewer rows: padding wastes it
    const int64_t padded_rows = amx ? (rows + 15) / 16 * 16 : rows;
    uint16_t *padded = NULL;
    if (k % 2 || padded_rows > rows) {  // rows copied with a zero after an odd k, zero rows after
        padded = (uint16_t *)calloc((size_t)(padded_rows * 2 * k2), sizeof(uint16_t));
        for (int64_t r = 0; r < rows; r++) memcpy(padded + r * 2 * k2, x + r * k, k * sizeof(uint16_t));
        x = padded;
    }
    Bf16Gemm a = {x, packed, out, rows, n, k2, (n + CB - 1) / CB, threads, amx};
    const int64_t units = amx ? (a.blocks + 1) / 2 : a.blocks;
    if (a.parts > units) a.parts = (int)units;
    if (rows * n * k < (1 << 18) || a.parts < 1) a.parts = 1;
    if (a.parts == 1) gemm_part(&a, 0);
    else parallel_tasks(gemm_part, &a, a.parts);
    free(padded);
}
