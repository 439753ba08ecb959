/* engine.c: opening a model for inference (engine.h). */
#include "engine/engine.h"

#include "dist/dist.h"
#include "dist/expert_par.h"
#include "dist/tensor_par.h"
#include "formats/identity.h"
#include "model/source.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct k3_engine {
    k3_engine_opts opts;
    k3_model *model;
    const k3_config *cfg;
    k3_tokenizer *tok;       /* NULL when the model has none and none was asked for */
    k3_runmem *rm;           /* the memory plan and the weight source */
    st_index *ix;            /* the open shards (the identity reads their headers) */
    int vocab;
    int chunk;               /* prefill positions per forward call (the plan's) */
    int threads;             /* what OpenMP will use */
    int eos_id;              /* config eos_token_id, else the tokenizer's, else -1 */
    FILE *step_log;          /* a line per forward call (--verbose), or NULL */
    uint64_t states_bytes;   /* decode states handed out and still live */
    struct { k3_state *s; uint64_t bytes; } *live;
    size_t nlive, caplive;
    /* expert parallelism (under mpirun with several ranks, dist/): this
     * process is rank `rank` of `ranks` and computes only its share of the
     * routed experts; every rank makes the same calls and gets the same
     * logits bits. Only rank 0 should talk to the user. */
    int rank, ranks;
    struct k3_ep *ep;        /* the expert-parallel source, or NULL */
    int32_t *owner;          /* [layers][experts] placement, or NULL */
    uint8_t *owned;          /* [layers][experts] this rank's share, or NULL */
};

void k3_engine_opts_init(k3_engine_opts *o) {
    memset(o, 0, sizeof *o);
    k3_runmem_args_init(&o->mem);
}

int k3_engine_parse_flag(k3_engine_opts *o, const char *cmd, int argc, char **argv, int *i, bool *used,
                         k3_err *err) {
    const char *f = argv[*i];
    const char *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    int64_t n;
    *used = true;
#define VALUE()                                                                          \
    do {                                                                                 \
        if (!v) return k3_fail(err, K3_EXIT_USAGE, "%s: %s needs a value", cmd, f);      \
        (*i)++;                                                                          \
    } while (0)
    if (!strcmp(f, "--tok")) {
        VALUE();
        o->tok_dir = v;
    } else if (!strcmp(f, "--threads")) {
        VALUE();
        if (!k3_parse_i64(v, 1, 4096, &n)) return k3_fail(err, K3_EXIT_USAGE, "%s: --threads: '%s' is not in 1..4096", cmd, v);
        o->threads = (int)n;
    } else if (!strcmp(f, "--layers")) {
        VALUE();
        if (!k3_parse_i64(v, 1, K3_MAX_LAYERS, &n))
            return k3_fail(err, K3_EXIT_USAGE, "%s: --layers: '%s' is not a layer count >= 1", cmd, v);
        o->layers = (int)n;
    } else if (!strcmp(f, "--kda-chunk")) {
        VALUE();
        if (!k3_parse_i64(v, 1, 4096, &n)) return k3_fail(err, K3_EXIT_USAGE, "%s: --kda-chunk: '%s' is not in 1..4096", cmd, v);
        o->kda_chunk = (int)n;
    } else if (!strcmp(f, "--peer-mla-eps")) {
        o->peer_mla_eps = true;
    } else if (!strcmp(f, "--expert-placement")) {
        VALUE();
        o->expert_placement = v;
    } else if (!strcmp(f, "--parallel-layout")) {
        VALUE();
        if (strcmp(v, "tp+ep") && strcmp(v, "ep") && strcmp(v, "tp"))
            return k3_fail(err, K3_EXIT_USAGE, "%s: --parallel-layout: '%s' is not tp+ep, tp or ep", cmd, v);
        o->layout_ep = !strcmp(v, "ep");
        o->layout_tp = !strcmp(v, "tp");
    } else if (!strcmp(f, "--max-memory")) {
        VALUE();
        if (!k3_parse_size(v, &o->max_memory) || !o->max_memory)
            return k3_fail(err, K3_EXIT_USAGE, "%s: --max-memory: '%s' is not a size like 512M or 8G", cmd, v);
    } else {
        return k3_runmem_parse(&o->mem, cmd, argc, argv, i, used, err);
    }
#undef VALUE
    return K3_OK;
}

void k3_sample_opts_init(k3_sample_opts *o) {
    memset(o, 0, sizeof *o);
    o->top_p = 1.0f;
}

int k3_sample_parse_flag(k3_sample_opts *o, const char *cmd, int argc, char **argv, int *i, bool *used,
                         k3_err *err) {
    const char *f = argv[*i];
    *used = strcmp(f, "--temperature") == 0 || strcmp(f, "--top-k") == 0 || strcmp(f, "--top-p") == 0 ||
            strcmp(f, "--min-p") == 0 || strcmp(f, "--seed") == 0;
    if (!*used) return K3_OK;
    if (*i + 1 >= argc)
        return k3_fail(err, K3_EXIT_USAGE, "%s: %s needs a value (see 'k3 help %s')", cmd, f, cmd);
    const char *v = argv[++*i];
    double d;
    int64_t n;
    const char *bad = NULL;
    if (!strcmp(f, "--temperature")) {
        if (!k3_parse_f64(v, &d) || d < 0) bad = "not a number >= 0";
        else o->temperature = (float)d;
    } else if (!strcmp(f, "--top-k")) {
        if (!k3_parse_i64(v, 0, INT_MAX, &n)) bad = "not a count >= 0";
        else o->top_k = (int)n;
    } else if (!strcmp(f, "--top-p")) {
        if (!k3_parse_f64(v, &d) || !k3_sample_top_p_ok(d, &o->top_p)) bad = "not in (0, 1] (as a float)";
    } else if (!strcmp(f, "--min-p")) {
        if (!k3_parse_f64(v, &d) || d < 0 || d > 1) bad = "not in [0, 1]";
        else o->min_p = (float)d;
    } else {
        if (!k3_parse_i64(v, 0, INT64_MAX, &n)) bad = "not an integer >= 0";
        else o->seed = (uint64_t)n;
    }
    /* worded as the commands' own usage errors (k3_usage_error) */
    if (bad) return k3_fail(err, K3_EXIT_USAGE, "%s: %s: '%s' is %s (see 'k3 help %s')", cmd, f, v, bad, cmd);
    if (strcmp(f, "--temperature") && strcmp(f, "--seed")) o->filtered = true;
    return K3_OK;
}

int k3_sample_opts_check(const k3_sample_opts *o, const char *cmd, k3_err *err) {
    if (o->filtered && o->temperature <= 0)
        return k3_fail(err, K3_EXIT_USAGE, "%s: --top-k/--top-p/--min-p need --temperature > 0 (see 'k3 help %s')",
                       cmd, cmd);
    return K3_OK;
}

void k3_sample_opts_sampler(const k3_sample_opts *o, int vocab, uint64_t seed_offset, k3_sampler *sp) {
    k3_sampler_init(sp, vocab, o->temperature, o->top_k, o->top_p, o->min_p, o->seed + seed_offset);
}

static bool is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int load_tokenizer(k3_engine *e, k3_err *err) {
    const k3_engine_opts *o = &e->opts;
    const char *dir = o->tok_dir ? o->tok_dir : o->model_dir;
    char path[4096];
    int k = snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    if (k < 0 || (size_t)k >= sizeof path) return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    if (!o->tok_dir && !is_file(path)) {
        if (o->need_tokenizer)
            return k3_fail(err, K3_EXIT_USAGE, "%s: no tokenizer (no tiktoken.model): give --tok DIR", dir);
        return K3_OK; /* ids only */
    }
    return tok_load(dir, &e->tok, err);
}

/* Expert parallelism, before the plan: the placement and this rank's share
 * (which the plan then sizes). run_cfg: the config as the run sees it
 * (k3_config_first_layers applied: --layers). */
static int ep_placement(k3_engine *e, const k3_config *run_cfg, k3_err *err) {
    const k3_engine_opts *o = &e->opts;
    k3_config c = *run_cfg;
    int rc;
    int moe = 0;
    for (int L = 0; L < c.num_layers; L++) moe += !c.layer_dense[L];
    if (c.num_experts <= 0 || !moe)
        return k3_fail(err, K3_EXIT_USAGE, "%s: no routed experts to spread over %d ranks: run it without mpirun",
                       o->model_dir, e->ranks);
    if (e->ranks > c.num_experts && !o->layout_tp)
        return k3_fail(err, K3_EXIT_USAGE,
                       "%s: %d ranks but %d routed experts per layer: expert parallelism takes at most one rank per "
                       "expert (mpirun -np %d or fewer)",
                       o->model_dir, e->ranks, c.num_experts, c.num_experts);
    if (o->mem.so.trace_dir)
        return k3_fail(err, K3_EXIT_USAGE,
                       "--dump-cache-trace: a rank of %d sees only its share of the experts' requests or rows: trace with one "
                       "process",
                       e->ranks);
    k3_placement p;
    if (o->expert_placement) {
        if ((rc = k3_placement_load(o->expert_placement, e->ranks, &c, &p, err))) return rc;
    } else {
        k3_placement_contiguous(e->ranks, c.num_layers, c.num_experts, &p);
    }
    size_t n = (size_t)c.num_layers * (size_t)c.num_experts;
    e->owner = p.owner;
    e->owned = xcalloc(n, 1);
    /* split experts: every rank holds its rows of every expert (no placement) */
    for (size_t i = 0; i < n; i++) e->owned[i] = o->layout_tp || p.owner[i] == e->rank;
    e->opts.mem.so.owned = o->layout_tp ? NULL : e->owned;
    if (!o->layout_ep) { /* the plan counts this rank's share of the split trunk (and experts) */
        e->opts.mem.so.tp_rank = e->rank;
        e->opts.mem.so.tp_ranks = e->ranks;
        e->opts.mem.so.tp_experts = o->layout_tp;
    }
    return K3_OK;
}

/* Every rank must open the same model with the same placement and feed the
 * same chunks: compared (and the chunk agreed) before any weight is read.
 * cfg: the config as the run sees it (--layers applied). The identity hashes
 * the files' bytes themselves (that is its point), not what was parsed. */
static int ep_check_same(k3_engine *e, const k3_config *cfg, k3_err *err) {
    struct { uint64_t model, place; int32_t chunk, pad; } mine = {0}, *all;
    int rc = k3_model_identity_of(e->opts.model_dir, e->ix, e->opts.tok_dir, 0, &mine.model, err);
    rc = k3_dist_agree(rc, err, "opening the model (identity)");
    if (rc) return rc;
    k3_placement p = {.ranks = e->ranks, .layers = cfg->num_layers, .experts = cfg->num_experts, .owner = e->owner};
    mine.place = k3_placement_hash(&p);
    mine.chunk = k3_runmem_chunk(e->rm);
    all = xmalloc_array((size_t)e->ranks, sizeof *all);
    k3_dist_allgather(&mine, sizeof mine, all, "opening the model (identity)");
    int chunk = all[0].chunk;
    for (int r = 0; r < e->ranks && !rc; r++) {
        if (all[r].chunk < chunk) chunk = all[r].chunk;
        if (all[r].model != all[0].model)
            rc = k3_fail(err, K3_EXIT_USAGE,
                         "rank %d of %d (%s): %s is not the same checkpoint as rank 0's (%s): config.json, the tensor "
                         "tables or the tokenizer differ; every host needs an identical copy",
                         r, e->ranks, k3_dist_host(r), e->opts.model_dir, k3_dist_host(0));
        else if (all[r].place != all[0].place)
            rc = k3_fail(err, K3_EXIT_USAGE,
                         "rank %d of %d (%s): its expert placement differs from rank 0's (%s): give every host the same "
                         "--expert-placement file",
                         r, e->ranks, k3_dist_host(r), k3_dist_host(0));
    }
    free(all);
    if (!rc) k3_runmem_limit_chunk(e->rm, chunk);
    return rc;
}

int k3_engine_open(const k3_engine_opts *o, k3_engine **out, k3_err *err) {
    *out = NULL;
    if (!o->model_dir) return k3_fail(err, K3_EXIT_USAGE, "no MODEL_DIR given");
    k3_engine *e = xcalloc(1, sizeof *e);
    e->opts = *o;
    e->eos_id = -1;
    e->rank = o->alone ? 0 : k3_dist_rank();
    e->ranks = o->alone ? 1 : k3_dist_size();
    if (o->threads > 0) omp_set_num_threads(o->threads);
    e->threads = omp_get_max_threads();
    int64_t max_pos = o->max_pos > 0 ? o->max_pos : 1;
    /* config.json and the shards' headers are read once, here: the
     * placement, the plan and the model are all made from these */
    k3_config *run_cfg = xmalloc(sizeof *run_cfg);
    st_index *ix = NULL;
    int rc = k3_config_load(o->model_dir, run_cfg, err);
    if (!rc) rc = k3_config_first_layers(run_cfg, o->layers, o->model_dir, err);
    if (!rc && e->ranks > 1) rc = ep_placement(e, run_cfg, err);
    if (!rc) rc = st_open(o->model_dir, &ix, err);
    if (!rc) e->ix = st_retain(ix);
    /* the plan comes first: a run that cannot fit is refused before any
     * weight is read; the model then keeps only its model-level tensors and
     * the plan's source serves the layers and the routed experts. Under
     * expert parallelism every rank plans for its own share, and a rank that
     * cannot fit refuses the job (its line names it) */
    if (!rc) rc = k3_runmem_begin(&e->opts.mem, run_cfg, ix, max_pos, o->max_memory, &e->rm, err);
    if (e->ranks > 1) {
        if ((rc = k3_dist_agree(rc, err, "opening the model (memory plan)"))) goto fail;
        if ((rc = ep_check_same(e, run_cfg, err))) goto fail;
    }
    if (rc) goto fail;
    /* run_cfg is already cut to --layers: the model takes it as it is */
    k3_model_opts mo = {.peer_mla_eps = o->peer_mla_eps, .kda_chunk = o->kda_chunk,
                        .top_only = true, .prefill_chunk = k3_runmem_chunk(e->rm)};
    rc = k3_model_open_index(o->model_dir, run_cfg, ix, &mo, &e->model, err);
    if (!rc) rc = k3_runmem_attach(e->rm, e->model, err);
    if (!rc) rc = load_tokenizer(e, err);
    if (e->ranks > 1 && (rc = k3_dist_agree(rc, err, "loading the weights"))) goto fail;
    if (rc) goto fail;
    if (e->ranks > 1) {
        const k3_config *c = k3_model_config(e->model);
        k3_placement p = {.ranks = e->ranks, .layers = c->num_layers, .experts = c->num_experts, .owner = e->owner};
        if (!o->layout_tp) { /* the experts through the expert exchange */
            e->ep = k3_ep_new(k3_runmem_source(e->rm), &p, e->rank, e->ranks);
            k3_model_set_source(e->model, k3_ep_source(e->ep));
        }
        if (!o->layout_ep) k3_model_set_ops(e->model, k3_tp_ops(o->layout_tp));
    }
    e->cfg = k3_model_config(e->model);
    e->vocab = e->cfg->vocab_size;
    e->chunk = k3_runmem_chunk(e->rm);
    e->eos_id = e->cfg->eos_token_id >= 0 ? e->cfg->eos_token_id : (e->tok ? tok_eos_id(e->tok) : -1);
    st_close(ix); /* the plan's source and the model hold their own references */
    free(run_cfg);
    *out = e;
    return K3_OK;
fail:
    st_close(ix);
    free(run_cfg);
    k3_engine_free(e);
    return rc;
}

void k3_engine_free(k3_engine *e) {
    if (!e) return;
    free(e->live);
    if (e->tok) tok_free(e->tok);
    k3_model_free(e->model);
    k3_ep_free(e->ep);
    if (e->ranks > 1 && !e->opts.layout_ep) k3_tp_release();
    k3_runmem_free(e->rm);
    st_close(e->ix);
    free(e->owner);
    free(e->owned);
    free(e);
}

int k3_engine_state_new(k3_engine *e, int64_t max_pos, uint64_t extra_bytes, k3_state **out, k3_err *err) {
    *out = NULL;
    if (max_pos < 1) max_pos = 1;
    k3_state_plan plan = k3_state_size(e->model, max_pos);
    uint64_t wbytes = k3_model_weight_bytes(e->model);
    uint64_t need = plan.total + wbytes;
    if (need < plan.total || need + e->states_bytes < need || need + e->states_bytes + extra_bytes < need)
        need = UINT64_MAX;
    else
        need += e->states_bytes + extra_bytes;
    const char *bname;
    uint64_t budget = k3_mem_limit(e->opts.max_memory, &bname);
    if ((budget && need > budget) || max_pos > INT_MAX - 1) {
        return k3_fail(err, K3_EXIT_BUDGET,
                       "%s: %lld positions need %s (weights %s, KDA state %s, MLA cache %s, scratch %s, other %s) "
                       "but %s is %s",
                       e->opts.model_dir, (long long)max_pos, k3_size_str(need), k3_size_str(wbytes),
                       k3_size_str(plan.kda_bytes), k3_size_str(plan.mla_bytes), k3_size_str(plan.scratch_bytes),
                       k3_size_str(e->states_bytes + extra_bytes), bname, k3_size_str(budget));
    }
    int rc = k3_state_new(e->model, (int)max_pos, out, err);
    if (rc) return rc;
    if (e->nlive == e->caplive) {
        e->caplive = e->caplive ? 2 * e->caplive : 4;
        e->live = xrealloc_array(e->live, e->caplive, sizeof *e->live);
    }
    e->live[e->nlive].s = *out;
    e->live[e->nlive++].bytes = plan.total;
    e->states_bytes += plan.total;
    return K3_OK;
}

void k3_engine_state_free(k3_engine *e, k3_state *s) {
    if (!s) return;
    for (size_t i = 0; i < e->nlive; i++)
        if (e->live[i].s == s) {
            e->states_bytes -= e->live[i].bytes;
            e->live[i] = e->live[--e->nlive];
            break;
        }
    k3_state_free(s);
}

int k3_engine_feed(k3_engine *e, k3_state *s, const int32_t *ids, size_t n, float *logits, bool all_logits,
                   bool prefill, k3_progress *progress, k3_err *err) {
    size_t V = (size_t)e->vocab;
    size_t slice = (size_t)e->chunk;
    for (size_t i = 0; i < n; i += slice) {
        size_t m = n - i < slice ? n - i : slice;
        bool last = i + m == n;
        float *out = all_logits ? logits + i * V : (last ? logits : NULL);
        int rc = k3_forward(e->model, s, ids + i, (int)m, out, all_logits, err);
        if (rc && e->ranks > 1) k3_dist_abort(err); /* the others wait in this call's exchanges */
        if (rc) return rc;
        k3_runmem_step(e->rm, prefill, (int)m, e->step_log);
        if (progress) k3_progress_update(progress, i + m);
    }
    return K3_OK;
}

int k3_engine_feed_batch_rows(k3_engine *e, k3_state *const *states, int n, const int *counts, const int32_t *ids,
                              float *logits, k3_err *err) {
    int64_t rows = 0;
    for (int q = 0; q < n; q++) rows += counts ? counts[q] : 1;
    /* a pass over streamed weights holds the experts of at most one chunk of
     * rows (one id per state: the server's slots, fewer than a chunk) */
    if (counts && rows > e->chunk)
        return k3_fail(err, K3_EXIT_USAGE, "a batch of %lld tokens exceeds the plan's chunk of %d", (long long)rows,
                       e->chunk);
    int rc = counts ? k3_forward_batch_rows(e->model, states, n, counts, ids, logits, err)
                    : k3_forward_batch(e->model, states, n, ids, logits, err);
    if (rc && e->ranks > 1) k3_dist_abort(err); /* the others wait in this call's exchanges */
    if (rc) return rc;
    k3_runmem_step(e->rm, false, (int)rows, e->step_log);
    return K3_OK;
}

int k3_engine_feed_batch(k3_engine *e, k3_state *const *states, int n, const int32_t *ids, float *logits,
                         k3_err *err) {
    return k3_engine_feed_batch_rows(e, states, n, NULL, ids, logits, err);
}

int k3_engine_recompute(k3_engine *e, k3_state *s, const int32_t *ids, size_t n, float *logits, k3_err *err) {
    k3_state_reset(s);
    size_t slice = (size_t)e->chunk;
    for (size_t i = 0; i < n; i += slice) {
        size_t m = n - i < slice ? n - i : slice;
        int rc = k3_forward(e->model, s, ids + i, (int)m, i + m == n ? logits : NULL, false, err);
        if (rc && e->ranks > 1) k3_dist_abort(err); /* the others wait in this call's exchanges */
        if (rc) return rc;
    }
    k3_runmem_step(e->rm, false, 1, e->step_log);
    return K3_OK;
}

int k3_engine_encode(const k3_engine *e, const char *what, const char *text, size_t len, bool allow_special,
                     int32_t **ids, size_t *n, k3_err *err) {
    *ids = NULL;
    *n = 0;
    if (!e->tok)
        return k3_fail(err, K3_EXIT_USAGE, "%s: no tokenizer (no tiktoken.model in %s): give --tok DIR", what,
                       e->opts.model_dir);
    int rc = tok_encode(e->tok, text, len, allow_special, ids, n, err);
    for (size_t i = 0; !rc && i < *n; i++)
        if ((*ids)[i] >= e->vocab)
            rc = k3_fail(err, K3_EXIT_USAGE, "%s: token id %d is outside the model's vocabulary [0, %d)", what,
                         (*ids)[i], e->vocab);
    if (rc) {
        free(*ids);
        *ids = NULL;
        *n = 0;
    }
    return rc;
}

int k3_engine_agree(k3_engine *e, int rc, k3_err *err, const char *what) {
    return e && e->ranks > 1 ? k3_dist_agree(rc, err, what) : rc;
}

int k3_engine_ready(k3_engine *e, int rc, k3_err *err) { return k3_engine_agree(e, rc, err, "starting the run"); }

long long k3_engine_getline(k3_engine *e, char **line, size_t *cap, FILE *f) {
    (void)e; /* k3_dist_getline is getline for one process */
    return k3_dist_getline(line, cap, f);
}

void k3_engine_silence_others(const k3_engine *e) {
    if (e->rank > 0) k3_dist_silence_others();
}

int k3_engine_fail(k3_engine *e, int rc, k3_err *err) {
    if (rc && e && e->ranks > 1) k3_dist_abort(err);
    return rc;
}

int k3_engine_identity(const k3_engine *e, uint64_t *out, k3_err *err) {
    uint64_t salt = (uint64_t)e->cfg->num_layers << 1 | (e->opts.peer_mla_eps ? 1u : 0u);
    return k3_model_identity_of(e->opts.model_dir, e->ix, e->opts.tok_dir, salt, out, err);
}

k3_model *k3_engine_model(const k3_engine *e) { return e->model; }
const k3_config *k3_engine_config(const k3_engine *e) { return e->cfg; }
k3_tokenizer *k3_engine_tokenizer(const k3_engine *e) { return e->tok; }
int k3_engine_vocab(const k3_engine *e) { return e->vocab; }
int k3_engine_chunk(const k3_engine *e) { return e->chunk; }
int k3_engine_threads(const k3_engine *e) { return e->threads; }
int k3_engine_eos_id(const k3_engine *e) { return e->eos_id; }
const char *k3_engine_model_dir(const k3_engine *e) { return e->opts.model_dir; }
const k3_engine_opts *k3_engine_options(const k3_engine *e) { return &e->opts; }
int k3_engine_rank(const k3_engine *e) { return e->rank; }
int k3_engine_ranks(const k3_engine *e) { return e->ranks; }
void k3_engine_set_step_log(k3_engine *e, FILE *f) { e->step_log = f; }

void k3_engine_print_plan(const k3_engine *e, FILE *f) { k3_runmem_print_plan(e->rm, f); }
void k3_engine_print_summary(const k3_engine *e, FILE *f) { k3_runmem_summary(e->rm, f); }
k3_runmem_reads k3_engine_decode_reads(const k3_engine *e) { return k3_runmem_decode_reads(e->rm); }
void k3_engine_report_json(const k3_engine *e, json_t *o) { k3_runmem_json(e->rm, o); }

k3_engine_mark k3_engine_mark_now(const k3_engine *e) {
    return (k3_engine_mark){.d = k3_dist_get_stats(), .trunk_disk = e && e->rm ? k3_runmem_trunk_read(e->rm) : 0};
}

json_t *k3_engine_dist_report(k3_engine *e, const char *phase, const k3_engine_mark *from_mark,
                              const k3_engine_mark *to_mark, double secs, uint64_t steps, FILE *f) {
    if (!e || e->ranks <= 1) return NULL;
    const k3_dist_stats *from = &from_mark->d;
    k3_dist_stats now = to_mark->d;
    struct { uint64_t held, exch, bytes, gath, gbytes, read, whole, disk; double wait, gwait; } mine = {0}, *all;
    const k3_config *c = e->cfg;
    for (size_t i = 0; i < (size_t)c->num_layers * (size_t)c->num_experts; i++)
        mine.held += e->owned[i] && !c->layer_dense[i / (size_t)c->num_experts];
    mine.exch = now.collectives - from->collectives;
    mine.bytes = now.bytes_sent - from->bytes_sent;
    mine.wait = now.wait_s - from->wait_s;
    mine.gath = now.split_gathers - from->split_gathers;
    mine.gbytes = now.split_bytes_sent - from->split_bytes_sent;
    mine.read = now.split_read - from->split_read;
    mine.whole = now.split_whole - from->split_whole;
    mine.gwait = now.split_wait_s - from->split_wait_s;
    mine.disk = to_mark->trunk_disk - from_mark->trunk_disk;
    all = xmalloc_array((size_t)e->ranks, sizeof *all);
    k3_dist_allgather(&mine, sizeof mine, all, "the run report");
    json_t *o = NULL;
    if (e->rank == 0) {
        double st = steps ? (double)steps : 1;
        o = json_object();
        json_t *held = json_array(), *bytes = json_array(), *share = json_array(), *wait = json_array();
        json_t *gbytes = json_array(), *gshare = json_array(), *tread = json_array(), *tdisk = json_array();
        double maxb = 0, maxs = 0, maxgb = 0, maxgs = 0, maxr = 0, minr = 1e300, maxd = 0, mind = 1e300, sumd = 0;
        uint64_t minh = UINT64_MAX, maxh = 0;
        for (int r = 0; r < e->ranks; r++) {
            if (all[r].held < minh) minh = all[r].held;
            if (all[r].held > maxh) maxh = all[r].held;
            json_array_append_new(held, json_integer((json_int_t)all[r].held));
            json_array_append_new(bytes, json_real((double)all[r].bytes / st));
            double sh = secs > 0 ? all[r].wait / secs : 0;
            json_array_append_new(share, json_real(sh));
            json_array_append_new(wait, json_real(all[r].wait));
            if ((double)all[r].bytes / st > maxb) maxb = (double)all[r].bytes / st;
            if (sh > maxs) maxs = sh;
            double gb = (double)all[r].gbytes / st, gs = secs > 0 ? all[r].gwait / secs : 0, rd = (double)all[r].read / st;
            json_array_append_new(gbytes, json_real(gb));
            json_array_append_new(gshare, json_real(gs));
            json_array_append_new(tread, json_real(rd));
            if (gb > maxgb) maxgb = gb;
            if (gs > maxgs) maxgs = gs;
            if (rd > maxr) maxr = rd;
            if (rd < minr) minr = rd;
            double dk = (double)all[r].disk / st;
            json_array_append_new(tdisk, json_real(dk));
            if (dk > maxd) maxd = dk;
            if (dk < mind) mind = dk;
            sumd += dk;
        }
        json_object_set_new(o, "phase", json_string(phase));
        json_object_set_new(o, "ranks", json_integer(e->ranks));
        json_object_set_new(o, "tokens", json_integer((json_int_t)steps));
        json_object_set_new(o, "seconds", json_real(secs));
        json_object_set_new(o, "experts_held", held);
        json_object_set_new(o, "exchanges_per_token", json_real((double)all[0].exch / st));
        json_object_set_new(o, "bytes_sent_per_token", bytes);
        json_object_set_new(o, "exchange_seconds", wait);
        json_object_set_new(o, "exchange_share", share);
        bool tp = all[0].gath > 0;
        json_object_set_new(o, "layout", json_string(e->opts.layout_ep ? "ep" : e->opts.layout_tp ? "tp" : "tp+ep"));
        /* the trunk's split products: gathers (part of the exchanges above),
         * their bytes and time, and the weight bytes their matrices read per
         * token on each rank beside what one process reads for them */
        if (!e->opts.layout_ep) {
            json_object_set_new(o, "split_gathers_per_token", json_real((double)all[0].gath / st));
            json_object_set_new(o, "split_bytes_sent_per_token", gbytes);
            json_object_set_new(o, "split_share", gshare);
            json_object_set_new(o, "trunk_bytes_read_per_token", tread);
            json_object_set_new(o, "trunk_bytes_one_process_per_token", json_real((double)all[0].whole / st));
        } else {
            json_decref(gbytes);
            json_decref(gshare);
            json_decref(tread);
        }
        bool streamed = e->opts.mem.so.trunk_dir != NULL;
        if (streamed) json_object_set_new(o, "trunk_disk_bytes_per_token", tdisk);
        else json_decref(tdisk);
        if (f && e->opts.layout_tp)
            fprintf(f,
                    "k3: split experts, %s: every rank holds its rows of %llu routed experts; per token %.1f "
                    "exchanges, up to %.1f kB sent per rank, up to %.1f%% of the time in exchanges\n",
                    phase, (unsigned long long)maxh, (double)all[0].exch / st, maxb / 1e3, 100 * maxs);
        else if (f)
            fprintf(f,
                    "k3: expert parallel, %s: %d ranks hold %llu..%llu routed experts each; per token %.1f exchanges, "
                    "up to %.1f kB sent per rank, up to %.1f%% of the time in exchanges\n",
                    phase, e->ranks, (unsigned long long)minh, (unsigned long long)maxh,
                    (double)all[0].exch / st, maxb / 1e3, 100 * maxs);
        if (f && tp)
            fprintf(f,
                    "k3: tensor parallel, %s: the %s matrices read %.2f..%.2f MB per token a rank (one process: "
                    "%.2f MB); %.1f of the exchanges are their gathers, up to %.1f kB sent per rank, up to %.1f%% of "
                    "the time\n",
                    phase, e->opts.layout_tp ? "trunk's and experts'" : "trunk's", minr / 1e6, maxr / 1e6,
                    (double)all[0].whole / st / 1e6, (double)all[0].gath / st,
                    maxgb / 1e3, 100 * maxgs);
        if (f && streamed)
            fprintf(f,
                    "k3: packed trunk, %s: each rank read %.3f..%.3f MB of streamed layers from disk per token "
                    "(%.3f MB together)\n",
                    phase, mind / 1e6, maxd / 1e6, sumd / 1e6);
    }
    free(all);
    return o;
}
