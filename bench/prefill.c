/* bench/prefill.c: prefill alone, repeated in one process, for old/new
 * comparisons on a shared machine (run two builds alternately; compare the
 * best and median CPU seconds, which time slicing by other jobs inflates
 * least).
 *
 *   bin/bench_prefill MODEL_DIR [--prompt N] [--reps R] [--chunk C] [--threads T]
 *
 * One warm-up prefill, then R (default 3) timed prefills of the same N-token
 * pseudo-random prompt (default 256; the ids bench_decode uses) from an empty
 * state, logits of the last position only. Prints one line per prefill
 * ("wall_s cpu_s") and a summary. Not a test. */
#include "bench.h"
#include "model/model.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef K3_PREFILL_CHUNK /* builds against an engine older than the constant (its default was 64) */
#define K3_PREFILL_CHUNK 64
#endif

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const char *dir = NULL;
    int np = 256, reps = 3, chunk = 0, threads = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--prompt") && i + 1 < argc) np = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc) chunk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else dir = NULL, i = argc;
    }
    if (!dir || np < 1 || reps < 1 || chunk < 0 || threads < 0) {
        fprintf(stderr, "usage: bench_prefill MODEL_DIR [--prompt N] [--reps R] [--chunk C] [--threads T]\n");
        return 2;
    }
    if (threads > 0) omp_set_num_threads(threads);
    k3_err err = {0};
    k3_model *m;
    k3_model_opts mo = {.prefill_chunk = chunk};
    if (k3_model_open(dir, &mo, &m, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    int V = k3_model_config(m)->vocab_size;
    int32_t *ids = xmalloc_array((size_t)np, sizeof *ids);
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < np; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[i] = (int32_t)(x % (uint64_t)V);
    }
    float *lg = xmalloc_array((size_t)V, sizeof *lg);
    double *w = xmalloc_array((size_t)reps, sizeof *w), *c = xmalloc_array((size_t)reps, sizeof *c);
    k3_state *s;
    if (k3_state_new(m, np, &s, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    printf("prefill of %d tokens, chunk %d, %d threads, kernels %s\n", np, chunk > 0 ? chunk : K3_PREFILL_CHUNK,
           omp_get_max_threads(), k_path_name());
    for (int r = -1; r < reps; r++) {
        k3_state_reset(s);
        double t0 = k3_now(), c0 = bench_cpu_now();
        if (k3_forward(m, s, ids, np, lg, false, &err)) {
            fprintf(stderr, "k3: %s\n", err.msg);
            return err.code;
        }
        if (r < 0) continue; /* warm-up: page cache, first touch */
        w[r] = k3_now() - t0;
        c[r] = bench_cpu_now() - c0;
        printf("%.4f %.4f\n", w[r], c[r]);
    }
    qsort(w, (size_t)reps, sizeof *w, cmp_double);
    qsort(c, (size_t)reps, sizeof *c, cmp_double);
    printf("best wall %.1f tok/s, median wall %.1f tok/s; CPU s best %.3f, median %.3f\n", np / w[0],
           np / w[reps / 2], c[0], c[reps / 2]);
    k3_state_free(s);
    k3_model_free(m);
    free(ids);
    free(lg);
    free(w);
    free(c);
    return 0;
}
