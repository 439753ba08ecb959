/* bench_layers: one decode token through each block kind of a config on its
 * own, with random weights made in memory (no checkpoint), at the config's
 * real dimensions: the KDA attention block, the Gated MLA block at several
 * context lengths (latent cache filled with random rows), the dense MLP, a
 * LatentMoE block with its top-k routed experts resident, and the head
 * (final RMSNorm + lm_head). Each is timed through the model's own block
 * functions (k3_kda, k3_mla, k3_mlp, k3_moe, the forward ops' products), and
 * set beside a streaming-read probe taken in the same run: bytes of weights
 * touched per call, achieved GB/s, and the ratio to the probe.
 *
 *   bin/bench_layers CONFIG [--threads N] [--reps N] [--contexts 1,1024,...] [--probe-mb MB] [--json FILE]
 *
 * CONFIG: a config.json or a directory holding one (the release's is
 * tests/fixtures/k3-release/config.json). Blocks are built one at a time and
 * freed before the next, so the peak is the largest block (the release's head,
 * 2.35 GB of BF16) plus the probe buffer. Random weights: BF16 entries of
 * random sign and mantissa at a magnitude of about 1/sqrt(inputs), MXFP4
 * experts of random E2M1 codes with the group scale set to the same
 * magnitude, norm gains 1; activations stay of order one, and every output is
 * checked finite (exit 1 otherwise). The router bias puts experts 0..k-1 on
 * top so the k experts that are resident are the ones chosen.
 *
 * Seconds per call: the best of --reps calls after one warm-up (the one least
 * disturbed by other processes on a shared machine) and the median. GB/s =
 * bytes / best seconds, where bytes are the weights read (k_mat_bytes) plus the
 * state a call reads (the KDA state S, the MLA latent rows attended over).
 * CPU ms is the process's CPU time per call (all threads); CPU GB/s = bytes /
 * (CPU time / threads), beside the probe's rate measured the same way.
 * Not a test: numbers depend on the machine and its load. */
#include "bench.h"
#include "formats/config.h"
#include "kernels/kernels.h"
#include "model/model.h"

#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Every allocation of the block being timed, freed before the next block. */
typedef struct {
    void **p;
    size_t n, cap;
    uint64_t weight_bytes; /* what one call reads of the matrices made so far */
} arena;

static void *arena_take(arena *a, void *p) {
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 64;
        a->p = xrealloc_array(a->p, a->cap, sizeof *a->p);
    }
    a->p[a->n++] = p;
    return p;
}

static void arena_free(arena *a) {
    for (size_t i = 0; i < a->n; i++) free(a->p[i]);
    free(a->p);
    memset(a, 0, sizeof *a);
}

/* The exponent e with 2^e nearest to 1 / (mean |entry| x sqrt(cols)), so a
 * row times a unit-scale input is of order one. */
static int scale_exp(int cols, double mean_abs) {
    return (int)lround(-log2(mean_abs * sqrt((double)cols)));
}

/* A BF16 matrix [rows][cols] of random sign and mantissa with exponent e
 * (|entry| in [2^e, 2^(e+1))); filled in parallel blocks seeded by their
 * index, so the contents do not depend on the thread count. */
static k3_mat rand_bf16(arena *a, int rows, int cols, uint64_t seed, bool counted) {
    size_t n = (size_t)rows * (size_t)cols;
    uint16_t *d = arena_take(a, xmalloc_aligned((n * 2 + 63) / 64 * 64));
    int e = scale_exp(cols, 1.5);
    uint16_t ex = (uint16_t)((127 + e) << 7);
    size_t blk = (size_t)1 << 20, nb = (n + blk - 1) / blk;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        uint64_t st = k3_mix64(seed * K3_GOLDEN64 + b);
        size_t hi = (b + 1) * blk < n ? (b + 1) * blk : n;
        uint64_t r = 0;
        for (size_t i = b * blk, j = 0; i < hi; i++, j++) {
            if (j % 4 == 0) r = k3_rng_next(&st);
            uint16_t bits = (uint16_t)(r & 0xFF);
            r >>= 16;
            d[i] = (uint16_t)((bits & 0x80) << 8 | ex | (bits & 0x7F));
        }
    }
    k3_mat m = {.type = KW_BF16, .rows = rows, .cols = cols, .data = d};
    if (counted) a->weight_bytes += k_mat_bytes(&m, rows);
    return m;
}

/* An MXFP4 matrix: random E2M1 codes (mean |value| 2.625 over the 16 codes),
 * every group's scale 2^e for unit-scale outputs. */
static k3_mat rand_mxfp4(arena *a, int rows, int cols, int group, uint64_t seed) {
    size_t np = (size_t)rows * (size_t)cols / 2, ns = (size_t)rows * (size_t)(cols / group);
    uint8_t *p = arena_take(a, xmalloc_aligned((np + 63) / 64 * 64));
    uint8_t *s = arena_take(a, xmalloc_aligned((ns + 63) / 64 * 64));
    uint64_t st = k3_mix64(seed);
    for (size_t i = 0; i < np; i += 8) {
        uint64_t r = k3_rng_next(&st);
        for (size_t j = i; j < np && j < i + 8; j++, r >>= 8) p[j] = (uint8_t)r;
    }
    memset(s, 127 + scale_exp(cols, 2.625), ns);
    k3_mat m = {.type = KW_MXFP4, .rows = rows, .cols = cols, .data = p, .scales = s, .group = group};
    a->weight_bytes += k_mat_bytes(&m, rows);
    return m;
}

static float *vec(arena *a, size_t n, float v) {
    float *x = arena_take(a, xmalloc_array(n, sizeof *x));
    for (size_t i = 0; i < n; i++) x[i] = v;
    return x;
}

/* Random values uniform in [-r, r). */
static float *rand_vec(arena *a, size_t n, float r, uint64_t seed) {
    float *x = arena_take(a, xmalloc_array(n, sizeof *x));
    uint64_t st = k3_mix64(seed);
    for (size_t i = 0; i < n; i++) x[i] = (float)((2 * k3_rng_unit(&st) - 1) * r);
    return x;
}

static bool all_finite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

/* One block kind ready to be called: fn runs one decode token. */
typedef struct {
    const k3_config *c;
    k3_kda_w kda;
    k3_kda_state ks;
    k3_mla_w mla;
    k3_mla_cache mc;
    int pos0;
    k3_mlp_w mlp;
    k3_moe_w moe;
    k3_expert_w *experts;
    k3_mat head;
    float *head_norm;
    const float *x;
    float *y, *tmp;
    size_t ny;
} block;

static void run_kda(block *b) { k3_kda(b->c, &b->kda, &b->ks, b->x, 1, b->y); }
static void run_mla(block *b) { k3_mla(b->c, b->c->mla_latent_eps, &b->mla, &b->mc, b->pos0, b->x, 1, b->y); }
static void run_mlp(block *b) { k3_mlp(b->c, &b->mlp, b->x, 1, b->y); }
static void run_moe(block *b) { k3_moe(b->c, &b->moe, b->experts, b->x, 1, b->y); }
/* The model's head: RMSNorm with the final gain, then lm_head through the
 * inference products (model.c's last step). */
static void run_head(block *b) {
    k3_rmsnorm_rows(b->tmp, NULL, b->x, b->head_norm, 1, b->c->hidden_size, b->c->rms_eps);
    k_prod p = {&b->head, b->tmp, 1, b->y};
    k3_infer_ops.products(&p, 1);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    double best, median, cpu;
} timing;

/* One warm-up call, then reps timed calls; false when an output is not finite. */
static bool time_block(block *b, void (*fn)(block *), int reps, timing *t) {
    double *dt = xmalloc_array((size_t)reps, sizeof *dt);
    fn(b);
    double c0 = bench_cpu_now();
    for (int r = 0; r < reps; r++) {
        double t0 = k3_now();
        fn(b);
        dt[r] = k3_now() - t0;
    }
    t->cpu = (bench_cpu_now() - c0) / reps;
    qsort(dt, (size_t)reps, sizeof *dt, cmp_double);
    t->best = dt[0];
    t->median = dt[reps / 2];
    free(dt);
    return all_finite(b->y, b->ny);
}

static const char *USAGE =
    "k3: usage: bench_layers CONFIG [--threads N] [--reps N>=1] [--contexts 1,1024,...] [--probe-mb MB>=16] [--json FILE]\n";

int main(int argc, char **argv) {
    const char *cfg_path = NULL, *json_path = NULL, *ctx_list = "1,1024,8192,32768";
    int64_t threads = omp_get_max_threads(), reps = 5, probe_mb = 512;
    for (int i = 1; i < argc; i++) {
        bool more = i + 1 < argc;
        if (!strcmp(argv[i], "--threads") && more) {
            if (!k3_parse_i64(argv[++i], 1, 1024, &threads)) goto usage;
        } else if (!strcmp(argv[i], "--reps") && more) {
            if (!k3_parse_i64(argv[++i], 1, 100000, &reps)) goto usage;
        } else if (!strcmp(argv[i], "--probe-mb") && more) {
            if (!k3_parse_i64(argv[++i], 16, 1 << 20, &probe_mb)) goto usage;
        } else if (!strcmp(argv[i], "--contexts") && more) {
            ctx_list = argv[++i];
        } else if (!strcmp(argv[i], "--json") && more) {
            json_path = argv[++i];
        } else if (argv[i][0] != '-' && !cfg_path) {
            cfg_path = argv[i];
        } else {
            goto usage;
        }
    }
    if (!cfg_path) goto usage;
    int64_t ctx[16];
    int nctx = 0;
    for (const char *p = ctx_list;;) {
        char tok[32];
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof tok || nctx == 16) goto usage;
        memcpy(tok, p, len);
        tok[len] = 0;
        if (!k3_parse_i64(tok, 1, 1 << 24, &ctx[nctx++])) goto usage;
        if (!p[len]) break;
        p += len + 1;
    }

    k3_err err = {0};
    k3_config cfg;
    if (k3_config_load(cfg_path, &cfg, &err)) {
        fprintf(stderr, "k3: bench_layers: %s\n", err.msg);
        return err.code;
    }
    const k3_config *c = &cfg;
    omp_set_num_threads((int)threads);
    int E = c->hidden_size;
    int kda_L = -1, mla_L = -1, dense_L = -1, moe_L = -1;
    for (int L = 0; L < c->num_layers; L++) {
        if (c->layer_kind[L] == 'K' && kda_L < 0) kda_L = L;
        if (c->layer_kind[L] == 'M' && mla_L < 0) mla_L = L;
        if (c->layer_dense[L] && dense_L < 0) dense_L = L;
        if (!c->layer_dense[L] && moe_L < 0) moe_L = L;
    }
    printf("config %s: hidden %d, %d layers (%d KDA, %d MLA), vocab %d, %d experts top-%d (%s)\n", cfg_path, E,
           c->num_layers, c->n_kda_layers, c->n_mla_layers, c->vocab_size, c->num_experts, c->experts_per_token,
           c->experts_mxfp4_declared ? "MXFP4" : "BF16");
    printf("kernels: %s, %lld threads\n", k_path_name(), (long long)threads);

    size_t pn = (size_t)probe_mb * 1024 * 1024 / sizeof(float);
    float *probe = xmalloc_array(pn, sizeof *probe);
    for (size_t i = 0; i < pn; i++) probe[i] = (float)(i & 1023) * 1e-3f;
    double bw, bwc;
    probe_read_gbs(probe, pn, (int)threads, &bw, &bwc);
    printf("read probe (%lld MB): %.1f GB/s wall, %.1f GB/s per CPU-second x threads\n\n", (long long)probe_mb, bw,
           bwc);

    size_t xmax = (size_t)E;
    float *x = xmalloc_array(xmax, sizeof *x);
    {
        uint64_t st = 7;
        for (size_t i = 0; i < xmax; i++) x[i] = (float)(2 * k3_rng_unit(&st) - 1) * 1.7f; /* rms about 1 */
    }
    json_t *jb = json_array();
    printf("%-12s %10s %9s | %9s %9s %8s %7s | %9s %8s %7s\n", "block", "weights MB", "state MB", "best ms",
           "median ms", "GB/s", "% probe", "CPU ms", "CPU GB/s", "% CPU");
    printf("%-12s %10s %9s | %9s %9s %8s %7s | %9s %8s %7s\n", "", "", "", "", "", "", "", "all thr.", "", "probe");
    int rc = 0;
    /* kinds: 0 KDA, 1.. MLA per context, then dense MLP, MoE, head */
    int nk = 1 + nctx + 3;
    for (int k = 0; k < nk && !rc; k++) {
        arena a = {0};
        block b = {.c = c, .x = x};
        void (*fn)(block *) = NULL;
        char name[48];
        uint64_t state_bytes = 0;
        int64_t context = 0;
        size_t ny = (size_t)E;
        uint64_t seed = 1000 * (uint64_t)(k + 1);
        if (k == 0) {
            if (kda_L < 0) continue;
            int H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
            k3_kda_w *w = &b.kda;
            w->q = rand_bf16(&a, P, E, seed + 1, true);
            w->k = rand_bf16(&a, P, E, seed + 2, true);
            w->v = rand_bf16(&a, P, E, seed + 3, true);
            for (int j = 0; j < 3; j++) w->conv[j] = rand_vec(&a, (size_t)P * K, 0.5f, seed + 4 + j);
            w->f_a = rand_bf16(&a, D, E, seed + 7, true);
            w->f_b = rand_bf16(&a, P, D, seed + 8, true);
            w->A_log = vec(&a, (size_t)H, 0);
            w->dt_bias = vec(&a, (size_t)P, 0);
            w->b = rand_bf16(&a, H, E, seed + 9, true);
            w->g = rand_bf16(&a, P, E, seed + 10, true);
            w->o_norm = vec(&a, (size_t)D, 1);
            w->o = rand_bf16(&a, E, P, seed + 11, true);
            b.ks.S = arena_take(&a, xcalloc((size_t)H * D * D, sizeof(float)));
            b.ks.conv = arena_take(&a, xcalloc((size_t)3 * P * (K - 1), sizeof(float)));
            state_bytes = (uint64_t)H * D * D * sizeof(float);
            fn = run_kda;
            snprintf(name, sizeof name, "kda");
        } else if (k <= nctx) {
            if (mla_L < 0) continue;
            context = ctx[k - 1];
            int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim,
                rq = c->q_lora_rank, rkv = c->kv_lora_rank;
            k3_mla_w *w = &b.mla;
            if (rq > 0) {
                w->q_a = rand_bf16(&a, rq, E, seed + 1, true);
                w->q_a_norm = vec(&a, (size_t)rq, 1);
                w->q_b = rand_bf16(&a, H * (dn + dr), rq, seed + 2, true);
            } else {
                w->q_b = rand_bf16(&a, H * (dn + dr), E, seed + 2, true);
            }
            w->kv_a = rand_bf16(&a, rkv + dr, E, seed + 3, true);
            w->kv_a_norm = vec(&a, (size_t)rkv, 1);
            w->kv_b = rand_bf16(&a, H * (dn + dv), rkv, seed + 4, true);
            w->o = rand_bf16(&a, E, H * dv, seed + 5, true);
            if (c->mla_output_gate) w->g = rand_bf16(&a, H * dv, E, seed + 6, true);
            size_t W = (size_t)(rkv + dr);
            b.mc.max_pos = (int)context;
            b.mc.latent = rand_vec(&a, (size_t)context * W, 1.7f, seed + 7);
            b.pos0 = (int)context - 1; /* the token attends over `context` positions, itself included */
            state_bytes = (uint64_t)context * W * sizeof(float);
            fn = run_mla;
            snprintf(name, sizeof name, "mla@%lld", (long long)context);
        } else if (k == nctx + 1) {
            if (dense_L < 0) continue;
            int I = c->dense_inter;
            b.mlp.gate = rand_bf16(&a, I, E, seed + 1, true);
            b.mlp.up = rand_bf16(&a, I, E, seed + 2, true);
            b.mlp.down = rand_bf16(&a, E, I, seed + 3, true);
            fn = run_mlp;
            snprintf(name, sizeof name, "dense_mlp");
        } else if (k == nctx + 2) {
            if (moe_L < 0) continue;
            int N = c->num_experts, l = c->latent_dim, I = c->moe_inter, S = c->num_shared_experts * I,
                kk = c->experts_per_token;
            int group = c->mxfp4_group > 0 ? c->mxfp4_group : 32;
            k3_moe_w *w = &b.moe;
            w->router = rand_bf16(&a, N, E, seed + 1, true);
            w->router_bias = vec(&a, (size_t)N, 0);
            for (int e = 0; e < kk; e++) w->router_bias[e] = 10; /* above any sigmoid score: always chosen */
            w->down = rand_bf16(&a, l, E, seed + 2, true);
            w->up = rand_bf16(&a, E, l, seed + 3, true);
            if (c->latent_moe_use_norm) w->norm = vec(&a, (size_t)l, 1);
            if (S > 0) {
                w->shared.gate = rand_bf16(&a, S, E, seed + 4, true);
                w->shared.up = rand_bf16(&a, S, E, seed + 5, true);
                w->shared.down = rand_bf16(&a, E, S, seed + 6, true);
            }
            /* the k chosen experts are resident; the others are never read
             * and share expert 0's matrices (k3_moe indexes [N_e]) */
            b.experts = arena_take(&a, xcalloc((size_t)N, sizeof *b.experts));
            for (int e = 0; e < kk; e++) {
                k3_expert_w *xe = &b.experts[e];
                bool mx = c->experts_mxfp4_declared && l % group == 0 && I % group == 0;
                if (mx) {
                    xe->w1 = rand_mxfp4(&a, I, l, group, seed + 100 + 3 * (uint64_t)e);
                    xe->w3 = rand_mxfp4(&a, I, l, group, seed + 101 + 3 * (uint64_t)e);
                    xe->w2 = rand_mxfp4(&a, l, I, group, seed + 102 + 3 * (uint64_t)e);
                } else {
                    xe->w1 = rand_bf16(&a, I, l, seed + 100 + 3 * (uint64_t)e, true);
                    xe->w3 = rand_bf16(&a, I, l, seed + 101 + 3 * (uint64_t)e, true);
                    xe->w2 = rand_bf16(&a, l, I, seed + 102 + 3 * (uint64_t)e, true);
                }
            }
            for (int e = kk; e < N; e++) b.experts[e] = b.experts[0];
            fn = run_moe;
            snprintf(name, sizeof name, "moe");
        } else {
            b.head = rand_bf16(&a, c->vocab_size, E, seed + 1, true);
            b.head_norm = vec(&a, (size_t)E, 1);
            b.tmp = arena_take(&a, xmalloc_array((size_t)E, sizeof(float)));
            ny = (size_t)c->vocab_size;
            fn = run_head;
            snprintf(name, sizeof name, "head");
        }
        b.y = arena_take(&a, xmalloc_array(ny, sizeof(float)));
        b.ny = ny;
        timing t;
        if (!time_block(&b, fn, (int)reps, &t)) {
            fprintf(stderr, "k3: bench_layers: %s: an output is not finite (random weights too large)\n", name);
            rc = K3_EXIT_RUNTIME;
        } else {
            uint64_t bytes = a.weight_bytes + state_bytes;
            /* the CPU rate: bytes over the time the threads actually ran
             * (CPU time / threads), beside the probe's; time slicing by
             * other processes disturbs it least */
            double gbs = (double)bytes / t.best / 1e9, cgbs = (double)bytes / (t.cpu / (double)threads) / 1e9;
            printf("%-12s %10.1f %9.1f | %9.3f %9.3f %8.2f %6.0f%% | %9.3f %8.2f %6.0f%%\n", name,
                   a.weight_bytes / 1e6, state_bytes / 1e6, 1e3 * t.best, 1e3 * t.median, gbs, 100 * gbs / bw,
                   1e3 * t.cpu, cgbs, 100 * cgbs / bwc);
            json_t *o = json_pack("{s:s, s:I, s:I, s:f, s:f, s:f, s:f, s:f, s:f, s:f}", "block", name,
                                  "weight_bytes", (json_int_t)a.weight_bytes, "state_bytes",
                                  (json_int_t)state_bytes, "best_s", t.best, "median_s", t.median, "cpu_s", t.cpu,
                                  "gbs", gbs, "probe_ratio", gbs / bw, "cpu_gbs", cgbs, "cpu_probe_ratio",
                                  cgbs / bwc);
            if (o && context) json_object_set_new(o, "context", json_integer(context));
            json_array_append_new(jb, o);
        }
        arena_free(&a);
    }
    if (!rc && json_path) {
        int n_dense = 0;
        for (int L = 0; L < c->num_layers; L++) n_dense += c->layer_dense[L];
        json_t *o = json_pack("{s:s, s:s, s:I, s:I, s:f, s:f, s:{s:i, s:i, s:i, s:i, s:i, s:i, s:i}, s:O}",
                              "config", cfg_path, "kernels", k_path_name(), "threads", (json_int_t)threads,
                              "reps", (json_int_t)reps, "probe_gbs", bw, "probe_cpu_gbs", bwc, "layers",
                              "total", c->num_layers, "kda", c->n_kda_layers, "mla", c->n_mla_layers, "dense",
                              n_dense, "moe", c->num_layers - n_dense, "hidden", E, "vocab", c->vocab_size,
                              "blocks", jb);
        char *txt = o ? json_dumps(o, JSON_INDENT(1) | JSON_REAL_PRECISION(6)) : NULL;
        json_decref(o);
        if (!txt || k3_write_file_atomic(json_path, txt, strlen(txt), &err)) {
            fprintf(stderr, "k3: bench_layers: %s\n", txt ? err.msg : "cannot build the JSON report");
            rc = txt ? err.code : K3_EXIT_RUNTIME;
        }
        free(txt);
    }
    json_decref(jb);
    free(probe);
    free(x);
    return rc;
usage:
    fputs(USAGE, stderr);
    return K3_EXIT_USAGE;
}
