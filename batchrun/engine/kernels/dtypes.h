// Element types the kernels read and write, by the code Python passes (kernels.KINDS), with
// scalar float32 conversions. Arithmetic is always float32.
#pragma once
#include <stdint.h>
#include <string.h>

enum { F32 = 0, F16 = 1, BF16 = 2 };

static inline int elt_size(int kind) { return kind == F32 ? 4 : 2; }

static inline float load_elt(int kind, const void *p, int64_t i) {
    if (kind == F32) return ((const float *)p)[i];
    if (kind == F16) return (float)((const _Float16 *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void store_elt(int kind, void *p, int64_t i, float f) {
    if (kind == F32) { ((float *)p)[i] = f; return; }
    if (kind == F16) { ((_Float16 *)p)[i] = (_Float16)f; return; }
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even (inputs are finite)
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}
