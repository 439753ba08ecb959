/* The streaming weight source: every budget (trunk resident or streamed with
 * pinned prefixes and one or two ring slots; expert caches from everything to
 * nothing) and every prefill split give the same logits bits as the resident
 * model, whose greedy ids in turn match the float64 PyTorch reference
 * (tests/fixtures/gen/.../expected.json). Plans that cannot fit are refused;
 * a read error poisons the source instead of producing tokens. */
#include "harness.h"
#include "memory/stream.h"
#include "model/records.h"

#include <dirent.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    int32_t ids[64];
    int n, nprompt;
    int32_t gen[64];
    int ngen;
} fixture_ids;

static bool load_ids(const char *dir, fixture_ids *f) {
    char path[1024];
    snprintf(path, sizeof path, "%s/expected.json", dir);
    json_t *root = json_load_file(path, 0, NULL);
    if (!root) return false;
    json_t *fed = json_object_get(root, "fed_ids"), *pr = json_object_get(root, "prompt_ids"),
           *gen = json_object_get(root, "generated_ids");
    bool ok = json_is_array(fed) && json_is_array(pr) && json_is_array(gen) && json_array_size(fed) <= 64 &&
              json_array_size(gen) <= 64;
    if (ok) {
        f->n = (int)json_array_size(fed);
        f->nprompt = (int)json_array_size(pr);
        f->ngen = (int)json_array_size(gen);
        for (int i = 0; i < f->n; i++) f->ids[i] = (int32_t)json_integer_value(json_array_get(fed, (size_t)i));
        for (int i = 0; i < f->ngen; i++) f->gen[i] = (int32_t)json_integer_value(json_array_get(gen, (size_t)i));
    }
    json_decref(root);
    return ok;
}

/* Logits of every fed token, resident model, fed all at once. */
static float *resident_logits(const char *dir, const fixture_ids *f, int *V) {
    k3_model *m;
    k3_err err = {0};
    if (k3_model_open(dir, NULL, &m, &err)) return NULL;
    *V = k3_model_config(m)->vocab_size;
    k3_state *st;
    float *lg = malloc((size_t)f->n * (size_t)*V * sizeof(float));
    if (k3_state_new(m, f->n, &st, &err) || k3_forward(m, st, f->ids, f->n, lg, true, &err)) {
        free(lg);
        lg = NULL;
    }
    k3_state_free(st);
    k3_model_free(m);
    return lg;
}

typedef struct {
    const char *trunk;       /* packed trunk dir or NULL */
    double trunk_gb, cache_gb;
    int chunk;               /* tokens per k3_forward call */
} budget;
/* decode waits for the whole expert batch (k3_stream_opts.expert_overlap off) */
static bool no_overlap;
/* pinned layers as a prefix instead of spread (k3_stream_opts.pin_spread off) */
static bool pin_prefix;

/* Runs the fed ids through a streamed model in chunks; 0 on success and
 * fills logits [n][V]; else the error code (err filled). */
static int streamed_logits(const char *dir, const fixture_ids *f, const budget *b, float *logits, k3_mem_plan *plan_out,
                           k3_stream_stats *stats, k3_err *err) {
    k3_model_opts mo = {.top_only = true};
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.trunk_dir = b->trunk;
    o.trunk_gb = b->trunk_gb;
    o.cache_gb = b->cache_gb;
    o.chunk = b->chunk;
    o.mem_limit = 1ull << 40;
    if (no_overlap) o.expert_overlap = false;
    if (pin_prefix) o.pin_spread = false;
    k3_config cfg;
    st_index *ix = NULL;
    k3_trunk *tr = NULL;
    int rc = k3_config_load(dir, &cfg, err);
    if (!rc) rc = st_open(dir, &ix, err);
    if (!rc && b->trunk) rc = k3_trunk_open(b->trunk, NULL, &tr, err);
    static k3_mem_plan plan;
    if (!rc) rc = k3_plan_make(&cfg, ix, tr, &o, f->n, &plan, err);
    if (rc) {
        k3_trunk_free(tr);
        st_close(ix);
        return rc;
    }
    if (plan_out) *plan_out = plan;
    k3_stream *s;
    if ((rc = k3_stream_open(&cfg, ix, tr, &plan, &o, &s, err))) return rc;
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
    int V = cfg.vocab_size;
    rc = k3_state_new(m, f->n, &st, err);
    for (int i = 0; !rc && i < f->n; i += b->chunk) {
        int T = f->n - i < b->chunk ? f->n - i : b->chunk;
        rc = k3_forward(m, st, f->ids + i, T, logits + (size_t)i * V, true, err);
    }
    if (stats) *stats = k3_stream_get_stats(s);
    k3_state_free(st);
    k3_model_free(m);
    k3_stream_free(s);
    return rc;
}

static void run_budgets(const char *fixture, bool with_trunk) {
    const char *dir = t_repo(fixture);
    fixture_ids f;
    CHECKF(load_ids(dir, &f), "%s: expected.json", dir);
    int V;
    float *want = resident_logits(dir, &f, &V);
    CHECK(want != NULL);
    /* the resident model agrees with the float64 reference's greedy ids */
    for (int i = 0; i < f.ngen - 1; i++)
        CHECKF(k3_argmax(want + (size_t)(f.nprompt - 1 + i) * V, V) == f.gen[i], "greedy %d", i);
    char trunk[1024];
    snprintf(trunk, sizeof trunk, "%s/trunk", t_outdir());
    k3_err err = {0};
    if (with_trunk) CHECKF(k3_trunk_pack(dir, trunk, &err) == 0, "%s", err.msg);
    /* sizes to aim budgets at */
    k3_mem_plan big;
    float *got = malloc((size_t)f.n * V * sizeof(float));
    budget all = {with_trunk ? trunk : NULL, -1, -1, 64};
    CHECKF(streamed_logits(dir, &f, &all, got, &big, NULL, &err) == 0, "%s", err.msg);
    CHECK(memcmp(got, want, (size_t)f.n * V * sizeof(float)) == 0);
    uint64_t maxlayer = 0, maxcopy = 0;
    for (int L = 0; L < big.num_layers; L++) {
        uint64_t a = (big.layer_bytes[L] + 4095) / 4096 * 4096;
        if (a > maxlayer) maxlayer = a;
        if (big.bind_bytes[L] > maxcopy) maxcopy = big.bind_bytes[L];
    }
    double one_slot = (double)(big.head_bytes + maxlayer + maxcopy) / 1e9;
    double two_slots = (double)(big.head_bytes + 2 * (maxlayer + maxcopy)) / 1e9;
    double xb = (double)big.expert_buf / 1e9;
    int k = big.top_k;
    budget bs[] = {
        {NULL, -1, xb * (k + 1), 1},               /* trunk resident, cache of one expert, token at a time */
        {NULL, -1, xb * (3 * k + 5), 3},           /* chunks of 3 */
        {NULL, -1, 0.5 * xb * big.total_experts, 5},
        {with_trunk ? trunk : NULL, with_trunk ? one_slot * 1.0001 : -1, xb * k, 1},   /* smallest: one slot, no cache */
        {with_trunk ? trunk : NULL, with_trunk ? two_slots * 1.0001 : -1, xb * (2 * k), 2},
        {with_trunk ? trunk : NULL, with_trunk ? two_slots * 1.0001 + 3 * (double)maxlayer / 1e9 : -1, -1, 64},
    };
    for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++) {
        k3_mem_plan p;
        k3_stream_stats st;
        memset(got, 0, (size_t)f.n * V * sizeof(float));
        int rc = streamed_logits(dir, &f, &bs[i], got, &p, &st, &err);
        CHECKF(rc == 0, "budget %zu: %s", i, err.msg);
        CHECKF(memcmp(got, want, (size_t)f.n * V * sizeof(float)) == 0, "budget %zu: logits differ", i);
        CHECKF(st.requests == st.hits + st.misses, "budget %zu", i);
        CHECKF(st.resident_hits <= st.hits, "budget %zu", i);
        if (bs[i].trunk && p.pinned < p.num_layers) CHECKF(st.trunk_read > 0, "budget %zu: no trunk reads", i);
        if (i == 3) {
            CHECKF(p.cache_experts == 0 && st.hits == 0, "budget 3: cache %lld hits %llu", (long long)p.cache_experts,
                   (unsigned long long)st.hits);
            if (with_trunk) CHECKF(p.ring_slots == 1 && p.pinned == 0, "slots %d pinned %d", p.ring_slots, p.pinned);
        }
        if (i == 4 && with_trunk) CHECKF(p.ring_slots == 2, "slots %d", p.ring_slots);
        if (i == 5 && with_trunk) {
            CHECKF(p.pinned > 0 && p.pinned < p.num_layers, "pinned %d", p.pinned);
            /* the same budget with the pinned layers as a prefix: same bits */
            k3_mem_plan q;
            pin_prefix = true;
            memset(got, 0, (size_t)f.n * V * sizeof(float));
            rc = streamed_logits(dir, &f, &bs[i], got, &q, NULL, &err);
            pin_prefix = false;
            CHECKF(rc == 0, "prefix: %s", err.msg);
            CHECKF(memcmp(got, want, (size_t)f.n * V * sizeof(float)) == 0, "prefix: logits differ");
            bool prefix = true;
            for (int L = 0; L < q.num_layers; L++) prefix = prefix && q.pin[L] == (L < q.pinned);
            CHECKF(prefix && q.pinned > 0, "prefix plan: %d pinned", q.pinned);
        }
        if (i == 0) CHECKF(st.evictions > 0, "budget 0: no evictions");
    }
    free(got);
    free(want);
}

TEST(stream_budgets_same_logits_resident_trunk) { run_budgets("tests/fixtures/gen/k3_like", false); }
TEST(stream_budgets_same_logits_packed_trunk) { run_budgets("tests/fixtures/gen/k3_like", true); }
TEST(stream_budgets_unquantised_experts) { run_budgets("tests/fixtures/gen/dense_experts", true); }

/* Decode computes each routed expert as its bytes arrive (reads overlap compute) and sums
 * them in the router's order afterwards: the order in which the experts
 * arrive cannot change a bit. K3_EXPERT_ORDER hands every batch to the model
 * reversed or shuffled; the logits must equal the resident model's and the
 * batch path's (no overlap), and the hook must really have reordered. */
TEST(stream_expert_arrival_order) {
    const char *dir = t_repo("tests/fixtures/gen/k3_like");
    fixture_ids f;
    CHECK(load_ids(dir, &f));
    int V;
    float *want = resident_logits(dir, &f, &V);
    CHECK(want != NULL);
    char trunk[1024];
    snprintf(trunk, sizeof trunk, "%s/trunk", t_outdir());
    k3_err err = {0};
    CHECKF(k3_trunk_pack(dir, trunk, &err) == 0, "%s", err.msg);
    size_t bytes = (size_t)f.n * V * sizeof(float);
    float *got = malloc(bytes);
    const char *orders[] = {NULL, "reverse", "shuffle"};
    for (int with_trunk = 0; with_trunk < 2; with_trunk++)
        for (int cached = 0; cached < 2; cached++) /* no cache (all read) or a cache that hits */
            for (int i = 0; i < 4; i++) {
                budget b = {with_trunk ? trunk : NULL, -1, cached ? -1 : 0.00002, 1};
                if (i < 3 && orders[i]) setenv("K3_EXPERT_ORDER", orders[i], 1);
                no_overlap = i == 3;
                k3_stream_stats st;
                memset(got, 0, bytes);
                int rc = streamed_logits(dir, &f, &b, got, NULL, &st, &err);
                unsetenv("K3_EXPERT_ORDER");
                no_overlap = false;
                const char *what = i == 3 ? "no overlap" : orders[i] ? orders[i] : "arrival";
                CHECKF(rc == 0, "%s: %s", what, err.msg);
                CHECKF(memcmp(got, want, bytes) == 0, "trunk %d cached %d %s: logits differ", with_trunk, cached, what);
                if (i == 1 || i == 2)
                    CHECKF(st.experts_reordered > 0, "%s: the order did not change (%llu)", what,
                           (unsigned long long)st.experts_reordered);
                if (cached) CHECKF(st.hits > 0, "%s: no cache hits", what);
            }
    free(got);
    free(want);
}

TEST(stream_plan_refusals) {
    const char *dir = t_repo("tests/fixtures/gen/k3_like");
    k3_config cfg;
    st_index *ix;
    k3_err err = {0};
    CHECK(k3_config_load(dir, &cfg, &err) == 0);
    CHECK(st_open(dir, &ix, &err) == 0);
    char trunk[1024];
    snprintf(trunk, sizeof trunk, "%s/trunk", t_outdir());
    CHECKF(k3_trunk_pack(dir, trunk, &err) == 0, "%s", err.msg);
    k3_trunk *tr;
    CHECK(k3_trunk_open(trunk, NULL, &tr, &err) == 0);
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.mem_limit = 1ull << 40;
    static k3_mem_plan p;
    /* resident trunk above --trunk-gb: refused, pointing at pack-trunk */
    o.trunk_gb = 1e-6;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_EXIT_BUDGET);
    CHECKF(strstr(err.msg, "pack-trunk") != NULL, "%s", err.msg);
    /* streamed, but not even one ring slot fits */
    CHECK(k3_plan_make(&cfg, ix, tr, &o, 16, &p, &err) == K3_EXIT_BUDGET);
    CHECKF(strstr(err.msg, "ring slot") != NULL, "%s", err.msg);
    /* a cache smaller than one token's experts */
    o.trunk_gb = -1;
    o.cache_gb = 1e-9;
    CHECK(k3_plan_make(&cfg, ix, tr, &o, 16, &p, &err) == K3_EXIT_BUDGET);
    CHECKF(strstr(err.msg, "one token needs") != NULL, "%s", err.msg);
    /* an explicit chunk the cache cannot hold; without --chunk it shrinks */
    CHECK(k3_plan_make(&cfg, ix, tr, &o, 16, &p, &err) == K3_EXIT_BUDGET);
    o.cache_gb = 0;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_EXIT_BUDGET);
    o.cache_gb = -1;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_OK);
    double xb = (double)p.expert_buf / 1e9;
    o.cache_gb = xb * 3 * cfg.experts_per_token;
    o.chunk = 8;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_EXIT_BUDGET);
    CHECKF(strstr(err.msg, "--chunk") != NULL, "%s", err.msg);
    o.chunk = 0;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_OK);
    CHECKF(p.chunk == 2 && p.batch_experts == 2 * cfg.experts_per_token, "chunk %d batch %d", p.chunk, p.batch_experts);
    /* more than the machine has */
    o.cache_gb = -1;
    o.mem_limit = 1000;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_EXIT_BUDGET);
    CHECKF(strstr(err.msg, "--max-memory") != NULL, "%s", err.msg);
    /* a long context grows the MLA cache linearly */
    o.mem_limit = 1ull << 40;
    k3_mem_plan q;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_OK);
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 32, &q, &err) == K3_OK);
    CHECK(q.state.mla_bytes == 2 * p.state.mla_bytes && q.state.mla_bytes > 0);
    k3_trunk_free(tr);
    st_close(ix);
}

TEST(stream_read_error_poisons) {
    const char *dir = t_repo("tests/fixtures/gen/k3_like");
    fixture_ids f;
    CHECK(load_ids(dir, &f));
    char trunk[1024];
    snprintf(trunk, sizeof trunk, "%s/trunk", t_outdir());
    k3_err err = {0};
    CHECKF(k3_trunk_pack(dir, trunk, &err) == 0, "%s", err.msg);
    float *got = malloc((size_t)f.n * 128 * sizeof(float));
    /* size a budget that streams the trunk and caches nothing (no reads yet) */
    k3_config cfg;
    st_index *ix;
    k3_trunk *tr;
    CHECK(k3_config_load(dir, &cfg, &err) == 0 && st_open(dir, &ix, &err) == 0);
    CHECK(k3_trunk_open(trunk, NULL, &tr, &err) == 0);
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.mem_limit = 1ull << 40;
    static k3_mem_plan p;
    CHECK(k3_plan_make(&cfg, ix, tr, &o, f.n, &p, &err) == 0);
    k3_trunk_free(tr);
    st_close(ix);
    uint64_t big = 0;
    for (int L = 0; L < p.num_layers; L++)
        if (p.layer_bytes[L] + p.bind_bytes[L] + 4096 > big) big = p.layer_bytes[L] + p.bind_bytes[L] + 4096;
    budget b = {trunk, (double)(p.head_bytes + 2 * big) / 1e9, (double)p.expert_buf * p.top_k / 1e9, 1};
    /* a few reads succeed, then every read fails: an error, never logits */
    setenv("K3_IO_FAIL_AFTER", "7", 1);
    int rc = streamed_logits(dir, &f, &b, got, NULL, NULL, &err);
    unsetenv("K3_IO_FAIL_AFTER");
    CHECKF(rc == K3_EXIT_RUNTIME, "rc %d: %s", rc, err.msg);
    CHECKF(strstr(err.msg, "Input/output error") != NULL, "%s", err.msg);
    free(got);
}

/* Copies a fixture directory's files into dst. */
static int copy_dir(const char *src, const char *dst) {
    mkdir(dst, 0755);
    DIR *d = opendir(src);
    if (!d) return 1;
    struct dirent *e;
    int bad = 0;
    while ((e = readdir(d)) && !bad) {
        if (e->d_name[0] == '.') continue;
        char a[2048], b[2048];
        snprintf(a, sizeof a, "%s/%s", src, e->d_name);
        snprintf(b, sizeof b, "%s/%s", dst, e->d_name);
        char *data;
        size_t n;
        k3_err err = {0};
        if (k3_read_file(a, &data, &n, &err)) { bad = 1; break; }
        bad = k3_write_file_atomic(b, data, n, &err) != 0;
        free(data);
    }
    closedir(d);
    return bad;
}

static int flip_byte(const char *path, uint64_t off) {
    FILE *fp = fopen(path, "r+b");
    if (!fp) return 1;
    fseek(fp, (long)off, SEEK_SET);
    int c = fgetc(fp);
    fseek(fp, (long)off, SEEK_SET);
    fputc(c ^ 0x40, fp);
    return fclose(fp) != 0;
}

/* With a packed trunk the head comes from run 0 of trunk.bin: a byte changed
 * in the middle of the shard's lm_head (outside the identity's samples) does
 * not reach the logits, which it does without --trunk; and a byte flipped in
 * run 0 (inside the embedding table, which is mapped, not kept) stops the run
 * at open with a checksum error. */
TEST(stream_head_from_trunk_run0) {
    const char *fix = t_repo("tests/fixtures/gen/k3_like");
    fixture_ids f;
    CHECK(load_ids(fix, &f));
    char dir[1024], trunk[1024];
    snprintf(dir, sizeof dir, "%s/model", t_outdir());
    snprintf(trunk, sizeof trunk, "%s/trunk", t_outdir());
    CHECK(copy_dir(fix, dir) == 0);
    int V;
    float *want = resident_logits(dir, &f, &V);
    CHECK(want != NULL);
    k3_err err = {0};
    CHECKF(k3_trunk_pack(dir, trunk, &err) == 0, "%s", err.msg);
    st_index *ix;
    CHECK(st_open(dir, &ix, &err) == 0);
    const st_tensor *h = st_find(ix, "language_model.lm_head.weight");
    CHECK(h != NULL && h->nbytes > 1024);
    char shard[1100];
    snprintf(shard, sizeof shard, "%s", st_shard_at(ix, h->shard)->path);
    uint64_t hoff = h->offset + h->nbytes / 2;
    st_close(ix);
    CHECK(flip_byte(shard, hoff) == 0);
    float *bent = resident_logits(dir, &f, &V);
    CHECK(bent != NULL);
    CHECKF(memcmp(bent, want, (size_t)f.n * V * sizeof(float)) != 0, "the flipped head byte changed nothing");
    float *got = malloc((size_t)f.n * V * sizeof(float));
    budget b = {trunk, -1, -1, 64};
    CHECKF(streamed_logits(dir, &f, &b, got, NULL, NULL, &err) == 0, "%s", err.msg);
    CHECKF(memcmp(got, want, (size_t)f.n * V * sizeof(float)) == 0, "the streamed head is not trunk.bin's");
    /* a flipped byte in run 0's embedding table */
    k3_trunk *tr;
    CHECK(k3_trunk_open(trunk, NULL, &tr, &err) == 0);
    const k3_trunk_run *r0 = k3_trunk_run_for(tr, K3_TRUNK_MODEL_RUN);
    uint64_t eoff = 0;
    for (int i = 0; r0 && i < r0->ntensors; i++)
        if (strstr(r0->tensors[i].name, "embed_tokens.weight"))
            eoff = r0->offset + r0->tensors[i].offset + r0->tensors[i].nbytes / 2;
    char bin[1100];
    snprintf(bin, sizeof bin, "%s", tr->bin_path);
    k3_trunk_free(tr);
    CHECK(eoff > 0);
    CHECK(flip_byte(bin, eoff) == 0);
    int rc = streamed_logits(dir, &f, &b, got, NULL, NULL, &err);
    CHECKF(rc == K3_EXIT_DATA && strstr(err.msg, "checksum"), "rc %d: %s", rc, err.msg);
    free(got);
    free(bent);
    free(want);
}

/* The source of the routed experts alone (bench/layers.c's MoE from disk):
 * it plans and binds no trunk, refuses a packed trunk and every layer_get,
 * and the MoE block fed from it (k3_moe_source: decode's overlapped path at
 * one position, experts_get at three) gives the resident block's bits, every
 * selected expert read from the shards through a cache of none. */
TEST(stream_experts_only_source) {
    const char *dir = t_repo("tests/fixtures/gen/k3_like");
    k3_err err = {0};
    k3_config cfg;
    st_index *ix;
    CHECK(k3_config_load(dir, &cfg, &err) == 0 && st_open(dir, &ix, &err) == 0);
    int L = 0;
    while (L < cfg.num_layers && cfg.layer_dense[L]) L++;
    CHECK(L < cfg.num_layers);
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.experts_only = true;
    o.mem_limit = 1ull << 40;
    o.chunk = 3;
    static k3_mem_plan p;
    char trunk[1024];
    snprintf(trunk, sizeof trunk, "%s/trunk", t_outdir());
    CHECKF(k3_trunk_pack(dir, trunk, &err) == 0, "%s", err.msg);
    k3_trunk *tr;
    CHECK(k3_trunk_open(trunk, NULL, &tr, &err) == 0);
    CHECK(k3_plan_make(&cfg, ix, tr, &o, 4, &p, &err) == K3_EXIT_USAGE);
    k3_trunk_free(tr);
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 4, &p, &err) == 0);
    CHECKF(p.trunk_bytes == 0 && p.head_bytes == 0 && p.pinned == 0 && p.total_experts > 0, "trunk %llu experts %lld",
           (unsigned long long)p.trunk_bytes, (long long)p.total_experts);
    int k = cfg.experts_per_token;
    o.cache_gb = (3.0 * k + 0.5) * (double)p.expert_buf / 1e9; /* one chunk's batch, nothing cached */
    CHECKF(k3_plan_make(&cfg, ix, NULL, &o, 4, &p, &err) == 0, "%s", err.msg);
    CHECKF(p.cache_experts == 0, "cache %lld", (long long)p.cache_experts);
    k3_stream *s;
    CHECKF(k3_stream_open(&cfg, ix, NULL, &p, &o, &s, &err) == 0, "%s", err.msg);
    const k3_weight_source *src = k3_stream_source(s);
    const k3_layer_w *lw;
    k3_err e2 = {0};
    CHECK(src->layer_get(src->ctx, L, &lw, &e2) != 0 && strstr(e2.msg, "experts only"));
    /* a fresh source: the refusal poisons the one above */
    k3_stream_free(s);
    CHECK(st_open(dir, &ix, &err) == 0);
    CHECKF(k3_stream_open(&cfg, ix, NULL, &p, &o, &s, &err) == 0, "%s", err.msg);
    src = k3_stream_source(s);
    k3_model *m;
    CHECKF(k3_model_open(dir, NULL, &m, &err) == 0, "%s", err.msg);
    const k3_layer_w *w = k3_model_layer(m, L);
    CHECK(w && !w->dense && w->moe.experts);
    int E = cfg.hidden_size;
    float *x = malloc(3 * (size_t)E * sizeof *x), *want = malloc(3 * (size_t)E * sizeof *x),
          *got = malloc(3 * (size_t)E * sizeof *x);
    uint64_t st = 5;
    for (int i = 0; i < 3 * E; i++) x[i] = (float)(2 * k3_rng_unit(&st) - 1);
    for (int T = 1; T <= 3; T += 2) {
        k3_moe(&cfg, &w->moe, w->moe.experts, x, T, want);
        memset(got, 0, 3 * (size_t)E * sizeof *got);
        CHECKF(k3_moe_source(&cfg, &w->moe, src, L, x, T, got, &err) == 0, "T %d: %s", T, err.msg);
        CHECKF(memcmp(got, want, (size_t)T * E * sizeof *got) == 0, "T %d: the bits differ from the resident block's",
               T);
    }
    k3_stream_stats ss = k3_stream_get_stats(s);
    CHECKF(ss.steps == 2 && ss.hits == 0 && ss.misses >= 2 * (uint64_t)k && ss.expert_read > 0,
           "steps %llu hits %llu misses %llu", (unsigned long long)ss.steps, (unsigned long long)ss.hits,
           (unsigned long long)ss.misses);
    free(x);
    free(want);
    free(got);
    k3_model_free(m);
    k3_stream_free(s);
}
