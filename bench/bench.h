/* bench/bench.h: what every benchmark program measures the same way. Each
 * bench/<name>.c is its own program, so these are static functions. */
#ifndef K3_BENCH_H
#define K3_BENCH_H

#include "kernels/kernels.h"
#include "util/common.h"

#include <omp.h>
#include <stdio.h>
#include <time.h>

/* CPU seconds of the whole process (all threads): what load does not inflate. */
static inline double bench_cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The F32 FMA peak of one core on the kernel path in force (k_isa_active():
 * K3_ISA or the best the CPU has), measured: independent FMA chains held in
 * registers (no loads), CPU time, best of 3. The chain count is what the
 * path's register file holds with the two operands beside it: 24 of 32 zmm
 * with AVX-512, 12 of 16 ymm with AVX2 (24 would spill to the stack and
 * measure store-to-load forwarding, about half the peak), 24 of 32 q
 * registers with NEON; each is more than FMA latency x FMA ports on the CPUs
 * of that path (4-5 cycles x 2 ports on x86, 4 x 4 on Neoverse V1), so the
 * FMA ports never wait. The scalar path counts one lane per FMA (fmaf: the
 * instruction where the CPU has it; not vectorised, as the scalar kernels
 * are not). The peak of n cores is n x this. */
#define BENCH_FMA_PROBE(NAME, TGT, VT, NCH, LANES, SET1, FMA, STORE)                      \
    TGT static double NAME(long n) {                                                      \
        VT c[NCH], a = SET1(0.999f), b = SET1(1e-7f);                                     \
        for (int i = 0; i < NCH; i++) c[i] = SET1(1e-3f + (float)i);                      \
        double t0 = bench_cpu_now();                                                      \
        for (long it = 0; it < n; it++) {                                                 \
            _Pragma("GCC unroll 24") for (int i = 0; i < NCH; i++) c[i] = FMA(a, c[i], b); \
        }                                                                                 \
        double dt = bench_cpu_now() - t0;                                                 \
        float lane[16], sum = 0;                                                          \
        for (int i = 0; i < NCH; i++) {                                                   \
            STORE(lane, c[i]);                                                            \
            for (int j = 0; j < LANES; j++) sum += lane[j];                               \
        }                                                                                 \
        volatile float sink = sum;                                                        \
        (void)sink;                                                                       \
        return (double)n * NCH * LANES * 2 / dt / 1e9;                                    \
    }

/* Read bandwidth (the roofline a decode step is held to): a streaming read
 * of n floats (make it larger than the caches), best of 4, as the best
 * wall-clock GB/s, and GB/s per CPU-second x threads
 * (the rate while the threads actually ran). */
static inline void probe_read_gbs(const float *a, size_t n, int threads, double *wall_gbs, double *cpu_gbs) {
    double best = 1e30, bestc = 1e30, sink = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = k3_now(), c0 = bench_cpu_now(), s = 0;
        size_t blk = 1 << 16, nb = (n + blk - 1) / blk;
#pragma omp parallel for num_threads(threads) reduction(+ : s) schedule(static)
        for (size_t b = 0; b < nb; b++) {
            size_t lo = b * blk, len = lo + blk <= n ? blk : n - lo;
            s += k_sum(a + lo, (int)len);
        }
        double dt = k3_now() - t0, dc = (bench_cpu_now() - c0) / threads;
        sink += s;
        if (dt < best) best = dt;
        if (dc < bestc) bestc = dc;
    }
    if (sink == 12345.678) puts(""); /* keep the reads */
    *wall_gbs = (double)n * sizeof(float) / best / 1e9;
    *cpu_gbs = (double)n * sizeof(float) / bestc / 1e9;
}

#include <math.h>
#define BENCH_S_SET1(x) (x)
#define BENCH_S_STORE(p, v) ((p)[0] = (v))
#if defined(__x86_64__)
#include <immintrin.h>
BENCH_FMA_PROBE(bench_fma_peak_avx512, __attribute__((target("avx512f,fma"))), __m512, 24, 16, _mm512_set1_ps,
                _mm512_fmadd_ps, _mm512_storeu_ps)
BENCH_FMA_PROBE(bench_fma_peak_avx2, __attribute__((target("avx2,fma"))), __m256, 12, 8, _mm256_set1_ps,
                _mm256_fmadd_ps, _mm256_storeu_ps)
BENCH_FMA_PROBE(bench_fma_peak_scalar_hw, __attribute__((target("fma"), optimize("no-tree-slp-vectorize"))), float, 12, 1, BENCH_S_SET1,
                fmaf, BENCH_S_STORE)
#elif defined(__aarch64__)
#include <arm_neon.h>
#define BENCH_NEON_FMA(a, c, b) vfmaq_f32((b), (a), (c))
BENCH_FMA_PROBE(bench_fma_peak_neon, , float32x4_t, 24, 4, vdupq_n_f32, BENCH_NEON_FMA, vst1q_f32)
#endif
BENCH_FMA_PROBE(bench_fma_peak_scalar_lib, __attribute__((optimize("no-tree-slp-vectorize"))), float, 12, 1, BENCH_S_SET1, fmaf, BENCH_S_STORE)

static inline double bench_fma_peak_once(void) {
    switch (k_isa_active()) {
#if defined(__x86_64__)
    case K_ISA_AVX512: return bench_fma_peak_avx512(5000000);
    case K_ISA_AVX2: return bench_fma_peak_avx2(10000000);
#elif defined(__aarch64__)
    case K_ISA_NEON: return bench_fma_peak_neon(5000000);
#endif
    default: break;
    }
#if defined(__x86_64__)
    if (k_isa_available(K_ISA_AVX2)) return bench_fma_peak_scalar_hw(20000000);
#endif
    return bench_fma_peak_scalar_lib(20000000);
}
static inline double bench_fma_peak_gflops(void) {
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double g = bench_fma_peak_once();
        if (g > best) best = g;
    }
    return best;
}

#endif
