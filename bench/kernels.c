/* bench/kernels.c: throughput of the k3 kernels beside the machine's own
 * limits, measured in the same run.
 *
 *   bin/bench_kernels [--quick]
 *
 * 1. read bandwidth: a STREAM-like sum over a buffer larger than the caches
 *    (1 and 2 threads) - the roofline for matrix-vector products;
 * 2. matvec GB/s (weight bytes read per second) for BF16 and MXFP4 over a bank
 *    of matrices larger than the last-level cache, 1 and 2 threads, with the
 *    scalar reference path at 1 thread for comparison (old vs new);
 * 3. matmul GFLOP/s (2 * rows * cols * tokens) for F32, BF16 and MXFP4;
 * 4. KDA recurrent vs chunked prefill, tokens/s.
 * Each figure is the best of a few repetitions (the machine is shared). */
#include "kernels/kernels.h"
#include "util/common.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool quick;

static uint64_t xs = 0x243f6a8885a308d3ull;
static uint64_t next64(void) {
    xs ^= xs << 13;
    xs ^= xs >> 7;
    xs ^= xs << 17;
    return xs;
}
static void fill_bytes(void *p, size_t n) {
    uint8_t *b = p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = next64();
        memcpy(b + i, &v, 8);
    }
    for (; i < n; i++) b[i] = (uint8_t)next64();
}
static float *rand_f32(size_t n, float scale) {
    float *x = xmalloc_aligned(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = scale * ((float)(next64() >> 40) / 16777216.0f - 0.5f);
    return x;
}

/* ---- read bandwidth ----------------------------------------------------------- */

static volatile uint64_t sink;

static double read_gbps(const uint64_t *p, size_t n, int threads) {
    omp_set_num_threads(threads);
    double best = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = k3_now();
        uint64_t s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static)
        for (size_t i = 0; i < n; i++) s += p[i];
        double dt = k3_now() - t0;
        sink = s;
        double g = (double)n * 8 / dt / 1e9;
        if (g > best) best = g;
    }
    return best;
}

/* ---- matvec bandwidth ------------------------------------------------------------- */

typedef struct {
    k3_mat *m;
    int count;
    size_t bytes; /* weight bytes of the whole bank */
} bank;

static bank make_bank(kw_type type, int rows, int cols, size_t total_bytes) {
    size_t per = type == KW_BF16 ? (size_t)rows * cols * 2
                                 : (size_t)rows * cols / 2 + (size_t)rows * (size_t)(cols / 32);
    bank b = {.count = (int)((total_bytes + per - 1) / per)};
    b.m = xcalloc((size_t)b.count, sizeof *b.m);
    for (int i = 0; i < b.count; i++) {
        k3_mat *m = &b.m[i];
        m->type = type;
        m->rows = rows;
        m->cols = cols;
        if (type == KW_BF16) {
            uint16_t *w = xmalloc_aligned((size_t)rows * cols * 2);
            for (size_t j = 0; j < (size_t)rows * cols; j++) /* |w| < 1, finite */
                w[j] = (uint16_t)(0x3c00u + (next64() & 0x3ff)) | (uint16_t)((next64() & 1) << 15);
            m->data = w;
        } else {
            uint8_t *p = xmalloc_aligned((size_t)rows * cols / 2);
            fill_bytes(p, (size_t)rows * cols / 2);
            uint8_t *s = xmalloc_aligned((size_t)rows * (size_t)(cols / 32));
            for (size_t j = 0; j < (size_t)rows * (size_t)(cols / 32); j++) s[j] = (uint8_t)(118 + next64() % 8);
            m->data = p;
            m->scales = s;
            m->group = 32;
        }
    }
    b.bytes = per * (size_t)b.count;
    return b;
}

static void free_bank(bank *b) {
    for (int i = 0; i < b->count; i++) {
        free((void *)b->m[i].data);
        free((void *)b->m[i].scales);
    }
    free(b->m);
}

/* GB/s of weight bytes over one sweep of the bank (best of reps). */
static double matvec_gbps(const bank *b, const float *x, float *y, int threads, bool scalar, int reps) {
    omp_set_num_threads(threads);
    k_set_scalar(scalar);
    double best = 0;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = k3_now();
        for (int i = 0; i < b->count; i++) k_matvec(&b->m[i], x, y);
        double g = (double)b->bytes / (k3_now() - t0) / 1e9;
        if (g > best) best = g;
    }
    k_set_scalar(false);
    return best;
}

/* ---- matmul ------------------------------------------------------------------------ */

static double matmul_gflops(const k3_mat *W, const float *X, int n, float *Y, int threads, bool scalar) {
    omp_set_num_threads(threads);
    k_set_scalar(scalar);
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = k3_now();
        k_matmul(W, X, n, Y);
        double dt = k3_now() - t0;
        if (dt < best) best = dt;
    }
    k_set_scalar(false);
    return 2.0 * W->rows * (double)W->cols * n / best / 1e9;
}

/* ---- KDA ------------------------------------------------------------------------------ */

static double kda_tps(int T, int H, int D, int C, int threads, bool scalar) {
    omp_set_num_threads(threads);
    k_set_scalar(scalar);
    size_t n = (size_t)T * H * D;
    float *q = rand_f32(n, 0.2f), *k = rand_f32(n, 0.2f), *v = rand_f32(n, 2), *g = rand_f32(n, 4);
    float *beta = rand_f32((size_t)T * H, 1), *o = rand_f32(n, 1), *S = rand_f32((size_t)H * D * D, 0);
    for (size_t i = 0; i < n; i++) g[i] = g[i] < 0 ? g[i] : -g[i];
    for (size_t i = 0; i < (size_t)T * H; i++) beta[i] += 0.5f;
    double best = 1e30;
    for (int rep = 0; rep < 2; rep++) {
        memset(S, 0, (size_t)H * D * D * sizeof *S);
        double t0 = k3_now();
        if (C > 0) k_kda_chunked(o, S, q, k, v, g, beta, T, H, D, C, -2.0f); /* g in [-2, 0] */
        else k_kda_recurrent(o, S, q, k, v, g, beta, T, H, D);
        double dt = k3_now() - t0;
        if (dt < best) best = dt;
    }
    free(q); free(k); free(v); free(g); free(beta); free(o); free(S);
    k_set_scalar(false);
    return T / best;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else { fprintf(stderr, "usage: bench_kernels [--quick]\n"); return 2; }
    }
    size_t big = quick ? (256u << 20) : (1024u << 20);
    printf("k3 kernels benchmark: path %s, %d CPUs, working sets %zu MB\n", k_path_name(), omp_get_num_procs(),
           big >> 20);

    /* The probe is repeated right before each matvec row (the machine may be
     * shared): each row's %bw is against the probe taken next to it. */
    size_t pbytes = big / 2;
    uint64_t *buf = xmalloc_aligned(pbytes);
    fill_bytes(buf, pbytes);
    double bw1 = read_gbps(buf, pbytes / 8, 1), bw2 = read_gbps(buf, pbytes / 8, 2);
    printf("\n%-34s %8s %8s\n", "read bandwidth (GB/s)", "1 thr", "2 thr");
    printf("%-34s %8.1f %8.1f\n", "STREAM-like sum", bw1, bw2);

    int rows = 4096, cols = 7168;
    float *x = rand_f32((size_t)cols, 2), *y = rand_f32((size_t)rows, 0);
    printf("\n%-34s %8s %8s %8s %8s %9s\n", "matvec 4096x7168 (weight GB/s)", "1 thr", "%bw", "2 thr", "%bw",
           "scalar 1");
    const kw_type types[2] = {KW_BF16, KW_MXFP4};
    const char *names[2] = {"BF16", "MXFP4 (packed + scales)"};
    for (int ti = 0; ti < 2; ti++) {
        bank b = make_bank(types[ti], rows, cols, big);
        matvec_gbps(&b, x, y, 2, false, 1); /* touch */
        bw1 = read_gbps(buf, pbytes / 8, 1);
        bw2 = read_gbps(buf, pbytes / 8, 2);
        double g1 = matvec_gbps(&b, x, y, 1, false, 3), g2 = matvec_gbps(&b, x, y, 2, false, 3);
        double gs = matvec_gbps(&b, x, y, 1, true, 1);
        printf("%-34s %8.1f %7.0f%% %8.1f %7.0f%% %9.2f   (probe %.1f / %.1f)\n", names[ti], g1, 100 * g1 / bw1, g2,
               100 * g2 / bw2, gs, bw1, bw2);
        free_bank(&b);
    }
    free(buf);
    free(x);
    free(y);

    int mr = 1024, mc = 7168, nt = quick ? 32 : 128;
    float *X = rand_f32((size_t)nt * mc, 2), *Y = rand_f32((size_t)nt * mr, 0);
    printf("\n%-34s %8s %8s %9s\n", "matmul 1024x7168, GFLOP/s", "1 thr", "2 thr", "scalar 1");
    const kw_type mt[3] = {KW_F32, KW_BF16, KW_MXFP4};
    const char *mn[3] = {"F32", "BF16", "MXFP4"};
    for (int ti = 0; ti < 3; ti++) {
        k3_mat W = {.type = mt[ti], .rows = mr, .cols = mc, .group = 32};
        void *d = NULL;
        uint8_t *s = NULL;
        if (mt[ti] == KW_F32) d = rand_f32((size_t)mr * mc, 1);
        if (mt[ti] == KW_BF16) {
            uint16_t *w = xmalloc_aligned((size_t)mr * mc * 2);
            for (size_t j = 0; j < (size_t)mr * mc; j++) w[j] = (uint16_t)(0x3c00u + (next64() & 0x3ff));
            d = w;
        }
        if (mt[ti] == KW_MXFP4) {
            d = xmalloc_aligned((size_t)mr * mc / 2);
            fill_bytes(d, (size_t)mr * mc / 2);
            s = xmalloc_aligned((size_t)mr * (mc / 32));
            for (size_t j = 0; j < (size_t)mr * (mc / 32); j++) s[j] = 120;
        }
        W.data = d;
        W.scales = s;
        double g1 = matmul_gflops(&W, X, nt, Y, 1, false), g2 = matmul_gflops(&W, X, nt, Y, 2, false);
        double gs = matmul_gflops(&W, X, 8, Y, 1, true);
        printf("%-34s %8.1f %8.1f %9.2f\n", mn[ti], g1, g2, gs);
        free(d);
        free(s);
    }
    free(X);
    free(Y);

    int T = quick ? 64 : 256, H = 8, D = 128;
    printf("\n%-34s %8s %8s %9s\n", "KDA prefill H=8 D=128, tokens/s", "1 thr", "2 thr", "scalar 1");
    printf("%-34s %8.0f %8.0f %9.0f\n", "recurrent", kda_tps(T, H, D, 0, 1, false), kda_tps(T, H, D, 0, 2, false),
           kda_tps(T, H, D, 0, 1, true));
    printf("%-34s %8.0f %8.0f %9.0f\n", "chunked C=64", kda_tps(T, H, D, 64, 1, false),
           kda_tps(T, H, D, 64, 2, false), kda_tps(T, H, D, 64, 1, true));
    return 0;
}
