// q5_0-block-bench: the AVX2 Q5_0 block of shared/engine/src/qkernels.rs (`impl Format for
// Q5_0`, i16 sums) written as a plain C loop, weights in L2 (128 columns x 1536 inputs), for
// 1, 2, 4 and 8 rows; G multiply-adds/s per core. Two layouts of a block's 8 columns x 32 values:
//   bits:  4 nibble lines (k-groups g and g + 4 in the low and high nibbles) and one line of
//          fifth bits (bit g of each byte for k-group g), as the engine's non-AVX2 paths keep it;
//   lines: 5 lines, k-groups 0..4 in the low 5 bits of lines 0..4, groups 5..7 spread over the
//          top 3 bits of the lines.
// The engine's own loop on the same shape: target/release/examples/kernel_loop Q5_0 1 1 40 avx2
// 128 (rows 1, 2, 4, 8), its "kernel alone" figure: the other one includes quantizing the
// activations, a quarter of a call at one row and this shape. (The engine's AVX2 path keeps Q5_0
// in the five lines since session 31.) Run alone on the machine:
//   gcc -O3 -mavx2 -mfma -mf16c scripts/q5_0-block-bench.c -o /tmp/q5 && /tmp/q5
// BENCHMARKS.md, sessions 30 and 31, quote its output on Zen 3.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NB 48 // blocks of 32 inputs: 1536
#define NG 16 // half-groups of 8 columns: 128 columns

typedef struct {
    int8_t qs[32];
    float d;
    int off; // the -16 offset's start of the i16 sums
} Act;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// Per row: the broadcast of 4 activation bytes, maddubs, i16 add.
#define DOT(W, g)                                                                           \
    for (int r = 0; r < R; r++) {                                                           \
        __m256i xv = _mm256_set1_epi32(*(const int *)(a[b * R + r].qs + 4 * (g)));          \
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16((W), xv));                       \
    }

// Per block: widen the i16 sums with madd, scale by the weights' and the row's scales.
#define EPILOGUE                                                                            \
    __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(sc + (gi * NB + b) * 8)));  \
    for (int r = 0; r < R; r++) {                                                           \
        __m256i i = _mm256_madd_epi16(s[r], ones);                                          \
        __m256 xd = _mm256_mul_ps(d, _mm256_set1_ps(a[b * R + r].d));                       \
        out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), xd, out[r]);                        \
    }

#define KERNEL(NAME, ROWS, DECODE)                                                             \
    __attribute__((noinline)) void NAME(const uint8_t *w, const uint16_t *sc, const Act *a, \
                                        float *y, long iters) {                             \
        enum { R = ROWS };                                                                  \
        const __m256i m4 = _mm256_set1_epi8(15), m10 = _mm256_set1_epi8(16);                \
        const __m256i m1f = _mm256_set1_epi8(31), m07 = _mm256_set1_epi8(7);                \
        const __m256i m18 = _mm256_set1_epi8(0x18), m08 = _mm256_set1_epi8(8);              \
        const __m256i ones = _mm256_set1_epi16(1);                                          \
        (void)m4, (void)m10, (void)m1f, (void)m07, (void)m18, (void)m08;                    \
        for (long it = 0; it < iters; it++)                                                 \
            for (int gi = 0; gi < NG; gi++) {                                               \
                __m256 out[R];                                                              \
                for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                   \
                for (int b = 0; b < NB; b++) {                                              \
                    const uint8_t *m = w + (gi * NB + b) * 160;                             \
                    __m256i s[R];                                                           \
                    for (int r = 0; r < R; r++) s[r] = _mm256_set1_epi32(a[b * R + r].off); \
                    DECODE                                                                  \
                    EPILOGUE                                                                \
                }                                                                           \
                for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r * NG + gi) * 8, out[r]); \
            }                                                                               \
    }

#define LOAD(i) _mm256_load_si256((const __m256i *)(m + 32 * (i)))

// The engine's layout: nibble, then the fifth bit shifted to bit 4 and or-ed in.
#define DECODE_BITS                                                                         \
    __m256i hv = LOAD(4);                                                                   \
    _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {                                   \
        __m256i v = LOAD(g % 4);                                                            \
        __m256i lo = g < 4 ? _mm256_and_si256(v, m4)                                        \
                           : _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);                 \
        __m256i hb = g < 4 ? _mm256_slli_epi16(hv, 4 - g) : _mm256_srli_epi16(hv, g - 4);   \
        __m256i wv = _mm256_or_si256(lo, _mm256_and_si256(hb, m10));                        \
        DOT(wv, g)                                                                          \
    }

// Five lines of whole 5-bit values for groups 0..4; groups 5..7 from the top bits.
#define TOP(l, s, mask) _mm256_and_si256(_mm256_srli_epi16((l), (s)), (mask))
#define DECODE_LINES                                                                        \
    __m256i l0 = LOAD(0), l1 = LOAD(1), l2 = LOAD(2), l3 = LOAD(3), l4 = LOAD(4);          \
    __m256i W[8] = {                                                                        \
        _mm256_and_si256(l0, m1f), _mm256_and_si256(l1, m1f), _mm256_and_si256(l2, m1f),   \
        _mm256_and_si256(l3, m1f), _mm256_and_si256(l4, m1f),                               \
        _mm256_or_si256(TOP(l0, 5, m07), TOP(l1, 2, m18)),                                  \
        _mm256_or_si256(TOP(l2, 5, m07), TOP(l3, 2, m18)),                                  \
        _mm256_or_si256(_mm256_or_si256(TOP(l4, 5, m07), TOP(l1, 4, m08)), TOP(l3, 3, m10)), \
    };                                                                                      \
    _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) { DOT(W[g], g) }

KERNEL(bits1, 1, DECODE_BITS)
KERNEL(bits2, 2, DECODE_BITS)
KERNEL(bits4, 4, DECODE_BITS)
KERNEL(lines1, 1, DECODE_LINES)
KERNEL(lines2, 2, DECODE_LINES)
KERNEL(lines4, 4, DECODE_LINES)
KERNEL(bits8, 8, DECODE_BITS)
KERNEL(lines8, 8, DECODE_LINES)

typedef void (*Kernel)(const uint8_t *, const uint16_t *, const Act *, float *, long);

int main(void) {
    uint8_t *w = aligned_alloc(64, NG * NB * 160);
    uint16_t *sc = aligned_alloc(64, NG * NB * 16);
    Act *a = aligned_alloc(64, sizeof(Act) * NB * 8);
    float *y = aligned_alloc(64, 8 * NG * 8 * sizeof(float));
    for (int i = 0; i < NG * NB * 160; i++) w[i] = rand();
    for (int i = 0; i < NG * NB * 8; i++) sc[i] = 0x3c00; // f16 1.0
    for (int i = 0; i < NB * 8; i++) {
        for (int j = 0; j < 32; j++) a[i].qs[j] = rand() % 255 - 127;
        a[i].d = 1.0f;
        a[i].off = 0;
    }
    const double macs = (double)NG * 8 * NB * 32;
    struct {
        const char *name;
        Kernel k;
        int rows;
    } runs[] = {{"bits", bits1, 1},   {"lines", lines1, 1}, {"bits", bits2, 2},
                {"lines", lines2, 2}, {"bits", bits4, 4},   {"lines", lines4, 4},
                {"bits", bits8, 8},   {"lines", lines8, 8}};
    for (int i = 0; i < 8; i++) {
        double best = 0;
        for (int rep = 0; rep < 5; rep++) { // best of 5: other processes only add time
            long iters = 20000 / runs[i].rows;
            double t = now();
            runs[i].k(w, sc, a, y, iters);
            t = now() - t;
            double g = macs * runs[i].rows * iters / t / 1e9;
            if (g > best) best = g;
        }
        printf("%-5s %d row%s: %5.1f G MAC/s\n", runs[i].name, runs[i].rows,
               runs[i].rows > 1 ? "s" : " ", best);
    }
    return 0;
}
