// The float8 e4m3fn decoding table dtypes.h's load_elt reads, filled when the library loads,
// and the conversions exported for tests (tests/unit/test_fp8_kv.py holds them to torch's).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

float fp8_e4m3_table[256];

__attribute__((constructor)) static void fill_fp8_table(void) {
    for (int x = 0; x < 256; x++) {
        const int e = (x >> 3) & 15, m = x & 7;
        float f = e ? ldexpf(1.f + m / 8.f, e - 7) : ldexpf((float)m, -9);
        if ((x & 0x7f) == 0x7f) {  // NaN (as bits: the library is built -ffinite-math-only)
            const uint32_t nan = 0x7fc00000u;
            memcpy(&f, &nan, 4);
        }
        fp8_e4m3_table[x] = x & 0x80 ? -f : f;
    }
}

void fp8_from_floats(const float *x, uint8_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = fp8_e4m3_from_float(x[i]);
}

void fp8_to_floats(const uint8_t *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = fp8_e4m3_table[x[i]];
}
