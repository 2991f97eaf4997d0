// The gated delta rule (Qwen3-Next's linear attention) over a step's packed sequences, one task
// per (sequence, value head), each continuing its sequence's state slot in place:
//   S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t
// S is [dk, dv] float32 row-major; q and k arrive L2-normalised (q also scaled by 1/sqrt(dk)),
// value head h reads query/key head h / (hv / hk). Each token is two passes over S: the decay
// with S^T k, then the rank-one update with S^T q, vectorised over dv (simd.h's lanes). On a CPU
// this token loop is the prefill kernel too: the chunked (WY) form trades these rank-one updates
// for small matrix products, which pays on tensor cores (triton_gated_delta.py), not here, where
// both forms stream S once per token per head from L1/L2.
#include <math.h>
#include <stdint.h>

#include "parallel.h"
#include "simd.h"

typedef struct {
    const float *q, *k, *v, *g, *beta;
    float *state, *out;
    const int64_t *slots, *query_start;
    int64_t seqs;
    int hk, hv, dk, dv, parts;
} GatedDelta;

static void delta_token(float *S, const float *q, const float *k, const float *v, float decay,
                        float beta, float *out, float *mem, int dk, int dv) {
    int j;
    for (j = 0; j < dv; j++) mem[j] = 0.0f;
    for (int i = 0; i < dk; i++) {  // S *= decay; mem = S^T k
        float *row = S + (int64_t)i * dv;
        const vf d = vset1(decay), ki = vset1(k[i]);
        for (j = 0; j + VW <= dv; j += VW) {
            const vf s = vmul(vload(row + j), d);
            vstore(row + j, s);
            vstore(mem + j, vfma(s, ki, vload(mem + j)));
        }
        for (; j < dv; j++) { row[j] *= decay; mem[j] += row[j] * k[i]; }
    }
    for (j = 0; j < dv; j++) { mem[j] = beta * (v[j] - mem[j]); out[j] = 0.0f; }  // mem: delta
    for (int i = 0; i < dk; i++) {  // S += k delta^T; out = S^T q
        float *row = S + (int64_t)i * dv;
        const vf ki = vset1(k[i]), qi = vset1(q[i]);
        for (j = 0; j + VW <= dv; j += VW) {
            const vf s = vfma(ki, vload(mem + j), vload(row + j));
            vstore(row + j, s);
            vstore(out + j, vfma(s, qi, vload(out + j)));
        }
        for (; j < dv; j++) { row[j] += k[i] * mem[j]; out[j] += row[j] * q[i]; }
    }
}

static void gated_delta_task(const GatedDelta *a, int64_t task, float *mem) {
    const int64_t seq = task / a->hv;
    const int h = (int)(task % a->hv), kh = h / (a->hv / a->hk), dk = a->dk, dv = a->dv;
    float *S = a->state + (a->slots[seq] * a->hv + h) * (int64_t)dk * dv;
    for (int64_t t = a->query_start[seq]; t < a->query_start[seq + 1]; t++) {
        const int64_t qk = (t * a->hk + kh) * dk, vo = (t * a->hv + h) * dv, gb = t * a->hv + h;
        delta_token(S, a->q + qk, a->k + qk, a->v + vo, expf(a->g[gb]), a->beta[gb],
                    a->out + vo, mem, dk, dv);
    }
}

static void gated_delta_part(const void *arg, int i) {
    const GatedDelta *a = (const GatedDelta *)arg;
    const int64_t tasks = a->seqs * a->hv;
    float mem[1024];  // dv <= 1024 (checked by the caller)
    for (int64_t t = tasks * i / a->parts; t < tasks * (i + 1) / a->parts; t++)
        gated_delta_task(a, t, mem);
}

// Returns 1 (nothing done) when dv is over 1024 or hv is not a multiple of hk.
int gated_delta_rule(const float *q, const float *k, const float *v, const float *g,
                     const float *beta, float *state, const int64_t *slots,
                     const int64_t *query_start, int64_t seqs, int hk, int hv, int dk, int dv,
                     float *out, int threads) {
    if (dv > 1024 || hk <= 0 || hv % hk) return 1;
    GatedDelta a = {q, k, v, g, beta, state, out, slots, query_start, seqs, hk, hv, dk, dv,
                    threads};
    const int64_t tasks = seqs * hv;
    if (a.parts > tasks) a.parts = (int)tasks;
    if (a.parts <= 1) { a.parts = 1; gated_delta_part(&a, 0); return 0; }
    parallel_tasks(gated_delta_part, &a, a.parts);
    return 0;
}
