/* bench_decode: prefill and decode throughput of a resident model directory at
 * each thread count, with the weight bytes one decoded token reads, the GB/s
 * that implies, and a STREAM-like read-bandwidth probe taken in the same run
 * (so the ratio to the machine's limit is visible).
 *
 *   bin/bench_decode MODEL_DIR [--prompt N] [--gen N] [--threads 1,2] [--probe-mb MB]
 *
 * Build a checkpoint with tools/gen_checkpoint.py (e.g. --preset issue7, 627 MB,
 * 96 MXFP4 experts). Not a test: numbers depend on the machine and its load. */
#include "model/model.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double probe_read_gbs(const float *a, size_t n, int threads) {
    double best = 1e30, sink = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = k3_now(), s = 0;
        size_t blk = 1 << 16, nb = (n + blk - 1) / blk;
#pragma omp parallel for num_threads(threads) reduction(+ : s) schedule(static)
        for (size_t b = 0; b < nb; b++) {
            size_t lo = b * blk, len = lo + blk <= n ? blk : n - lo;
            s += k_sum(a + lo, (int)len);
        }
        double dt = k3_now() - t0;
        sink += s;
        if (dt < best) best = dt;
    }
    if (sink == 12345.678) puts(""); /* keep the reads */
    return (double)n * sizeof(float) / best / 1e9;
}

int main(int argc, char **argv) {
    const char *dir = NULL, *tlist = "1,2";
    int np = 64, ng = 32, probe_mb = 1024;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--prompt") && i + 1 < argc) np = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--gen") && i + 1 < argc) ng = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) tlist = argv[++i];
        else if (!strcmp(argv[i], "--probe-mb") && i + 1 < argc) probe_mb = atoi(argv[++i]);
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else {
            fprintf(stderr, "usage: bench_decode MODEL_DIR [--prompt N] [--gen N] [--threads 1,2] [--probe-mb MB]\n");
            return 2;
        }
    }
    if (!dir || np < 1 || ng < 2 || probe_mb < 16) {
        fprintf(stderr, "usage: bench_decode MODEL_DIR [--prompt N] [--gen N>=2] [--threads 1,2] [--probe-mb MB>=16]\n");
        return 2;
    }
    int threads[16], nt = 0;
    for (const char *p = tlist; *p && nt < 16;) {
        threads[nt++] = atoi(p);
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }

    k3_err err = {0};
    k3_model *m;
    if (k3_model_open(dir, NULL, &m, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    uint64_t bpt = k3_model_bytes_per_token(m);
    printf("model %s: %d layers, hidden %d, %d experts (top-%d), weights %.1f MB resident, %.1f MB read per decoded token\n",
           dir, c->num_layers, c->hidden_size, c->num_experts, c->experts_per_token,
           k3_model_weight_bytes(m) / 1e6, bpt / 1e6);
    printf("kernels: %s\n", k_path_name());

    size_t n = (size_t)probe_mb * 1024 * 1024 / sizeof(float);
    float *a = xmalloc_array(n, sizeof *a);
    for (size_t i = 0; i < n; i++) a[i] = (float)(i & 1023) * 1e-3f;

    int32_t *ids = xmalloc_array((size_t)np + ng, sizeof *ids);
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < np; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[i] = (int32_t)(x % (uint64_t)V);
    }
    float *lg = xmalloc_array((size_t)V, sizeof *lg);

    printf("\n%-8s %12s %14s %13s %12s %14s %10s\n", "threads", "probe GB/s", "prefill tok/s", "decode tok/s",
           "decode GB/s", "% of probe", "ms/token");
    for (int ti = 0; ti < nt; ti++) {
        int t = threads[ti];
        omp_set_num_threads(t);
        double bw = probe_read_gbs(a, n, t);
        k3_state *s;
        if (k3_state_new(m, np + ng + 8, &s, &err)) {
            fprintf(stderr, "k3: %s\n", err.msg);
            return err.code;
        }
        /* warm-up: touch the trunk and some experts once (page cache, first-touch) */
        if (k3_forward(m, s, ids, np < 8 ? np : 8, lg, false, &err)) goto fail;
        k3_state_reset(s);
        double t0 = k3_now();
        if (k3_forward(m, s, ids, np, lg, false, &err)) goto fail;
        double t1 = k3_now();
        for (int g = 0; g < ng; g++) {
            ids[np + g] = k3_argmax(lg, V);
            if (k3_forward(m, s, &ids[np + g], 1, lg, false, &err)) goto fail;
        }
        double t2 = k3_now();
        k3_state_free(s);
        double pre = np / (t1 - t0), dec = ng / (t2 - t1), gbs = dec * (double)bpt / 1e9;
        printf("%-8d %12.1f %14.1f %13.2f %12.2f %13.0f%% %10.1f\n", t, bw, pre, dec, gbs, 100 * gbs / bw,
               1e3 * (t2 - t1) / ng);
        continue;
    fail:
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    printf("\n(prompt %d tokens, %d decoded tokens greedy; decode GB/s = tok/s x bytes per token)\n", np, ng);
    free(lg);
    free(ids);
    free(a);
    k3_model_free(m);
    return 0;
}
