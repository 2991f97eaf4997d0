// The MoE experts' GEMMs for steps with few rows per expert (decode): rows sorted by expert, and
// for each *active* group g, out[p, :] = W[experts[g]] x[p, :] for p in [bounds[g], bounds[g+1]).
// Only the listed groups are visited, so a step costs its (token, expert) pairs' work whatever the
// number of experts (torch._grouped_mm's CPU loop spends about a microsecond on each empty one);
// each active expert's weight rows stream from memory once (a task's COLS rows stay in cache
// across its blocks of RB input rows).
// W is [experts, n, k] row-major (out = x W^T, as a linear layer); float32 or bfloat16 (kind).
#include <stdint.h>

#include "dtypes.h"
#include "parallel.h"
#include "simd.h"

enum { RB = 8, COLS = 32 };  // rows sharing each weight load; output columns per task

typedef struct {
    const void *x, *w;
    void *out;
    const int64_t *experts, *bounds;
    int64_t n, k, tasks, col_tasks;
    int kind, parts;
} ExpertGemm;

// out rows [p, p + R) of output columns [c0, c1): two weight rows at a time against R input
// rows (R a literal, so the 2R accumulators stay in registers): 2 + R loads per 2R FMAs.
SIMD_INLINE void rows_block(const ExpertGemm *a, int64_t p, int64_t c0, int64_t c1,
                            int64_t wbase, const int R) {
    const int64_t k = a->k;
    for (int64_t c = c0; c < c1; c += 2) {
        const int two = c + 1 < c1;
        const int64_t w0 = wbase + c * k, w1 = two ? w0 + k : w0;
        vf acc0[RB], acc1[RB];
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = vzero();
        int64_t i = 0;
        for (; i + VW <= k; i += VW) {
            const vf wa = vload_kv(a->kind, a->w, w0 + i), wb = vload_kv(a->kind, a->w, w1 + i);
            for (int r = 0; r < R; r++) {
                const vf xv = vload_kv(a->kind, a->x, (p + r) * k + i);
                acc0[r] = vfma(xv, wa, acc0[r]);
                acc1[r] = vfma(xv, wb, acc1[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            float s0 = vhsum(acc0[r]), s1 = vhsum(acc1[r]);
            for (int64_t j = i; j < k; j++) {
                const float xj = load_elt(a->kind, a->x, (p + r) * k + j);
                s0 += xj * load_elt(a->kind, a->w, w0 + j);
                s1 += xj * load_elt(a->kind, a->w, w1 + j);
            }
            store_elt(a->kind, a->out, (p + r) * a->n + c, s0);
            if (two) store_elt(a->kind, a->out, (p + r) * a->n + c + 1, s1);
        }
    }
}

static void expert_gemm_task(const ExpertGemm *a, int64_t task) {
    const int64_t g = task / a->col_tasks, c0 = task % a->col_tasks * COLS;
    const int64_t c1 = c0 + COLS < a->n ? c0 + COLS : a->n;
    const int64_t wbase = a->experts[g] * a->n * a->k;
    for (int64_t p = a->bounds[g]; p < a->bounds[g + 1]; p += RB) {
        const int64_t left = a->bounds[g + 1] - p;
        switch (left < RB ? (int)left : RB) {
            case 1: rows_block(a, p, c0, c1, wbase, 1); break;
            case 2: rows_block(a, p, c0, c1, wbase, 2); break;
            case 3: rows_block(a, p, c0, c1, wbase, 3); break;
            case 4: rows_block(a, p, c0, c1, wbase, 4); break;
            case 5: rows_block(a, p, c0, c1, wbase, 5); break;
            case 6: rows_block(a, p, c0, c1, wbase, 6); break;
            case 7: rows_block(a, p, c0, c1, wbase, 7); break;
            default: rows_block(a, p, c0, c1, wbase, RB); break;
        }
    }
}

static void expert_gemm_part(const void *arg, int i) {
    const ExpertGemm *a = (const ExpertGemm *)arg;
    for (int64_t t = a->tasks * i / a->parts; t < a->tasks * (i + 1) / a->parts; t++)
        expert_gemm_task(a, t);
}

void expert_gemm(const void *x, const void *w, void *out, const int64_t *experts,
                 const int64_t *bounds, int64_t groups, int64_t n, int64_t k, int kind, int threads) {
    const int64_t col_tasks = (n + COLS - 1) / COLS;
    ExpertGemm a = {x, w, out, experts, bounds, n, k, groups * col_tasks, col_tasks, kind, threads};
    if (a.parts > a.tasks) a.parts = (int)a.tasks;
    if (bounds[groups] * n * k < (1 << 16)) a.parts = 1;
    if (a.parts <= 1) { a.parts = 1; expert_gemm_part(&a, 0); return; }
    parallel_tasks(expert_gemm_part, &a, a.parts);
}
