// int8-mix-bench: what the AVX2 int8 instruction mixes of the kernels (shared/engine/src/
// qkernels.rs) can reach on one core of this CPU, independent of memory. Prints the clock
// (a chain of dependent adds, one per cycle) and G multiply-adds/s per core for:
//   1. vpmaddubsw alone (eight independent registers),
//   2. vpmaddubsw + the vpaddw that sums it (the i16 sums of the AVX2 path),
//   3. vpbroadcastd from memory + vpmaddubsw + vpaddw (one activation broadcast per line).
// Run alone on the machine:  gcc -O2 scripts/int8-mix-bench.c -o /tmp/mix && /tmp/mix
// (x86-64 with AVX2; BENCHMARKS.md, session 15, quotes its output on Zen 3). The AVX-512 VNNI
// counterpart is scripts/vnni-chains.c.
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    long n = 500000000, k = n, x = 0;
    double t = now();
    __asm__ volatile("1: add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n sub $4, %1\n jnz 1b"
                     : "+r"(x), "+r"(k));
    printf("clock: %.2f GHz (dependent adds)\n", n / (now() - t) / 1e9);

    n = 200000000;
    k = n;
    t = now();
    __asm__ volatile(
        "vpxor %%ymm14,%%ymm14,%%ymm14\n vpxor %%ymm15,%%ymm15,%%ymm15\n1:\n"
        "vpmaddubsw %%ymm15,%%ymm14,%%ymm0\n vpmaddubsw %%ymm15,%%ymm14,%%ymm1\n"
        "vpmaddubsw %%ymm15,%%ymm14,%%ymm2\n vpmaddubsw %%ymm15,%%ymm14,%%ymm3\n"
        "vpmaddubsw %%ymm15,%%ymm14,%%ymm4\n vpmaddubsw %%ymm15,%%ymm14,%%ymm5\n"
        "vpmaddubsw %%ymm15,%%ymm14,%%ymm6\n vpmaddubsw %%ymm15,%%ymm14,%%ymm7\n"
        "dec %0\n jnz 1b"
        : "+r"(k)::"xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm14",
          "xmm15");
    printf("vpmaddubsw:                      %4.0f G MAC/s\n", 8.0 * n * 32 / (now() - t) / 1e9);

    k = n;
    t = now();
    __asm__ volatile(
        "1:\n"
        "vpmaddubsw %%ymm15,%%ymm14,%%ymm0\n vpaddw %%ymm0,%%ymm8,%%ymm8\n"
        "vpmaddubsw %%ymm15,%%ymm14,%%ymm1\n vpaddw %%ymm1,%%ymm9,%%ymm9\n"
        "vpmaddubsw %%ymm15,%%ymm14,%%ymm2\n vpaddw %%ymm2,%%ymm10,%%ymm10\n"
        "vpmaddubsw %%ymm15,%%ymm14,%%ymm3\n vpaddw %%ymm3,%%ymm11,%%ymm11\n"
        "dec %0\n jnz 1b"
        : "+r"(k)::"xmm0", "xmm1", "xmm2", "xmm3", "xmm8", "xmm9", "xmm10", "xmm11", "xmm14",
          "xmm15");
    printf("vpmaddubsw + vpaddw:             %4.0f G MAC/s\n", 4.0 * n * 32 / (now() - t) / 1e9);

    static int buf[64];
    k = n;
    t = now();
    __asm__ volatile(
        "1:\n"
        "vpbroadcastd (%1),%%ymm4\n vpmaddubsw %%ymm4,%%ymm14,%%ymm0\n vpaddw %%ymm0,%%ymm8,%%ymm8\n"
        "vpbroadcastd 4(%1),%%ymm5\n vpmaddubsw %%ymm5,%%ymm14,%%ymm1\n vpaddw %%ymm1,%%ymm9,%%ymm9\n"
        "vpbroadcastd 8(%1),%%ymm6\n vpmaddubsw %%ymm6,%%ymm14,%%ymm2\n vpaddw %%ymm2,%%ymm10,%%ymm10\n"
        "vpbroadcastd 12(%1),%%ymm7\n vpmaddubsw %%ymm7,%%ymm14,%%ymm3\n vpaddw %%ymm3,%%ymm11,%%ymm11\n"
        "dec %0\n jnz 1b"
        : "+r"(k)
        : "r"(buf)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
          "xmm11", "xmm14");
    printf("vpbroadcastd + vpmaddubsw + vpaddw: %4.0f G MAC/s\n", 4.0 * n * 32 / (now() - t) / 1e9);
    return 0;
}
