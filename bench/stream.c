/* bench_stream: seconds per decoded token and GB/s read at a ladder of memory
 * budgets, beside the disk's measured bandwidth, so "bytes read per token /
 * disk bandwidth" (the I/O floor) can be compared with the time achieved.
 *
 *   bin/bench_stream MODEL_DIR TRUNK_DIR [--prompt N] [--gen N] [--repeat R]
 *                    [--probe S] [--rungs I,J,..] [--compare] [--json FILE] [--svg FILE]
 *   bin/bench_stream --identity MODEL_DIR      the start-up identity check:
 *                    one read per sample (as first written) vs merged reads
 *
 * Every streamed byte (trunk ring slots, routed experts) is read with O_DIRECT,
 * so the page cache cannot serve them however large the machine: the ladder
 * measures the disk, not memory. The resident rungs map the trunk from the
 * shards (page cache). Build the checkpoint with tools/gen_checkpoint.py and
 * the trunk with `k3 pack-trunk`. Not a test: the numbers depend on the
 * machine and its load.
 *
 * The disk's bandwidth is measured right before and after every run of a
 * rung (--probe S seconds of random 4 MiB O_DIRECT reads at depth 16, the
 * better of the largest shard and trunk.bin): on a shared machine it moves
 * from minute to minute, so each run's I/O floor (bytes read per token / that
 * bandwidth) uses the figures taken around it.
 * Each rung runs --repeat times (medians reported). --compare also runs each
 * rung as decode did before reads overlapped compute (the model waits for the
 * whole expert batch, then computes; no buffers registered with io_uring;
 * pinned layers as a prefix),
 * alternating run by run with the current way, so old and new are measured
 * in the same conditions. */
#include "memory/io.h"
#include "memory/stream.h"

#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Random reads of `block` bytes at `depth` over the file for `seconds`: MB/s. */
static double disk_mbs(const char *path, uint64_t block, int depth, double seconds) {
    struct stat st;
    if (stat(path, &st) != 0 || (uint64_t)st.st_size < 4 * block) return -1;
    k3_io *io = k3_io_new(depth, true);
    k3_err err = {0};
    int fd;
    if (k3_io_open(io, path, &fd, NULL, &err)) { k3_io_free(io); return -1; }
    uint64_t span = (uint64_t)st.st_size / K3_DIO_ALIGN * K3_DIO_ALIGN - block;
    k3_io_req *rq = xcalloc((size_t)depth, sizeof *rq);
    for (int i = 0; i < depth; i++) rq[i].buf = k3_dio_alloc(block);
    uint64_t seed = 0x2545F4914F6CDD1DULL, bytes = 0;
    double t0 = k3_now(), t = 0;
    while (t < seconds) {
        for (int i = 0; i < depth; i++) {
            seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
            rq[i] = (k3_io_req){.fd = fd, .offset = (seed >> 20) % span / K3_DIO_ALIGN * K3_DIO_ALIGN, .len = block,
                                .buf = rq[i].buf};
        }
        if (k3_io_read(io, rq, (size_t)depth, &err)) break;
        bytes += (uint64_t)depth * block;
        t = k3_now() - t0;
    }
    for (int i = 0; i < depth; i++) free(rq[i].buf);
    free(rq);
    close(fd);
    k3_io_free(io);
    return (double)bytes / t / 1e6;
}

/* The reference bandwidth: the better of random 4 MiB reads at depth 16 over
 * the largest shard and over trunk.bin (the two files the engine reads). */
static double disk_ref(const char *shard, const char *tbin, double seconds) {
    double a = disk_mbs(shard, 4u << 20, 16, seconds / 2), b = disk_mbs(tbin, 4u << 20, 16, seconds / 2);
    return a > b ? a : b;
}


/* ---- the identity check: one read per sample vs merged, batched reads ---- */

/* Drops the page cache of every shard (clean pages), so both ways read the disk. */
static void uncache(st_index *ix) {
    for (int s = 0; s < st_nshards(ix); s++) {
        int fd = open(st_shard_at(ix, s)->path, O_RDONLY);
        if (fd < 0) continue;
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
}

static int identity_one_by_one(st_index *ix, char out[17], uint64_t *reads, k3_err *err) {
    uint64_t h = K3_FNV_OFFSET;
    *reads = 0;
    for (int s = 0; s < st_nshards(ix); s++) {
        const st_shard *sh = st_shard_at(ix, s);
        const char *base = strrchr(sh->path, '/');
        base = base ? base + 1 : sh->path;
        h = k3_fnv1a64(h, base, strlen(base) + 1);
        h = k3_fnv1a64(h, &sh->file_size, sizeof sh->file_size);
        char *hdr = xmalloc(sh->data_start - 8);
        int rc = st_pread(ix, s, 8, hdr, sh->data_start - 8, err);
        if (!rc) h = k3_fnv1a64(h, hdr, sh->data_start - 8);
        free(hdr);
        if (rc) return rc;
        ++*reads;
    }
    for (size_t i = 0; i < st_count(ix); i++) {
        const st_tensor *t = st_at(ix, i);
        if (!k3_trunk_wants(t->name) || t->nbytes == 0) continue;
        uint8_t buf[128];
        uint64_t k = t->nbytes < 64 ? t->nbytes : 64;
        int rc = st_pread(ix, t->shard, t->offset, buf, k, err);
        if (!rc) rc = st_pread(ix, t->shard, t->offset + t->nbytes - k, buf + k, k, err);
        if (rc) return rc;
        h = k3_fnv1a64(h, buf, 2 * k);
        *reads += 2;
    }
    snprintf(out, 17, "%016llx", (unsigned long long)h);
    return K3_OK;
}

static int bench_identity(const char *dir) {
    st_index *ix;
    k3_err err = {0};
    if (st_open(dir, &ix, &err)) { fprintf(stderr, "k3: %s\n", err.msg); return 1; }
    printf("identity check of %s (%d shards, %zu tensors); before each: the shards' page cache dropped, then the "
           "index opened (which reads the headers), as at start-up:\n",
           dir, st_nshards(ix), st_count(ix));
    for (int rep = 0; rep < 3; rep++) {
        char a[17], b[17];
        uint64_t n1;
        k3_identity_stats st;
        uncache(ix);
        st_close(ix);
        if (st_open(dir, &ix, &err)) { fprintf(stderr, "k3: %s\n", err.msg); return 1; }
        double t0 = k3_now();
        if (identity_one_by_one(ix, a, &n1, &err)) { fprintf(stderr, "k3: %s\n", err.msg); return 1; }
        double t1 = k3_now();
        uncache(ix);
        st_close(ix);
        if (st_open(dir, &ix, &err)) { fprintf(stderr, "k3: %s\n", err.msg); return 1; }
        double t2 = k3_now();
        if (k3_checkpoint_identity_ex(ix, 1, b, &st, &err)) { fprintf(stderr, "k3: %s\n", err.msg); return 1; }
        double t3 = k3_now();
        uncache(ix);
        st_close(ix);
        if (st_open(dir, &ix, &err)) { fprintf(stderr, "k3: %s\n", err.msg); return 1; }
        char c[17];
        double t4 = k3_now();
        if (k3_checkpoint_identity_ex(ix, 2, c, NULL, &err)) { fprintf(stderr, "k3: %s\n", err.msg); return 1; }
        double t5 = k3_now();
        printf("  FNV, one read per sample (old): %5llu reads %6.3f s | FNV, merged reads: %4llu reads (%.1f MB) %6.3f s "
               "(same value: %s) | scheme 2 (new), merged reads: %6.3f s | old/new %.1fx\n",
               (unsigned long long)n1, t1 - t0, (unsigned long long)st.reads, (double)st.bytes / 1e6, t3 - t2,
               strcmp(a, b) ? "NO" : "yes", t5 - t4, (t1 - t0) / (t5 - t4));
    }
    st_close(ix);
    return 0;
}

typedef struct {
    const char *name;
    bool trunk;              /* stream from the packed trunk */
    double trunk_gb, cache_gb;
} rung_def;

typedef struct {             /* one run of a rung */
    double plan_gb, s_per_tok, mb_per_tok, trunk_mb_per_tok, expert_mb_per_tok, gbs_busy, disk_share, stall_share,
        resident_rate, disk_mbs;
    int pinned, slots;
    int64_t cache_experts;
} rung_run;

static int run_rung(const char *dir, const char *trunk_dir, const rung_def *d, bool old_io, const int32_t *prompt,
                    int np, int ng, int32_t *out, rung_run *r, k3_err *err) {
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.trunk_dir = d->trunk ? trunk_dir : NULL;
    o.trunk_gb = d->trunk_gb;
    o.cache_gb = d->cache_gb;
    /* as before reads overlapped compute: wait for the whole expert batch; reads
     * into unregistered buffers (k3_io_register is read at open) */
    if (old_io) {
        o.expert_overlap = false;
        o.pin_spread = false;
    }
    if (old_io) setenv("K3_IO_REGISTER", "0", 1);
    else unsetenv("K3_IO_REGISTER");
    k3_config cfg;
    st_index *ix = NULL;
    k3_trunk *tr = NULL;
    static k3_mem_plan plan;
    int rc = k3_config_load(dir, &cfg, err);
    if (!rc) rc = st_open(dir, &ix, err);
    if (!rc && d->trunk) rc = k3_trunk_open(trunk_dir, NULL, &tr, err);
    if (!rc) rc = k3_plan_make(&cfg, ix, tr, &o, np + ng, &plan, err);
    if (rc) {
        k3_trunk_free(tr);
        st_close(ix);
        return rc;
    }
    r->plan_gb = (double)plan.total / 1e9;
    r->pinned = plan.pinned;
    r->slots = plan.ring_slots;
    r->cache_experts = plan.cache_experts;
    k3_stream *s;
    if ((rc = k3_stream_open(&cfg, ix, tr, &plan, &o, &s, err))) return rc;
    k3_model_opts mo = {.top_only = true};
    k3_model *m;
    if ((rc = k3_model_open(dir, &mo, &m, err))) {
        k3_stream_free(s);
        return rc;
    }
    if ((rc = k3_stream_attach(s, m, err))) {
        k3_model_free(m);
        k3_stream_free(s);
        return rc;
    }
    k3_state *st;
    float *lg = xmalloc_array((size_t)cfg.vocab_size, sizeof(float));
    rc = k3_state_new(m, np + ng, &st, err);
    for (int i = 0; !rc && i < np; i += plan.chunk) {
        int T = np - i < plan.chunk ? np - i : plan.chunk;
        rc = k3_forward(m, st, prompt + i, T, lg, false, err);
    }
    k3_stream_stats a = k3_stream_get_stats(s);
    double t0 = k3_now();
    int32_t id = 0;
    for (int g = 0; !rc && g < ng; g++) {
        id = k3_argmax(lg, cfg.vocab_size);
        out[g] = id;
        rc = k3_forward(m, st, &id, 1, lg, false, err);
    }
    double dt = k3_now() - t0;
    k3_stream_stats b = k3_stream_get_stats(s);
    if (!rc) {
        uint64_t tb = b.trunk_read - a.trunk_read, xb = b.expert_read - a.expert_read;
        double busy = b.disk_busy_s - a.disk_busy_s;
        r->s_per_tok = dt / ng;
        r->trunk_mb_per_tok = (double)tb / 1e6 / ng;
        r->expert_mb_per_tok = (double)xb / 1e6 / ng;
        r->mb_per_tok = r->trunk_mb_per_tok + r->expert_mb_per_tok;
        r->gbs_busy = busy > 0 ? (double)(tb + xb) / 1e9 / busy : 0;
        r->disk_share = dt > 0 ? busy / dt : 0;
        r->stall_share = dt > 0 ? ((b.trunk_stall_s - a.trunk_stall_s) + (b.expert_stall_s - a.expert_stall_s)) / dt : 0;
        uint64_t rq = b.requests - a.requests;
        r->resident_rate = rq ? (double)(b.resident_hits - a.resident_hits) / (double)rq : 0;
    }
    free(lg);
    k3_state_free(st);
    k3_model_free(m);
    k3_stream_free(s);
    return rc;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {             /* a rung's medians over its runs */
    bool ok;
    rung_run r;              /* plan figures, and medians of the measured ones */
    double floor_s, compute_s, io_ratio, roof_ratio;
} rung_sum;

#define MAXREP 16
static rung_sum summarise(rung_run *runs, int n, double compute_s) {
    rung_sum o = {.ok = n > 0};
    if (!n) return o;
    o.r = runs[0];
    double v[6][MAXREP];
    for (int i = 0; i < n; i++) {
        double fl = runs[i].mb_per_tok / runs[i].disk_mbs;
        v[0][i] = runs[i].s_per_tok;
        v[1][i] = fl;
        v[2][i] = fl / runs[i].s_per_tok;
        v[3][i] = (fl > compute_s ? fl : compute_s) / runs[i].s_per_tok;
        v[4][i] = runs[i].disk_share;
        v[5][i] = runs[i].gbs_busy;
    }
    double mbx[MAXREP], dk[MAXREP], st[MAXREP], rr[MAXREP];
    for (int i = 0; i < n; i++) {
        mbx[i] = runs[i].mb_per_tok;
        dk[i] = runs[i].disk_mbs;
        st[i] = runs[i].stall_share;
        rr[i] = runs[i].resident_rate;
    }
    o.r.s_per_tok = median(v[0], n);
    o.floor_s = median(v[1], n);
    o.io_ratio = median(v[2], n);
    o.roof_ratio = median(v[3], n);
    o.r.disk_share = median(v[4], n);
    o.r.gbs_busy = median(v[5], n);
    o.r.mb_per_tok = median(mbx, n);
    o.r.disk_mbs = median(dk, n);
    o.r.stall_share = median(st, n);
    o.r.resident_rate = median(rr, n);
    o.compute_s = compute_s;
    return o;
}

/* s/token against the plan's GB (log axis), with the I/O floor beside it. */
static void write_svg(const char *path, const rung_def *d, const rung_sum *r, int n, const char *title) {
    FILE *f = fopen(path, "w");
    if (!f) { fprintf(stderr, "bench_stream: cannot write %s\n", path); return; }
    const double W = 760, H = 440, L = 70, R = 20, T = 40, B = 60;
    double xmin = 1e30, xmax = 0, ymax = 0;
    for (int i = 0; i < n; i++) {
        if (!r[i].ok) continue;
        if (r[i].r.plan_gb < xmin) xmin = r[i].r.plan_gb;
        if (r[i].r.plan_gb > xmax) xmax = r[i].r.plan_gb;
        if (r[i].r.s_per_tok > ymax) ymax = r[i].r.s_per_tok;
        if (r[i].floor_s > ymax) ymax = r[i].floor_s;
    }
    if (xmax <= xmin) xmax = xmin * 2;
    double lx0 = log10(xmin) - 0.05, lx1 = log10(xmax) + 0.05;
    ymax *= 1.15;
#define X(v) (L + (log10(v) - lx0) / (lx1 - lx0) * (W - L - R))
#define Y(v) (H - B - (v) / ymax * (H - T - B))
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
               "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H);
    fprintf(f, "<text x=\"%.0f\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">%s</text>\n", W / 2, title);
    fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L, H - B, W - R, H - B);
    fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L, T, L, H - B);
    for (int k = 0; k <= 4; k++) {
        double v = ymax / 1.15 * k / 4;
        fprintf(f, "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%.3f</text>\n", L - 6, Y(v) + 4, v);
        fprintf(f, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", L, Y(v), W - R, Y(v));
    }
    for (double dd = pow(10, floor(lx0)); dd <= pow(10, lx1); dd *= 10)
        for (int m = 1; m <= 9; m++) {
            double v = dd * m;
            if (log10(v) < lx0 || log10(v) > lx1) continue;
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"black\"/>\n", X(v), H - B, X(v),
                    H - B + (m == 1 ? 6 : 3));
            if (m == 1 || m == 2 || m == 5)
                fprintf(f, "<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n", X(v), H - B + 18, v);
        }
    fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">memory plan (GB, log scale)</text>\n", (W + L) / 2,
            H - 18);
    fprintf(f, "<text transform=\"translate(16,%.0f) rotate(-90)\" text-anchor=\"middle\">seconds per decoded token</text>\n",
            (H + T - B) / 2);
    const char *col[2] = {"#1f5fa8", "#c0392b"};
    for (int series = 0; series < 2; series++) {
        /* one line per kind of trunk (resident, packed): same budget axis */
        for (int kind = 0; kind < 2; kind++) {
            fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"", col[series],
                    series ? " stroke-dasharray=\"5,4\"" : "");
            for (int i = n - 1; i >= 0; i--) {
                if (!r[i].ok || d[i].trunk != (kind == 1)) continue;
                double v = series ? r[i].floor_s : r[i].r.s_per_tok;
                fprintf(f, "%.1f,%.1f ", X(r[i].r.plan_gb), Y(v));
            }
            fprintf(f, "\"/>\n");
        }
        for (int i = 0; i < n; i++) {
            if (!r[i].ok) continue;
            double v = series ? r[i].floor_s : r[i].r.s_per_tok;
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n", X(r[i].r.plan_gb), Y(v), col[series]);
            if (!series && r[i].io_ratio > 0.05)
                fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"10\">%.0f%%</text>\n",
                        X(r[i].r.plan_gb), Y(v) - 8, 100 * r[i].io_ratio);
        }
    }
    fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"340\" height=\"58\" fill=\"white\" stroke=\"#999\"/>\n", W - R - 345, T + 5);
    fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"2\"/>"
               "<text x=\"%.0f\" y=\"%.0f\">measured s/token (label: %% of the disk roofline)</text>\n",
            W - R - 335, T + 19, W - R - 305, T + 19, col[0], W - R - 298, T + 23);
    fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"2\" "
               "stroke-dasharray=\"5,4\"/><text x=\"%.0f\" y=\"%.0f\">bytes read per token / disk bandwidth</text>\n",
            W - R - 335, T + 37, W - R - 305, T + 37, col[1], W - R - 298, T + 41);
    fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"10\">(measured around each run)</text>\n", W - R - 298, T + 55);
    fprintf(f, "</svg>\n");
#undef X
#undef Y
    fclose(f);
}

int main(int argc, char **argv) {
    const char *dir = NULL, *tdir = NULL, *json_path = NULL, *svg = NULL, *only = NULL;
    int np = 16, ng = 8, rep = 3;
    double probe = 1;
    bool compare = false;
    if (argc == 3 && !strcmp(argv[1], "--identity")) return bench_identity(argv[2]);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--prompt") && i + 1 < argc) np = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--gen") && i + 1 < argc) ng = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) rep = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--probe") && i + 1 < argc) probe = atof(argv[++i]);
        else if (!strcmp(argv[i], "--rungs") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--compare")) compare = true;
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
        else if (!strcmp(argv[i], "--svg") && i + 1 < argc) svg = argv[++i];
        else if (!dir) dir = argv[i];
        else if (!tdir) tdir = argv[i];
        else { fprintf(stderr, "bench_stream: unexpected '%s'\n", argv[i]); return 2; }
    }
    if (!dir || !tdir || np < 1 || ng < 1 || rep < 1 || rep > MAXREP || probe <= 0) {
        fprintf(stderr, "usage: bench_stream MODEL_DIR TRUNK_DIR [--prompt N] [--gen N] [--repeat R<=%d] [--probe S] "
                        "[--rungs I,J,..] [--compare] [--json F] [--svg F]\n       bench_stream --identity MODEL_DIR\n",
                MAXREP);
        return 2;
    }
    static char shard_buf[4096];
    uint64_t shard_size;
    const char *shard = k3_largest_shard(dir, shard_buf, sizeof shard_buf, &shard_size) ? shard_buf : NULL;
    if (!shard) { fprintf(stderr, "bench_stream: %s: no shards\n", dir); return 2; }
    k3_config cfg;
    k3_err err = {0};
    if (k3_config_load(dir, &cfg, &err)) { fprintf(stderr, "k3: %s\n", err.msg); return 1; }
    /* the disk read the ways the engine reads it, once, for the record */
    st_index *ix;
    if (st_open(dir, &ix, &err)) { fprintf(stderr, "k3: %s\n", err.msg); return 1; }
    uint64_t xbytes = 0, nx = 0;
    for (size_t i = 0; i < st_count(ix); i++) {
        const char *nm = st_at(ix, i)->name;
        if (strstr(nm, ".experts.0.")) xbytes += st_at(ix, i)->nbytes;
        if (strstr(nm, ".experts.0.w1.")) nx += !strstr(nm, "weight_scale");
    }
    st_close(ix);
    if (nx) xbytes /= nx;
    xbytes = (xbytes + 2 * K3_DIO_ALIGN - 1) / K3_DIO_ALIGN * K3_DIO_ALIGN;
    char tbin[4200];
    snprintf(tbin, sizeof tbin, "%s/trunk.bin", tdir);
    double big16 = disk_mbs(shard, 4u << 20, 16, probe), tr4 = disk_mbs(tbin, 2u << 20, 4, probe),
           ex8 = disk_mbs(shard, xbytes, 8, probe), ex32 = disk_mbs(shard, xbytes, 32, probe);
    printf("disk (O_DIRECT, random): %.0f MB/s in 4 MiB reads at depth 16 (the reference); %.0f MB/s in 2 MiB trunk "
           "pieces at depth 4; %.0f / %.0f MB/s in %.0f kB expert reads at depth 8 / 32\n",
           big16, tr4, ex8, ex32, (double)xbytes / 1e3);

    static const rung_def ladder[] = {
        {.name = "resident, all experts cached", .trunk = false, .trunk_gb = -1, .cache_gb = -1},
        {.name = "resident, cache 0.1 GB", .trunk = false, .trunk_gb = -1, .cache_gb = 0.1},
        {.name = "resident, cache 0.0018 GB (one token)", .trunk = false, .trunk_gb = -1, .cache_gb = 0.0018},
        {.name = "packed trunk all pinned, all cached", .trunk = true, .trunk_gb = -1, .cache_gb = -1},
        {.name = "trunk 0.25 GB (4 pinned, 2 slots), cache 0.5", .trunk = true, .trunk_gb = 0.25, .cache_gb = 0.5},
        {.name = "trunk 0.25 GB, cache 0.1 GB", .trunk = true, .trunk_gb = 0.25, .cache_gb = 0.1},
        {.name = "trunk 0.17 GB (2 slots), cache 0.1 GB", .trunk = true, .trunk_gb = 0.17, .cache_gb = 0.1},
        {.name = "trunk 0.17 GB (2 slots), cache 0.02 GB", .trunk = true, .trunk_gb = 0.17, .cache_gb = 0.02},
        {.name = "trunk 0.125 GB (1 slot), cache 0.0018 GB", .trunk = true, .trunk_gb = 0.125, .cache_gb = 0.0018},
    };
    enum { NR = (int)(sizeof ladder / sizeof ladder[0]) };
    bool use[NR];
    for (int i = 0; i < NR; i++) use[i] = !only;
    use[0] = true; /* the compute-bound reference */
    for (const char *p = only; p && *p;) {
        int k = atoi(p);
        if (k >= 0 && k < NR) use[k] = true;
        p = strchr(p, ',');
        if (p) p++;
    }
    int32_t *prompt = xmalloc_array((size_t)np, sizeof *prompt);
    uint64_t seed = 7;
    for (int i = 0; i < np; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        prompt[i] = (int32_t)((seed >> 33) % (uint64_t)cfg.vocab_size);
    }
    int32_t *ref = xcalloc((size_t)ng, sizeof *ref), *got = xcalloc((size_t)ng, sizeof *got);
    bool same = true, have_ref = false;
    static rung_run runs[2][NR][MAXREP];
    int nrun[2][NR] = {{0}};
    rung_sum sum[2][NR];
    double compute_s = 0;
    printf("\n%-46s %7s %6s %7s %8s %8s %7s %8s %6s %6s %6s %6s\n", "budget", "plan GB", "pinned", "cached", "s/token",
           "MB/token", "disk MB/s", "floor s", "%disk", "%roof", "busy", "hits");
    for (int i = 0; i < NR; i++) {
        if (!use[i]) continue;
        int npass = compare && i > 0 ? 2 : 1;
        bool failed = false;
        /* old and new alternate, run by run, so both see the same load */
        for (int k = 0; k < rep && !failed; k++)
            for (int pass = 0; pass < npass && !failed; pass++) {
                rung_run r = {0};
                double d0 = disk_ref(shard, tbin, probe);
                int rc = run_rung(dir, tdir, &ladder[i], pass == 1, prompt, np, ng, have_ref ? got : ref, &r, &err);
                double d1 = disk_ref(shard, tbin, probe);
                if (rc) {
                    printf("%-46s refused or failed: %s\n", ladder[i].name, err.msg);
                    failed = true;
                    break;
                }
                if (have_ref && memcmp(got, ref, (size_t)ng * sizeof *got)) same = false;
                have_ref = true;
                r.disk_mbs = 0.5 * (d0 + d1);
                runs[pass][i][nrun[pass][i]++] = r;
            }
        for (int pass = 0; pass < npass; pass++) {
            sum[pass][i] = summarise(runs[pass][i], nrun[pass][i], compute_s);
            if (i == 0 && sum[0][0].ok) {
                compute_s = sum[0][0].r.s_per_tok;
                sum[0][0] = summarise(runs[0][0], nrun[0][0], compute_s);
            }
            const rung_sum *s = &sum[pass][i];
            if (!s->ok) continue;
            char name[80];
            snprintf(name, sizeof name, "%s%s", pass ? "  (before: no overlap) " : "", ladder[i].name);
            printf("%-46s %7.3f %3d/%-2d %7lld %8.3f %8.1f %7.0f %8.3f %5.0f%% %5.0f%% %5.0f%% %5.0f%%\n", name,
                   s->r.plan_gb, s->r.pinned, cfg.num_layers, (long long)s->r.cache_experts, s->r.s_per_tok,
                   s->r.mb_per_tok, s->r.disk_mbs, s->floor_s, 100 * s->io_ratio, 100 * s->roof_ratio,
                   100 * s->r.disk_share, 100 * s->r.resident_rate);
            fflush(stdout);
        }
    }
    printf("\ngenerated ids identical at every budget: %s\n", same ? "yes" : "NO");
    printf("threads %d; prompt %d tokens, %d decoded; medians of %d runs; floor = MB read per token / the disk's MB/s "
           "measured around each run; %%disk = floor / time (the disk roofline), %%roof = max(floor, compute) / time "
           "with compute = the resident all-cached s/token (%.3f); busy = share of the time with a read in flight\n",
           omp_get_max_threads(), np, ng, rep, compute_s);
    if (json_path) {
        FILE *f = fopen(json_path, "w");
        if (f) {
            fprintf(f, "{\"disk_mbs_4m_qd16\": %.1f, \"disk_mbs_trunk_2m_qd4\": %.1f, \"disk_mbs_expert_qd8\": %.1f, "
                       "\"disk_mbs_expert_qd32\": %.1f,\n \"threads\": %d, \"prompt\": %d, \"gen\": %d, \"repeat\": %d, "
                       "\"compute_s_per_token\": %.4f, \"same_ids\": %s, \"ladder\": [\n",
                    big16, tr4, ex8, ex32, omp_get_max_threads(), np, ng, rep, compute_s, same ? "true" : "false");
            bool firstj = true;
            for (int pass = 0; pass < 2; pass++)
                for (int i = 0; i < NR; i++) {
                    if (!use[i] || !nrun[pass][i]) continue;
                    const rung_sum *s = &sum[pass][i];
                    fprintf(f,
                            "%s  {\"budget\": \"%s\", \"io\": \"%s\", \"plan_gb\": %.4f, \"pinned\": %d, \"ring_slots\": "
                            "%d, \"cache_experts\": %lld, \"s_per_token\": %.4f, \"mb_per_token\": %.2f, "
                            "\"disk_mbs\": %.1f, \"floor_s\": %.4f, \"disk_roofline_ratio\": %.3f, "
                            "\"roofline_ratio\": %.3f, \"disk_busy\": %.3f, \"gbs_while_busy\": %.3f, \"stall_share\": "
                            "%.3f, \"resident_hit_rate\": %.3f}",
                            firstj ? "" : ",\n", ladder[i].name, pass ? "before" : "overlap", s->r.plan_gb,
                            s->r.pinned, s->r.slots, (long long)s->r.cache_experts, s->r.s_per_tok, s->r.mb_per_tok,
                            s->r.disk_mbs, s->floor_s, s->io_ratio, s->roof_ratio, s->r.disk_share, s->r.gbs_busy,
                            s->r.stall_share, s->r.resident_rate);
                    firstj = false;
                }
            fprintf(f, "\n]}\n");
            fclose(f);
        }
    }
    if (svg) {
        char title[256];
        snprintf(title, sizeof title, "k3 decode on a %d-layer MXFP4 checkpoint: s/token vs memory budget (%d threads)",
                 cfg.num_layers, omp_get_max_threads());
        rung_def d[NR];
        rung_sum s[NR];
        int n = 0;
        for (int i = 0; i < NR; i++)
            if (use[i] && sum[0][i].ok) {
                d[n] = ladder[i];
                s[n++] = sum[0][i];
            }
        write_svg(svg, d, s, n, title);
    }
    free(prompt);
    free(ref);
    free(got);
    return same ? 0 : 1;
}
