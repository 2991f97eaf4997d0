// The vector layer the attention kernels are written over, chosen at build time by the compiler's
// target flags: AVX-512F (16 float lanes), AVX2 + FMA (8 lanes) or portable C (1 lane, left to
// the compiler's auto-vectorizer). kernels/__init__.py builds `-mno-avx512f` and
// `-mno-avx2 -mno-avx512f -mno-fma` variants so tests run every path on any x86-64 machine.
//
//   vf                   a vector of VW float32 lanes
//   vzero/vset1/vload/vstore/vadd/vsub/vmul/vdiv/vfma/vmax/vmin
//   vhsum(x), vhmax(x)   horizontal sum / max
//   vhsums(a)            lane i = horizontal sum of a[i], for VW vectors at once
//   vexp(x)              e^x, lanes below -87 give exactly 0 (a 5th-degree polynomial after
//                        range reduction, within 2 ulp of expf on [-87, 88])
//   vload_kv(kind, p, i) VW consecutive KV elements from element i, widened to float32 (fp8
//                        e4m3 through float16: its bits shifted into a half's are the value
//                        times 2^-8, subnormals included, which vcvtph2ps widens exactly)
//   vload_i8(p)          VW consecutive int8 values, widened to float32
//   vpair_lo/vpair_hi(p) VW consecutive 32-bit lanes holding bfloat16 pairs: the low / high
//                        bfloat16 of each, widened to float32 (a bfloat16 is the top half of a
//                        float32); pair_lo/pair_hi the same of one lane, as a float
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define SIMD_INLINE static inline __attribute__((always_inline))
// The operations AVX-512 and AVX2 spell alike but for the prefix (_mm512 / _mm256).
#define SIMD_BASIC_OPS(P)                                                         \
    SIMD_INLINE vf vzero(void) { return P##_setzero_ps(); }                       \
    SIMD_INLINE vf vset1(float x) { return P##_set1_ps(x); }                      \
    SIMD_INLINE vf vload(const float *p) { return P##_loadu_ps(p); }              \
    SIMD_INLINE void vstore(float *p, vf x) { P##_storeu_ps(p, x); }              \
    SIMD_INLINE vf vadd(vf a, vf b) { return P##_add_ps(a, b); }                  \
    SIMD_INLINE vf vsub(vf a, vf b) { return P##_sub_ps(a, b); }                  \
    SIMD_INLINE vf vmul(vf a, vf b) { return P##_mul_ps(a, b); }                  \
    SIMD_INLINE vf vdiv(vf a, vf b) { return P##_div_ps(a, b); }                  \
    SIMD_INLINE vf vfma(vf a, vf b, vf c) { return P##_fmadd_ps(a, b, c); }       \
    SIMD_INLINE vf vmax(vf a, vf b) { return P##_max_ps(a, b); }                  \
    SIMD_INLINE vf vmin(vf a, vf b) { return P##_min_ps(a, b); }

#if defined(__AVX512F__)
enum { VW = 16, SIMD_PATH = 2 };
typedef __m512 vf;
SIMD_BASIC_OPS(_mm512)
SIMD_INLINE vf vfloor(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
SIMD_INLINE float vhsum(vf x) { return _mm512_reduce_add_ps(x); }
SIMD_INLINE float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
SIMD_INLINE vf vhsums(const vf *a) {  // a transpose-and-add tree: 45 instructions for 16 sums
    vf x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d u = _mm512_castps_pd(x[2 * i]), w = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, w)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)));
    }
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
SIMD_INLINE vf vpow2i(vf n) {  // 2^n for integral n in [-126, 127]
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                                  _mm512_set1_epi32(127)), 23));
}
SIMD_INLINE vf vzero_below(vf x, vf r, float lo) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ), r);
}
SIMD_INLINE vf vpair_lo(const uint32_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
SIMD_INLINE vf vpair_hi(const uint32_t *p) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(-65536)));
}
SIMD_INLINE vf vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
SIMD_INLINE vf vload_kv(int kind, const void *pool, int64_t i) {
    if (kind == F32) return _mm512_loadu_ps((const float *)pool + i);
    if (kind == I8) return vload_i8((const int8_t *)pool + i);
    if (kind == FP8) {
        const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)pool + i)));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7),
                                          _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
    }
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i));
    if (kind == F16) return _mm512_cvtph_ps(raw);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
enum { VW = 8, SIMD_PATH = 1 };
typedef __m256 vf;
SIMD_BASIC_OPS(_mm256)
SIMD_INLINE vf vfloor(vf x) { return _mm256_floor_ps(x); }
SIMD_INLINE float vhsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
SIMD_INLINE float vhmax(vf x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
SIMD_INLINE vf vhsums(const vf *a) {
    vf x[4], y[2];
    for (int i = 0; i < 4; i++)
        x[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m256d u = _mm256_castps_pd(x[2 * i]), w = _mm256_castps_pd(x[2 * i + 1]);
        y[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(u, w)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(u, w)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20),
                         _mm256_permute2f128_ps(y[0], y[1], 0x31));
}
SIMD_INLINE vf vpow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                  _mm256_set1_epi32(127)), 23));
}
SIMD_INLINE vf vzero_below(vf x, vf r, float lo) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GE_OQ), r);
}
SIMD_INLINE vf vpair_lo(const uint32_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)p), 16));
}
SIMD_INLINE vf vpair_hi(const uint32_t *p) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p),
                                                _mm256_set1_epi32(-65536)));
}
SIMD_INLINE vf vload_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
SIMD_INLINE vf vload_kv(int kind, const void *pool, int64_t i) {
    if (kind == F32) return _mm256_loadu_ps((const float *)pool + i);
    if (kind == I8) return vload_i8((const int8_t *)pool + i);
    if (kind == FP8) {
#if defined(__F16C__)
        const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)pool + i)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7),
                                       _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8));
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
#else
        float f[8];
        for (int d = 0; d < 8; d++) f[d] = load_elt(FP8, pool, i + d);
        return _mm256_loadu_ps(f);
#endif
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i));
#if defined(__F16C__)
    if (kind == F16) return _mm256_cvtph_ps(raw);
#else
    if (kind == F16) {
        float f[8];
        for (int d = 0; d < 8; d++) f[d] = load_elt(F16, pool, i + d);
        return _mm256_loadu_ps(f);
    }
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#else
enum { VW = 1, SIMD_PATH = 0 };
typedef float vf;
SIMD_INLINE vf vzero(void) { return 0.f; }
SIMD_INLINE vf vset1(float x) { return x; }
SIMD_INLINE vf vload(const float *p) { return *p; }
SIMD_INLINE void vstore(float *p, vf x) { *p = x; }
SIMD_INLINE vf vadd(vf a, vf b) { return a + b; }
SIMD_INLINE vf vsub(vf a, vf b) { return a - b; }
SIMD_INLINE vf vmul(vf a, vf b) { return a * b; }
SIMD_INLINE vf vdiv(vf a, vf b) { return a / b; }
SIMD_INLINE vf vfma(vf a, vf b, vf c) { return a * b + c; }
SIMD_INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }
SIMD_INLINE vf vmin(vf a, vf b) { return a < b ? a : b; }
SIMD_INLINE vf vfloor(vf x) { return floorf(x); }
SIMD_INLINE float vhsum(vf x) { return x; }
SIMD_INLINE float vhmax(vf x) { return x; }
SIMD_INLINE vf vhsums(const vf *a) { return a[0]; }
SIMD_INLINE vf vpow2i(vf n) {
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
SIMD_INLINE vf vzero_below(vf x, vf r, float lo) { return x >= lo ? r : 0.f; }
SIMD_INLINE vf vload_kv(int kind, const void *pool, int64_t i) { return load_elt(kind, pool, i); }
SIMD_INLINE vf vload_i8(const int8_t *p) { return (float)*p; }
#endif

SIMD_INLINE float pair_lo(uint32_t pair) {
    const uint32_t bits = pair << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
SIMD_INLINE float pair_hi(uint32_t pair) {
    const uint32_t bits = pair & 0xffff0000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
SIMD_INLINE vf vpair_lo(const uint32_t *p) { return pair_lo(*p); }
SIMD_INLINE vf vpair_hi(const uint32_t *p) { return pair_hi(*p); }
#endif

SIMD_INLINE vf vexp(vf x) {
    const vf in = x;
    x = vmax(vmin(x, vset1(88.3762626647949f)), vset1(-87.0f));
    const vf n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
    x = vfma(n, vset1(-0.693359375f), x);
    x = vfma(n, vset1(2.12194440e-4f), x);
    vf y = vset1(1.9875691500E-4f);
    y = vfma(y, x, vset1(1.3981999507E-3f));
    y = vfma(y, x, vset1(8.3334519073E-3f));
    y = vfma(y, x, vset1(4.1665795894E-2f));
    y = vfma(y, x, vset1(1.6666665459E-1f));
    y = vfma(y, x, vset1(5.0000001201E-1f));
    y = vfma(y, vmul(x, x), vadd(x, vset1(1.f)));
    return vzero_below(in, vmul(y, vpow2i(n)), -87.0f);
}

// cap * tanh(x / cap) with inv2 = 2 / cap, as tanh y = 1 - 2 / (e^2y + 1) (2y clamped to +-30,
// where tanh is +-1 in float32): Gemma 2's soft-capping of attention scores and logits.
SIMD_INLINE vf vsoftcap(vf x, vf inv2, vf cap) {
    const vf one = vset1(1.f);
    const vf y = vmax(vmin(vmul(x, inv2), vset1(30.f)), vset1(-30.f));
    return vmul(cap, vsub(one, vdiv(vset1(2.f), vadd(vexp(y), one))));
}
