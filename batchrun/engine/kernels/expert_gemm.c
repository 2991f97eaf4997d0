// The MoE experts' GEMMs for steps with few rows per expert (decode): rows sorted by expert, and
// for each *active* group g, out[p, :] = W[experts[g]] x[p, :] for p in [bounds[g], bounds[g+1]).
// Only the listed groups are visited, so a step costs its (token, expert) pairs' work whatever the
// number of experts (torch._grouped_mm's CPU loop spends about a microsecond on each empty one);
// each active expert's weight rows stream from memory once per block of RB rows.
// W is [experts, n, k] row-major (out = x W^T, as a linear layer); float32 or bfloat16 (kind).
#include <stdint.h>

#include "dtypes.h"
#include "parallel.h"
#include "simd.h"

enum { RB = 4, COLS = 32 };  // rows sharing each weight load; output columns per task

typedef struct {
    const void *x, *w;
    void *out;
    const int64_t *experts, *bounds;
    int64_t n, k, tasks, col_tasks;
    int kind, parts;
} ExpertGemm;

static void expert_gemm_task(const ExpertGemm *a, int64_t task) {
    const int64_t g = task / a->col_tasks, c0 = task % a->col_tasks * COLS;
    const int64_t c1 = c0 + COLS < a->n ? c0 + COLS : a->n, k = a->k;
    const int64_t wbase = a->experts[g] * a->n * k;
    for (int64_t p = a->bounds[g]; p < a->bounds[g + 1]; p += RB) {
        const int rows = a->bounds[g + 1] - p < RB ? (int)(a->bounds[g + 1] - p) : RB;
        for (int64_t c = c0; c < c1; c++) {
            const int64_t wrow = wbase + c * k;
            vf acc[RB] = {vzero(), vzero(), vzero(), vzero()};
            int64_t i = 0;
            for (; i + VW <= k; i += VW) {
                const vf wv = vload_kv(a->kind, a->w, wrow + i);
                for (int r = 0; r < rows; r++)
                    acc[r] = vfma(vload_kv(a->kind, a->x, (p + r) * k + i), wv, acc[r]);
            }
            for (int r = 0; r < rows; r++) {
                float s = vhsum(acc[r]);
                for (int64_t j = i; j < k; j++)
                    s += load_elt(a->kind, a->x, (p + r) * k + j) * load_elt(a->kind, a->w, wrow + j);
                store_elt(a->kind, a->out, (p + r) * a->n + c, s);
            }
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
