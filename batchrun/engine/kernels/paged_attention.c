// Decode attention that reads the paged KV cache in place (no gather copy).
//
// One query token per sequence. Work is split over (sequence, kv head) pairs across a few
// pthreads; each pair reads its K blocks once (scores for the group's query heads), takes the
// softmax, then reads its V blocks once. KV elements are float32 or float16 (converted on load).
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q;          // [B, H, D]
    const void *k, *v;       // [slots, Hkv, D]
    const int64_t *tables;   // [B, max_blocks]
    const int64_t *lens;     // [B]
    float *out;              // [B, H, D]
    int B, H, Hkv, D, block_size, max_blocks, half;
    float scale;
    int first, last;         // range of (b * Hkv + kvh) work items
} Job;

// float16 -> float32 for one row of D elements (F16C when the CPU has it).
static inline void widen(const uint16_t *src, float *dst, int D) {
    int d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16)
        _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + d))));
#elif defined(__F16C__)
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
    for (; d < D; d++) dst[d] = (float)((const _Float16 *)src)[d];
}

static void run_item(const Job *j, int item, float *scores) {
    const int b = item / j->Hkv, kvh = item % j->Hkv;
    const int G = j->H / j->Hkv, D = j->D, bs = j->block_size;
    const int64_t L = j->lens[b];
    const int64_t *table = j->tables + (int64_t)b * j->max_blocks;
    const float *q = j->q + ((int64_t)b * j->H + (int64_t)kvh * G) * D;
    float *out = j->out + ((int64_t)b * j->H + (int64_t)kvh * G) * D;
    float kv_row[512];

    for (int64_t t = 0; t < L; t++) {
        const int64_t slot = table[t / bs] * bs + t % bs;
        const int64_t base = (slot * j->Hkv + kvh) * D;
        const float *k;
        if (j->half) {
            widen((const uint16_t *)j->k + base, kv_row, D);
            k = kv_row;
        } else {
            k = (const float *)j->k + base;
        }
        for (int g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += qg[d] * k[d];
            scores[g * L + t] = s * j->scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = scores + g * L, m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < L; t++) m = sg[t] > m ? sg[t] : m;
        for (int64_t t = 0; t < L; t++) { sg[t] = expf(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; t++) sg[t] *= inv;
        memset(out + g * D, 0, sizeof(float) * D);
    }
    for (int64_t t = 0; t < L; t++) {
        const int64_t slot = table[t / bs] * bs + t % bs;
        const int64_t base = (slot * j->Hkv + kvh) * D;
        const float *v;
        if (j->half) {
            widen((const uint16_t *)j->v + base, kv_row, D);
            v = kv_row;
        } else {
            v = (const float *)j->v + base;
        }
        for (int g = 0; g < G; g++) {
            const float p = scores[g * L + t];
            float *og = out + g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) og[d] += p * v[d];
        }
    }
}

static void *run_range(void *arg) {
    const Job *j = (const Job *)arg;
    int64_t longest = 0;
    for (int item = j->first; item < j->last; item++) {
        const int64_t L = j->lens[item / j->Hkv];
        longest = L > longest ? L : longest;
    }
    float *scores = malloc(sizeof(float) * (j->H / j->Hkv) * (longest ? longest : 1));
    for (int item = j->first; item < j->last; item++) run_item(j, item, scores);
    free(scores);
    return NULL;
}

int paged_decode_attention(const float *q, const void *k, const void *v, const int64_t *tables,
                           const int64_t *lens, float *out, int B, int H, int Hkv, int D,
                           int block_size, int max_blocks, float scale, int half, int threads) {
    if (D > 512) return -1;
    const int items = B * Hkv;
    if (threads < 1) threads = 1;
    if (threads > items) threads = items;
    Job jobs[64];
    pthread_t tids[64];
    if (threads > 64) threads = 64;
    // Split by total context length so threads get similar amounts of KV to read.
    int64_t total = 0;
    for (int b = 0; b < B; b++) total += lens[b] * Hkv;
    int item = 0;
    int64_t acc = 0;
    for (int i = 0; i < threads; i++) {
        const int64_t goal = total * (i + 1) / threads;
        jobs[i] = (Job){q, k, v, tables, lens, out, B, H, Hkv, D, block_size, max_blocks, half,
                        scale, item, item};
        while (item < items && (acc < goal || i == threads - 1)) acc += lens[item++ / Hkv];
        jobs[i].last = item;
    }
    for (int i = 1; i < threads; i++) pthread_create(&tids[i], NULL, run_range, &jobs[i]);
    run_range(&jobs[0]);
    for (int i = 1; i < threads; i++) pthread_join(tids[i], NULL);
    return 0;
}
