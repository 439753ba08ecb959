/* bench/train.c: training throughput of `k3 train`'s step (forward, backward
 * and the optimiser) on random tokens, without data files.
 *
 *   bin/bench_train [--config F] [--batch B] [--seq T] [--accum A] [--steps N]
 *                   [--threads LIST] [--optimizer muon|adamw] [--kda-chunk C] [--bf16]
 *                   [--json]
 *   bin/bench_train --gemm     (GFLOP/s of the training GEMM: F32, vdpbf16ps, AMX)
 *   bin/bench_train --peak     (measured peaks of one core: F32 FMA, vdpbf16ps, AMX)
 *
 * "weights" is a hash of the parameters after the last step: two builds give
 * the same hash iff their F32 steps are bit-identical (used for A/B checks).
 *
 * Per thread count: one warm-up step, then N timed optimiser steps. Prints
 * tokens/s and seconds per step by wall clock AND by process CPU time (on a
 * shared machine the wall clock includes time other jobs held the cores;
 * CPU time / threads is the busy time), the model FLOPs per token (see
 * flops_per_token) and the achieved FLOP/s. scripts/bench_train.sh runs it
 * beside the PyTorch reference. */
#include "bench.h"
#include "train/tinternal.h"
#include "kernels/kernels.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Model FLOPs of one training token (forward + backward = 3x forward):
 *  - every weight matrix a token goes through: 2 * rows * cols forward
 *    (routed experts: k of the num_experts; the embedding is a gather);
 *  - MLA scores and values: causal, on average (T+1)/2 keys per query;
 *  - KDA, as the recurrent form counts it: 4 D^2 multiply-adds per head and
 *    token (decay, S^T k, the rank-1 write, S^T q).
 * Elementwise work (norms, gates, softmax) is not counted. */
static double flops_per_token(const tmodel *m, int T) {
    const k3_config *c = &m->cfg;
    double f = 0;
    for (int i = 0; i < m->np; i++) {
        const tparam *p = &m->params[i];
        if (p->rank != 2 || p->off == m->embed || p->shape[0] == 1) continue;
        double mm = 2.0 * p->shape[0] * p->shape[1];
        if (strstr(p->name, ".experts.")) mm *= (double)c->experts_per_token / c->num_experts;
        f += mm;
    }
    for (int l = 0; l < c->num_layers; l++) {
        if (c->layer_kind[l] == 'M') {
            double keys = (T + 1) / 2.0;
            f += 2.0 * c->mla_heads * keys * (c->qk_nope_dim + c->qk_rope_dim + c->v_head_dim);
        } else {
            f += 2.0 * 4.0 * c->kda_heads * (double)c->kda_head_dim * c->kda_head_dim;
        }
    }
    return 3.0 * f;
}

/* the i-th draw of the common generator seeded 0 (a pure function of i) */
static uint64_t mix(uint64_t i) { return k3_rng_next(&i); }

#if defined(__x86_64__)
#include <immintrin.h>
/* The same for vdpbf16ps (2 multiply-adds per lane = 64 flops each). */
__attribute__((target("avx512f,avx512bf16"))) static double bf16_peak_gflops(void) {
    __m512 c[24];
    for (int i = 0; i < 24; i++) c[i] = _mm512_set1_ps(1e-3f * (float)i);
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x33803380);
    const long n = 10000000;
    double t0 = bench_cpu_now();
    for (long it = 0; it < n; it++) {
        _Pragma("GCC unroll 24") for (int i = 0; i < 24; i++) c[i] = _mm512_dpbf16_ps(c[i], x, y);
    }
    double dt = bench_cpu_now() - t0;
    __m512 s = c[0];
    for (int i = 1; i < 24; i++) s = _mm512_add_ps(s, c[i]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return (double)n * 24 * 64 / dt / 1e9;
}
/* AMX: 4 independent C tiles, TDPBF16PS on resident A/B tiles (16 x 16 x 32
 * multiply-adds = 16,384 flops each); 0 without AMX. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) bench_tilecfg;
__attribute__((target("amx-tile,amx-bf16"))) static double amx_peak_gflops(void) {
    if (!k_gemm_amx_available()) return 0;
    bench_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    static uint16_t ab[16 * 32] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) ab[i] = 0x3f80; /* 1.0 */
    _tile_loadd(4, ab, 64);
    _tile_loadd(5, ab, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const long n = 2000000;
    double t0 = bench_cpu_now();
    for (long it = 0; it < n; it++) {
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 5);
    }
    double dt = bench_cpu_now() - t0;
    static float out[256] __attribute__((aligned(64)));
    _tile_stored(0, out, 64);
    _tile_release();
    volatile float sink = out[0];
    (void)sink;
    return (double)n * 4 * 16384 / dt / 1e9;
}
#else
static double bf16_peak_gflops(void) { return 0; }
static double amx_peak_gflops(void) { return 0; }
#endif

/* FNV-1a of the weights' bits: equal across builds iff the F32 step is bit-exact. */
static uint64_t weights_hash(const tmodel *m) {
    uint64_t h = 1469598103934665603ull;
    const unsigned char *p = (const unsigned char *)m->w;
    for (size_t i = 0; i < m->nw * sizeof(float); i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* GFLOP/s of the training GEMM on the three products of one linear layer
 * (n tokens, in -> out), F32 and BF16, at the given thread count. */
static void gemm_bench(int nt, int n, int in, int out) {
    omp_set_num_threads(nt);
    /* one thread: CPU time (immune to other jobs holding the core); two: wall */
    double (*clk)(void) = nt == 1 ? bench_cpu_now : k3_now;
    float *X = xmalloc_aligned(sizeof(float) * (size_t)n * in), *W = xmalloc_aligned(sizeof(float) * (size_t)out * in);
    float *Y = xmalloc_aligned(sizeof(float) * (size_t)n * out), *G = xmalloc_aligned(sizeof(float) * (size_t)out * in);
    float *DX = xmalloc_aligned(sizeof(float) * (size_t)n * in);
    for (size_t i = 0; i < (size_t)n * in; i++) X[i] = (float)(mix(i) >> 40) / 16777216.0f - 0.5f;
    for (size_t i = 0; i < (size_t)out * in; i++) W[i] = (float)(mix(i + 99) >> 40) / 16777216.0f - 0.5f;
    for (size_t i = 0; i < (size_t)n * out; i++) Y[i] = (float)(mix(i + 7) >> 40) / 16777216.0f - 0.5f;
    memset(G, 0, sizeof(float) * (size_t)out * in);
    printf("GEMM %d tokens, %d -> %d, %d thread(s), GFLOP/s:", n, in, out, nt);
    for (int mode = 0; mode < 3; mode++) { /* f32, bf16 vdpbf16ps, bf16 AMX */
        if (mode > 0 && !k_gemm_bf16_fast()) { /* the scalar emulation is not what is measured */
            printf("  (BF16: no tiles on the %s path)", k_path_name());
            break;
        }
        if (mode == 2 && !k_gemm_amx_available()) break;
        k_gemm_set_amx(mode == 2);
        double best[3] = {0, 0, 0};
        for (int rep = 0; rep < 3; rep++) {
            double t0 = clk();
            k_gemm_mode tm = mode ? K_GEMM_BF16 : K_GEMM_F32;
            k_gemm(Y, out, n, out, in, (k_view){X, in, 1}, (k_view){W, 1, in}, false, tm);
            double t1 = clk();
            k_gemm(DX, in, n, in, out, (k_view){Y, out, 1}, (k_view){W, in, 1}, false, tm);
            double t2 = clk();
            k_gemm(G, in, out, in, n, (k_view){Y, 1, out}, (k_view){X, in, 1}, true, tm);
            double t3 = clk();
            double f = 2.0 * n * in * out / 1e9;
            double g[3] = {f / (t1 - t0), f / (t2 - t1), f / (t3 - t2)};
            for (int i = 0; i < 3; i++) if (g[i] > best[i]) best[i] = g[i];
        }
        printf("  %s fwd %.1f dX %.1f dW %.1f", mode == 2 ? "amx" : mode ? "vdpbf16ps" : "f32", best[0], best[1],
               best[2]);
    }
    k_gemm_set_amx(true);
    printf("\n");
    free(X); free(W); free(Y); free(G); free(DX);
}

int main(int argc, char **argv) {
    const char *cfgp = "configs/smol-5m.json", *thr = "1,2", *optn = "muon";
    int B = 16, T = 256, A = 1, steps = 2;
    bool json = false, bf16 = false;
    int kda_chunk = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json")) { json = true; continue; }
        if (!strcmp(a, "--bf16")) { bf16 = true; continue; }
        if (!strcmp(a, "--no-amx")) { k_gemm_set_amx(false); continue; }
        if (!strcmp(a, "--peak")) {
            double best = bench_fma_peak_gflops();
            double bb = 0, am = 0;
            if (k_gemm_bf16_available())
                for (int r = 0; r < 3; r++) { double g = bf16_peak_gflops(); if (g > bb) bb = g; }
            for (int r = 0; r < 3; r++) { double g = amx_peak_gflops(); if (g > am) am = g; }
            if (json)
                printf("{\"fma_peak_gflops_per_core\":%.2f,\"bf16_peak_gflops_per_core\":%.2f,"
                       "\"amx_peak_gflops_per_core\":%.2f}\n", best, bb, am);
            else printf("FMA peak, one core: %.1f GFLOP/s (f32 FMA chains on the kernel path in force); "
                        "vdpbf16ps peak %.1f GFLOP/s; AMX-BF16 peak %.1f GFLOP/s (0: no AMX)\n", best, bb, am);
            return 0;
        }
        if (!strcmp(a, "--gemm")) {
            for (int nt = 1; nt <= 2; nt++) {
                gemm_bench(nt, 4096, 320, 960);
                gemm_bench(nt, 512, 160, 320);
                gemm_bench(nt, 4096, 320, 8192);
            }
            return 0;
        }
        if (!v) { fprintf(stderr, "k3: bench_train: %s needs a value\n", a); return 2; }
        i++;
        if (!strcmp(a, "--config")) cfgp = v;
        else if (!strcmp(a, "--batch")) B = atoi(v);
        else if (!strcmp(a, "--seq")) T = atoi(v);
        else if (!strcmp(a, "--accum")) A = atoi(v);
        else if (!strcmp(a, "--steps")) steps = atoi(v);
        else if (!strcmp(a, "--threads")) thr = v;
        else if (!strcmp(a, "--optimizer")) optn = v;
        else if (!strcmp(a, "--kda-chunk")) kda_chunk = atoi(v);
        else { fprintf(stderr, "k3: bench_train: unknown flag %s\n", a); return 2; }
    }
    if (B < 1 || T < 1 || A < 1 || steps < 1) { fprintf(stderr, "k3: bench_train: bad sizes\n"); return 2; }
    k3_config cfg;
    k3_err err = {0};
    tmodel m;
    if (k3_config_load(cfgp, &cfg, &err) || tm_build(&m, &cfg, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return err.code ? err.code : 2;
    }
    tm_init(&m, 1);
    if (kda_chunk >= 0) m.kda_chunk = kda_chunk;
    m.bf16 = bf16;
    topt_cfg oc;
    topt_defaults(&oc);
    oc.muon = strcmp(optn, "adamw") != 0;
    oc.total_steps = 1000;
    topt opt;
    topt_init(&opt, &m, &oc);
    const int V = cfg.vocab_size;
    int32_t *tok = xmalloc_array((size_t)B * (T + 1), sizeof(int32_t));
    const double fpt = flops_per_token(&m, T);
    const int64_t ntok = (int64_t)A * B * T;
    if (!json)
        printf("bench_train: %s, %zu parameters, batch %dx%d, accumulation %d (%lld tokens/step), "
               "%s, KDA %s %d, %s, model GFLOP/token %.4f, kernels %s\n",
               cfgp, m.nw, B, T, A, (long long)ntok, oc.muon ? "muon" : "adamw",
               m.kda_chunk ? "chunk" : "recurrent", m.kda_chunk, m.bf16 ? "bf16" : "f32", fpt / 1e9, k_path_name());
    char list[64];
    snprintf(list, sizeof list, "%s", thr);
    uint64_t ctr = 0;
    for (char *s = strtok(list, ","); s; s = strtok(NULL, ",")) {
        int nt = atoi(s);
        if (nt < 1) continue;
        omp_set_num_threads(nt);
        double wall = 0, cpu = 0, loss = 0, fwd = 0, bwd = 0, optt = 0;
        for (int st = 0; st <= steps; st++) {
            double w0 = k3_now(), c0 = bench_cpu_now();
            memset(m.g, 0, m.nw * sizeof(float));
            m.qb_record = true;
            loss = 0;
            double tf = 0, tb = 0;
            for (int a = 0; a < A; a++) {
                for (size_t i = 0; i < (size_t)B * (T + 1); i++) tok[i] = (int32_t)(mix(ctr++) % (uint64_t)V);
                double t0 = bench_cpu_now();
                loss += tm_forward(&m, tok, B, T);
                double t1 = bench_cpu_now();
                tm_backward(&m, 1.0f / (float)ntok);
                tf += t1 - t0;
                tb += bench_cpu_now() - t1;
            }
            m.qb_record = false;
            double t2 = bench_cpu_now(), lr;
            topt_step(&opt, &m, &lr);
            tm_qb_update(&m);
            double t3 = bench_cpu_now();
            if (st == 0) continue; /* warm-up: allocation, first touch */
            wall += k3_now() - w0;
            cpu += bench_cpu_now() - c0;
            fwd += tf;
            bwd += tb;
            optt += t3 - t2;
        }
        double sw = wall / steps, sc = cpu / steps;
        if (json)
            printf("{\"config\":\"%s\",\"kda_chunk\":%d,\"bf16\":%s,\"optimizer\":\"%s\",\"threads\":%d,\"tokens_per_step\":%lld,\"s_per_step\":%.4f,"
                   "\"cpu_s_per_step\":%.4f,\"tokens_per_s\":%.2f,\"tokens_per_cpu_s\":%.2f,"
                   "\"flops_per_token\":%.6e,\"gflops\":%.3f,\"forward_cpu_s\":%.4f,\"backward_cpu_s\":%.4f,"
                   "\"optimizer_cpu_s\":%.4f,\"loss\":%.5f,\"amx\":%s,\"weights_fnv\":\"%016llx\"}\n",
                   cfgp, m.kda_chunk, m.bf16 ? "true" : "false", oc.muon ? "muon" : "adamw", nt, (long long)ntok, sw, sc, ntok / sw, ntok / sc, fpt, fpt * ntok / sw / 1e9,
                   fwd / steps, bwd / steps, optt / steps, loss / ntok, m.bf16 && k_gemm_amx_available() ? "true" : "false",
                   (unsigned long long)weights_hash(&m));
        else
            printf("threads %d: %.3f s/step wall (%.1f tokens/s, %.2f GFLOP/s), %.3f s CPU/step "
                   "(%.1f tokens per CPU-s); CPU s: forward %.3f, backward %.3f, optimiser %.3f; loss %.4f; "
                   "weights %016llx\n",
                   nt, sw, ntok / sw, fpt * ntok / sw / 1e9, sc, ntok / sc, fwd / steps, bwd / steps,
                   optt / steps, loss / ntok, (unsigned long long)weights_hash(&m));
        fflush(stdout);
    }
    free(tok);
    topt_free(&opt);
    tm_free(&m);
    return 0;
}
