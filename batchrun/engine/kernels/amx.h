// AMX tile registers (Intel Sapphire Rapids and later): what the tile kernels share.
//
// Linux hands out the tiles' 8 KB of state only to a process that asks for it (5.16 and later);
// each thread loads the one configuration the kernels use (eight tiles of 16 rows x 64 bytes)
// before its first tile instruction and releases it after. HAS_AMX says whether the build has
// the instructions (BATCHRUN_SIMD=avx512 builds without: kernels.VARIANTS).
#pragma once
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define HAS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0)  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

// Rows a tile GEMM takes at a time, all its weights streaming past them: their activations stay
// in L1/L2 (all rows under each pair of weight blocks in turn made a 1,024-row int8 GEMM re-read
// every activation for each pair, half oneDNN's speed).
#define AMX_CHUNK_ROWS 128

// The rows of one chunk when `rows` are split into equal chunks of at most `most` (a multiple of
// 16): 131 rows as 128 + 3 streamed all the weights a second time for 3 rows.
static inline int64_t amx_chunk(int64_t rows, int64_t most) {
    const int64_t chunks = (rows + most - 1) / most;
    return ((rows + chunks - 1) / chunks + 15) / 16 * 16;
}

static inline void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}
#else
#define HAS_AMX 0
static inline int amx_permitted(void) { return 0; }
#endif
