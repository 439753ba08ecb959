/* bench/bench.h: what every benchmark program measures the same way. Each
 * bench/<name>.c is its own program, so these are static functions. */
#ifndef K3_BENCH_H
#define K3_BENCH_H

#include "kernels/kernels.h"

#include <time.h>

/* CPU seconds of the whole process (all threads): what load does not inflate. */
static inline double bench_cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The F32 FMA peak of one core, measured: 24 independent FMA chains in
 * registers (no loads, enough chains to cover the FMA latency on two ports),
 * CPU time, best of 3. On the widest path the CPU has (16 lanes with AVX-512,
 * 8 with AVX2); 0 on a CPU without FMA. The peak of n cores is n x this.
 * Target attributes + the CPUID check: the benches are built for baseline
 * x86-64. */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx512f,fma"))) static double bench_fma_peak_avx512(long n) {
    __m512 c[24], a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 24; i++) c[i] = _mm512_set1_ps(1e-3f + (float)i);
    double t0 = bench_cpu_now();
    for (long it = 0; it < n; it++) {
        _Pragma("GCC unroll 24") for (int i = 0; i < 24; i++) c[i] = _mm512_fmadd_ps(a, c[i], b);
    }
    double dt = bench_cpu_now() - t0;
    __m512 s = c[0];
    for (int i = 1; i < 24; i++) s = _mm512_add_ps(s, c[i]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return (double)n * 24 * 32 / dt / 1e9;
}
__attribute__((target("avx2,fma"))) static double bench_fma_peak_avx2(long n) {
    __m256 c[24], a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 24; i++) c[i] = _mm256_set1_ps(1e-3f + (float)i);
    double t0 = bench_cpu_now();
    for (long it = 0; it < n; it++) {
        _Pragma("GCC unroll 24") for (int i = 0; i < 24; i++) c[i] = _mm256_fmadd_ps(a, c[i], b);
    }
    double dt = bench_cpu_now() - t0;
    float lane[8], sum = 0;
    for (int i = 0; i < 24; i++) {
        _mm256_storeu_ps(lane, c[i]);
        for (int j = 0; j < 8; j++) sum += lane[j];
    }
    volatile float sink = sum;
    (void)sink;
    return (double)n * 24 * 16 / dt / 1e9;
}
static inline double bench_fma_peak_gflops(void) {
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double g = k_isa_available(K_ISA_AVX512) ? bench_fma_peak_avx512(5000000)
                   : k_isa_available(K_ISA_AVX2) ? bench_fma_peak_avx2(5000000)
                                                 : 0;
        if (g > best) best = g;
    }
    return best;
}
#else
static inline double bench_fma_peak_gflops(void) { return 0; }
#endif

#endif
