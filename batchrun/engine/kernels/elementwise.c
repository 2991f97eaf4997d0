// Fused elementwise ops of a decoder layer: SiLU-and-multiply, rotary embedding applied in place,
// the residual add fused with the RMSNorm after it, logit soft-capping, and writing a step's K/V
// rows into the paged cache. Each replaces several PyTorch ops (and
// their temporaries) with one pass over the data. Tensors are float32 or bfloat16 (kind 0 / 2);
// arithmetic is float32.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "parallel.h"
#include "simd.h"

// Runs fn(ctx, first_row, last_row) over `rows` split across up to `threads` threads; one
// thread when the work is too small to be worth waking another.
typedef void (*row_fn)(const void *ctx, int64_t first, int64_t last);
typedef struct { row_fn fn; const void *ctx; int64_t rows; int parts; } RowSplit;

static void row_part(const void *arg, int i) {
    const RowSplit *s = (const RowSplit *)arg;
    s->fn(s->ctx, s->rows * i / s->parts, s->rows * (i + 1) / s->parts);
}

static void parallel_rows(row_fn fn, const void *ctx, int64_t rows, int64_t work_per_row, int threads) {
    if (threads < 1 || rows * work_per_row < (1 << 15)) threads = 1;
    if (threads > rows) threads = (int)rows;
    if (threads <= 1) { fn(ctx, 0, rows); return; }
    const RowSplit split = {fn, ctx, rows, threads};
    parallel_tasks(row_part, &split, threads);
}

// out[r, :] = act(x[r, :n]) * x[r, n:2n], act SiLU or (gelu) GELU's tanh approximation. Both are
// g / (1 + e^-z): z = g for SiLU; for GELU 0.5 g (1 + tanh y) = g / (1 + e^-2y), z = 2y with
// y = sqrt(2 / pi) (g + 0.044715 g^3).
typedef struct { const void *x; void *out; int64_t n; int kind, gelu; } SiluMul;
#define GELU_C 0.7978845608028654f

static inline float act_arg(float g, int gelu) {
    return gelu ? 2.f * GELU_C * (g + 0.044715f * g * g * g) : g;
}

// o[i] = act(g[i]) * u[i] for i < n, float32, simd.h's vector exp (the compiler leaves expf a
// scalar call).
static void act_mul(const float *g, const float *u, float *o, int64_t n, int gelu) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf gv = vload(g + i);
        const vf z = gelu ? vmul(vset1(2.f * GELU_C), vfma(vmul(vmul(gv, gv), gv), vset1(0.044715f), gv))
                          : gv;
        const vf e = vexp(vsub(vzero(), z));
        vstore(o + i, vmul(vdiv(gv, vadd(vset1(1.f), e)), vload(u + i)));
    }
    for (; i < n; i++) o[i] = g[i] / (1.f + expf(-act_arg(g[i], gelu))) * u[i];
}

// Rows of another element type: a chunk widened to float32, act_mul, narrowed back (a literal
// kind, so the conversions vectorise).
SIMD_INLINE void act_mul_rows_of(const SiluMul *a, int64_t first, int64_t last, const int kind) {
    const int64_t n = a->n;
    float g[1024], u[1024];
    for (int64_t r = first; r < last; r++)
        for (int64_t c0 = 0; c0 < n; c0 += 1024) {
            const int64_t m = n - c0 < 1024 ? n - c0 : 1024;
            for (int64_t i = 0; i < m; i++) {
                g[i] = load_elt(kind, a->x, r * 2 * n + c0 + i);
                u[i] = load_elt(kind, a->x, r * 2 * n + n + c0 + i);
            }
            act_mul(g, u, g, m, a->gelu);
            for (int64_t i = 0; i < m; i++) store_elt(kind, a->out, r * n + c0 + i, g[i]);
        }
}

static void silu_mul_rows(const void *arg, int64_t first, int64_t last) {
    const SiluMul *a = (const SiluMul *)arg;
    const int64_t n = a->n;
    switch (a->kind) {
        case F32:
            for (int64_t r = first; r < last; r++) {
                const float *g = (const float *)a->x + r * 2 * n;
                act_mul(g, g + n, (float *)a->out + r * n, n, a->gelu);
            }
            return;
        case BF16: act_mul_rows_of(a, first, last, BF16); return;
        case F16: act_mul_rows_of(a, first, last, F16); return;
        default: act_mul_rows_of(a, first, last, a->kind); return;
    }
}

void silu_mul(const void *x, void *out, int64_t rows, int64_t n, int kind, int threads) {
    const SiluMul a = {x, out, n, kind, 0};
    parallel_rows(silu_mul_rows, &a, rows, n, threads);
}

void gelu_tanh_mul(const void *x, void *out, int64_t rows, int64_t n, int kind, int threads) {
    const SiluMul a = {x, out, n, kind, 1};
    parallel_rows(silu_mul_rows, &a, rows, n, threads);
}

// res[r, :] += x[r, :] (x NULL: nothing added), then out[r, :] = res[r, :] / rms(res[r, :]) * w:
// the residual stream's add and the RMSNorm that reads it, in one pass over the rows instead of
// PyTorch's add, square, mean, rsqrt and two multiplies (each its own op and pass). x, w and out
// are in `kind`, res in `res_kind`: a bfloat16 model keeps its stream in float32 (res_kind F32;
// each sublayer's output rounded to bfloat16 would otherwise be added into a bfloat16 sum).
typedef struct { const void *x, *w; void *res, *out; int64_t n; float eps; int kind, res_kind; } AddNorm;

// v stored as VW elements of `kind` from element i of p, rounded as store_elt rounds.
SIMD_INLINE void vstore_kind(int kind, void *p, int64_t i, vf v) {
    if (kind == F32) { vstore((float *)p + i, v); return; }
#if defined(__AVX512F__)
    if (kind == BF16) {  // round to nearest even on the bits, then keep the top halves
        const __m512i b = _mm512_castps_si512(v);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
        return;
    }
#endif
    float tmp[VW];
    vstore(tmp, v);
    for (int d = 0; d < VW; d++) store_elt(kind, p, i + d, tmp[d]);
}

static void add_rms_norm_rows(const void *arg, int64_t first, int64_t last) {
    const AddNorm *a = (const AddNorm *)arg;
    const int64_t n = a->n;
    const int kind = a->kind, rk = a->res_kind;
    for (int64_t r = first; r < last; r++) {
        const int64_t row = r * n;
        vf ss = vzero();
        float tail = 0.f;
        int64_t i = 0;
        for (; i + VW <= n; i += VW) {
            vf h = vload_kv(rk, a->res, row + i);
            if (a->x) { h = vadd(h, vload_kv(kind, a->x, row + i)); vstore_kind(rk, a->res, row + i, h); }
            ss = vfma(h, h, ss);
        }
        for (; i < n; i++) {
            float h = load_elt(rk, a->res, row + i);
            if (a->x) { h += load_elt(kind, a->x, row + i); store_elt(rk, a->res, row + i, h); }
            tail += h * h;
        }
        const float inv = 1.f / sqrtf((vhsum(ss) + tail) / (float)n + a->eps);
        const vf vinv = vset1(inv);
        for (i = 0; i + VW <= n; i += VW)
            vstore_kind(kind, a->out, row + i,
                        vmul(vmul(vload_kv(rk, a->res, row + i), vinv), vload_kv(kind, a->w, i)));
        for (; i < n; i++)
            store_elt(kind, a->out, row + i, load_elt(rk, a->res, row + i) * inv * load_elt(kind, a->w, i));
    }
}

void add_rms_norm(const void *x, void *res, const void *w, void *out, int64_t rows, int64_t n,
                  float eps, int kind, int res_kind, int threads) {
    const AddNorm a = {x, w, res, out, n, eps, kind, res_kind};
    parallel_rows(add_rms_norm_rows, &a, rows, n, threads);
}

// x[r, :n] = cap * tanh(x[r, :n] / cap) in place, float32: Gemma 2's final-logit soft-cap in one
// pass over the [rows, vocab] logits (PyTorch's div, tanh and mul are three).
typedef struct { float *x; int64_t n; float cap; } SoftCap;

static void softcap_rows(const void *arg, int64_t first, int64_t last) {
    const SoftCap *a = (const SoftCap *)arg;
    const vf inv2 = vset1(2.f / a->cap), cap = vset1(a->cap);
    for (int64_t r = first; r < last; r++) {
        float *x = a->x + r * a->n;
        int64_t i = 0;
        for (; i + VW <= a->n; i += VW) vstore(x + i, vsoftcap(vload(x + i), inv2, cap));
        for (; i < a->n; i++) x[i] = a->cap * tanhf(x[i] / a->cap);
    }
}

void softcap_inplace(float *x, int64_t rows, int64_t n, float cap, int threads) {
    const SoftCap a = {x, n, cap};
    parallel_rows(softcap_rows, &a, rows, n, threads);
}

// Rotary embedding (rotate-half form) in place on the q and k heads of each row of a fused qkv
// tensor: x[:half], x[half:] <- x1 * cos - x2 * sin, x2 * cos + x1 * sin.
typedef struct {
    void *qkv;
    const int64_t *positions;
    const float *cos, *sin;  // [max_positions, head_dim]
    int64_t row_stride;      // elements between rows of qkv
    int heads, head_dim, kind;  // heads = q heads + k heads, stored first in each row
} Rope;

// Heads whose half is whole vectors: VW pairs at a time, widened and narrowed in registers (a
// literal kind, so the conversions are inlined). Products rounded before they are added, no
// FMAs: the same float32 bits as the reference's x * cos + rotate_half(x) * sin.
__attribute__((optimize("fp-contract=off")))
static void rope_rows_of(const Rope *a, int64_t first, int64_t last, const int kind) {
    const int D = a->head_dim, half = D / 2;
    for (int64_t r = first; r < last; r++) {
        const float *c = a->cos + a->positions[r] * D, *s = a->sin + a->positions[r] * D;
        for (int h = 0; h < a->heads; h++) {
            const int64_t base = r * a->row_stride + (int64_t)h * D;
            for (int i = 0; i < half; i += VW) {
                const vf x1 = vload_kv(kind, a->qkv, base + i), x2 = vload_kv(kind, a->qkv, base + half + i);
                vstore_kind(kind, a->qkv, base + i, vsub(vmul(x1, vload(c + i)), vmul(x2, vload(s + i))));
                vstore_kind(kind, a->qkv, base + half + i,
                            vadd(vmul(x2, vload(c + half + i)), vmul(x1, vload(s + half + i))));
            }
        }
    }
}

__attribute__((optimize("fp-contract=off")))
static void rope_rows(const void *arg, int64_t first, int64_t last) {
    const Rope *a = (const Rope *)arg;
    const int D = a->head_dim, half = D / 2;
    if (half % VW == 0) {
        if (a->kind == F32) { rope_rows_of(a, first, last, F32); return; }
        if (a->kind == BF16) { rope_rows_of(a, first, last, BF16); return; }
    }
    for (int64_t r = first; r < last; r++) {
        const float *c = a->cos + a->positions[r] * D, *s = a->sin + a->positions[r] * D;
        for (int h = 0; h < a->heads; h++) {
            const int64_t base = r * a->row_stride + (int64_t)h * D;
            float x1[256], x2[256];
            for (int i = 0; i < half; i++) {
                x1[i] = load_elt(a->kind, a->qkv, base + i);
                x2[i] = load_elt(a->kind, a->qkv, base + half + i);
            }
            for (int i = 0; i < half; i++) {
                store_elt(a->kind, a->qkv, base + i, x1[i] * c[i] - x2[i] * s[i]);
                store_elt(a->kind, a->qkv, base + half + i, x2[i] * c[half + i] + x1[i] * s[half + i]);
            }
        }
    }
}

int rope_inplace(void *qkv, const int64_t *positions, const float *cos, const float *sin,
                 int64_t rows, int64_t row_stride, int heads, int head_dim, int kind, int threads) {
    if (head_dim > 512 || head_dim % 2) return -1;
    const Rope a = {qkv, positions, cos, sin, row_stride, heads, head_dim, kind};
    parallel_rows(rope_rows, &a, rows, (int64_t)heads * head_dim, threads);
    return 0;
}

// cache[slot[r], :] = src[r, :] for the K and V rows of a step, converting element type.
// src_stride: elements between source rows; width: elements per row (Hkv * D).
void kv_write(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots,
              int64_t rows, int64_t src_stride, int64_t width, int src_kind, int dst_kind) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t dst = slots[r] * width, src = r * src_stride;
        if (src_kind == dst_kind) {
            const size_t elt = elt_size(src_kind);
            memcpy((char *)k_cache + dst * elt, (const char *)k + src * elt, elt * width);
            memcpy((char *)v_cache + dst * elt, (const char *)v + src * elt, elt * width);
            continue;
        }
        if (src_kind == F32 && dst_kind == BF16) {  // the common case, in a loop the compiler vectorizes
            const float *ks = (const float *)k + src, *vs = (const float *)v + src;
            uint16_t *kd = (uint16_t *)k_cache + dst, *vd = (uint16_t *)v_cache + dst;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) {
                kd[i] = bf16_bits(ks[i]);
                vd[i] = bf16_bits(vs[i]);
            }
            continue;
        }
        for (int64_t i = 0; i < width; i++) {
            store_elt(dst_kind, k_cache, dst + i, load_elt(src_kind, k, src + i));
            store_elt(dst_kind, v_cache, dst + i, load_elt(src_kind, v, src + i));
        }
    }
}
