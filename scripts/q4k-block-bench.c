// q4k-block-bench: the AVX2 Q4_K block of shared/engine/src/qkernels.rs (`impl Format for Q4K`,
// i16 sums) as a plain C loop, in the engine's layout (per group of 16 columns and block of 256
// values: 32 lines of 64 bytes, each half of a line the nibbles of 8 columns, then the 6-bit
// sub-block scales and mins), weights in L2 (128 columns x 1536 inputs), 1, 4 and 8 rows;
// G multiply-adds/s per core. Three loops:
//   subblocks:  the sub-blocks only (products, i16 sums, one `madd` by the scales per sub-block);
//   +finish:    and the block's end as the engine does it (mins, the float epilogue);
//   prebcast:   the sub-blocks with the activations stored already broadcast (each 4-byte group
//               8 times), so that `vpmaddubsw` reads them from memory instead of a
//               `vpbroadcastd` per line and row (8x the activation bytes).
// Compare with the engine's own loop, its "kernel alone" figure:
//   target/release/examples/kernel_loop Q4K R 1 3 avx2 128   (R = 1, 4, 8)
// Run alone on the machine:
//   gcc -O3 -mavx2 -mfma -mf16c scripts/q4k-block-bench.c -o /tmp/q4k && /tmp/q4k
// BENCHMARKS.md, session 31, quotes its output on Zen 3.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NB 6      // blocks of 256 inputs: 1536
#define NG 8      // groups of 16 columns: 128 columns
#define SLOT 2304 // bytes per (group, block): 2048 of nibbles, 128 of scales, 128 of mins
#define ACT 576   // bytes per activation block: 256 int8, then the scale and the sums
#define ACT_D 256 // offset of the activation block's float scale
#define ACT_BS 400 // offset of its pairs of sub-block sums (for the mins)

static uint8_t *W;  // weights
static int8_t *A;   // activations, block-major: block b of row r at (b * R + r) * ACT
static int8_t *AB;  // the same values broadcast: 64 groups x 32 bytes per (block, row)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// One row's 4 activation bytes of k-group KG: a broadcast, or the stored broadcast copy.
#define BCAST(KG) _mm256_set1_epi32(*(const int *)(A + (b * R + r) * ACT + 4 * (KG)))
#define STORED(KG) _mm256_load_si256((const __m256i *)(AB + ((size_t)(b * R + r) * 64 + (KG)) * 32))

#define KERNEL(NAME, ROWS, X, FINISH)                                                             \
    __attribute__((noinline)) void NAME(long iters, float *y) {                                  \
        enum { R = ROWS };                                                                        \
        const __m256i m4 = _mm256_set1_epi8(15);                                                  \
        for (long it = 0; it < iters; it++)                                                       \
            for (int gi = 0; gi < NG; gi++)                                                       \
                for (int half = 0; half < 2; half++) {                                            \
                    __m256 out[R];                                                                \
                    for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                     \
                    for (int b = 0; b < NB; b++) {                                                \
                        const uint8_t *w = W + (gi * NB + b) * SLOT + 32 * half;                  \
                        __m256i sumi[R];                                                          \
                        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();             \
                        for (int hi = 0; hi < 2; hi++)                                            \
                            for (int j = 0; j < 4; j++) {                                         \
                                __m256i a[R];                                                     \
                                for (int r = 0; r < R; r++) a[r] = _mm256_setzero_si256();        \
                                _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {             \
                                    __m256i v = _mm256_loadu_si256(                               \
                                        (const __m256i *)(w + (8 * j + t) * 64));                 \
                                    __m256i wv = hi ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) \
                                                    : _mm256_and_si256(v, m4);                    \
                                    int kg = 32 * hi + 8 * j + t;                                 \
                                    for (int r = 0; r < R; r++)                                   \
                                        a[r] = _mm256_add_epi16(                                  \
                                            a[r], _mm256_maddubs_epi16(wv, X(kg)));               \
                                }                                                                 \
                                __m256i sc = _mm256_shuffle_epi8(                                 \
                                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(                         \
                                        (const __m128i *)(w + 2048 + 16 * (4 * hi + j)))),        \
                                    m4);                                                          \
                                for (int r = 0; r < R; r++)                                       \
                                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(a[r], sc)); \
                            }                                                                     \
                        FINISH                                                                    \
                    }                                                                             \
                    for (int r = 0; r < R; r++)                                                   \
                        _mm256_storeu_ps(y + (r * NG * 2 + gi * 2 + half) * 8, out[r]);           \
                }                                                                                 \
    }

// Without the block's end, the integer sums still reach the output.
#define NO_FINISH                                                                                 \
    for (int r = 0; r < R; r++) out[r] = _mm256_add_ps(out[r], _mm256_castsi256_ps(sumi[r]));

// The block's end: the mins times the activations' sub-block sums, then per row
// out += d * xd * sumi - dmin * xd * summ.
#define ENGINE_FINISH                                                                             \
    __m256i summ[R];                                                                              \
    for (int r = 0; r < R; r++) summ[r] = _mm256_setzero_si256();                                 \
    for (int p = 0; p < 4; p++) {                                                                 \
        __m256i mp = _mm256_cvtepu8_epi16(                                                        \
            _mm_loadu_si128((const __m128i *)(w + 2048 + 128 + 32 * p)));                        \
        for (int r = 0; r < R; r++)                                                               \
            summ[r] = _mm256_add_epi32(                                                           \
                summ[r], _mm256_madd_epi16(mp, _mm256_set1_epi32(*(const int *)(                  \
                             A + (b * R + r) * ACT + ACT_BS + 4 * p))));                           \
    }                                                                                             \
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2200)));                     \
    __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2216)));                  \
    for (int r = 0; r < R; r++) {                                                                 \
        __m256 xd = _mm256_set1_ps(*(const float *)(A + (b * R + r) * ACT + ACT_D));              \
        out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(d, xd), out[r]);      \
        out[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ[r]), _mm256_mul_ps(dmin, xd), out[r]);  \
    }

KERNEL(sub1, 1, BCAST, NO_FINISH)
KERNEL(sub4, 4, BCAST, NO_FINISH)
KERNEL(sub8, 8, BCAST, NO_FINISH)
KERNEL(fin1, 1, BCAST, ENGINE_FINISH)
KERNEL(fin4, 4, BCAST, ENGINE_FINISH)
KERNEL(fin8, 8, BCAST, ENGINE_FINISH)
KERNEL(pre1, 1, STORED, NO_FINISH)
KERNEL(pre4, 4, STORED, NO_FINISH)
KERNEL(pre8, 8, STORED, NO_FINISH)

int main(void) {
    W = aligned_alloc(64, NG * NB * SLOT);
    A = aligned_alloc(64, NB * 8 * ACT);
    AB = aligned_alloc(64, (size_t)NB * 8 * 64 * 32);
    float *y = aligned_alloc(64, 8 * NG * 2 * 8 * sizeof(float));
    for (int i = 0; i < NG * NB * SLOT; i++) W[i] = rand();
    // The f16 scales the epilogue reads (and the mins around them): 1.0 (0x3c00), finite and
    // normal whatever the half.
    for (int s = 0; s < NG * NB; s++)
        for (int i = 2176; i < SLOT; i++) W[s * SLOT + i] = i % 2 ? 0x3c : 0x00;
    for (int i = 0; i < NB * 8 * ACT; i++) A[i] = rand() % 200 - 100;
    for (int i = 0; i < NB * 8; i++) *(float *)(A + i * ACT + ACT_D) = 1.0f;
    for (size_t i = 0; i < (size_t)NB * 8 * 64 * 32; i++) AB[i] = rand() % 200 - 100;
    struct {
        const char *name;
        void (*k)(long, float *);
        int rows;
    } runs[] = {{"subblocks", sub1, 1}, {"+finish", fin1, 1}, {"prebcast", pre1, 1},
                {"subblocks", sub4, 4}, {"+finish", fin4, 4}, {"prebcast", pre4, 4},
                {"subblocks", sub8, 8}, {"+finish", fin8, 8}, {"prebcast", pre8, 8}};
    const double macs = (double)NG * 16 * NB * 256;
    for (int i = 0; i < 9; i++) {
        double best = 0;
        for (int rep = 0; rep < 5; rep++) { // best of 5: other processes only add time
            long iters = 20000 / runs[i].rows;
            double t = now();
            runs[i].k(iters, y);
            t = now() - t;
            double g = macs * runs[i].rows * iters / t / 1e9;
            if (g > best) best = g;
        }
        printf("%-9s %d row%s: %5.1f G MAC/s\n", runs[i].name, runs[i].rows,
               runs[i].rows > 1 ? "s" : " ", best);
    }
    return 0;
}
