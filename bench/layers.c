/* bench_layers: one decode token through each block kind of a config on its
 * own, with random weights made in memory (no checkpoint), at the config's
 * real dimensions: the KDA attention block, the Gated MLA block at several
 * context lengths (latent cache filled with random rows), the dense MLP, a
 * LatentMoE block with its top-k routed experts resident, and the head
 * (final RMSNorm + lm_head). Each is timed through the model's own block
 * functions (k3_kda, k3_mla, k3_mlp, k3_moe, the forward ops' products), and
 * set beside a streaming-read probe taken in the same run: bytes of weights
 * touched per call, achieved GB/s, and the ratio to the probe. Then the same
 * LatentMoE block with its k routed experts read from disk (moe_disk): the
 * experts written at their real size and layout into a file under --tmp DIR
 * (default $TMPDIR, else /tmp; removed at the end), dropped from the page
 * cache, and read at every call by the engine's streaming source (the
 * memory module's expert path: io_uring, O_DIRECT where the filesystem takes
 * it, each expert computed as it arrives) through a cache of none; its
 * output must equal the resident block's bits. Beside it: MB/s read, the
 * time spent waiting on reads, the page cache's share of the file after the
 * drop (mincore; a warning when it is not 0), and the disk's sequential rate
 * through the same reader (the file read whole in 2 MiB pieces, 4 in flight,
 * as the trunk ring reads a layer). --no-disk leaves it out.
 *
 *   bin/bench_layers CONFIG [--threads N] [--reps N] [--contexts 1,1024,...] [--probe-mb MB]
 *                    [--tmp DIR | --no-disk] [--json FILE]
 *
 * CONFIG: a config.json or a directory holding one (the release's is
 * tests/fixtures/k3-release/config.json). The weights are bound by the
 * model's binder (k3_bind_layer, checked against the config as at a
 * directory open) from a lookup that makes each tensor when it is asked for;
 * the head is the lm_head product alone (a [V][E] BF16 matrix). One layer
 * is bound at a time (the first of each attention and MLP kind) and freed
 * before the next, so the peak is the largest of them (the release's layer 0,
 * KDA + the dense MLP, 2.34 GB; the head 2.35 GB) plus the probe buffer
 * (the MoE from disk adds k expert buffers and writes k + 1 experts to disk:
 * 281 MB and 298 MB for the release).
 * Random weights: BF16 entries of
 * random sign and mantissa at a magnitude of about 1/sqrt(inputs), MXFP4
 * experts of random E2M1 codes with the group scale set to the same
 * magnitude, norm gains 1; activations stay of order one, and every output is
 * checked finite (exit 1 otherwise). The router bias puts experts 0..k-1 on
 * top, so the k experts the router picks are k distinct resident ones; the
 * lookup hands expert 0's bytes for the others, which are never read.
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
#include "formats/names.h"
#include "formats/safetensors.h"
#include "kernels/kernels.h"
#include "memory/io.h"
#include "memory/stream.h"
#include "model/model.h"
#include "model/records.h"
#include "model/source.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Every allocation of the block being timed, freed before the next block. */
typedef struct {
    void **p;
    size_t n, cap;
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

/* BF16 [n] of random sign and mantissa with exponent e (|entry| in [2^e,
 * 2^(e+1))), e set for `cols` inputs; filled in parallel blocks seeded by
 * their index, so the contents do not depend on the thread count. */
static uint16_t *rand_bf16(arena *a, size_t n, int cols, uint64_t seed) {
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
    return d;
}

/* Random packed E2M1 codes [n] bytes (mean |value| 2.625 over the 16 codes). */
static uint8_t *rand_bytes(arena *a, size_t n, uint64_t seed) {
    uint8_t *p = arena_take(a, xmalloc_aligned((n + 63) / 64 * 64));
    uint64_t st = k3_mix64(seed);
    for (size_t i = 0; i < n; i += 8) {
        uint64_t r = k3_rng_next(&st);
        for (size_t j = i; j < n && j < i + 8; j++, r >>= 8) p[j] = (uint8_t)r;
    }
    return p;
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

/* ---- the lookup the binder reads a layer from ---------------------------- */
/* A tensor the layer has: its name, shape and how to fill it (made on the
 * binder's first request). */
typedef enum { T_BF16, T_CONST, T_RAND } tkind;
typedef struct {
    char name[96];
    tkind kind;
    int rank;
    int64_t shape[3];
    float value;       /* T_CONST: every entry; T_RAND: the range */
    const void *data;
} tdesc;
typedef struct {
    const k3_config *c;
    arena *a;
    tdesc *t;
    int n, cap;
    uint64_t seed;
    const void **ex; /* [k][3][2]: experts 0..k-1's w1, w2, w3: packed (or BF16), scale */
    bool mx;         /* the config declares MXFP4 experts */
} lookup_ctx;

static void add(lookup_ctx *x, const char *name, tkind kind, int rank, int64_t d0, int64_t d1, int64_t d2, float v) {
    if (x->n == x->cap) {
        x->cap = x->cap ? 2 * x->cap : 64;
        x->t = xrealloc_array(x->t, (size_t)x->cap, sizeof *x->t);
    }
    tdesc *t = &x->t[x->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->kind = kind;
    t->rank = rank;
    t->shape[0] = d0, t->shape[1] = d1, t->shape[2] = d2;
    t->value = v;
}

static void add_mlp(lookup_ctx *x, const char *pre, int64_t E, int64_t I) {
    char n[96];
    snprintf(n, sizeof n, "%s" K3N_GATE_PROJ, pre);
    add(x, n, T_BF16, 2, I, E, 0, 0);
    snprintf(n, sizeof n, "%s" K3N_UP_PROJ, pre);
    add(x, n, T_BF16, 2, I, E, 0, 0);
    snprintf(n, sizeof n, "%s" K3N_DOWN_PROJ, pre);
    add(x, n, T_BF16, 2, E, I, 0, 0);
}

/* The tensors of layer L in the released layout (spec section 3), shapes from
 * the config; what the binder asks beyond these is "absent", and it says so. */
static void describe_layer(lookup_ctx *x, int L) {
    const k3_config *c = x->c;
    int64_t E = c->hidden_size;
    x->n = 0;
    add(x, K3N_IN_NORM, T_CONST, 1, E, 0, 0, 1);
    add(x, K3N_POST_NORM, T_CONST, 1, E, 0, 0, 1);
    add(x, K3N_ATTN_RES_NORM, T_CONST, 1, E, 0, 0, 1);
    add(x, K3N_ATTN_RES_PROJ, T_RAND, 2, 1, E, 0, 0.1f);
    add(x, K3N_MLP_RES_NORM, T_CONST, 1, E, 0, 0, 1);
    add(x, K3N_MLP_RES_PROJ, T_RAND, 2, 1, E, 0, 0.1f);
    if (c->layer_kind[L] == 'K') {
        int64_t H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
        add(x, K3N_Q_PROJ, T_BF16, 2, P, E, 0, 0);
        add(x, K3N_K_PROJ, T_BF16, 2, P, E, 0, 0);
        add(x, K3N_V_PROJ, T_BF16, 2, P, E, 0, 0);
        add(x, K3N_Q_CONV, T_RAND, 3, P, 1, K, 0.5f);
        add(x, K3N_K_CONV, T_RAND, 3, P, 1, K, 0.5f);
        add(x, K3N_V_CONV, T_RAND, 3, P, 1, K, 0.5f);
        add(x, K3N_F_A, T_BF16, 2, D, E, 0, 0);
        add(x, K3N_F_B, T_BF16, 2, P, D, 0, 0);
        add(x, K3N_A_LOG, T_CONST, 1, H, 0, 0, 0);
        add(x, K3N_DT_BIAS, T_CONST, 1, P, 0, 0, 0);
        add(x, K3N_B_PROJ, T_BF16, 2, H, E, 0, 0);
        add(x, K3N_G_PROJ, T_BF16, 2, P, E, 0, 0);
        add(x, K3N_O_NORM, T_CONST, 1, D, 0, 0, 1);
        add(x, K3N_O_PROJ, T_BF16, 2, E, P, 0, 0);
    } else {
        int64_t H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim,
                rq = c->q_lora_rank, rkv = c->kv_lora_rank;
        if (rq > 0) {
            add(x, K3N_Q_A, T_BF16, 2, rq, E, 0, 0);
            add(x, K3N_Q_A_NORM, T_CONST, 1, rq, 0, 0, 1);
            add(x, K3N_Q_B, T_BF16, 2, H * (dn + dr), rq, 0, 0);
        } else {
            add(x, K3N_Q_PROJ, T_BF16, 2, H * (dn + dr), E, 0, 0);
        }
        add(x, K3N_KV_A, T_BF16, 2, rkv + dr, E, 0, 0);
        add(x, K3N_KV_A_NORM, T_CONST, 1, rkv, 0, 0, 1);
        add(x, K3N_KV_B, T_BF16, 2, H * (dn + dv), rkv, 0, 0);
        add(x, K3N_O_PROJ, T_BF16, 2, E, H * dv, 0, 0);
        add(x, K3N_G_PROJ, T_BF16, 2, H * dv, E, 0, 0);
    }
    if (c->layer_dense[L]) {
        add_mlp(x, K3N_MLP, E, c->dense_inter);
    } else {
        int64_t N = c->num_experts, l = c->latent_dim;
        add(x, K3N_ROUTER, T_BF16, 2, N, E, 0, 0);
        add(x, K3N_ROUTER_BIAS, T_CONST, 1, N, 0, 0, 0); /* experts 0..k-1 raised in the lookup */
        add(x, K3N_LAT_DOWN, T_BF16, 2, l, E, 0, 0);
        add(x, K3N_LAT_UP, T_BF16, 2, E, l, 0, 0);
        add(x, K3N_LAT_NORM, T_CONST, 1, l, 0, 0, 1);
        add_mlp(x, K3N_SHARED, E, (int64_t)c->num_shared_experts * c->moe_inter);
    }
}

/* A routed expert's tensor: experts.E.wJ.weight_packed / .weight_scale
 * (MXFP4 where the config declares it) or .weight (BF16). Experts k and up
 * hand expert (e mod k)'s bytes: the router never picks them. */
static int expert_tensor(lookup_ctx *x, const char *name, k3_tensor *t) {
    const k3_config *c = x->c;
    int e, j, len = 0;
    char suffix[32];
    if (sscanf(name, K3N_EXPERTS "%d.w%d%31s%n", &e, &j, suffix, &len) != 3 || name[len] || j < 1 || j > 3 ||
        e < 0 || e >= c->num_experts)
        return 1;
    int64_t l = c->latent_dim, I = c->moe_inter;
    int64_t rows = j == 2 ? l : I, cols = j == 2 ? I : l;
    int group = c->mxfp4_group > 0 ? c->mxfp4_group : 32;
    int k = c->experts_per_token, src = e % k;
    bool packed = !strcmp(suffix, K3N_PACKED), scale = !strcmp(suffix, K3N_SCALE), plain = !strcmp(suffix, K3N_WEIGHT);
    if (x->mx ? !(packed || scale) : !plain) return 1;
    /* expert src's tensor j, made the first time it is asked for */
    size_t slot = (size_t)src * 3 + (size_t)(j - 1);
    const void **mine = &x->ex[slot * 2 + (scale ? 1 : 0)];
    if (!*mine) {
        uint64_t sd = x->seed + 1000 + slot;
        if (packed) *mine = rand_bytes(x->a, (size_t)(rows * cols / 2), sd);
        else if (scale) {
            uint8_t *s = arena_take(x->a, xmalloc_aligned(((size_t)(rows * (cols / group)) + 63) / 64 * 64));
            memset(s, 127 + scale_exp((int)cols, 2.625), (size_t)(rows * (cols / group)));
            *mine = s;
        } else {
            *mine = rand_bf16(x->a, (size_t)(rows * cols), (int)cols, sd);
        }
    }
    t->dtype = packed || scale ? KT_U8 : KT_BF16;
    t->rank = 2;
    t->shape[0] = rows;
    t->shape[1] = packed ? cols / 2 : scale ? cols / group : cols;
    t->data = *mine;
    return K3_OK;
}

static int lookup(void *vctx, int layer, const char *name, k3_tensor *t, k3_err *err) {
    lookup_ctx *x = vctx;
    (void)layer;
    (void)err;
    if (!strncmp(name, K3N_EXPERTS, strlen(K3N_EXPERTS))) return expert_tensor(x, name, t);
    for (int i = 0; i < x->n; i++) {
        tdesc *d = &x->t[i];
        if (strcmp(d->name, name)) continue;
        size_t n = 1;
        for (int r = 0; r < d->rank; r++) n *= (size_t)d->shape[r];
        if (!d->data) {
            uint64_t sd = x->seed + (uint64_t)i;
            if (d->kind == T_BF16) d->data = rand_bf16(x->a, n, (int)d->shape[d->rank - 1], sd);
            else if (d->kind == T_RAND) d->data = rand_vec(x->a, n, d->value, sd);
            else {
                float *v = vec(x->a, n, d->value);
                if (!strcmp(name, K3N_ROUTER_BIAS)) /* above any sigmoid score: always chosen */
                    for (int e = 0; e < x->c->experts_per_token && (size_t)e < n; e++) v[e] = 10;
                d->data = v;
            }
        }
        t->dtype = d->kind == T_BF16 ? KT_BF16 : KT_F32;
        t->rank = d->rank;
        for (int r = 0; r < d->rank; r++) t->shape[r] = d->shape[r];
        t->data = d->data;
        return K3_OK;
    }
    return 1;
}

static uint64_t mats_bytes(const k3_mat *const *m, int n) {
    uint64_t b = 0;
    for (int i = 0; i < n; i++)
        if (m[i]->rows) b += k_mat_bytes(m[i], m[i]->rows);
    return b;
}

static bool all_finite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

/* One block kind ready to be called: fn runs one decode token. */
typedef struct block {
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
    /* the MoE block with its experts read from disk: the source, the layer it
     * serves, the file whose pages are dropped before each call, the first
     * error */
    const k3_weight_source *src;
    int layer;
    int drop_fd;
    int rc;
    k3_err err;
    void (*prep)(struct block *); /* before each call, untimed */
} block;

static void run_kda(block *b) { k3_kda(b->c, &b->kda, &b->ks, b->x, 1, b->y); }
static void run_mla(block *b) { k3_mla(b->c, b->c->mla_latent_eps, &b->mla, &b->mc, b->pos0, b->x, 1, b->y); }
static void run_mlp(block *b) { k3_mlp(b->c, &b->mlp, b->x, 1, b->y); }
static void run_moe(block *b) { k3_moe(b->c, &b->moe, b->experts, b->x, 1, b->y); }
static void run_moe_disk(block *b) {
    k3_err err = {0};
    int rc = k3_moe_source(b->c, &b->moe, b->src, b->layer, b->x, 1, b->y, &err);
    if (rc && !b->rc) {
        b->rc = rc;
        b->err = err;
    }
}
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
    if (b->prep) b->prep(b);
    fn(b);
    double cpu = 0;
    for (int r = 0; r < reps; r++) {
        if (b->prep) b->prep(b);
        double c0 = bench_cpu_now(), t0 = k3_now();
        fn(b);
        dt[r] = k3_now() - t0;
        cpu += bench_cpu_now() - c0;
    }
    t->cpu = cpu / reps;
    qsort(dt, (size_t)reps, sizeof *dt, cmp_double);
    t->best = dt[0];
    t->median = dt[reps / 2];
    free(dt);
    return all_finite(b->y, b->ny);
}

/* What every block's row shares: the run's settings, the probe, the JSON. */
typedef struct {
    int threads, reps;
    double bw, bwc;
    json_t *out;
} measure_ctx;

/* Times fn on b, prints its row and appends it to the JSON; K3_EXIT_RUNTIME
 * when an output is not finite. */
static int measure(measure_ctx *m, const char *name, void (*fn)(block *), block *b, uint64_t weight_bytes,
                   uint64_t state_bytes, int64_t context) {
    timing t;
    if (!time_block(b, fn, m->reps, &t)) {
        fprintf(stderr, "k3: bench_layers: %s: an output is not finite (random weights too large)\n", name);
        return K3_EXIT_RUNTIME;
    }
    /* the CPU rate: bytes over the time the threads actually ran (CPU time /
     * threads), beside the probe's; time slicing by other processes disturbs
     * it least */
    uint64_t bytes = weight_bytes + state_bytes;
    double gbs = (double)bytes / t.best / 1e9, cgbs = (double)bytes / (t.cpu / (double)m->threads) / 1e9;
    printf("%-12s %10.1f %9.1f | %9.3f %9.3f %8.2f %6.0f%% | %9.3f %8.2f %6.0f%%\n", name, weight_bytes / 1e6,
           state_bytes / 1e6, 1e3 * t.best, 1e3 * t.median, gbs, 100 * gbs / m->bw, 1e3 * t.cpu, cgbs,
           100 * cgbs / m->bwc);
    fflush(stdout);
    json_t *o = json_pack("{s:s, s:I, s:I, s:f, s:f, s:f, s:f, s:f, s:f, s:f}", "block", name, "weight_bytes",
                          (json_int_t)weight_bytes, "state_bytes", (json_int_t)state_bytes, "best_s", t.best,
                          "median_s", t.median, "cpu_s", t.cpu, "gbs", gbs, "probe_ratio", gbs / m->bw, "cpu_gbs",
                          cgbs, "cpu_probe_ratio", cgbs / m->bwc);
    if (o && context) json_object_set_new(o, "context", json_integer(context));
    json_array_append_new(m->out, o);
    return K3_OK;
}

/* ---- the MoE block with its experts read from disk ---------------------------- */
/* Share of fd's pages (size bytes) in the page cache (mincore over a mapping,
 * which faults nothing in), or -1 when it cannot be told. */
static double cached_share(int fd, uint64_t size) {
    if (!size) return 0;
    void *m = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return -1;
    size_t page = (size_t)sysconf(_SC_PAGESIZE), n = (size_t)((size + page - 1) / page), in = 0;
    unsigned char *v = xmalloc(n);
    double f = -1;
    if (!mincore(m, (size_t)size, v)) {
        for (size_t i = 0; i < n; i++) in += v[i] & 1;
        f = (double)in / (double)n;
    }
    free(v);
    munmap(m, (size_t)size);
    return f;
}

/* Before each call: the file's pages out of the page cache, so a buffered
 * read (O_DIRECT refused) comes from the disk too. */
static void drop_pages(block *b) { posix_fadvise(b->drop_fd, 0, 0, POSIX_FADV_DONTNEED); }

/* This disk's sequential read rate, GB/s (best of 3, the file's pages
 * dropped before each): the file read whole through the engine's reader as
 * the trunk ring reads a layer, 2 MiB pieces with 4 in flight (io.h; O_DIRECT
 * when wanted and taken, *direct says). -1 when it cannot be read. */
static double disk_probe_gbs(const char *path, int drop_fd, uint64_t size, bool want_direct, bool *direct) {
    enum { DEPTH = 4 };
    const uint64_t piece = 2u << 20;
    k3_io *io = k3_io_new(DEPTH, want_direct);
    k3_err err = {0};
    int fd = -1;
    double best = -1;
    if (k3_io_open(io, path, &fd, direct, &err)) {
        k3_io_free(io);
        return -1;
    }
    uint8_t *buf = k3_dio_alloc(DEPTH * piece);
    k3_io_req q[DEPTH];
    for (int rep = 0; rep < 3; rep++) {
        posix_fadvise(drop_fd, 0, 0, POSIX_FADV_DONTNEED);
        double t0 = k3_now();
        uint64_t off = 0;
        int inflight = 0, rc = K3_OK;
        for (int i = 0; i < DEPTH && off < size && !rc; i++, off += piece, inflight++) {
            q[i] = (k3_io_req){.fd = fd, .offset = off, .len = size - off < piece ? size - off : piece,
                               .buf = buf + (uint64_t)i * piece};
            rc = k3_io_submit(io, &q[i], &err);
        }
        while (inflight > 0 && !rc) {
            k3_io_req *d;
            if ((rc = k3_io_complete(io, &d, &err))) break;
            inflight--;
            if (off < size) { /* the freed buffer takes the next piece */
                *d = (k3_io_req){.fd = fd, .offset = off, .len = size - off < piece ? size - off : piece, .buf = d->buf};
                off += piece;
                if (!(rc = k3_io_submit(io, d, &err))) inflight++;
            }
        }
        if (rc) {
            best = -1;
            break;
        }
        double gbs = (double)size / (k3_now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    k3_io_free(io); /* waits for what is still in flight */
    free(buf);
    close(fd);
    return best;
}

/* The MoE block of layer L (bound in b, its experts resident in lx) with its
 * routed experts read from disk by the engine's streaming source
 * (memory/stream.h, experts only), as a streamed run reads them: the k
 * experts the router picks plus one it never picks are written at their real
 * size and layout (the checkpoint's tensor names, one contiguous run each in
 * the release's order w1, w2, w3, packed then scale) into a file under tmp,
 * dropped from the page cache, and served through a cache of no experts, so
 * every call reads all k (io_uring, O_DIRECT where the filesystem takes it).
 * The output must equal the resident block's bits (want). */
static int moe_from_disk(measure_ctx *m, const char *cfg_path, const k3_config *c, int L, const lookup_ctx *lx,
                         const block *b, uint64_t weight_bytes, const float *want, const char *tmp) {
    int k = c->experts_per_token, nx = k + 1, group = c->mxfp4_group > 0 ? c->mxfp4_group : 32;
    int64_t l = c->latent_dim, I = c->moe_inter;
    k3_err err = {0};
    int rc = K3_OK, fd = -1;
    char dir[4096], path[4200];
    /* the file holds them as the first MoE layer's (the layers before it are
     * dense: the plan then asks for no other layer's experts) */
    int Lx = 0;
    while (Lx < L && c->layer_dense[Lx]) Lx++;
    if (snprintf(dir, sizeof dir, "%s/k3-bench-layers-XXXXXX", tmp) >= (int)sizeof dir || !mkdtemp(dir)) {
        fprintf(stderr, "k3: bench_layers: --tmp %s: cannot make a folder there: %s\n", tmp, strerror(errno));
        return K3_EXIT_USAGE;
    }
    snprintf(path, sizeof path, "%s/experts.safetensors", dir);
    int per = c->experts_mxfp4_declared ? 6 : 3, nt = nx * per;
    st_out_tensor *ts = xcalloc((size_t)nt, sizeof *ts);
    char (*names)[160] = xcalloc((size_t)nt, sizeof *names);
    uint64_t expert_bytes = 0;
    for (int e = 0, t = 0; e < nx; e++) {
        int src = e % k; /* the spare expert repeats expert 0's bytes */
        for (int j = 1; j <= 3; j++) {
            int64_t rows = j == 2 ? l : I, cols = j == 2 ? I : l;
            size_t slot = (size_t)src * 3 + (size_t)(j - 1);
            for (int part = 0; part < (per == 6 ? 2 : 1); part++, t++) {
                st_out_tensor *o = &ts[t];
                snprintf(names[t], sizeof names[t], K3N_PREFIX "layers.%d." K3N_EXPERT_FMT "%s", Lx, e, j,
                         per == 3 ? K3N_WEIGHT : part ? K3N_SCALE : K3N_PACKED);
                o->name = names[t];
                o->rank = 2;
                o->shape[0] = rows;
                o->dtype = per == 3 ? ST_BF16 : ST_U8;
                o->shape[1] = per == 3 ? cols : part ? cols / group : cols / 2;
                o->nbytes = (uint64_t)rows * (uint64_t)o->shape[1] * (per == 3 ? 2 : 1);
                o->data = lx->ex[slot * 2 + (size_t)part];
                if (e == 0) expert_bytes += o->nbytes;
            }
        }
    }
    double t0 = k3_now();
    rc = st_write(path, NULL, 0, ts, (size_t)nt, &err);
    double write_s = k3_now() - t0;
    free(ts);
    free(names);
    double before = -1, after = -1;
    struct stat sb;
    if (!rc && ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0 || fstat(fd, &sb)))
        rc = k3_fail(&err, K3_EXIT_RUNTIME, "%s: %s", path, strerror(errno));
    if (!rc) { /* written and synced by st_write; synced again, then dropped */
        fsync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        before = cached_share(fd, (uint64_t)sb.st_size);
    }
    k3_config dc = *c; /* the file's checkpoint: layers up to L, nx experts a layer */
    st_index *ix = NULL;
    k3_stream *s = NULL;
    static k3_mem_plan plan;
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.experts_only = true;
    o.chunk = 1;
    if (!rc) rc = k3_config_first_layers(&dc, Lx + 1, cfg_path, &err);
    dc.num_experts = nx;
    if (!rc) rc = st_open(path, &ix, &err);
    if (!rc) rc = k3_plan_make(&dc, ix, NULL, &o, 1, &plan, &err);
    if (!rc) { /* buffers for one token's k experts and none to cache: every call reads them all */
        o.cache_gb = ((double)k + 0.5) * (double)plan.expert_buf / 1e9;
        rc = k3_plan_make(&dc, ix, NULL, &o, 1, &plan, &err);
        if (!rc && (plan.cache_experts != 0 || plan.batch_experts != k))
            rc = k3_fail(&err, K3_EXIT_RUNTIME, "the plan holds %lld cached experts and a batch of %d, not 0 and %d",
                         (long long)plan.cache_experts, plan.batch_experts, k);
    }
    if (!rc) {
        rc = k3_stream_open(&dc, ix, NULL, &plan, &o, &s, &err);
        ix = NULL; /* the source owns it now */
    }
    if (rc) {
        fprintf(stderr, "k3: bench_layers: the MoE block from disk: %s\n", err.msg);
    } else {
        block d = {.c = c, .x = b->x, .y = xmalloc_array((size_t)c->hidden_size, sizeof(float)),
                   .ny = (size_t)c->hidden_size, .moe = b->moe, .src = k3_stream_source(s), .layer = Lx,
                   .drop_fd = fd, .prep = drop_pages};
        rc = measure(m, "moe_disk", run_moe_disk, &d, weight_bytes, 0, 0);
        if (!rc && d.rc) {
            fprintf(stderr, "k3: bench_layers: moe_disk: %s\n", d.err.msg);
            rc = d.rc;
        }
        if (!rc && memcmp(d.y, want, (size_t)c->hidden_size * sizeof(float))) {
            fprintf(stderr, "k3: bench_layers: moe_disk: the output differs from the resident block's\n");
            rc = K3_EXIT_RUNTIME;
        }
        k3_stream_stats st = k3_stream_get_stats(s);
        uint64_t calls = (uint64_t)m->reps + 1;
        if (!rc && st.misses != calls * (uint64_t)k) {
            fprintf(stderr, "k3: bench_layers: moe_disk: %llu experts read in %llu calls, not %d a call\n",
                    (unsigned long long)st.misses, (unsigned long long)calls, k);
            rc = K3_EXIT_RUNTIME;
        }
        after = cached_share(fd, (uint64_t)sb.st_size);
        bool pdirect = false;
        double probe = rc ? -1 : disk_probe_gbs(path, fd, (uint64_t)sb.st_size, o.direct, &pdirect);
        if (!rc) {
            json_t *row = json_array_get(m->out, json_array_size(m->out) - 1);
            json_t *res = json_array_get(m->out, json_array_size(m->out) - 2);
            double best = json_real_value(json_object_get(row, "best_s")),
                   rbest = json_real_value(json_object_get(res, "best_s"));
            double rd = (double)st.expert_read / (double)calls, stall = st.expert_stall_s / (double)calls;
            printf("  %d experts of %llu B read a call (%.1f MB) through %s%s from %s: best %.1f ms (resident %.1f ms, "
                   "+%.1f ms), %.0f MB/s read; waiting on reads %.1f ms a call; written in %.1f s\n",
                   k, (unsigned long long)expert_bytes, rd / 1e6, st.backend, st.direct ? " + O_DIRECT" : " (buffered)",
                   tmp, 1e3 * best, 1e3 * rbest, 1e3 * (best - rbest), rd / best / 1e6, 1e3 * stall, write_s);
            printf("  page cache: %.1f%% of the file after fsync + POSIX_FADV_DONTNEED, %.1f%% after the calls\n",
                   before < 0 ? -1.0 : 100 * before, after < 0 ? -1.0 : 100 * after);
            if (before != 0)
                printf("  warning: the drop from the page cache could not be guaranteed (%s): the figure may be "
                       "partly a memory figure\n",
                       before < 0 ? "mincore cannot tell" : "pages stayed resident: a memory filesystem?");
            if (!st.direct)
                printf("  note: O_DIRECT refused here: buffered reads, the pages dropped before each call\n");
            printf("  disk read probe: the %.1f MB file read whole as the trunk ring reads (2 MiB pieces, 4 in "
                   "flight%s), best of 3: %.2f GB/s\n",
                   (double)sb.st_size / 1e6, pdirect ? ", O_DIRECT" : ", buffered", probe);
            json_object_set_new(row, "experts_read", json_integer(k));
            json_object_set_new(row, "expert_bytes", json_integer((json_int_t)expert_bytes));
            json_object_set_new(row, "read_bytes", json_real(rd));
            json_object_set_new(row, "read_mbs", json_real(rd / best / 1e6));
            json_object_set_new(row, "read_wait_s", json_real(stall));
            json_object_set_new(row, "resident_best_s", json_real(rbest));
            json_object_set_new(row, "backend", json_string(st.backend));
            json_object_set_new(row, "direct", json_boolean(st.direct));
            json_object_set_new(row, "cached_after_drop", json_real(before));
            json_object_set_new(row, "cached_after_calls", json_real(after));
            json_object_set_new(row, "disk_probe_gbs", json_real(probe));
        }
        free(d.y);
    }
    k3_stream_free(s);
    st_close(ix);
    if (fd >= 0) close(fd);
    k3_remove_flat_dir(dir);
    return rc;
}

static const char *USAGE =
    "k3: usage: bench_layers CONFIG [--threads N] [--reps N>=1] [--contexts 1,1024,...] [--probe-mb MB>=16] "
    "[--tmp DIR | --no-disk] [--json FILE]\n";

int main(int argc, char **argv) {
    const char *cfg_path = NULL, *json_path = NULL, *ctx_list = "1,1024,8192,32768";
    const char *tmp = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    bool disk = true;
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
        } else if (!strcmp(argv[i], "--tmp") && more) {
            tmp = argv[++i];
        } else if (!strcmp(argv[i], "--no-disk")) {
            disk = false;
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
    measure_ctx mx = {.threads = (int)threads, .reps = (int)reps, .bw = bw, .bwc = bwc, .out = jb};
    int rc = 0;
    /* the first layer of each attention and MLP kind, each bound once */
    int want[4] = {kda_L, mla_L, dense_L, moe_L}, nl = 0, Ls[4];
    for (int i = 0; i < 4; i++) {
        bool seen = want[i] < 0;
        for (int j = 0; j < nl; j++) seen = seen || Ls[j] == want[i];
        if (!seen) Ls[nl++] = want[i];
    }
    bool done[4] = {false, false, false, false}; /* kda, mla, dense, moe */
    for (int li = 0; li < nl && !rc; li++) {
        int L = Ls[li], k = c->experts_per_token;
        arena a = {0};
        lookup_ctx lx = {.c = c, .a = &a, .seed = 1000 * (uint64_t)(L + 1), .mx = c->experts_mxfp4_declared};
        lx.ex = xcalloc((size_t)k * 6, sizeof *lx.ex);
        describe_layer(&lx, L);
        k3_layer_w w;
        k3_owned own = {0};
        if (k3_bind_layer(c, L, lookup, &lx, &w, &own, &err)) {
            fprintf(stderr, "k3: bench_layers: layer %d: %s\n", L, err.msg);
            rc = err.code;
        }
        block b = {.c = c, .x = x, .y = xmalloc_array((size_t)E, sizeof(float)), .ny = (size_t)E};
        if (!rc && w.kind == 'K' && !done[0]) {
            int H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
            const k3_kda_w *kw = &w.kda;
            const k3_mat *m[] = {&kw->q, &kw->k, &kw->v, &kw->f_a, &kw->f_b, &kw->b, &kw->g, &kw->o};
            b.kda = w.kda;
            b.ks.S = xcalloc((size_t)H * D * D, sizeof(float));
            b.ks.conv = xcalloc((size_t)3 * P * (K - 1), sizeof(float));
            rc = measure(&mx, "kda", run_kda, &b, mats_bytes(m, 8), (uint64_t)H * D * D * sizeof(float), 0);
            free(b.ks.S);
            free(b.ks.conv);
            done[0] = true;
        }
        if (!rc && w.kind == 'M' && !done[1]) {
            const k3_mla_w *mw = &w.mla;
            const k3_mat *m[] = {&mw->q_a, &mw->q_b, &mw->kv_a, &mw->kv_b, &mw->o, &mw->g};
            size_t W = (size_t)(c->kv_lora_rank + c->qk_rope_dim);
            b.mla = w.mla;
            for (int i = 0; i < nctx && !rc; i++) {
                char name[48];
                snprintf(name, sizeof name, "mla@%lld", (long long)ctx[i]);
                arena ca = {0};
                b.mc.max_pos = (int)ctx[i];
                b.mc.latent = rand_vec(&ca, (size_t)ctx[i] * W, 1.7f, 77 + (uint64_t)i);
                b.pos0 = (int)ctx[i] - 1; /* the token attends over ctx[i] positions, itself included */
                rc = measure(&mx, name, run_mla, &b, mats_bytes(m, 6), (uint64_t)ctx[i] * W * sizeof(float), ctx[i]);
                arena_free(&ca);
            }
            done[1] = true;
        }
        if (!rc && w.dense && !done[2]) {
            const k3_mat *m[] = {&w.mlp.gate, &w.mlp.up, &w.mlp.down};
            b.mlp = w.mlp;
            rc = measure(&mx, "dense_mlp", run_mlp, &b, mats_bytes(m, 3), 0, 0);
            done[2] = true;
        }
        if (!rc && !w.dense && !done[3]) {
            const k3_moe_w *ew = &w.moe;
            const k3_mat *m[] = {&ew->router, &ew->down, &ew->up, &ew->shared.gate, &ew->shared.up, &ew->shared.down};
            uint64_t bytes = mats_bytes(m, 6);
            for (int e = 0; e < k; e++) {
                const k3_mat *xm[] = {&ew->experts[e].w1, &ew->experts[e].w2, &ew->experts[e].w3};
                bytes += mats_bytes(xm, 3);
            }
            b.moe = w.moe;
            b.experts = w.moe.experts;
            rc = measure(&mx, "moe", run_moe, &b, bytes, 0, 0);
            if (!rc && disk) rc = moe_from_disk(&mx, cfg_path, c, L, &lx, &b, bytes, b.y, tmp);
            done[3] = true;
        }
        free(b.y);
        k3_owned_free(&own);
        arena_free(&a);
        free(lx.t);
        free(lx.ex);
    }
    if (!rc) { /* the head: final RMSNorm and the lm_head product */
        arena a = {0};
        block b = {.c = c, .x = x, .ny = (size_t)c->vocab_size};
        b.head = (k3_mat){.type = KW_BF16, .rows = c->vocab_size, .cols = E,
                          .data = rand_bf16(&a, (size_t)c->vocab_size * E, E, 99)};
        b.head_norm = vec(&a, (size_t)E, 1);
        b.tmp = arena_take(&a, xmalloc_array((size_t)E, sizeof(float)));
        b.y = arena_take(&a, xmalloc_array(b.ny, sizeof(float)));
        const k3_mat *m[] = {&b.head};
        rc = measure(&mx, "head", run_head, &b, mats_bytes(m, 1), 0, 0);
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
