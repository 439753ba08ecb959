/* engine.c: opening a model for inference (engine.h). */
#include "engine/engine.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void k3_engine_opts_init(k3_engine_opts *o) {
    memset(o, 0, sizeof *o);
    k3_runmem_args_init(&o->mem);
}

/* "512M", "8G", "1.5T", "4096" (bytes); an optional trailing B. */
static bool parse_size(const char *s, uint64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || v < 0 || !isfinite(v)) return false;
    double mul = 1;
    if (*end) {
        switch (*end) {
        case 'k': case 'K': mul = 1024.0; break;
        case 'm': case 'M': mul = 1024.0 * 1024; break;
        case 'g': case 'G': mul = 1024.0 * 1024 * 1024; break;
        case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; break;
        default: return false;
        }
        end++;
        if (*end == 'B' || *end == 'b') end++;
        if (*end) return false;
    }
    double b = v * mul;
    if (b >= 1.8e19) return false;
    *out = (uint64_t)b;
    return true;
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
    } else if (!strcmp(f, "--max-memory")) {
        VALUE();
        if (!parse_size(v, &o->max_memory) || !o->max_memory)
            return k3_fail(err, K3_EXIT_USAGE, "%s: --max-memory: '%s' is not a size like 512M or 8G", cmd, v);
    } else {
        return k3_runmem_parse(&o->mem, argc, argv, i, used, err);
    }
#undef VALUE
    return K3_OK;
}

const char *k3_engine_size_str(uint64_t b, char *buf, size_t n) {
    const double k = 1024.0;
    if (b < 1024) snprintf(buf, n, "%llu B", (unsigned long long)b);
    else if (b < 1024 * 1024) snprintf(buf, n, "%.1f KiB", (double)b / k);
    else if (b < 1024ull * 1024 * 1024) snprintf(buf, n, "%.1f MiB", (double)b / (k * k));
    else snprintf(buf, n, "%.3f GiB", (double)b / (k * k * k));
    return buf;
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

int k3_engine_open(const k3_engine_opts *o, k3_engine **out, k3_err *err) {
    *out = NULL;
    if (!o->model_dir) return k3_fail(err, K3_EXIT_USAGE, "no MODEL_DIR given");
    k3_engine *e = xcalloc(1, sizeof *e);
    e->opts = *o;
    e->eos_id = -1;
    if (o->threads > 0) omp_set_num_threads(o->threads);
    e->threads = omp_get_max_threads();
    int64_t max_pos = o->max_pos > 0 ? o->max_pos : 1;
    /* the plan comes first: a run that cannot fit is refused before any
     * weight is read; the model then keeps only its model-level tensors and
     * the plan's source serves the layers and the routed experts */
    int rc = k3_runmem_begin(&o->mem, o->model_dir, o->layers, max_pos, o->max_memory, &e->rm, err);
    if (rc) goto fail;
    k3_model_opts mo = {.layers = o->layers, .peer_mla_eps = o->peer_mla_eps, .kda_chunk = o->kda_chunk,
                        .top_only = true, .prefill_chunk = k3_runmem_chunk(e->rm)};
    if ((rc = k3_model_open(o->model_dir, &mo, &e->model, err))) goto fail;
    if ((rc = k3_runmem_attach(e->rm, e->model, err))) goto fail;
    e->cfg = k3_model_config(e->model);
    e->vocab = e->cfg->vocab_size;
    e->chunk = k3_runmem_chunk(e->rm);
    if ((rc = load_tokenizer(e, err))) goto fail;
    e->eos_id = e->cfg->eos_token_id >= 0 ? e->cfg->eos_token_id : (e->tok ? tok_eos_id(e->tok) : -1);
    *out = e;
    return K3_OK;
fail:
    k3_engine_free(e);
    return rc;
}

void k3_engine_free(k3_engine *e) {
    if (!e) return;
    free(e->live);
    if (e->tok) tok_free(e->tok);
    k3_model_free(e->model);
    k3_runmem_free(e->rm);
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
    uint64_t budget = e->opts.max_memory ? e->opts.max_memory : k3_mem_available_bytes();
    const char *bname = e->opts.max_memory ? "--max-memory" : "MemAvailable";
    if ((budget && need > budget) || max_pos > INT_MAX - 1) {
        char s[7][32];
        return k3_fail(err, K3_EXIT_BUDGET,
                       "%s: %lld positions need %s (weights %s, KDA state %s, MLA cache %s, scratch %s, other %s) "
                       "but %s is %s",
                       e->opts.model_dir, (long long)max_pos, k3_engine_size_str(need, s[0], 32),
                       k3_engine_size_str(wbytes, s[1], 32), k3_engine_size_str(plan.kda_bytes, s[2], 32),
                       k3_engine_size_str(plan.mla_bytes, s[3], 32), k3_engine_size_str(plan.scratch_bytes, s[4], 32),
                       k3_engine_size_str(e->states_bytes + extra_bytes, s[5], 32), bname,
                       k3_engine_size_str(budget, s[6], 32));
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
        if (rc) return rc;
        k3_runmem_step(e->rm, prefill, (int)m, e->step_log);
        if (progress) k3_progress_update(progress, i + m);
    }
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
