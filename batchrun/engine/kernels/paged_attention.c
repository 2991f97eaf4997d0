// Attention that reads the paged KV cache in place (no gather copy), for decode tokens and for
// prefill chunks over a cached context, with shared-prefix ("cascade") grouping.
//
// A call attends query rows (tokens; each has H heads) given per row a block table and a context
// length (the row sees positions [0, len)). Rows come in groups: a group's rows share the first
// `shared` blocks of their tables (the same physical blocks), and for each KV head the group
// walks those blocks once, scoring every row of the group against each block while it is in L1,
// then each row walks its own remaining blocks. A row's running state is an online softmax
// (max m, sum l, weighted values acc): the shared part and the tail are merged exactly by the
// usual log-sum-exp rescaling as the walk goes from one block to the next.
//
//   decode: a group is a set of sequences whose block tables begin with the same blocks
//           (prefix-cache hits, n > 1 forks), found by cascade_groups below; a sequence that
//           shares nothing is a group of one (the plain kernel).
//   prefill chunk over a cached context: a group is a tile of up to MAX_GROUP consecutive
//           tokens of one chunk; the blocks every token of the tile sees fully are shared, the
//           last one or two (the causal diagonal) are each token's own.
//
// Work is split across threads by estimated cost over items: a group with all its KV heads (a
// block's rows hold the heads side by side, so a tile's memory is read in one sweep), or a
// (group, KV head) when there are too few groups to keep the threads busy. A row walks its
// blocks in tiles of about TILE_KEYS keys: all the tile's scores, then one online-softmax
// update, while the next tile is prefetched (the blocks lie anywhere in the pool, where the
// hardware prefetchers do not look). Over a group's shared blocks (AVX-512 and AVX2 paths) all
// its query vectors are scored at once as a small GEMM against the tile's keys (group_tile).
// KV elements are
// float32, float16, bfloat16, fp8 e4m3 or int8, widened to float32 on load; arithmetic is
// float32. A bfloat16 cache is scored against the query rounded to bfloat16 (on every path);
// on a CPU with AVX512-BF16 a row's tiles (not the group GEMM) are read unwidened: scores by
// VDPBF16PS, values two keys at a time against their softmax weights rounded to bfloat16 (the
// weights' sum l stays float32), as 16-bit GPU attention kernels multiply P by V. An int8 cache has a float32 scale per (slot, KV head) beside it (ks / vs): a tile's
// scores are multiplied by their keys' scales before the softmax, its weights by the values'
// scales after it (the sum l stays the weights' own). The vector
// width comes from simd.h (AVX-512, AVX2+FMA or portable); G (query heads per KV head) and D
// are compile-time constants for the common shapes so the loops unroll into registers.
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "simd.h"

#define MAX_D 256
#define MAX_G 16
#define MAX_BS 256
#define MAX_TILE 256  // keys per softmax update (p's row length; >= MAX_BS)
#ifndef TILE_KEYS
#define TILE_KEYS 64  // keys a tile aims at: 4 blocks of 16 (their K and V fit in L1)
#endif
#define MAX_GROUP 16  // rows attended together over shared blocks
#define NEG (-1e30f)  // "minus infinity" that stays finite (the library is built -ffinite-math-only)

typedef struct {
    const float *q;            // [rows, H, D], any rows not in a group are left alone
    const void *k, *v;         // [slots, Hkv, D]
    const int64_t *tables;     // [tables, max_blocks]
    const int64_t *row_table;  // [rows] which table a row reads
    const int64_t *row_len;    // [rows] context length the row sees
    float *out;                // [rows, H, D]
    const int32_t *order;      // rows in group order
    const int32_t *group_start;  // [groups + 1] into order
    const int32_t *group_shared; // [groups] leading blocks read once for the group (NULL: none)
    const int64_t *row_first;  // [rows] first position a row sees (window or chunk; NULL: 0)
    int H, Hkv, D, bs, max_blocks, kind;
    int per_item;              // KV heads per work item (all of them, or 1 when there are few groups)
    float scale;
    float softcap;             // scores become softcap * tanh(score / softcap) (0: as they are)
    const float *sinks;        // [H] a logit per query head that joins the softmax's denominator
                               // only (GPT-OSS's attention sinks; NULL: none)
    const float *ks, *vs;      // [slots, Hkv] int8 KV's scales (NULL: none)
    const float *alibi;        // [H] ALiBi slopes: head h's score of the key at position p gains
                               // alibi[h] * (p - (row_len - 1)) (NULL: none)
    int per_row;               // score each row on its own over the shared blocks too (see run_group)
    int first, last;           // range of (group, first head) work items
} Job;

typedef struct {  // one row's query heads of one KV head
    float *q, *acc;
    float m[MAX_G], l[MAX_G];
    int8_t *qi;                   // an int8 cache's: q rounded to int8 per head, q = qi * qs,
    float qs[MAX_G], qsum[MAX_G]; // with sum(qi) per head
    uint32_t *qb;                 // a bfloat16 cache's: q as bfloat16 pairs (the memory of qi)
    float slope[MAX_G];           // ALiBi: each head's slope (Job.alibi), and the row's last
    int64_t last_pos;             // position, which its biases are measured from
} State;
// floats a State's q, acc and qi / qb take
#define STATE_FLOATS(G, D) (2 * (G) * (D) + (G) * (D) / 2)

int simd_path(void) { return SIMD_PATH; }

// p[g][t] for nt <= VW keys from element row0 (a literal nt keeps the accumulators in registers).
SIMD_INLINE void score_keys(const Job *j, const State *s, int64_t row0, const int nt, float *p,
                            const int G, const int CH) {
    const int D = CH * VW;
    const int64_t stride = (int64_t)j->Hkv * D;
    for (int g = 0; g < G; g++) {
        vf acc[VW];
        for (int t = 0; t < VW; t++) acc[t] = vzero();
        for (int c = 0; c < CH; c++) {
            const vf qc = vload(s->q + g * D + c * VW);
            for (int t = 0; t < nt; t++)
                acc[t] = vfma(vload_kv(j->kind, j->k, row0 + t * stride + c * VW), qc, acc[t]);
        }
        vstore(p + g * MAX_TILE, vhsums(acc));
    }
}

// acc[r] += sum_t p[r * ps + t * pt] v_t for NR query vectors r over the n keys of a tile of
// nblk blocks (rows from element row0[b]; bs keys each, the last one last_n), CB vector columns
// at a time: NR * CB accumulators in registers for the whole tile, each weight broadcast once
// per CB columns.
SIMD_INLINE void add_values(const Job *j, float *const *acc, const float *p, int64_t ps,
                            int64_t pt, const int64_t *row0, int nblk, int last_n, const int NR,
                            const int CH) {
    const int bs = j->bs;
    const int64_t stride = (int64_t)j->Hkv * CH * VW;
    const int CB = VW == 1 || NR * CH <= 12 ? CH : 12 / NR > 0 ? 12 / NR : 1;
    for (int c0 = 0; c0 < CH; c0 += CB) {
        const int cb = CH - c0 < CB ? CH - c0 : CB;
        vf a[VW == 1 ? MAX_G * MAX_D : MAX_G * 12];
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < cb; c++) a[r * CB + c] = vload(acc[r] + (c0 + c) * VW);
        for (int b = 0; b < nblk; b++) {
            const int nb = b == nblk - 1 ? last_n : bs;
            for (int t = 0; t < nb; t++) {
                const float *pk = p + (int64_t)(b * bs + t) * pt;
                vf vc[VW == 1 ? MAX_D : 12];
                for (int c = 0; c < cb; c++)
                    vc[c] = vload_kv(j->kind, j->v, row0[b] + t * stride + (c0 + c) * VW);
                for (int r = 0; r < NR; r++) {
                    const vf w = vset1(pk[r * ps]);
                    for (int c = 0; c < cb; c++) a[r * CB + c] = vfma(w, vc[c], a[r * CB + c]);
                }
            }
        }
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < cb; c++) vstore(acc[r] + (c0 + c) * VW, a[r * CB + c]);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI_SCORES 1
// score_keys for an int8 cache by VNNI dot products: (k + 128) as unsigned bytes against the
// query's int8 values, 4 products per lane per instruction (D % 64 == 0), less 128 * sum(qi);
// the sums are exact in int32 and in float32 (|sum| < 2^24 for D <= 256), the keys' scales are
// applied after (scale_keys), the query's here.
SIMD_INLINE void score_keys_i8(const Job *j, const State *s, int64_t row0, const int nt, float *p,
                               const int G, const int D) {
    const int64_t stride = (int64_t)j->Hkv * D;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int g = 0; g < G; g++) {
        __m512i acc[VW];
        for (int t = 0; t < VW; t++) acc[t] = _mm512_setzero_si512();
        for (int c = 0; c < D; c += 64) {
            const __m512i qv = _mm512_loadu_si512(s->qi + g * D + c);
            for (int t = 0; t < nt; t++) {
                const __m512i k = _mm512_loadu_si512((const int8_t *)j->k + row0 + t * stride + c);
                acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_xor_si512(k, flip), qv);
            }
        }
        vf f[VW];
        for (int t = 0; t < VW; t++) f[t] = _mm512_cvtepi32_ps(acc[t]);
        vstore(p + g * MAX_TILE, vmul(vsub(vhsums(f), vset1(128.f * s->qsum[g])), vset1(s->qs[g])));
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_SCORES 1
// score_keys for a bfloat16 cache: 2 products per lane per VDPBF16PS straight from the keys'
// bfloat16 pairs against the query's (round_query_bf16), times the scale, D % 32 == 0.
SIMD_INLINE void score_keys_bf16(const Job *j, const State *s, int64_t row0, const int nt,
                                 float *p, const int G, const int D) {
    const int64_t stride = (int64_t)j->Hkv * D;
    for (int g = 0; g < G; g++) {
        vf acc[VW];
        for (int t = 0; t < VW; t++) acc[t] = vzero();
        for (int c = 0; c < D; c += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(s->qb + (g * D + c) / 2);
            for (int t = 0; t < nt; t++) {
                const __m512i k = _mm512_loadu_si512((const uint16_t *)j->k + row0 + t * stride + c);
                acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)k, qv);
            }
        }
        vstore(p + g * MAX_TILE, vmul(vhsums(acc), vset1(j->scale)));
    }
}

// add_values for a bfloat16 cache, over one row's tile (p[g * MAX_TILE + key], keys numbered
// across the tile's blocks as attend_tile numbers them): keys two at a time by VDPBF16PS, the
// weights rounded to bfloat16 pairs and the two value rows interleaved into pairs in d order
// (a block's odd last key alone, widened, with its float32 weight). D % 32 == 0.
SIMD_INLINE void add_values_bf16(const Job *j, float *const *acc, const float *p,
                                 const int64_t *row0, int nblk, int last_n, const int G,
                                 const int D) {
    const int bs = j->bs, n = (nblk - 1) * bs + last_n;
    const int64_t stride = (int64_t)j->Hkv * D;
    const uint16_t *v = (const uint16_t *)j->v;
    uint16_t pb[MAX_G * MAX_TILE] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++)
        for (int t = 0; t < n; t += VW)
            _mm256_storeu_si256((__m256i *)(pb + g * MAX_TILE + t),
                                (__m256i)_mm512_cvtneps_pbh(vload(p + g * MAX_TILE + t)));
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    vf a[MAX_G * MAX_D / VW];
    const int CH = D / VW;
    for (int g = 0; g < G; g++)
        for (int c = 0; c < CH; c++) a[g * CH + c] = vload(acc[g] + c * VW);
    for (int b = 0; b < nblk; b++) {
        const int nb = b == nblk - 1 ? last_n : bs;
        const uint16_t *vb = v + row0[b];
        int t = 0;
        for (; t + 1 < nb; t += 2) {
            const int k = b * bs + t;
            __m512i pair[MAX_D / 16];
            for (int c = 0; c < D; c += 32) {
                const __m512i x = _mm512_loadu_si512(vb + t * stride + c);
                const __m512i y = _mm512_loadu_si512(vb + (t + 1) * stride + c);
                pair[c / 16] = _mm512_permutex2var_epi16(x, lo, y);
                pair[c / 16 + 1] = _mm512_permutex2var_epi16(x, hi, y);
            }
            for (int g = 0; g < G; g++) {
                uint32_t w;
                memcpy(&w, pb + g * MAX_TILE + k, 4);
                const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)w);
                for (int c = 0; c < CH; c++)
                    a[g * CH + c] = _mm512_dpbf16_ps(a[g * CH + c], (__m512bh)pair[c], wv);
            }
        }
        if (t < nb) {  // a block's odd last key
            const int k = b * bs + t;
            for (int c = 0; c < CH; c++) {
                const vf x = vload_kv(BF16, v, row0[b] + t * stride + c * VW);
                for (int g = 0; g < G; g++) a[g * CH + c] = vfma(vset1(p[g * MAX_TILE + k]), x, a[g * CH + c]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < CH; c++) vstore(acc[g] + c * VW, a[g * CH + c]);
}
#endif

// whether a bfloat16 cache's tiles are read by VDPBF16PS (score_keys_bf16, add_values_bf16)
#ifdef BF16_SCORES
int bf16_products(void) { return 1; }
#else
int bf16_products(void) { return 0; }
#endif

// x[r * rs + t * ts] *= scale[key t] for r < R (query vectors) over the keys of a tile (as
// add_values walks them): key t of block b is slot row0[b] / D + t * Hkv of the scales.
SIMD_INLINE void scale_keys(const Job *j, const float *scale, float *x, int64_t rs, int64_t ts,
                            const int64_t *row0, int nblk, int last_n, int R, int D) {
    for (int b = 0; b < nblk; b++) {
        const int nb = b == nblk - 1 ? last_n : j->bs;
        const float *sb = scale + row0[b] / D;
        for (int t = 0; t < nb; t++) {
            const float st = sb[(int64_t)t * j->Hkv];
            float *xt = x + (int64_t)(b * j->bs + t) * ts;
            for (int r = 0; r < R; r++) xt[r * rs] *= st;
        }
    }
}

// x[0, n) = cap * tanh(x / cap) (simd.h's vsoftcap); n rounded up to whole vectors, x padded
// to them.
SIMD_INLINE void soft_cap(float *x, int64_t n, float cap) {
    const vf inv2 = vset1(2.f / cap), vcap = vset1(cap);
    for (int64_t t = 0; t < n; t += VW) vstore(x + t, vsoftcap(vload(x + t), inv2, vcap));
}

// Fold a tile of nblk blocks into a row's state: block b's rows start at element row0[b] of the
// pools and hold bs keys, the last one last_n. The tile's scores are all computed before one
// online-softmax update (one max, one rescale per query head per tile, not per block: the
// update is a chain of dependent reductions that a single 16-key block cannot hide).
SIMD_INLINE void attend_tile(const Job *j, State *s, const int64_t *row0, int nblk, int last_n,
                             int skip, int64_t pos0, float *p, const int G, const int CH) {
    const int D = CH * VW, bs = j->bs;
    const int64_t stride = (int64_t)j->Hkv * D;
    const int n = (nblk - 1) * bs + last_n;
    // Scores p[g][t] = q_g . k_t (q is pre-scaled), VW keys at a time: one accumulator per key,
    // then one transpose-and-add tree (vhsums) gives the VW scores as a vector. A store past a
    // block's end is overwritten by the next block's scores (or padded below).
    for (int b = 0; b < nblk; b++) {
        const int nb = b == nblk - 1 ? last_n : bs;
        for (int t0 = 0; t0 < nb; t0 += VW) {
#ifdef VNNI_SCORES
            if (j->kind == I8 && D % 64 == 0) {
                if (nb - t0 >= VW) score_keys_i8(j, s, row0[b] + t0 * stride, VW, p + b * bs + t0, G, D);
                else score_keys_i8(j, s, row0[b] + t0 * stride, nb - t0, p + b * bs + t0, G, D);
                continue;
            }
#endif
#ifdef BF16_SCORES
            if (j->kind == BF16 && D % 32 == 0) {
                if (nb - t0 >= VW) score_keys_bf16(j, s, row0[b] + t0 * stride, VW, p + b * bs + t0, G, D);
                else score_keys_bf16(j, s, row0[b] + t0 * stride, nb - t0, p + b * bs + t0, G, D);
                continue;
            }
#endif
            if (nb - t0 >= VW) score_keys(j, s, row0[b] + t0 * stride, VW, p + b * bs + t0, G, CH);
            else score_keys(j, s, row0[b] + t0 * stride, nb - t0, p + b * bs + t0, G, CH);
        }
    }
    if (j->ks) scale_keys(j, j->ks, p, MAX_TILE, 1, row0, nblk, last_n, G, D);
    const int padded = (n + VW - 1) / VW * VW;
    for (int g = 0; g < G; g++) {  // online softmax: rescale to the new max, exponentiate
        float *pg = p + g * MAX_TILE;
        if (j->softcap > 0.f) soft_cap(pg, n, j->softcap);
        if (j->alibi)  // key t sits at position pos0 + t
            for (int t = 0; t < n; t++) pg[t] += s->slope[g] * (float)(pos0 + t - s->last_pos);
        for (int t = 0; t < skip; t++) pg[t] = NEG;  // before the row's window
        for (int t = n; t < padded; t++) pg[t] = NEG;
        vf vm = vset1(NEG);
        for (int t = 0; t < padded; t += VW) vm = vmax(vm, vload(pg + t));
        const float mx = vhmax(vm);
        if (mx > s->m[g]) {
            const float c = expf(s->m[g] - mx);
            s->l[g] *= c;
            const vf vc = vset1(c);
            for (int d = 0; d < D; d += VW) vstore(s->acc + g * D + d, vmul(vload(s->acc + g * D + d), vc));
            s->m[g] = mx;
        }
        const vf vmx = vset1(s->m[g]);
        vf sum = vzero();
        for (int t = 0; t < padded; t += VW) {
            const vf e = vexp(vsub(vload(pg + t), vmx));
            vstore(pg + t, e);
            sum = vadd(sum, e);
        }
        s->l[g] += vhsum(sum);
    }
    if (j->vs) scale_keys(j, j->vs, p, MAX_TILE, 1, row0, nblk, last_n, G, D);
    float *acc[MAX_G];  // acc_g += sum_t p[g][t] v_t
    for (int g = 0; g < G; g++) acc[g] = s->acc + g * D;
#ifdef BF16_SCORES
    if (j->kind == BF16 && D % 32 == 0) {
        add_values_bf16(j, acc, p, row0, nblk, last_n, G, D);
        return;
    }
#endif
    add_values(j, acc, p, MAX_TILE, 1, row0, nblk, last_n, G, CH);
}

// ---- The shared blocks of a group of rows, scored as one small GEMM -------------------------
//
// A group's rows see its shared blocks alike, so all its query vectors (row s, head g: vector
// r = s * G + g) are scored together: with the queries transposed once per group (qt[d][r]),
// the scores of NK keys against VW query vectors are NK x (VW-wide) accumulators fed by one
// broadcast key element and one query vector per step of d, no horizontal sums; the scores come
// out as sc[t][r], so the softmax of every query vector is elementwise across the keys.

// sc[kk][rv0 .. rv0 + RB vectors) = keys krow + kk * stride (kk < NK) against qt's vectors.
SIMD_INLINE void group_scores(const Job *j, const float *qt, int RP, int rv0, int64_t krow,
                              float *sc, const int NK, const int RB, const int D) {
    const int64_t stride = (int64_t)j->Hkv * D;
    vf a[4][4];
    for (int kk = 0; kk < NK; kk++)
        for (int i = 0; i < RB; i++) a[kk][i] = vzero();
    for (int d = 0; d < D; d++) {
        vf q[4];
        for (int i = 0; i < RB; i++) q[i] = vload(qt + (int64_t)d * RP + (rv0 + i) * VW);
        for (int kk = 0; kk < NK; kk++) {
            const vf kd = vset1(load_elt(j->kind, j->k, krow + kk * stride + d));
            for (int i = 0; i < RB; i++) a[kk][i] = vfma(kd, q[i], a[kk][i]);
        }
    }
    for (int kk = 0; kk < NK; kk++)
        for (int i = 0; i < RB; i++) vstore(sc + (int64_t)kk * RP + (rv0 + i) * VW, a[kk][i]);
}

// Folds the tile of nblk full blocks at row0[] into the states of all the group's query vectors
// (m, l, acc[r]; RV vectors of VW query vectors, padded with zero queries).
SIMD_INLINE void group_tile(const Job *j, const float *qt, float *sc, float *m, float *l,
                            float *const *acc, int R, const int64_t *row0, int nblk,
                            const State *const *st, int64_t pos0, const int CH) {
    const int D = CH * VW, bs = j->bs, n = nblk * bs, RV = (R + VW - 1) / VW, RP = RV * VW;
    for (int b = 0; b < nblk; b++)
        for (int t = 0; t < bs; t += 4) {
            const int64_t krow = row0[b] + t * (int64_t)j->Hkv * D;
            float *out = sc + (int64_t)(b * bs + t) * RP;
            int rv0 = 0;
            if (bs - t >= 4) {  // RB literal: 4 keys x up to 4 vectors of query vectors per call
                for (; rv0 + 4 <= RV; rv0 += 4) group_scores(j, qt, RP, rv0, krow, out, 4, 4, D);
                if (RV - rv0 == 3) group_scores(j, qt, RP, rv0, krow, out, 4, 3, D);
                else if (RV - rv0 == 2) group_scores(j, qt, RP, rv0, krow, out, 4, 2, D);
                else if (RV - rv0 == 1) group_scores(j, qt, RP, rv0, krow, out, 4, 1, D);
            } else {
                for (int kk = 0; kk < bs - t; kk++)
                    for (rv0 = 0; rv0 < RV; rv0++)
                        group_scores(j, qt, RP, rv0, krow + kk * (int64_t)j->Hkv * D, out + (int64_t)kk * RP, 1, 1, D);
            }
        }
    if (j->ks) scale_keys(j, j->ks, sc, 1, RP, row0, nblk, bs, RP, D);
    if (j->softcap > 0.f) soft_cap(sc, (int64_t)n * RP, j->softcap);
    if (j->alibi) {  // query vector r is head r % G of the row whose state is st[r / G]
        const int G = j->H / j->Hkv;
        for (int r = 0; r < R; r++) {
            const State *x = st[r / G];
            const float slope = x->slope[r % G];
            for (int t = 0; t < n; t++) sc[(int64_t)t * RP + r] += slope * (float)(pos0 + t - x->last_pos);
        }
    }
    float c[MAX_GROUP * MAX_G + VW];
    for (int rv = 0; rv < RV; rv++) {  // online softmax of every query vector, across the keys
        vf mx = vset1(NEG);
        for (int t = 0; t < n; t++) mx = vmax(mx, vload(sc + (int64_t)t * RP + rv * VW));
        const vf mo = vload(m + rv * VW), mn = vmax(mo, mx);
        vstore(c + rv * VW, vexp(vsub(mo, mn)));
        vstore(m + rv * VW, mn);
        vf sum = vzero();
        for (int t = 0; t < n; t++) {
            float *x = sc + (int64_t)t * RP + rv * VW;
            const vf e = vexp(vsub(vload(x), mn));
            vstore(x, e);
            sum = vadd(sum, e);
        }
        vstore(l + rv * VW, vadd(vmul(vload(l + rv * VW), vload(c + rv * VW)), sum));
    }
    for (int r = 0; r < R; r++)
        if (c[r] != 1.f) {
            const vf vc = vset1(c[r]);
            for (int d = 0; d < D; d += VW) vstore(acc[r] + d, vmul(vload(acc[r] + d), vc));
        }
    if (j->vs) scale_keys(j, j->vs, sc, 1, RP, row0, nblk, bs, RP, D);
    const int NR = VW == 1 ? 1 : 12 / CH > 0 ? 12 / CH : 1;
    int r0 = 0;
    for (; r0 + NR <= R; r0 += NR) add_values(j, acc + r0, sc + r0, 1, RP, row0, nblk, bs, NR, CH);
    for (; r0 < R; r0++) add_values(j, acc + r0, sc + r0, 1, RP, row0, nblk, bs, 1, CH);
}

// An int8 cache scores against the query rounded to int8 per head (as int8_kv.quantize_rows
// rounds a row; the Python wrapper has rounded it already, which this leaves as it is): qi, its
// scale and sum for score_keys_i8, and q itself set to qi * qs for the float paths.
__attribute__((optimize("no-reciprocal-math")))
static void round_query(State *x, int G, int D) {
    for (int g = 0; g < G; g++) {
        float *q = x->q + g * D, amax = 0.f;
        for (int d = 0; d < D; d++) amax = fmaxf(amax, fabsf(q[d]));
        const float scale = amax > 0.f ? amax / 127.f : 1.f, inv = amax > 0.f ? 127.f / amax : 1.f;
        int sum = 0;
        for (int d = 0; d < D; d++) {
            const float r = fminf(fmaxf(rintf(q[d] * inv), -127.f), 127.f);
            x->qi[g * D + d] = (int8_t)r;
            sum += (int)r;
            q[d] = r * scale;
        }
        x->qs[g] = scale;
        x->qsum[g] = (float)sum;
    }
}

// A bfloat16 cache scores against the query q (not yet scaled) rounded to bfloat16, to nearest
// even, on every path: x->q = that times scale, and qb its bfloat16 pairs for score_keys_bf16
// (which scales the scores instead). A bfloat16 model's query is left as it is.
static void round_query_bf16(State *x, const float *q, float scale, int G, int D) {
    for (int i = 0; i < G * D; i++) {
        const uint32_t bits = (uint32_t)bf16_bits(q[i]) << 16;
        float r;
        memcpy(&r, &bits, 4);
        x->q[i] = r * scale;
    }
    for (int i = 0; i < G * D / 2; i++)
        x->qb[i] = (uint32_t)bf16_bits(q[2 * i]) | (uint32_t)bf16_bits(q[2 * i + 1]) << 16;
}

// Asks the memory system for the K and V rows of heads [h0, h0 + per) of n blocks of a table,
// from block b0. The blocks of a table lie anywhere in the pool, which the hardware prefetchers
// cannot guess: without this the kernel waits on memory at the first touch of every block.
// Into L2, not L1 (locality 2, prefetcht1): a tile's K and V are larger than L1, and fetching
// the next tile into L1 evicted the one being computed (20-35% of the kernel's time on a
// scattered pool; benchmarks/decode_attention.py).
static inline void prefetch_blocks(const Job *j, const int64_t *table, int64_t b0, int64_t n,
                                   int h0, int per) {
    const int elt = elt_size(j->kind), per_line = 64 / elt, D = j->D;
    const int64_t stride = (int64_t)j->Hkv * D;
    for (int64_t b = b0; b < b0 + n; b++) {
        const int64_t base = table[b] * j->bs * stride + (int64_t)h0 * D;
        for (int t = 0; t < j->bs; t++)
            for (int d = 0; d < per * D; d += per_line) {
                __builtin_prefetch((const char *)j->k + (base + t * stride + d) * elt, 0, 2);
                __builtin_prefetch((const char *)j->v + (base + t * stride + d) * elt, 0, 2);
            }
    }
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The first tile of item `item`'s first row, its h-th head: asked for while the item before it
// finishes (a thread's items follow each other, and a row of its own starts cold otherwise).
static void prefetch_item(const Job *j, int item, int h, int tile) {
    const int per = j->per_item, grp = item / (j->Hkv / per), h0 = item % (j->Hkv / per) * per;
    const int64_t row = j->order[j->group_start[grp]];
    const int64_t blocks = (j->row_len[row] + j->bs - 1) / j->bs;
    const int64_t b0 = j->row_first ? j->row_first[row] / j->bs : 0;
    if (b0 < blocks)
        prefetch_blocks(j, j->tables + j->row_table[row] * j->max_blocks, b0, min64(tile, blocks - b0), h0 + h, 1);
}

// One item: a group's rows for KV heads [h0, h0 + per). G_lit and CH_lit are literals for the
// specialised shapes, 0 else. A tile's blocks are walked for every head of the item while they
// are in cache (a block's rows hold all the heads side by side), and while one tile is
// computed the next one (of the same walk, or the next row's first, or at the item's end the
// first of the thread's next item: `next`, -1 for none) is prefetched.
SIMD_INLINE void run_group(const Job *j, int item, int next, float *buf, State *st, float *gbuf,
                           const int G_lit, const int CH_lit) {
    const int per = j->per_item, grp = item / (j->Hkv / per), h0 = item % (j->Hkv / per) * per;
    const int G = G_lit ? G_lit : j->H / j->Hkv, CH = CH_lit ? CH_lit : j->D / VW;
    const int D = CH * VW, bs = j->bs, first = j->group_start[grp];
    const int tile = TILE_KEYS / bs > 1 ? TILE_KEYS / bs : 1;  // blocks per tile
    const int count = j->group_start[grp + 1] - first;
    // A row with a window starts its walk where its window does: no blocks are shared then.
    int64_t shared = j->group_shared && !j->row_first ? j->group_shared[grp] : 0;
    // per_row (--batch-invariant): the shared blocks are still read from memory once for the
    // group, but each row is scored by attend_tile, as it would be alone, and the shared walk ends
    // on a tile boundary, so a row's tiles (and online-softmax updates) fall where they fall
    // alone: the same bits in a group or not.
    if (j->per_row) shared -= shared % tile;
    float p[MAX_G * MAX_TILE + 16];
    int64_t row0[MAX_TILE];
    for (int s = 0; s < count; s++) {  // state s * per + h: row s, head h0 + h
        const int64_t row = j->order[first + s];
        for (int h = 0; h < per; h++) {
            State *x = &st[s * per + h];
            const float *q = j->q + (row * j->H + (int64_t)(h0 + h) * G) * D;
            x->q = buf + (int64_t)(s * per + h) * STATE_FLOATS(G, D);
            x->acc = x->q + G * D;
            x->qi = (int8_t *)(x->acc + G * D);
            x->qb = (uint32_t *)(x->acc + G * D);
            for (int i = 0; i < G * D; i++) { x->q[i] = q[i] * j->scale; x->acc[i] = 0.f; }
            for (int g = 0; g < G; g++) { x->m[g] = NEG; x->l[g] = 0.f; }
            if (j->kind == I8) round_query(x, G, D);
            if (j->kind == BF16) round_query_bf16(x, q, j->scale, G, D);
            x->last_pos = j->row_len[row] - 1;
            for (int g = 0; g < G; g++) x->slope[g] = j->alibi ? j->alibi[(h0 + h) * G + g] : 0.f;
        }
    }
#define TABLE(s) (j->tables + j->row_table[j->order[first + (s)]] * j->max_blocks)
#define BLOCKS(s) ((j->row_len[j->order[first + (s)]] + bs - 1) / bs)
    const int64_t *table0 = TABLE(0);
    // Rows sharing blocks: their query vectors scored together (group_tile), per head h with
    // m, l and the transposed queries at gbuf + h * (D + 2) * RP and scores at sc.
    const int R = count * G, RP = (R + VW - 1) / VW * VW;
    const int grouped = VW > 1 && count > 1 && shared > 0 && !j->per_row;
    float *const sc = gbuf + (int64_t)per * (D + 2) * RP;
    float *acc[MAX_GROUP * MAX_G];
    if (grouped)
        for (int h = 0; h < per; h++) {
            float *gm = gbuf + (int64_t)h * (D + 2) * RP, *qt = gm + 2 * RP;
            for (int r = 0; r < RP; r++) {
                gm[r] = NEG;
                gm[RP + r] = 0.f;
                const State *x = &st[(r < R ? r / G : 0) * per + h];
                for (int d = 0; d < D; d++) qt[(int64_t)d * RP + r] = r < R ? x->q[(r % G) * D + d] : 0.f;
            }
        }
    // asked for again when the item before it did (prefetch_item): dropping this was 2-5% slower
    prefetch_blocks(j, table0, 0, min64(tile, shared > 0 ? shared : BLOCKS(0)), h0, per);
    for (int64_t b0 = 0; b0 < shared; b0 += tile) {  // the shared blocks: one pass for the group
        const int nblk = (int)min64(shared - b0, tile);
        if (b0 + nblk < shared) prefetch_blocks(j, table0, b0 + nblk, min64(tile, shared - b0 - nblk), h0, per);
        else prefetch_blocks(j, table0, shared, min64(tile, BLOCKS(0) - shared), h0, per);
        for (int h = 0; h < per; h++) {
            for (int b = 0; b < nblk; b++) row0[b] = (table0[b0 + b] * bs * j->Hkv + h0 + h) * D;
            if (grouped) {
                float *const gm = gbuf + (int64_t)h * (D + 2) * RP;
                const State *rows[MAX_GROUP];
                for (int s = 0; s < count; s++) rows[s] = &st[s * per + h];
                for (int r = 0; r < R; r++) acc[r] = st[(r / G) * per + h].acc + (r % G) * D;
                group_tile(j, gm + 2 * RP, sc, gm, gm + RP, acc, R, row0, nblk, rows, b0 * bs, CH);
            } else {
                for (int s = 0; s < count; s++) attend_tile(j, &st[s * per + h], row0, nblk, bs, 0, b0 * bs, p, G, CH);
            }
        }
    }
    if (grouped)  // the group's m and l back into its rows' states
        for (int h = 0; h < per; h++)
            for (int r = 0; r < R; r++) {
                const float *gm = gbuf + (int64_t)h * (D + 2) * RP;
                st[(r / G) * per + h].m[r % G] = gm[r];
                st[(r / G) * per + h].l[r % G] = gm[RP + r];
            }
    for (int s = 0; s < count; s++) {  // each row's own blocks, then out = acc / l
        const int64_t row = j->order[first + s], L = j->row_len[row];
        const int64_t *table = TABLE(s);
        const int64_t blocks = BLOCKS(s), first_pos = j->row_first ? j->row_first[row] : 0;
        const int64_t start = shared > first_pos / bs ? shared : first_pos / bs;
        for (int64_t b0 = start; b0 < blocks; b0 += tile) {
            const int nblk = (int)min64(blocks - b0, tile);
            const int last_n = (int)(b0 + nblk == blocks ? L - (blocks - 1) * bs : bs);
            const int skip = (int)(b0 == start ? first_pos - start * bs : 0);
            for (int h = 0; h < per; h++) {
                // the next tile, a head at a time: in one burst its lines overran the core's
                // outstanding misses and stalled it (int8 cache 0.82x the time, 16-bit 0.93-0.98x)
                if (b0 + nblk < blocks) prefetch_blocks(j, table, b0 + nblk, min64(tile, blocks - b0 - nblk), h0 + h, 1);
                else if (s + 1 < count) prefetch_blocks(j, TABLE(s + 1), shared, min64(tile, BLOCKS(s + 1) - shared), h0 + h, 1);
                else if (next >= 0) prefetch_item(j, next, h, tile);
                for (int b = 0; b < nblk; b++) row0[b] = (table[b0 + b] * bs * j->Hkv + h0 + h) * D;
                attend_tile(j, &st[s * per + h], row0, nblk, last_n, skip, b0 * bs, p, G, CH);
            }
        }
        for (int h = 0; h < per; h++) {
            const State *x = &st[s * per + h];
            float *out = j->out + (row * j->H + (int64_t)(h0 + h) * G) * D;
            for (int g = 0; g < G; g++) {
                float inv = 1.f / x->l[g];
                if (j->sinks) {  // the sink's exp(logit) joins the sum, rescaled to a common max
                    const float sink = j->sinks[(h0 + h) * G + g], mx = sink > x->m[g] ? sink : x->m[g];
                    const float c = expf(x->m[g] - mx);
                    inv = c / (x->l[g] * c + expf(sink - mx));
                }
                for (int d = 0; d < D; d++) out[g * D + d] = x->acc[g * D + d] * inv;
            }
        }
    }
#undef TABLE
#undef BLOCKS
}

#define CASE(g, d) case (g) * 1024 + (d): run_group(j, item, next, buf, st, gbuf, g, (d) / VW); return;
static void run_item(const Job *j, int item, int next, float *buf, State *st, float *gbuf) {
    switch ((j->H / j->Hkv) * 1024 + j->D) {
#if defined(ONLY_G) && defined(ONLY_D)  // one model's shape: a build in a tenth of the time
        CASE(ONLY_G, ONLY_D)
#elif defined(ONLY_CASES)  // a few shapes: CASE(g, d) ... (kernels.shape_flags)
        ONLY_CASES
#elif !defined(NO_SPECIALISED)
        CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64)
        CASE(8, 64) CASE(1, 128) CASE(2, 128) CASE(3, 128) CASE(4, 128) CASE(5, 128)
        CASE(6, 128) CASE(7, 128) CASE(8, 128)
#endif
    }
    run_group(j, item, next, buf, st, gbuf, 0, 0);
}

static void run_range(const void *arg, int i) {
    const Job *j = (const Job *)arg + i;
    if (j->first >= j->last) return;
    const int states = MAX_GROUP * j->per_item;
    float *buf = malloc(sizeof(float) * states * STATE_FLOATS(j->H / j->Hkv, j->D));
    State *st = malloc(sizeof(State) * states);
    // group_tile's scratch: per head of an item m, l and the transposed queries, then the scores
    const int64_t RP = (MAX_GROUP * (j->H / j->Hkv) + VW - 1) / VW * VW;
    float *gbuf = malloc(sizeof(float) * RP * ((int64_t)j->per_item * (j->D + 2) + MAX_TILE));
    if (buf && st && gbuf)
        for (int item = j->first; item < j->last; item++)
            run_item(j, item, item + 1 < j->last ? item + 1 : -1, buf, st, gbuf);
    free(buf);
    free(st);
    free(gbuf);
}

// Attention for the rows of `groups` groups (see the top of the file), row r seeing positions
// [row_first[r], row_len[r]) (row_first NULL: from 0) with scores soft-capped at softcap (0:
// none) and sinks[h] (NULL: none) added to head h's softmax denominator as exp(sinks[h]);
// ks / vs: an int8 cache's scales per (slot, KV head) (NULL: none); alibi[h] (NULL: none): head
// h's score of the key at position p gains alibi[h] * (p - (row_len[r] - 1)), ALiBi measured from
// the row's last visible key (a constant per row, which the softmax ignores: BLOOM's slope * p).
// per_row: every row's numbers as it would get them alone (Job.per_row).
// Returns 0, or -1 for shapes the kernel does not take (the caller then uses PyTorch).
int paged_attention_scaled(const float *q, const void *k, const void *v, const int64_t *tables,
                           int max_blocks, const int64_t *row_table, const int64_t *row_len,
                           float *out, int H, int Hkv, int D, int block_size, float scale, int kind,
                           int threads, int groups, const int32_t *order,
                           const int32_t *group_start, const int32_t *group_shared,
                           const int64_t *row_first, float softcap, const float *sinks,
                           const float *ks, const float *vs, const float *alibi, int per_row) {
    if (D > MAX_D || D % VW || H % Hkv || H / Hkv > MAX_G || block_size > MAX_BS) return -1;
    for (int g = 0; g < groups; g++)
        if (group_start[g + 1] - group_start[g] > MAX_GROUP) return -1;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    // An item takes all the KV heads of a group (their rows lie side by side in a block) unless
    // that leaves too few items to spread over the threads.
    const int per = groups >= 4 * threads ? Hkv : 1, items = groups * (Hkv / per);
    if (threads > items) threads = items;
    if (threads < 1) return 0;
    // Split by estimated cost: every row's context is computed on, shared blocks are read once.
    int64_t *cost = malloc(sizeof(int64_t) * (groups + 1)), total = 0;
    if (!cost) return -1;
    for (int g = 0; g < groups; g++) {
        const int64_t shared_rows = (group_shared && !row_first ? group_shared[g] : 0) * (int64_t)block_size;
        int64_t c = shared_rows;
        for (int s = group_start[g]; s < group_start[g + 1]; s++)
            c += 2 * (row_len[order[s]] - (row_first ? row_first[order[s]] : 0)) - shared_rows;
        cost[g] = c;
        total += c * (Hkv / per);
    }
    Job jobs[64];
    int item = 0;
    int64_t acc = 0;
    for (int i = 0; i < threads; i++) {
        const int64_t goal = total * (i + 1) / threads;
        jobs[i] = (Job){q, k, v, tables, row_table, row_len, out, order, group_start, group_shared,
                        row_first, H, Hkv, D, block_size, max_blocks, kind, per, scale, softcap,
                        sinks, ks, vs, alibi, per_row, item, item};
        while (item < items && (acc < goal || i == threads - 1)) acc += cost[item++ / (Hkv / per)];
        jobs[i].last = item;
    }
    free(cost);
    parallel_tasks(run_range, jobs, threads);
    return 0;
}

// paged_attention_scaled for a cache without scales.
int paged_attention_masked(const float *q, const void *k, const void *v, const int64_t *tables,
                           int max_blocks, const int64_t *row_table, const int64_t *row_len,
                           float *out, int H, int Hkv, int D, int block_size, float scale, int kind,
                           int threads, int groups, const int32_t *order,
                           const int32_t *group_start, const int32_t *group_shared,
                           const int64_t *row_first, float softcap, const float *sinks) {
    return paged_attention_scaled(q, k, v, tables, max_blocks, row_table, row_len, out, H, Hkv, D,
                                  block_size, scale, kind, threads, groups, order, group_start,
                                  group_shared, row_first, softcap, sinks, NULL, NULL, NULL, 0);
}

// paged_attention_masked with every row seeing its whole context, scores as they are.
int paged_attention(const float *q, const void *k, const void *v, const int64_t *tables,
                    int max_blocks, const int64_t *row_table, const int64_t *row_len, float *out,
                    int H, int Hkv, int D, int block_size, float scale, int kind, int threads,
                    int groups, const int32_t *order, const int32_t *group_start,
                    const int32_t *group_shared) {
    return paged_attention_masked(q, k, v, tables, max_blocks, row_table, row_len, out, H, Hkv,
                                  D, block_size, scale, kind, threads, groups, order, group_start,
                                  group_shared, NULL, 0.f, NULL);
}

// Decode attention, one query token per sequence, each sequence on its own (no grouping): the
// interface benchmarks/decode_attention.py and the plain path use.
int paged_decode_attention(const float *q, const void *k, const void *v, const int64_t *tables,
                           const int64_t *lens, float *out, int B, int H, int Hkv, int D,
                           int block_size, int max_blocks, float scale, int kind, int threads) {
    int64_t *rows = malloc(sizeof(int64_t) * (B + 1));
    int32_t *idx = malloc(sizeof(int32_t) * (B + 1));
    int rc = -1;
    if (rows && idx) {
        for (int b = 0; b <= B; b++) { rows[b] = b; idx[b] = b; }
        rc = paged_attention(q, k, v, tables, max_blocks, rows, lens, out, H, Hkv, D, block_size,
                             scale, kind, threads, B, idx, idx, NULL);
    }
    free(rows);
    free(idx);
    return rc;
}

// ---- Grouping decode sequences by shared leading blocks -------------------------------------

typedef struct {
    const int64_t *tables, *lens;
    int max_blocks, bs;
} Tables;

static int64_t full_blocks(const Tables *t, int b) {  // blocks wholly inside b's context
    const int64_t f = t->lens[b] / t->bs;
    return f < t->max_blocks ? f : t->max_blocks;
}

static int64_t common_blocks(const Tables *t, int a, int b) {
    const int64_t n = full_blocks(t, a) < full_blocks(t, b) ? full_blocks(t, a) : full_blocks(t, b);
    const int64_t *ta = t->tables + (int64_t)a * t->max_blocks, *tb = t->tables + (int64_t)b * t->max_blocks;
    int64_t i = 0;
    while (i < n && ta[i] == tb[i]) i++;
    return i;
}

static int table_less(const Tables *t, int a, int b) {  // lexicographic on full blocks, then index
    const int64_t i = common_blocks(t, a, b), fa = full_blocks(t, a), fb = full_blocks(t, b);
    if (i < fa && i < fb) return t->tables[(int64_t)a * t->max_blocks + i] < t->tables[(int64_t)b * t->max_blocks + i];
    if (fa != fb) return fa < fb;
    return a < b;
}

static void merge_sort(const Tables *t, int32_t *x, int32_t *tmp, int n) {
    if (n < 2) return;
    const int h = n / 2;
    merge_sort(t, x, tmp, h);
    merge_sort(t, x + h, tmp, n - h);
    int i = 0, k = h, o = 0;
    while (i < h && k < n) tmp[o++] = table_less(t, x[k], x[i]) ? x[k++] : x[i++];
    while (i < h) tmp[o++] = x[i++];
    while (k < n) tmp[o++] = x[k++];
    memcpy(x, tmp, sizeof(int32_t) * n);
}

// Groups the B sequences (block tables [B, max_blocks], context lengths lens) so that blocks
// read once for a group save the most reads: sequences sorted by their tables, then cut into
// runs of at most max_group maximising sum over groups of (size - 1) * shared blocks (dynamic
// programming over the sorted order). Writes order [B], group_start [groups + 1] and
// shared [groups] (0 for a sequence alone) and returns the number of groups, or -1.
int cascade_groups(const int64_t *tables, const int64_t *lens, int B, int max_blocks,
                   int block_size, int max_group, int32_t *order, int32_t *group_start,
                   int32_t *shared) {
    const Tables t = {tables, lens, max_blocks, block_size};
    if (max_group > MAX_GROUP) max_group = MAX_GROUP;
    int32_t *tmp = malloc(sizeof(int32_t) * (B + 1)), *from = malloc(sizeof(int32_t) * (B + 1));
    int64_t *lcp = malloc(sizeof(int64_t) * (B + 1)), *best = malloc(sizeof(int64_t) * (B + 1));
    int groups = -1;
    if (!tmp || !from || !lcp || !best) goto done;
    for (int b = 0; b < B; b++) order[b] = b;
    merge_sort(&t, order, tmp, B);
    for (int i = 1; i < B; i++) lcp[i] = common_blocks(&t, order[i - 1], order[i]);
    best[0] = 0;  // best[j]: most blocks saved by grouping the first j sorted sequences
    for (int j = 1; j <= B; j++) {
        best[j] = best[j - 1];
        from[j] = j - 1;
        int64_t mn = INT64_MAX;
        for (int i = j - 2; i >= 0 && j - i <= max_group; i--) {  // group = sorted[i, j)
            if (lcp[i + 1] < mn) mn = lcp[i + 1];
            if (mn == 0) break;
            if (best[i] + (j - i - 1) * mn > best[j]) { best[j] = best[i] + (j - i - 1) * mn; from[j] = i; }
        }
    }
    groups = 0;  // backtrack: group starts from the end, then reverse
    for (int j = B; j > 0; j = from[j]) tmp[groups++] = from[j];
    for (int g = 0; g < groups; g++) {
        const int start = tmp[groups - 1 - g], end = g + 1 < groups ? tmp[groups - 2 - g] : B;
        group_start[g] = start;
        int64_t mn = end - start > 1 ? INT64_MAX : 0;
        for (int i = start + 1; i < end; i++) mn = lcp[i] < mn ? lcp[i] : mn;
        shared[g] = (int32_t)mn;
    }
    group_start[groups] = B;
done:
    free(tmp); free(from); free(lcp); free(best);
    return groups;
}
