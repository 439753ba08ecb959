/* bench_exchange: the cost of one expert-output exchange (dist.h) alone, with
 * no compute around it, under mpirun:
 *
 *     mpirun -np R bin/bench_exchange [--config MODEL_DIR/config.json] [--iters N]
 *
 * For each block size (the decode exchange of the given config at this rank
 * count: ceil(k / R) slots of latent width floats per rank, and a few fixed
 * sizes), rank 0 prints the median and best microseconds of an exchange and the
 * bytes each rank sent, as JSON lines. Figures for bench/mpi.sh and the
 * projection (bench/mpi_projection.py); never a test. */
#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"
#include "formats/config.h"

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int rc = k3_dist_init(&argc, &argv);
    if (rc) return k3_dist_finish(rc);
    int R = k3_dist_size(), me = k3_dist_rank(), iters = 2000;
    const char *cfg_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--config") && i + 1 < argc) cfg_path = argv[++i];
    }
    if (iters < 10) iters = 10;
    size_t sizes[8];
    int ns = 0;
    if (cfg_path) { /* the decode block of this model at this rank count (+ the header) */
        k3_config c;
        k3_err err = {0};
        char *dir = xstrdup(cfg_path), *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        if (k3_config_load(dir, &c, &err)) {
            if (me == 0) fprintf(stderr, "bench_exchange: %s\n", err.msg);
            return k3_dist_finish(2);
        }
        free(dir);
        int per = (c.experts_per_token + R - 1) / R;
        sizes[ns++] = 24 + (size_t)per * (size_t)c.latent_dim * sizeof(float);
    }
    static const size_t fixed[] = {64, 4096, 65536, 1u << 20};
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++) sizes[ns++] = fixed[i];
    size_t maxs = 0;
    for (int i = 0; i < ns; i++)
        if (sizes[i] > maxs) maxs = sizes[i];
    char *mine = xcalloc(1, maxs);
    void **theirs = xcalloc((size_t)R, sizeof *theirs);
    size_t *tb = xcalloc((size_t)R, sizeof *tb);
    for (int r = 0; r < R; r++) theirs[r] = xcalloc(1, maxs);
    double *t = xmalloc_array((size_t)iters, sizeof *t);
    for (int s = 0; s < ns; s++) {
        for (int r = 0; r < R; r++) tb[r] = sizes[s];
        int n = sizes[s] >= (1u << 20) ? iters / 20 + 10 : iters;
        for (int w = 0; w < 10; w++) k3_dist_exchange(mine, sizes[s], theirs, tb, "bench");
        for (int i = 0; i < n; i++) {
            double t0 = k3_now();
            k3_dist_exchange(mine, sizes[s], theirs, tb, "bench");
            t[i] = k3_now() - t0;
        }
        qsort(t, (size_t)n, sizeof *t, cmp_d);
        if (me == 0)
            printf("{\"ranks\": %d, \"block_bytes\": %zu, \"sent_per_rank_bytes\": %zu, \"median_us\": %.2f, "
                   "\"best_us\": %.2f, \"model_block\": %s}\n",
                   R, sizes[s], sizes[s] * (size_t)(R - 1), 1e6 * t[n / 2], 1e6 * t[0],
                   cfg_path && s == 0 ? "true" : "false");
    }
    fflush(stdout);
    free(t);
    for (int r = 0; r < R; r++) free(theirs[r]);
    free(theirs);
    free(tb);
    free(mine);
    return k3_dist_finish(0);
}
