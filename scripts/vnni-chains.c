// Why the multi-row kernels need many accumulators (BENCHMARKS.md, session 9): the rate of
// 512-bit `vpdpbusd` on one core with 16 and with 8 independent accumulator chains, with the
// kernels' memory-broadcast operands, and the Q4_K paired sub-block loop (one weight line, two
// nibble masks, 16 `vpdpbusd` per line for 8 rows) with and without its per-sub-block scale
// tail (`vpmulld` + add, or cvt + FMA).
//
//   cc -O2 -mavx512f -mavx512vnni scripts/vnni-chains.c -o /tmp/vnni-chains && /tmp/vnni-chains
//
// Needs AVX-512 VNNI. Prints G `vpdpbusd` per second; ×64 for G multiply-adds.
#include <stdio.h>
#include <stdint.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int8_t act[8*384*2] __attribute__((aligned(64)));
static int8_t w[64*64] __attribute__((aligned(64)));
#define N 20000000L
#define NP 5000000L
#define Z(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define B(i,p,o) "vpdpbusd " #o "(%" #p ")%{1to16%}, %%zmm30, %%zmm" #i "\n\t"
#define D(off,wr,acc) "vpdpbusd " #off "(%%r14,%%rax,4)%{1to16%}, %%zmm" #wr ", %%zmm" #acc "\n\t"
double chains16_reg(void){double t=now();for(long i=0;i<N;i++){__asm__ volatile(
Z(0)Z(1)Z(2)Z(3)Z(4)Z(5)Z(6)Z(7)Z(8)Z(9)Z(10)Z(11)Z(12)Z(13)Z(14)Z(15) ::: "memory");}return N*16/(now()-t)/1e9;}
double chains8_reg(void){double t=now();for(long i=0;i<N;i++){__asm__ volatile(
Z(0)Z(1)Z(2)Z(3)Z(4)Z(5)Z(6)Z(7)Z(0)Z(1)Z(2)Z(3)Z(4)Z(5)Z(6)Z(7) ::: "memory");}return N*16/(now()-t)/1e9;}
double chains16_bcast(void){char*p0=(char*)act,*p1=(char*)act+384,*p2=(char*)act+768,*p3=(char*)act+1152;double t=now();for(long i=0;i<N;i++){__asm__ volatile(
B(0,0,0)B(1,1,0)B(2,2,0)B(3,3,0)B(4,0,4)B(5,1,4)B(6,2,4)B(7,3,4)B(8,0,8)B(9,1,8)B(10,2,8)B(11,3,8)B(12,0,12)B(13,1,12)B(14,2,12)B(15,3,12)
::"r"(p0),"r"(p1),"r"(p2),"r"(p3):"memory");}return N*16/(now()-t)/1e9;}
double pair_loop(int tail){double t=now();for(long i=0;i<NP;i++){__asm__ volatile(
"vpxord %%zmm9,%%zmm9,%%zmm9\n\t" "vpxord %%zmm10,%%zmm10,%%zmm10\n\t" "vpxord %%zmm11,%%zmm11,%%zmm11\n\t" "vpxord %%zmm12,%%zmm12,%%zmm12\n\t"
"vpxord %%zmm13,%%zmm13,%%zmm13\n\t" "vpxord %%zmm14,%%zmm14,%%zmm14\n\t" "vpxord %%zmm15,%%zmm15,%%zmm15\n\t" "vpxord %%zmm16,%%zmm16,%%zmm16\n\t"
"vpxord %%zmm17,%%zmm17,%%zmm17\n\t" "vpxord %%zmm18,%%zmm18,%%zmm18\n\t" "vpxord %%zmm19,%%zmm19,%%zmm19\n\t" "vpxord %%zmm20,%%zmm20,%%zmm20\n\t"
"vpxord %%zmm21,%%zmm21,%%zmm21\n\t" "vpxord %%zmm22,%%zmm22,%%zmm22\n\t" "vpxord %%zmm23,%%zmm23,%%zmm23\n\t" "vpxord %%zmm24,%%zmm24,%%zmm24\n\t"
"xor %%rax,%%rax\n\t" "mov %0,%%r8\n\t" "mov %1,%%r14\n\t"
"1:\n\t"
"vmovdqu64 (%%r8),%%zmm25\n\t" "vpsrlw $4,%%zmm25,%%zmm26\n\t" "vpandq %%zmm27,%%zmm25,%%zmm25\n\t" "vpandq %%zmm27,%%zmm26,%%zmm26\n\t"
D(0,25,24) D(128,26,22) D(384,25,23) D(512,26,19) D(768,25,21) D(896,26,18) D(1152,25,20) D(1280,26,15)
D(1536,25,17) D(1664,26,14) D(1920,25,16) D(2048,26,11) D(2304,25,13) D(2432,26,10) D(2688,25,12) D(2816,26,9)
"inc %%rax\n\t" "add $64,%%r8\n\t" "cmp $8,%%rax\n\t" "jne 1b\n\t"
"test %2,%2\n\t" "jz 2f\n\t" "cmp $2,%2\n\t" "je 3f\n\t"
"vpmulld %%zmm28,%%zmm24,%%zmm24\n\t vpaddd %%zmm24,%%zmm8,%%zmm8\n\t vpmulld %%zmm29,%%zmm22,%%zmm22\n\t vpaddd %%zmm22,%%zmm8,%%zmm8\n\t"
"vpmulld %%zmm28,%%zmm23,%%zmm23\n\t vpaddd %%zmm23,%%zmm7,%%zmm7\n\t vpmulld %%zmm29,%%zmm19,%%zmm19\n\t vpaddd %%zmm19,%%zmm7,%%zmm7\n\t"
"vpmulld %%zmm28,%%zmm21,%%zmm21\n\t vpaddd %%zmm21,%%zmm6,%%zmm6\n\t vpmulld %%zmm29,%%zmm18,%%zmm18\n\t vpaddd %%zmm18,%%zmm6,%%zmm6\n\t"
"vpmulld %%zmm28,%%zmm20,%%zmm20\n\t vpaddd %%zmm20,%%zmm5,%%zmm5\n\t vpmulld %%zmm29,%%zmm15,%%zmm15\n\t vpaddd %%zmm15,%%zmm5,%%zmm5\n\t"
"vpmulld %%zmm28,%%zmm17,%%zmm17\n\t vpaddd %%zmm17,%%zmm4,%%zmm4\n\t vpmulld %%zmm29,%%zmm14,%%zmm14\n\t vpaddd %%zmm14,%%zmm4,%%zmm4\n\t"
"vpmulld %%zmm28,%%zmm16,%%zmm16\n\t vpaddd %%zmm16,%%zmm3,%%zmm3\n\t vpmulld %%zmm29,%%zmm11,%%zmm11\n\t vpaddd %%zmm11,%%zmm3,%%zmm3\n\t"
"vpmulld %%zmm28,%%zmm13,%%zmm13\n\t vpaddd %%zmm13,%%zmm2,%%zmm2\n\t vpmulld %%zmm29,%%zmm10,%%zmm10\n\t vpaddd %%zmm10,%%zmm2,%%zmm2\n\t"
"vpmulld %%zmm28,%%zmm12,%%zmm12\n\t vpaddd %%zmm12,%%zmm1,%%zmm1\n\t vpmulld %%zmm29,%%zmm9,%%zmm9\n\t vpaddd %%zmm9,%%zmm1,%%zmm1\n\t"
"jmp 2f\n\t" "3:\n\t""vcvtdq2ps %%zmm24,%%zmm24\n\t vfmadd231ps %%zmm28,%%zmm24,%%zmm8\n\t vcvtdq2ps %%zmm22,%%zmm22\n\t vfmadd231ps %%zmm29,%%zmm22,%%zmm8\n\t"
"vcvtdq2ps %%zmm23,%%zmm23\n\t vfmadd231ps %%zmm28,%%zmm23,%%zmm7\n\t vcvtdq2ps %%zmm19,%%zmm19\n\t vfmadd231ps %%zmm29,%%zmm19,%%zmm7\n\t"
"vcvtdq2ps %%zmm21,%%zmm21\n\t vfmadd231ps %%zmm28,%%zmm21,%%zmm6\n\t vcvtdq2ps %%zmm18,%%zmm18\n\t vfmadd231ps %%zmm29,%%zmm18,%%zmm6\n\t"
"vcvtdq2ps %%zmm20,%%zmm20\n\t vfmadd231ps %%zmm28,%%zmm20,%%zmm5\n\t vcvtdq2ps %%zmm15,%%zmm15\n\t vfmadd231ps %%zmm29,%%zmm15,%%zmm5\n\t"
"vcvtdq2ps %%zmm17,%%zmm17\n\t vfmadd231ps %%zmm28,%%zmm17,%%zmm4\n\t vcvtdq2ps %%zmm14,%%zmm14\n\t vfmadd231ps %%zmm29,%%zmm14,%%zmm4\n\t"
"vcvtdq2ps %%zmm16,%%zmm16\n\t vfmadd231ps %%zmm28,%%zmm16,%%zmm3\n\t vcvtdq2ps %%zmm11,%%zmm11\n\t vfmadd231ps %%zmm29,%%zmm11,%%zmm3\n\t"
"vcvtdq2ps %%zmm13,%%zmm13\n\t vfmadd231ps %%zmm28,%%zmm13,%%zmm2\n\t vcvtdq2ps %%zmm10,%%zmm10\n\t vfmadd231ps %%zmm29,%%zmm10,%%zmm2\n\t"
"vcvtdq2ps %%zmm12,%%zmm12\n\t vfmadd231ps %%zmm28,%%zmm12,%%zmm1\n\t vcvtdq2ps %%zmm9,%%zmm9\n\t vfmadd231ps %%zmm29,%%zmm9,%%zmm1\n\t"
"2:\n\t"
::"r"(w),"r"(act),"r"((long)tail):"rax","r8","r14","memory");}return NP*128/(now()-t)/1e9;}

int main(void){
  for(int r=0;r<3;r++)
    printf("16 chains %.2f, 8 chains %.2f, 16 chains with broadcast operands %.2f; "
           "paired Q4_K loop: no tail %.2f, vpmulld tail %.2f, float tail %.2f G vpdpbusd/s\n",
           chains16_reg(),chains8_reg(),chains16_bcast(),pair_loop(0),pair_loop(1),pair_loop(2));
  return 0;
}
