// W8A8 int8 GEMM on AMX-INT8 tiles (TDPBUSD: unsigned bytes times signed bytes into int32):
// out[r, c] = (float)(sum_i ux[r, i] w[c, i] - 128 wsum[c]) * ws[c], float32, where ux = q + 128
// is a row of activations as quantize_rows(unsigned=True) writes it and wsum[c] = sum_i w[c, i].
// The zero point's share comes out in int32, so every sum is exact, whatever the rows around it
// (the output a row gets does not depend on the batch: --batch-invariant holds by construction).
//
// w is packed (models/quant/int8_amx.py) as AMX's B operand: blocks of 16 output columns, and in
// each, for every 4 inputs, the 16 columns' 4 weights side by side: [n / 16][k / 4][16][4], k a
// multiple of 64 (one tile row), n padded with zero weights. Four accumulator tiles (32 rows x
// 32 columns) from two A tiles and two B tiles, as bf16_gemm.c's tiles.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "parallel.h"

typedef struct {
    const uint8_t *x;     // [rows][k]
    const uint8_t *tail;  // rows [tail_row, rows) padded with zero rows to 16 (or NULL)
    int64_t tail_row;
    const int8_t *w;      // packed [blocks][k / 4][16][4]
    const int32_t *wsum;  // [n]
    const float *ws;      // [n]
    float *out;           // [rows][n]
    int64_t rows, n, k, blocks;
    int parts;
} Int8Gemm;

#if HAS_AMX
static void int8_epilogue(const Int8Gemm *a, const int32_t *buf, int64_t r, int64_t b) {
    const int64_t c = b * 16, nc = a->n - c < 16 ? a->n - c : 16;
    const __mmask16 m = (__mmask16)((1u << nc) - 1);
    const __m512i zero_share = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m, a->wsum + c), 7);
    const __m512 ws = _mm512_maskz_loadu_ps(m, a->ws + c);
    for (int64_t i = 0; i < 16 && r + i < a->rows; i++) {
        const __m512i acc = _mm512_sub_epi32(_mm512_loadu_si512(buf + 16 * i), zero_share);
        _mm512_mask_storeu_ps(a->out + (r + i) * a->n + c, m, _mm512_mul_ps(_mm512_cvtepi32_ps(acc), ws));
    }
}

#define INT8_STORE(t, r, b)                                 \
    do {                                                    \
        if ((b) < a->blocks && (r) < a->rows) {             \
            int32_t buf[16 * 16];                           \
            _tile_stored(t, buf, 64);                       \
            int8_epilogue(a, buf, r, b);                    \
        }                                                   \
    } while (0)

static void int8_tile(const Int8Gemm *a, int64_t r, int two_rows, int64_t b) {
    const int64_t k = a->k;
    const uint8_t *x0 = r >= a->tail_row ? a->tail : a->x + r * k;
    const uint8_t *x1 = r + 16 >= a->tail_row ? a->tail : x0 + 16 * k;
    const int8_t *w0 = a->w + b * k * 16;
    const int8_t *w1 = b + 1 < a->blocks ? w0 + k * 16 : w0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < k; j += 64) {  // 64 inputs: a tile row of x, 16 rows of 4 in w
        _tile_loadd(4, x0 + j, k);
        _tile_loadd(6, w0 + j * 16, 64);
        _tile_loadd(7, w1 + j * 16, 64);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        if (two_rows) {
            _tile_loadd(5, x1 + j, k);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
    }
    INT8_STORE(0, r, b);
    INT8_STORE(1, r, b + 1);
    if (two_rows) {
        INT8_STORE(2, r + 16, b);
        INT8_STORE(3, r + 16, b + 1);
    }
}

// A thread's pairs of blocks, over the rows in equal chunks of at most AMX_CHUNK_ROWS (amx.h).
static void int8_part(const void *arg, int i) {
    const Int8Gemm *a = (const Int8Gemm *)arg;
    const int64_t pairs = (a->blocks + 1) / 2;
    const int64_t b0 = 2 * (pairs * i / a->parts), b1 = 2 * (pairs * (i + 1) / a->parts);
    amx_configure();
    const int64_t chunk = amx_chunk(a->rows, AMX_CHUNK_ROWS);
    for (int64_t r0 = 0; r0 < a->rows; r0 += chunk) {
        const int64_t r1 = r0 + chunk < a->rows ? r0 + chunk : a->rows;
        for (int64_t b = b0; b < b1; b += 2)
            for (int64_t r = r0; r < r1; r += 32) int8_tile(a, r, r + 16 < r1, b);
    }
    _tile_release();
}
#endif

// Whether int8_amx_gemm runs here (built with AMX, and the OS lets this process use the tiles).
int int8_amx(void) { return HAS_AMX && amx_permitted(); }

// out [rows, n] as above from ux [rows, k] uint8 (k % 64 == 0); 0, or -1 where int8_amx() is not.
int int8_amx_gemm(const uint8_t *ux, const int8_t *packed, const int32_t *wsum, const float *ws,
                  float *out, int64_t rows, int64_t n, int64_t k, int threads) {
#if HAS_AMX
    if (!int8_amx() || k % 64) return -1;
    // The tiles read whole strips of 16 rows: the last rows past a multiple of 16 are copied with
    // zero rows after them (only those: a padded copy of every row, from mmap at a few hundred
    // KB, faulted its pages in on every call).
    const int64_t tail_row = rows / 16 * 16;
    uint8_t *tail = NULL;
    if (tail_row < rows) {
        tail = (uint8_t *)calloc((size_t)(16 * k), 1);
        memcpy(tail, ux + tail_row * k, (size_t)((rows - tail_row) * k));
    }
    Int8Gemm a = {ux, tail, tail_row, packed, wsum, ws, out, rows, n, k, (n + 15) / 16, threads};
    const int64_t pairs = (a.blocks + 1) / 2;
    if (a.parts > pairs) a.parts = (int)pairs;
    if (rows * n * k < (1 << 18) || a.parts < 1) a.parts = 1;
    if (a.parts == 1) int8_part(&a, 0);
    else parallel_tasks(int8_part, &a, a.parts);
    free(tail);
    return 0;
#else
    (void)ux; (void)packed; (void)wsum; (void)ws; (void)out; (void)rows; (void)n; (void)k; (void)threads;
    return -1;
#endif
}
