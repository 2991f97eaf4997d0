// Element types the kernels read and write, by the code Python passes (kernels.KINDS), with
// scalar float32 conversions. Arithmetic is always float32. FP8 is float8 e4m3fn (torch's
// float8_e4m3fn: bias 7, no infinities, 0x7f/0xff NaN, largest finite 448): read through a
// 256-entry table, written rounding to nearest even and saturating at +-448 (the caller has
// divided by the layer's scale: attention/fp8_kv.py).
#pragma once
#include <stdint.h>
#include <string.h>

enum { F32 = 0, F16 = 1, BF16 = 2, FP8 = 3, I8 = 4 };  // I8: read only (int8 KV, its scales
                                                        // per (token, head) beside it)

static inline int elt_size(int kind) { return kind == F32 ? 4 : kind >= FP8 ? 1 : 2; }

extern float fp8_e4m3_table[256];  // fp8.c fills it when the library loads

static inline uint8_t fp8_e4m3_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    const float a = f < 0.f ? -f : f;
    if (!(a < 448.f)) return sign | 0x7e;  // saturate
    if (a < 0x1p-6f) {  // subnormal: a multiple of 2^-9; 8 * 2^-9 is the smallest normal, 0x08
        const int m = (int)__builtin_rintf(a * 512.f);  // the default rounding: to nearest even
        return sign | (uint8_t)m;
    }
    uint32_t ab = bits & 0x7fffffffu;
    ab += 0x7ffffu + ((ab >> 20) & 1);  // round the 20 dropped mantissa bits to nearest even
    return sign | (uint8_t)((ab >> 20) - (120u << 3));  // rebias the exponent: 127 -> 7
}

static inline float load_elt(int kind, const void *p, int64_t i) {
    if (kind == F32) return ((const float *)p)[i];
    if (kind == F16) return (float)((const _Float16 *)p)[i];
    if (kind == FP8) return fp8_e4m3_table[((const uint8_t *)p)[i]];
    if (kind == I8) return (float)((const int8_t *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t bf16_bits(float f) {  // to nearest even (inputs are finite)
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static inline void store_elt(int kind, void *p, int64_t i, float f) {
    if (kind == F32) { ((float *)p)[i] = f; return; }
    if (kind == F16) { ((_Float16 *)p)[i] = (_Float16)f; return; }
    if (kind == FP8) { ((uint8_t *)p)[i] = fp8_e4m3_from_float(f); return; }
    ((uint16_t *)p)[i] = bf16_bits(f);
}
