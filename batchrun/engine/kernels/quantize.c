// Per-token dynamic int8 quantization of activations for the W8A8 linears (models/quant/):
// each row's scale is max|x| / 127 and q = round-half-even(x / scale), as torch.round does;
// and the rescaling of the int8 GEMM's rows by those scales afterwards. One pass over a row
// held in cache instead of PyTorch's five over the whole tensor.
#include <math.h>
#include <stdint.h>

#include "dtypes.h"
#include "parallel.h"
#include "simd.h"

typedef struct {
    const void *x; int8_t *q; float *scales; int64_t cols; int kind; int flip;
    const float *mult; const int64_t *outliers; int64_t n_out; uint16_t *x_out;  // mult..x_out: optional
} QuantRows;
typedef struct {
    float *y; const float *scales; const float *bias; int64_t cols;
    // y += xo @ f, the outlier channels' bfloat16 GEMM over k2 pairs of channels (0: none):
    // xo [rows][k2] and f [k2][cols] hold a pair of bfloat16 per 32-bit lane, lower channel low
    const uint32_t *xo, *f; int64_t k2;
} ScaleRows;
typedef struct { void (*fn)(const void *, int64_t, int64_t); const void *ctx; int64_t rows; int parts; } Split;

static void split_part(const void *arg, int i) {
    const Split *s = (const Split *)arg;
    s->fn(s->ctx, s->rows * i / s->parts, s->rows * (i + 1) / s->parts);
}

static void over_rows(void (*fn)(const void *, int64_t, int64_t), const void *ctx, int64_t rows,
                      int64_t cols, int threads) {
    // below 32K elements a thread team's hand-off costs more than it saves (as elementwise.c);
    // a decode step's activations (~200 rows x 576) took 30% less time on two threads than one
    if (threads < 1 || rows * cols < (1 << 15)) threads = 1;
    if (threads > rows) threads = (int)rows;
    if (threads <= 1) { fn(ctx, 0, rows); return; }
    const Split split = {fn, ctx, rows, threads};
    parallel_tasks(split_part, &split, threads);
}

static void quantize_part(const void *arg, int64_t first, int64_t last) {
    const QuantRows *a = (const QuantRows *)arg;
    const int64_t n = a->cols, out_stride = (a->n_out + 1) / 2 * 2;
    float buf[4096];
    for (int64_t r = first; r < last; r++) {
        uint16_t *xo = a->n_out ? a->x_out + r * out_stride : NULL;
        if (a->n_out % 2) xo[a->n_out] = 0;  // the odd channel's pair partner
        const float *x;
        if ((a->kind == F32 && !a->mult && !a->n_out) || n > 4096) {
            x = (const float *)a->x + r * n;  // (a wider bfloat16 or multiplied row: refused in Python)
        } else {
            const float *xf = (const float *)a->x + r * n;
            if (a->kind == F32) {
                for (int64_t j = 0; j < a->n_out; j++) store_elt(BF16, xo, j, xf[a->outliers[j]]);
#pragma omp simd
                for (int64_t i = 0; i < n; i++) buf[i] = xf[i] * a->mult[i];
            } else {
                for (int64_t i = 0; i < n; i++) buf[i] = load_elt(a->kind, a->x, r * n + i);
                for (int64_t j = 0; j < a->n_out; j++) store_elt(BF16, xo, j, buf[a->outliers[j]]);
                if (a->mult) {
#pragma omp simd
                    for (int64_t i = 0; i < n; i++) buf[i] *= a->mult[i];
                }
            }
            x = buf;
        }
        float amax = 0.f;
#pragma omp simd reduction(max:amax)
        for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float scale = (amax > 1e-12f ? amax : 1e-12f) / 127.f;  // as activations.py
        a->scales[r] = scale;
        int8_t *q = a->q + r * n;
        const int flip = a->flip;  // 0x80 turns a two's complement byte b into the uint8 b + 128
#pragma omp simd
        for (int64_t i = 0; i < n; i++) q[i] = (int8_t)((int)rintf(x[i] / scale) ^ flip);
    }
}

void quantize_rows_int8(const void *x, int8_t *q, float *scales, int64_t rows, int64_t cols,
                        int kind, int threads) {
    const QuantRows a = {x, q, scales, cols, kind, 0, 0, 0, 0, 0};
    over_rows(quantize_part, &a, rows, cols, threads);
}

// As quantize_rows_int8, each value stored as the uint8 q + 128 (zero point 128).
void quantize_rows_u8(const void *x, uint8_t *q, float *scales, int64_t rows, int64_t cols,
                      int kind, int threads) {
    const QuantRows a = {x, (int8_t *)q, scales, cols, kind, 0x80, 0, 0, 0, 0};
    over_rows(quantize_part, &a, rows, cols, threads);
}

// As quantize_rows_u8 of x * mult (per column; mult NULL: 1), after copying the n_out columns
// `outliers` of the unmultiplied x to x_out [rows, n_out rounded up to even] as bfloat16 (to
// nearest even; an odd n_out's last column 0). cols <= 4096.
void quantize_rows_split_u8(const void *x, const float *mult, const int64_t *outliers, int64_t n_out,
                            uint16_t *x_out, uint8_t *q, float *scales, int64_t rows, int64_t cols,
                            int kind, int threads) {
    const QuantRows a = {x, (int8_t *)q, scales, cols, kind, 0x80, mult, outliers, n_out, x_out};
    over_rows(quantize_part, &a, rows, cols, threads);
}

// R rows from r0, columns [c, c + CV * VW): scaled, biased, plus the outliers' products, held in
// R x CV vector registers while each pair row of f is loaded once for the R rows. With
// AVX512-BF16 one VDPBF16PS per pair of channels (both products exact in float32, summed into
// the lane); else the pair widened to float32 and two FMAs.
SIMD_INLINE void outlier_block(const ScaleRows *a, int64_t r0, const int R, int64_t c, const int CV) {
    const int64_t n = a->cols, k2 = a->k2;
    vf acc[4][4];
    for (int i = 0; i < R; i++) {
        const vf s = vset1(a->scales[r0 + i]);
        for (int v = 0; v < CV; v++) {
            const vf y = vmul(vload(a->y + (r0 + i) * n + c + v * VW), s);
            acc[i][v] = a->bias ? vadd(y, vload(a->bias + c + v * VW)) : y;
        }
    }
    for (int64_t j = 0; j < k2; j++) {
        const uint32_t *fj = a->f + j * n + c;
#if defined(__AVX512BF16__)
        __m512bh f[4];
        for (int v = 0; v < CV; v++) f[v] = (__m512bh)_mm512_loadu_si512(fj + v * VW);
        for (int i = 0; i < R; i++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a->xo[(r0 + i) * k2 + j]);
            for (int v = 0; v < CV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], x, f[v]);
        }
#else
        vf lo[4], hi[4];
        for (int v = 0; v < CV; v++) {
            lo[v] = vpair_lo(fj + v * VW);
            hi[v] = vpair_hi(fj + v * VW);
        }
        for (int i = 0; i < R; i++) {
            const uint32_t x = a->xo[(r0 + i) * k2 + j];
            const vf xl = vset1(pair_lo(x)), xh = vset1(pair_hi(x));
            for (int v = 0; v < CV; v++) acc[i][v] = vfma(xh, hi[v], vfma(xl, lo[v], acc[i][v]));
        }
#endif
    }
    for (int i = 0; i < R; i++)
        for (int v = 0; v < CV; v++) vstore(a->y + (r0 + i) * n + c + v * VW, acc[i][v]);
}

SIMD_INLINE void outlier_rows(const ScaleRows *a, int64_t r0, const int R) {
    const int64_t n = a->cols;
    int64_t c = 0;
    for (; c + 4 * VW <= n; c += 4 * VW) outlier_block(a, r0, R, c, 4);
    for (; c + VW <= n; c += VW) outlier_block(a, r0, R, c, 1);
    for (; c < n; c++)  // the last columns of a width that is not a multiple of VW
        for (int i = 0; i < R; i++) {
            float y = a->y[(r0 + i) * n + c] * a->scales[r0 + i] + (a->bias ? a->bias[c] : 0.f);
            for (int64_t j = 0; j < a->k2; j++) {
                const uint32_t x = a->xo[(r0 + i) * a->k2 + j], f = a->f[j * n + c];
                y += pair_lo(x) * pair_lo(f) + pair_hi(x) * pair_hi(f);
            }
            a->y[(r0 + i) * n + c] = y;
        }
}

static void scale_part(const void *arg, int64_t first, int64_t last) {
    const ScaleRows *a = (const ScaleRows *)arg;
    int64_t r = first;
    for (; r + 4 <= last; r += 4) outlier_rows(a, r, 4);
    switch (last - r) {
        case 3: outlier_rows(a, r, 3); break;
        case 2: outlier_rows(a, r, 2); break;
        case 1: outlier_rows(a, r, 1); break;
    }
}

// y[r, :] = y[r, :] * scales[r] (+ bias) (+ xo[r, :] @ f: a smoothed Int8Linear's outlier
// channels, k2 pairs of them in bfloat16 as ScaleRows holds them; k2 0: none), float32 in place,
// one pass over y (models/quant/activations.py rescale_rows).
void scale_rows(float *y, const float *scales, const float *bias, const uint32_t *xo,
                const uint32_t *f, int64_t k2, int64_t rows, int64_t cols, int threads) {
    const ScaleRows a = {y, scales, bias, cols, xo, f, k2};
    over_rows(scale_part, &a, rows, cols * (k2 + 1), threads);
}

// The int8 KV cache's rows (engine/attention/int8_kv.py): each (token, KV head) row of x
// [rows, heads, D] (token r from element r * stride) gets scale = max|x| / 127 (1 for a zero
// row) and q = round-half-even(x * (127 / max|x|)), as int8_kv.quantize_rows computes them
// (reciprocal-math off, so the divisions are the ones written). Stored at slot slots[r] of
// cache [slots, heads, D] with the scale at scales [slots, heads] (cache NULL: not stored);
// rounded [rows, heads, D] float32 gets q * scale, what the cache hands back (NULL: not written).
__attribute__((optimize("no-reciprocal-math")))
static void int8_kv_row(const float *x, int D, int8_t *q, float *scale_out, float *rounded) {
    float amax = 0.f;
#pragma omp simd reduction(max:amax)
    for (int i = 0; i < D; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float scale = amax > 0.f ? amax / 127.f : 1.f, inv = amax > 0.f ? 127.f / amax : 1.f;
    if (q) {
        *scale_out = scale;
#pragma omp simd
        for (int i = 0; i < D; i++) q[i] = (int8_t)fminf(fmaxf(rintf(x[i] * inv), -127.f), 127.f);
    }
    if (rounded) {
#pragma omp simd
        for (int i = 0; i < D; i++) rounded[i] = fminf(fmaxf(rintf(x[i] * inv), -127.f), 127.f) * scale;
    }
}

void int8_kv_rows(const void *x, int kind, int64_t rows, int64_t stride, int heads, int D,
                  const int64_t *slots, int8_t *cache, float *scales, float *rounded) {
    float buf[1024];
    if (D > 1024) return;  // refused in Python
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            const int64_t src = r * stride + (int64_t)h * D, dst = cache ? slots[r] * heads + h : 0;
            const float *row = (const float *)x + src;
            if (kind != F32) {
                for (int i = 0; i < D; i++) buf[i] = load_elt(kind, x, src + i);
                row = buf;
            }
            int8_kv_row(row, D, cache ? cache + dst * D : NULL, cache ? scales + dst : NULL,
                        rounded ? rounded + (r * heads + h) * (int64_t)D : NULL);
        }
}
