/* bench_index: time st_open on a model directory (the sparse replica of the
 * release: 497,220 tensors in 96 shards, tools/make_sparse_replica.py).
 *
 *   bin/bench_index DIR [REPEATS] [--json FILE]
 *
 * Prints the best and median wall time of REPEATS opens (default 5) and the
 * tensors indexed per second, and the CPU seconds per open (all threads),
 * which a busy machine does not inflate. OMP_NUM_THREADS sets the threads.
 * --json also writes those figures to FILE (for bench/report.sh). */
#include "formats/safetensors.h"

#include <jansson.h>
#include <omp.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_sec +
           1e-6 * (double)ru.ru_stime.tv_usec;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const char *json_path = NULL;
    if (argc >= 4 && !strcmp(argv[argc - 2], "--json")) {
        json_path = argv[argc - 1];
        argc -= 2;
    }
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: bench_index DIR [REPEATS] [--json FILE]\n");
        return K3_EXIT_USAGE;
    }
    int reps = argc == 3 ? atoi(argv[2]) : 5;
    if (reps < 1 || reps > 1000) {
        fprintf(stderr, "k3: bench_index: REPEATS must be 1..1000\n");
        return K3_EXIT_USAGE;
    }
    double *t = xmalloc_array((size_t)reps, sizeof *t);
    size_t n = 0;
    int nshards = 0;
    double cpu0 = cpu_seconds();
    for (int r = 0; r < reps; r++) {
        st_index *ix = NULL;
        k3_err err = {0};
        double t0 = k3_now();
        int rc = st_open(argv[1], &ix, &err);
        t[r] = k3_now() - t0;
        if (rc) {
            fprintf(stderr, "k3: %s\n", err.msg);
            free(t);
            return rc;
        }
        n = st_count(ix);
        nshards = st_nshards(ix);
        st_close(ix);
    }
    double cpu = (cpu_seconds() - cpu0) / reps;
    qsort(t, (size_t)reps, sizeof *t, cmp_d);
    printf("indexed %zu tensors in %d shards with %d threads\n", n, nshards, omp_get_max_threads());
    printf("best %.3f s, median %.3f s over %d runs: %.2f M tensors/s (best)\n", t[0], t[reps / 2], reps,
           (double)n / t[0] / 1e6);
    /* CPU time is the figure that does not depend on what else the machine runs */
    printf("cpu %.3f s per open (user+sys, all threads)\n", cpu);
    if (json_path) {
        json_t *o = json_pack("{s:s, s:I, s:i, s:i, s:i, s:f, s:f, s:f}", "dir", argv[1], "tensors", (json_int_t)n,
                              "shards", nshards, "threads", omp_get_max_threads(), "repeats", reps, "best_s", t[0],
                              "median_s", t[reps / 2], "cpu_s_per_open", cpu);
        char *txt = o ? json_dumps(o, JSON_INDENT(1) | JSON_REAL_PRECISION(6)) : NULL;
        json_decref(o);
        k3_err err = {0};
        if (!txt || k3_write_file_atomic(json_path, txt, strlen(txt), &err)) {
            fprintf(stderr, "k3: %s\n", txt ? err.msg : "bench_index: cannot build the JSON report");
            free(txt);
            free(t);
            return 1;
        }
        free(txt);
    }
    free(t);
    return 0;
}
