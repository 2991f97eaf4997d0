// The depthwise causal convolution with SiLU of the gated delta layers (Qwen3-Next's mixer), over
// a step's packed rows, each sequence continuing its state slot's last K - 1 inputs:
//   out[t, c] = silu(sum_j w[j, c] * in(t - (K - 1) + j, c))
// where in(p, c) is the sequence's row p, or for p < 0 its slot's row K - 1 + p (zero for a fresh
// sequence). The slot then keeps the last K - 1 inputs. One pass over the rows replaces the
// PyTorch form's gathers, K products and sums over [T, C] temporaries. float32 throughout; one
// task per (sequence, block of channels), so a task's state rows are read before it writes them.
#include <math.h>
#include <stdint.h>

#include "parallel.h"
#include "simd.h"

enum { CB = 256 };  // channels per task

typedef struct {
    const float *x, *w;  // x [T, C]; w [K, C] (tap j reads K - 1 - j rows back)
    float *state, *out;  // state [slots, K - 1, C]; out [T, C]
    const int64_t *slots, *query_start;
    const uint8_t *fresh;
    int64_t seqs, c, tasks, blocks;
    int k, parts;
} CausalConv;

static inline const float *input_row(const CausalConv *a, const float *st, int64_t q0, int64_t p,
                                     int fresh) {
    if (p >= 0) return a->x + (q0 + p) * a->c;
    return fresh ? NULL : st + (a->k - 1 + p) * a->c;
}

static void conv_task(const CausalConv *a, int64_t task) {
    const int64_t seq = task / a->blocks, c0 = task % a->blocks * CB, C = a->c;
    const int64_t c1 = c0 + CB < C ? c0 + CB : C, q0 = a->query_start[seq];
    const int64_t n = a->query_start[seq + 1] - q0;
    const int keep = a->k - 1, fresh = a->fresh[seq] != 0;
    float *st = a->state + a->slots[seq] * keep * C;
    for (int64_t t = 0; t < n; t++) {
        float *o = a->out + (q0 + t) * C;
        int64_t c = c0;
        for (; c + VW <= c1; c += VW) {
            vf acc = vzero();
            for (int j = 0; j < a->k; j++) {
                const float *in = input_row(a, st, q0, t - keep + j, fresh);
                if (in) acc = vfma(vload(a->w + (int64_t)j * C + c), vload(in + c), acc);
            }
            vstore(o + c, vdiv(acc, vadd(vset1(1.f), vexp(vsub(vzero(), acc)))));
        }
        for (; c < c1; c++) {
            float acc = 0.f;
            for (int j = 0; j < a->k; j++) {
                const float *in = input_row(a, st, q0, t - keep + j, fresh);
                if (in) acc += a->w[(int64_t)j * C + c] * in[c];
            }
            o[c] = acc / (1.f + expf(-acc));
        }
    }
    // new slot row i is input n - keep + i: a later old row (n + i > i, not yet overwritten),
    // a step row, or zero (a fresh sequence with fewer than keep inputs)
    for (int i = 0; i < keep; i++) {
        const float *in = input_row(a, st, q0, n - keep + i, fresh);
        float *dst = st + (int64_t)i * C;
        for (int64_t c = c0; c < c1; c++) dst[c] = in ? in[c] : 0.f;
    }
}

static void conv_part(const void *arg, int i) {
    const CausalConv *a = (const CausalConv *)arg;
    for (int64_t t = a->tasks * i / a->parts; t < a->tasks * (i + 1) / a->parts; t++)
        conv_task(a, t);
}

void causal_conv_silu(const float *x, const float *w, float *state, const int64_t *slots,
                      const int64_t *query_start, const uint8_t *fresh, int64_t seqs, int64_t c,
                      int k, float *out, int threads) {
    const int64_t blocks = (c + CB - 1) / CB;
    CausalConv a = {x, w, state, out, slots, query_start, fresh, seqs, c, seqs * blocks, blocks,
                    k, threads};
    if (a.parts > a.tasks) a.parts = (int)a.tasks;
    if (query_start[seqs] * c * k < (1 << 16)) a.parts = 1;
    if (a.parts <= 1) { a.parts = 1; conv_part(&a, 0); return; }
    parallel_tasks(conv_part, &a, a.parts);
}
