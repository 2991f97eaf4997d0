// Decode attention that reads the paged KV cache in place (no gather copy).
//
// One query token per sequence. Work is split over (sequence, kv head) pairs across a few
// threads. Each pair walks its blocks once with an online softmax: per block it scores the
// block's keys for the group's query heads, rescales the running sums, and adds the block's
// values. KV elements are float32, float16 or bfloat16 (widened to float32 on load).
//
// The AVX-512 path keeps each key row in registers and does one horizontal sum per query head
// and row. (Software prefetch of the next block was tried and measured no gain.)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "parallel.h"

#define MAX_D 256
#define MAX_G 16
#define MAX_BS 256

typedef struct {
    const float *q;          // [B, H, D]
    const void *k, *v;       // [slots, Hkv, D]
    const int64_t *tables;   // [B, max_blocks]
    const int64_t *lens;     // [B]
    float *out;              // [B, H, D]
    int B, H, Hkv, D, block_size, max_blocks, kind;  // kind: 0 f32, 1 f16, 2 bf16
    float scale;
    int first, last;         // range of (b * Hkv + kvh) work items
} Job;

// Row `r` of a KV pool widened to float32 into `dst` (or returned in place when float32).
static inline const float *load_row(const Job *j, const void *pool, int64_t r, float *dst) {
    if (j->kind == F32) return (const float *)pool + r;
    for (int d = 0; d < j->D; d++) dst[d] = load_elt(j->kind, pool, r + d);
    return dst;
}

#if defined(__AVX512F__)
#define INLINE static inline __attribute__((always_inline))

// 16 consecutive KV elements starting at element i, as float32.
INLINE __m512 load16(int kind, const void *pool, int64_t i) {
    if (kind == F32) return _mm512_loadu_ps((const float *)pool + i);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i));
    if (kind == F16) return _mm512_cvtph_ps(raw);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// scores[g * MAX_BS + t] = q_g . k_t for the n rows of one block (q already scaled). G and
// CH = D / 16 are compile-time constants at each call site, so the row stays in registers.
INLINE void block_scores(const Job *j, int64_t row0, int n, const float *q, float *scores,
                         const int G, const int CH) {
    const int64_t stride = (int64_t)j->Hkv * CH * 16;
    for (int t = 0; t < n; t++) {
        __m512 acc[MAX_G];
        const int64_t r = row0 + t * stride;
        for (int c = 0; c < CH; c++) {
            const __m512 kc = load16(j->kind, j->k, r + 16 * c);
            for (int g = 0; g < G; g++)
                acc[g] = c == 0 ? _mm512_mul_ps(kc, _mm512_loadu_ps(q + (g * CH + c) * 16))
                                : _mm512_fmadd_ps(kc, _mm512_loadu_ps(q + (g * CH + c) * 16), acc[g]);
        }
        for (int g = 0; g < G; g++) scores[g * MAX_BS + t] = _mm512_reduce_add_ps(acc[g]);
    }
}

// acc_g += sum_t p[g][t] * v_t over the n rows of one block.
INLINE void block_values(const Job *j, int64_t row0, int n, const float *p, float *acc,
                         const int G, const int CH) {
    const int64_t stride = (int64_t)j->Hkv * CH * 16;
    __m512 a[MAX_G * 8];
    for (int i = 0; i < G * CH; i++) a[i] = _mm512_loadu_ps(acc + 16 * i);
    for (int t = 0; t < n; t++) {
        const int64_t r = row0 + t * stride;
        for (int c = 0; c < CH; c++) {
            const __m512 vc = load16(j->kind, j->v, r + 16 * c);
            for (int g = 0; g < G; g++)
                a[g * CH + c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * MAX_BS + t]), vc, a[g * CH + c]);
        }
    }
    for (int i = 0; i < G * CH; i++) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

static inline void block_scores_generic(const Job *j, int64_t row0, int n, const float *q,
                                        float *scores) {
    const int G = j->H / j->Hkv, D = j->D;
    const int64_t stride = (int64_t)j->Hkv * D;
    float buf[MAX_D];
    for (int t = 0; t < n; t++) {
        const float *k = load_row(j, j->k, row0 + t * stride, buf);
        for (int g = 0; g < G; g++) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += q[g * D + d] * k[d];
            scores[g * MAX_BS + t] = s;
        }
    }
}

static inline void block_values_generic(const Job *j, int64_t row0, int n, const float *p,
                                        float *acc) {
    const int G = j->H / j->Hkv, D = j->D;
    const int64_t stride = (int64_t)j->Hkv * D;
    float buf[MAX_D];
    for (int t = 0; t < n; t++) {
        const float *v = load_row(j, j->v, row0 + t * stride, buf);
        for (int g = 0; g < G; g++) {
            const float w = p[g * MAX_BS + t];
#pragma omp simd
            for (int d = 0; d < D; d++) acc[g * D + d] += w * v[d];
        }
    }
}

// One (sequence, kv head) pair. G and CH are literals where the AVX-512 path is taken (see
// run_item), 0 for the portable path.
static inline __attribute__((always_inline)) void attend(const Job *j, int item, const int G_fast,
                                                         const int CH) {
    const int b = item / j->Hkv, kvh = item % j->Hkv;
    const int G = G_fast ? G_fast : j->H / j->Hkv, D = j->D, bs = j->block_size;
    const int64_t L = j->lens[b];
    const int64_t *table = j->tables + (int64_t)b * j->max_blocks;
    const float *q_in = j->q + ((int64_t)b * j->H + (int64_t)kvh * G) * D;
    float *out = j->out + ((int64_t)b * j->H + (int64_t)kvh * G) * D;
    float q[MAX_G * MAX_D], acc[MAX_G * MAX_D], p[MAX_G * MAX_BS], m[MAX_G], l[MAX_G];
    for (int i = 0; i < G * D; i++) { q[i] = q_in[i] * j->scale; acc[i] = 0.f; }
    for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; }

    const int64_t blocks = (L + bs - 1) / bs;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int n = (int)(blk == blocks - 1 ? L - blk * bs : bs);
        const int64_t row0 = (table[blk] * bs * j->Hkv + kvh) * D;
#if defined(__AVX512F__)
        if (G_fast) block_scores(j, row0, n, q, p, G_fast, CH);
        else
#endif
            block_scores_generic(j, row0, n, q, p);
        for (int g = 0; g < G; g++) {
            float *pg = p + g * MAX_BS, mx = m[g];
            for (int t = 0; t < n; t++) mx = pg[t] > mx ? pg[t] : mx;
            if (mx > m[g]) {  // rescale what has been summed so far to the new maximum
                const float c = expf(m[g] - mx);
                l[g] *= c;
                for (int d = 0; d < D; d++) acc[g * D + d] *= c;
                m[g] = mx;
            }
            float sum = 0.f;
            for (int t = 0; t < n; t++) { pg[t] = expf(pg[t] - mx); sum += pg[t]; }
            l[g] += sum;
        }
#if defined(__AVX512F__)
        if (G_fast) block_values(j, row0, n, p, acc, G_fast, CH);
        else
#endif
            block_values_generic(j, row0, n, p, acc);
    }
    for (int g = 0; g < G; g++) {
        const float inv = 1.f / l[g];
        for (int d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv;
    }
}

#define CASE(g, ch) case (g) * 16 + (ch): attend(j, item, g, ch); return;
static void run_item(const Job *j, int item) {
#if defined(__AVX512F__)
    const int G = j->H / j->Hkv;
    if (j->D % 16 == 0) switch (G * 16 + j->D / 16) {
        CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(5, 4) CASE(6, 4) CASE(7, 4) CASE(8, 4)
        CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8) CASE(5, 8) CASE(6, 8) CASE(7, 8) CASE(8, 8)
    }
#endif
    attend(j, item, 0, 0);
}

static void run_range(const void *arg, int i) {
    const Job *j = (const Job *)arg + i;
    for (int item = j->first; item < j->last; item++) run_item(j, item);
}

int paged_decode_attention(const float *q, const void *k, const void *v, const int64_t *tables,
                           const int64_t *lens, float *out, int B, int H, int Hkv, int D,
                           int block_size, int max_blocks, float scale, int kind, int threads) {
    if (D > MAX_D || H / Hkv > MAX_G || block_size > MAX_BS) return -1;
    const int items = B * Hkv;
    if (threads < 1) threads = 1;
    if (threads > items) threads = items;
    if (threads > 64) threads = 64;
    Job jobs[64];
    // Split by total context length so threads get similar amounts of KV to read.
    int64_t total = 0;
    for (int b = 0; b < B; b++) total += lens[b] * Hkv;
    int item = 0;
    int64_t acc = 0;
    for (int i = 0; i < threads; i++) {
        const int64_t goal = total * (i + 1) / threads;
        jobs[i] = (Job){q, k, v, tables, lens, out, B, H, Hkv, D, block_size, max_blocks, kind,
                        scale, item, item};
        while (item < items && (acc < goal || i == threads - 1)) acc += lens[item++ / Hkv];
        jobs[i].last = item;
    }
    parallel_tasks(run_range, jobs, threads);
    return 0;
}
