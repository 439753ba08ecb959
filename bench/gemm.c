/* bench/gemm.c: the products of a prefill chunk, one shape at a time, in
 * GFLOP per CPU-second beside the FMA peak measured in the same run.
 *
 *   bin/bench_gemm [--tokens N] [--reps R]
 *
 * Shapes are those of the decode benchmark's checkpoint (hidden 1280, KDA/MLA
 * projections, the dense MLP, 96 MXFP4 experts top-8 with latent 512 and
 * inner 256): BF16 trunk products over N inputs (default 256, one prefill
 * chunk) and MXFP4 expert products over N * 8 / 96 inputs (the average an
 * expert gets in such a chunk). One thread, CPU time, best of R (default 5)
 * repetitions: figures a shared machine disturbs least. Each shape runs the
 * AVX-512 products two ways, alternated within the run: "direct" (the 4 x 6
 * tiles that decode BF16/MXFP4 in the loop, the engine before the panel path)
 * and "panel" (rows decoded once into an f32 panel, column blocks; the
 * default). Same bits either way. Not a test. */
#include "bench.h"
#include "kernels/kernels.h"
#include "kernels/internal.h"
#include "util/common.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t xs = 0x9e3779b97f4a7c15ull;
static uint64_t next64(void) {
    xs ^= xs << 13;
    xs ^= xs >> 7;
    xs ^= xs << 17;
    return xs;
}


typedef struct {
    const char *name;
    kw_type type;
    int rows, cols, expert; /* expert: inputs are the per-expert share */
} shape;

int main(int argc, char **argv) {
    int T = 256, reps = 5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) T = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_gemm [--tokens N] [--reps R]\n");
            return 2;
        }
    }
    if (T < 1 || reps < 1) {
        fprintf(stderr, "usage: bench_gemm [--tokens N>=1] [--reps R>=1]\n");
        return 2;
    }
    static const shape shapes[] = {
        {"bf16 q/k/v/g/o 1280x1280", KW_BF16, 1280, 1280, 0},
        {"bf16 dense gate 3072x1280", KW_BF16, 3072, 1280, 0},
        {"bf16 dense down 1280x3072", KW_BF16, 1280, 3072, 0},
        {"bf16 moe down 512x1280", KW_BF16, 512, 1280, 0},
        {"bf16 moe up 1280x512", KW_BF16, 1280, 512, 0},
        {"bf16 f_b 1280x128", KW_BF16, 1280, 128, 0},
        {"mxfp4 expert w1 256x512", KW_MXFP4, 256, 512, 1},
        {"mxfp4 expert w2 512x256", KW_MXFP4, 512, 256, 1},
    };
    omp_set_num_threads(1);
    double peak = bench_fma_peak_gflops();
    printf("k3 prefill products: path %s, 1 thread, %d tokens per chunk, FMA peak %.1f GFLOP/s (CPU time)\n",
           k_path_name(), T, peak);
    printf("%-28s %7s | %12s %9s | %12s %9s\n", "product", "inputs", "direct", "", "panel", "");
    printf("%-28s %7s | %12s %9s | %12s %9s\n", "", "", "GFLOP/CPU-s", "% peak", "GFLOP/CPU-s", "% peak");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const shape *s = &shapes[si];
        int n = s->expert ? (T * 8 + 95) / 96 : T;
        size_t nw = (size_t)s->rows * (size_t)s->cols;
        k3_mat W = {.type = s->type, .rows = s->rows, .cols = s->cols, .group = 32};
        void *data;
        uint8_t *sc = NULL;
        if (s->type == KW_BF16) {
            uint16_t *p = xmalloc_aligned(nw * 2);
            for (size_t i = 0; i < nw; i++) p[i] = k3_f32_to_bf16((float)(next64() >> 40) / 16777216.0f - 0.5f);
            data = p;
        } else {
            uint8_t *p = xmalloc_aligned(nw / 2);
            for (size_t i = 0; i < nw / 2; i++) p[i] = (uint8_t)next64();
            sc = xmalloc(nw / 32);
            for (size_t i = 0; i < nw / 32; i++) sc[i] = (uint8_t)(118 + next64() % 8);
            data = p;
        }
        W.data = data;
        W.scales = sc;
        float *X = xmalloc_aligned((size_t)n * s->cols * sizeof *X), *Y = xmalloc_aligned((size_t)n * s->rows * sizeof *Y);
        for (size_t i = 0; i < (size_t)n * s->cols; i++) X[i] = (float)(next64() >> 40) / 16777216.0f - 0.5f;
        /* repeat small products so one timing covers ~20 ms */
        double flop = 2.0 * (double)nw * n;
        int inner = (int)(4e9 / flop) + 1;
        double best[2] = {1e30, 1e30};
        for (int r = 0; r < reps; r++)
            for (int v = 0; v < 2; v++) {
#if defined(__x86_64__)
                k_avx512_set_panel(v == 1);
#endif
                double c0 = bench_cpu_now();
                for (int k = 0; k < inner; k++) k_matmul(&W, X, n, Y);
                double dt = (bench_cpu_now() - c0) / inner;
                if (dt < best[v]) best[v] = dt;
            }
        double g0 = flop / best[0] / 1e9, g1 = flop / best[1] / 1e9;
        printf("%-28s %7d | %12.1f %8.0f%% | %12.1f %8.0f%%\n", s->name, n, g0, peak > 0 ? 100 * g0 / peak : 0, g1,
               peak > 0 ? 100 * g1 / peak : 0);
        free(data);
        free(sc);
        free(X);
        free(Y);
    }
#if defined(__x86_64__)
    k_avx512_set_panel(true);
#endif
    double peak2 = bench_fma_peak_gflops(); /* again: a busy moment at the start would understate it */
    if (peak2 > peak) printf("(FMA peak measured again at the end: %.1f GFLOP/s; %% above used the first)\n", peak2);
    return 0;
}
