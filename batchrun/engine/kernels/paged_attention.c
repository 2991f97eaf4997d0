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
// Work is split over (group, kv head) items across threads by estimated cost. KV elements are
// float32, float16 or bfloat16, widened to float32 on load; arithmetic is float32. The vector
// width comes from simd.h (AVX-512, AVX2+FMA or portable); G (query heads per KV head) and D
// are compile-time constants for the common shapes so the loops unroll into registers.
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "simd.h"

#define MAX_D 256
#define MAX_G 16
#define MAX_BS 256
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
    int H, Hkv, D, bs, max_blocks, kind;
    float scale;
    int first, last;           // range of (group * Hkv + kvh) work items
} Job;

typedef struct {  // one row's query heads of one KV head
    float *q, *acc;
    float m[MAX_G], l[MAX_G];
} State;

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
        vstore(p + g * MAX_BS, vhsums(acc));
    }
}

// Fold the n rows of one block (starting at element row0 of the pools) into a row's state.
SIMD_INLINE void attend_block(const Job *j, State *s, int64_t row0, int n, float *p, const int G,
                              const int CH) {
    const int D = CH * VW;
    const int64_t stride = (int64_t)j->Hkv * D;
    // Scores p[g][t] = q_g . k_t (q is pre-scaled), VW keys at a time: one accumulator per key,
    // then one transpose-and-add tree (vhsums) gives the VW scores as a vector.
    for (int t0 = 0; t0 < n; t0 += VW) {
        if (n - t0 >= VW) score_keys(j, s, row0 + t0 * stride, VW, p + t0, G, CH);
        else score_keys(j, s, row0 + t0 * stride, n - t0, p + t0, G, CH);
    }
    const int padded = (n + VW - 1) / VW * VW;
    for (int g = 0; g < G; g++) {  // online softmax: rescale to the new max, exponentiate
        float *pg = p + g * MAX_BS;
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
    // acc_g += sum_t p[g][t] v_t, CB vector columns at a time (G * CB accumulators in registers,
    // each p[g][t] broadcast once per CB columns).
    const int CB = G * CH <= 12 ? CH : 12 / G > 0 ? 12 / G : 1;
    for (int c0 = 0; c0 < CH; c0 += CB) {
        const int cb = CH - c0 < CB ? CH - c0 : CB;
        vf a[MAX_G * 12];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < cb; c++) a[g * CB + c] = vload(s->acc + g * D + (c0 + c) * VW);
        for (int t = 0; t < n; t++) {
            vf vc[12];
            for (int c = 0; c < cb; c++) vc[c] = vload_kv(j->kind, j->v, row0 + t * stride + (c0 + c) * VW);
            for (int g = 0; g < G; g++) {
                const vf pg = vset1(p[g * MAX_BS + t]);
                for (int c = 0; c < cb; c++) a[g * CB + c] = vfma(pg, vc[c], a[g * CB + c]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < cb; c++) vstore(s->acc + g * D + (c0 + c) * VW, a[g * CB + c]);
    }
}

// One (group, kv head) item. G_lit and CH_lit are literals for the specialised shapes, 0 else.
SIMD_INLINE void run_group(const Job *j, int item, float *buf, const int G_lit, const int CH_lit) {
    const int grp = item / j->Hkv, kvh = item % j->Hkv;
    const int G = G_lit ? G_lit : j->H / j->Hkv, CH = CH_lit ? CH_lit : j->D / VW;
    const int D = CH * VW, bs = j->bs, first = j->group_start[grp];
    const int count = j->group_start[grp + 1] - first;
    const int64_t shared = j->group_shared ? j->group_shared[grp] : 0;
    State st[MAX_GROUP];
    float p[MAX_G * MAX_BS + 16];
    for (int s = 0; s < count; s++) {
        const int64_t row = j->order[first + s];
        const float *q = j->q + (row * j->H + (int64_t)kvh * G) * D;
        st[s].q = buf + (int64_t)s * 2 * G * D;
        st[s].acc = st[s].q + G * D;
        for (int i = 0; i < G * D; i++) { st[s].q[i] = q[i] * j->scale; st[s].acc[i] = 0.f; }
        for (int g = 0; g < G; g++) { st[s].m[g] = NEG; st[s].l[g] = 0.f; }
    }
    const int64_t *table0 = j->tables + j->row_table[j->order[first]] * j->max_blocks;
    for (int64_t blk = 0; blk < shared; blk++) {  // the shared blocks: one pass for the group
        const int64_t row0 = (table0[blk] * bs * j->Hkv + kvh) * D;
        for (int s = 0; s < count; s++) attend_block(j, &st[s], row0, bs, p, G, CH);
    }
    for (int s = 0; s < count; s++) {  // each row's own blocks, then out = acc / l
        const int64_t row = j->order[first + s], L = j->row_len[row];
        const int64_t *table = j->tables + j->row_table[row] * j->max_blocks;
        const int64_t blocks = (L + bs - 1) / bs;
        for (int64_t blk = shared; blk < blocks; blk++) {
            const int n = (int)(blk == blocks - 1 ? L - blk * bs : bs);
            attend_block(j, &st[s], (table[blk] * bs * j->Hkv + kvh) * D, n, p, G, CH);
        }
        float *out = j->out + (row * j->H + (int64_t)kvh * G) * D;
        for (int g = 0; g < G; g++) {
            const float inv = 1.f / st[s].l[g];
            for (int d = 0; d < D; d++) out[g * D + d] = st[s].acc[g * D + d] * inv;
        }
    }
}

#define CASE(g, d) case (g) * 1024 + (d): run_group(j, item, buf, g, (d) / VW); return;
static void run_item(const Job *j, int item, float *buf) {
    switch ((j->H / j->Hkv) * 1024 + j->D) {
#if defined(ONLY_G) && defined(ONLY_D)  // one model's shape: a build in a tenth of the time
        CASE(ONLY_G, ONLY_D)
#elif !defined(NO_SPECIALISED)
        CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64)
        CASE(8, 64) CASE(1, 128) CASE(2, 128) CASE(3, 128) CASE(4, 128) CASE(5, 128)
        CASE(6, 128) CASE(7, 128) CASE(8, 128)
#endif
    }
    run_group(j, item, buf, 0, 0);
}

static void run_range(const void *arg, int i) {
    const Job *j = (const Job *)arg + i;
    if (j->first >= j->last) return;
    float *buf = malloc(sizeof(float) * MAX_GROUP * 2 * j->H / j->Hkv * j->D);
    if (!buf) return;
    for (int item = j->first; item < j->last; item++) run_item(j, item, buf);
    free(buf);
}

// Attention for the rows of `groups` groups (see the top of the file). Returns 0, or -1 for
// shapes the kernel does not take (the caller then uses PyTorch).
int paged_attention(const float *q, const void *k, const void *v, const int64_t *tables,
                    int max_blocks, const int64_t *row_table, const int64_t *row_len, float *out,
                    int H, int Hkv, int D, int block_size, float scale, int kind, int threads,
                    int groups, const int32_t *order, const int32_t *group_start,
                    const int32_t *group_shared) {
    if (D > MAX_D || D % VW || H % Hkv || H / Hkv > MAX_G || block_size > MAX_BS) return -1;
    for (int g = 0; g < groups; g++)
        if (group_start[g + 1] - group_start[g] > MAX_GROUP) return -1;
    const int items = groups * Hkv;
    if (threads < 1) threads = 1;
    if (threads > items) threads = items;
    if (threads > 64) threads = 64;
    if (threads < 1) return 0;
    // Split by estimated cost: every row's context is computed on, shared blocks are read once.
    int64_t *cost = malloc(sizeof(int64_t) * (groups + 1)), total = 0;
    if (!cost) return -1;
    for (int g = 0; g < groups; g++) {
        const int64_t shared_rows = (group_shared ? group_shared[g] : 0) * (int64_t)block_size;
        int64_t c = shared_rows;
        for (int s = group_start[g]; s < group_start[g + 1]; s++)
            c += 2 * row_len[order[s]] - shared_rows;
        cost[g] = c;
        total += c * Hkv;
    }
    Job jobs[64];
    int item = 0;
    int64_t acc = 0;
    for (int i = 0; i < threads; i++) {
        const int64_t goal = total * (i + 1) / threads;
        jobs[i] = (Job){q, k, v, tables, row_table, row_len, out, order, group_start, group_shared,
                        H, Hkv, D, block_size, max_blocks, kind, scale, item, item};
        while (item < items && (acc < goal || i == threads - 1)) acc += cost[item++ / Hkv];
        jobs[i].last = item;
    }
    free(cost);
    parallel_tasks(run_range, jobs, threads);
    return 0;
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
