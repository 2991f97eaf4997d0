// Weight-only linear over int8 weights in groups along the input (GGUF's Q8_0, Q5_K, Q6_K as
// models/quant/grouped_int8_linear.py holds them): for each output column c and row r,
//   out[r, c] = sum_g scale[c, g] * (x[r, g] . q[c, g]) + min[c, g] * sum(x[r, g])
// Weights are widened a vector at a time and never stored as floats: a decode step reads one
// byte per weight. Each weight load serves RB rows; threads split the output columns.
#include <stdint.h>
#include <stdlib.h>

#include "dtypes.h"
#include "parallel.h"
#include "simd.h"

enum { RB = 4 };

typedef struct {
    const void *x;
    const int8_t *q;
    const float *scale, *min, *xsum;  // xsum [rows, k / group] when min is set
    void *out;
    int64_t rows, n, k, group;
    int kind, parts;
} GroupedInt8;

// R rows (a constant once inlined, so the accumulators stay in registers) of columns [c0, c1).
SIMD_INLINE void grouped_rows(const GroupedInt8 *a, int64_t p, const int R, int64_t c0, int64_t c1) {
    const int64_t k = a->k, g = a->group, ng = k / g;
    for (int64_t c = c0; c < c1; c++) {
        const int8_t *q = a->q + c * k;
        const float *scale = a->scale + c * ng;
        vf acc[RB];
        for (int r = 0; r < R; r++) acc[r] = vzero();
        for (int64_t j = 0; j < ng; j++) {
            vf part[RB];
            for (int r = 0; r < R; r++) part[r] = vzero();
            for (int64_t i = j * g; i < (j + 1) * g; i += VW) {
                const vf w = vload_i8(q + i);
                for (int r = 0; r < R; r++)
                    part[r] = vfma(vload_kv(a->kind, a->x, (p + r) * k + i), w, part[r]);
            }
            const vf s = vset1(scale[j]);
            for (int r = 0; r < R; r++) acc[r] = vfma(part[r], s, acc[r]);
        }
        for (int r = 0; r < R; r++) {
            float y = vhsum(acc[r]);
            if (a->min)
                for (int64_t j = 0; j < ng; j++) y += a->min[c * ng + j] * a->xsum[(p + r) * ng + j];
            store_elt(a->kind, a->out, (p + r) * a->n + c, y);
        }
    }
}

static void grouped_columns(const GroupedInt8 *a, int64_t c0, int64_t c1) {
    for (int64_t p = 0; p < a->rows; p += RB) {
        switch (a->rows - p < RB ? (int)(a->rows - p) : RB) {
            case 1: grouped_rows(a, p, 1, c0, c1); break;
            case 2: grouped_rows(a, p, 2, c0, c1); break;
            case 3: grouped_rows(a, p, 3, c0, c1); break;
            default: grouped_rows(a, p, RB, c0, c1); break;
        }
    }
}

static void grouped_part(const void *arg, int i) {
    const GroupedInt8 *a = (const GroupedInt8 *)arg;
    grouped_columns(a, a->n * i / a->parts, a->n * (i + 1) / a->parts);
}

// x and out in `kind` (float32 or bfloat16), q int8 [n, k], scale and min (or NULL) float32
// [n, k / group]; group a multiple of 16 (every vector path's width divides it).
void grouped_int8_linear(const void *x, const int8_t *q, const float *scale, const float *min,
                         void *out, int64_t rows, int64_t n, int64_t k, int64_t group, int kind,
                         int threads) {
    const int64_t ng = k / group;
    float *xsum = NULL;
    if (min) {
        xsum = (float *)malloc(sizeof(float) * rows * ng);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < ng; j++) {
                float s = 0.f;
                for (int64_t i = j * group; i < (j + 1) * group; i++) s += load_elt(kind, x, r * k + i);
                xsum[r * ng + j] = s;
            }
    }
    GroupedInt8 a = {x, q, scale, min, xsum, out, rows, n, k, group, kind, threads};
    if (a.parts > n) a.parts = (int)n;
    if (rows * n * k < (1 << 16)) a.parts = 1;
    if (a.parts <= 1) {
        a.parts = 1;
        grouped_part(&a, 0);
    } else {
        parallel_tasks(grouped_part, &a, a.parts);
    }
    free(xsum);
}
