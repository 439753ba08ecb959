/* export.c: a trained model -> a model directory `k3 run` loads (export.h).
 *
 * The training parameters already carry the released names and shapes
 * (train.c), so export is a dtype decision per tensor plus the MXFP4 encoder:
 *  - routed experts (block_sparse_moe.experts.E.w{1,2,3}.weight): MXFP4 as
 *    NAME.weight_packed + NAME.weight_scale, or a float NAME.weight;
 *  - other matrices (rank 2): BF16 or F32 as asked;
 *  - vectors and ShortConv taps (norm gains, A_log, dt_bias, conv, router
 *    biases): always F32, as the released checkpoint keeps its small fp32
 *    parameters (and they are a rounding error in size). */
#include "formats/names.h"
#include "train/export.h"
#include "formats/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>

#include "model/model.h"
#include "tokenizer/tokenizer.h"
#include "train/data.h"
#include "train/tops.h"

/* ---- MXFP4 ------------------------------------------------------------------------------ */

static const float E2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

/* Round to nearest: the boundaries are the midpoints between neighbouring E2M1
 * values; at a midpoint the even code wins (its mantissa bit is 0), as IEEE
 * round-to-nearest-even does. */
uint8_t mxfp4_code(float v) {
    float a = fabsf(v);
    uint8_t c;
    if (a <= 0.25f) c = 0;
    else if (a < 0.75f) c = 1;
    else if (a <= 1.25f) c = 2;
    else if (a < 1.75f) c = 3;
    else if (a <= 2.5f) c = 4;
    else if (a < 3.5f) c = 5;
    else if (a <= 5.0f) c = 6;
    else c = 7;
    return (uint8_t)(c && v < 0 ? c | 8 : c);
}

static float code_value(uint8_t c) { return (c & 8) ? -E2M1[c & 7] : E2M1[c & 7]; }

uint8_t mxfp4_quantize_group(const float *x, uint8_t *codes) {
    float amax = 0;
    for (int i = 0; i < MXFP4_GROUP; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (!(amax > 0)) {
        memset(codes, 0, MXFP4_GROUP);
        return 127;
    }
    int ex;
    frexpf(amax, &ex);            /* amax = m 2^ex, m in [0.5, 1): floor(log2 amax) = ex - 1 */
    const int e0 = ex - 1 - 2;    /* puts amax in [4, 8): the top of E2M1's range */
    double best = INFINITY;
    int best_e = e0;
    for (int e = e0 - 1; e <= e0 + 1; e++) {
        if (e < -127 || e > 127) continue;
        double sse = 0;
        for (int i = 0; i < MXFP4_GROUP; i++) {
            double q = (double)code_value(mxfp4_code(ldexpf(x[i], -e))) * ldexp(1.0, e);
            double d = (double)x[i] - q;
            sse += d * d;
        }
        if (sse < best) {
            best = sse;
            best_e = e;
        }
    }
    for (int i = 0; i < MXFP4_GROUP; i++) codes[i] = mxfp4_code(ldexpf(x[i], -best_e));
    return (uint8_t)(best_e + 127);
}

void mxfp4_quantize(const float *w, int rows, int cols, uint8_t *packed, uint8_t *scales) {
    const int G = cols / MXFP4_GROUP;
    uint8_t codes[MXFP4_GROUP];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < G; g++) {
            const float *x = w + (size_t)r * cols + (size_t)g * MXFP4_GROUP;
            scales[(size_t)r * G + g] = mxfp4_quantize_group(x, codes);
            uint8_t *p = packed + (size_t)r * (cols / 2) + (size_t)g * (MXFP4_GROUP / 2);
            for (int j = 0; j < MXFP4_GROUP / 2; j++) p[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
        }
}

/* ---- the safetensors writer ------------------------------------------------------------- */

typedef struct {
    char *name;
    const char *dtype;     /* "F32", "BF16", "U8" */
    int rank;
    int64_t shape[3];
    void *data;            /* owned */
    size_t bytes;
} tex_tensor;

typedef struct {
    tex_tensor *t;
    size_t n, cap;
} tex_list;

static void add(tex_list *l, const char *name, const char *dtype, int rank, const int64_t *shape, void *data,
                size_t bytes) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 256;
        l->t = xrealloc_array(l->t, l->cap, sizeof *l->t);
    }
    tex_tensor *t = &l->t[l->n++];
    t->name = xstrdup(name);
    t->dtype = dtype;
    t->rank = rank;
    for (int i = 0; i < 3; i++) t->shape[i] = i < rank ? shape[i] : 0;
    t->data = data;
    t->bytes = bytes;
}

static void add_f32(tex_list *l, const char *name, int rank, const int64_t *shape, const float *x, size_t n) {
    float *d = xmalloc_array(n ? n : 1, sizeof(float));
    memcpy(d, x, n * sizeof(float));
    add(l, name, "F32", rank, shape, d, n * sizeof(float));
}

static void add_bf16(tex_list *l, const char *name, int rank, const int64_t *shape, const float *x, size_t n) {
    uint16_t *d = xmalloc_array(n ? n : 1, sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) d[i] = k3_f32_to_bf16(x[i]);
    add(l, name, "BF16", rank, shape, d, n * sizeof(uint16_t));
}

static void list_free(tex_list *l) {
    for (size_t i = 0; i < l->n; i++) {
        free(l->t[i].name);
        free(l->t[i].data);
    }
    free(l->t);
    memset(l, 0, sizeof *l);
}

/* Data in the order F32, BF16, U8: each tensor then starts at a multiple of
 * its element size, so the engine can use the mapped bytes in place. */
static int write_safetensors(const char *path, tex_list *l, int64_t step, k3_err *err) {
    static const char *const order[] = {"F32", "BF16", "U8"};
    size_t *seq = xmalloc_array(l->n ? l->n : 1, sizeof(size_t)), ns = 0;
    for (int k = 0; k < 3; k++)
        for (size_t i = 0; i < l->n; i++)
            if (!strcmp(l->t[i].dtype, order[k])) seq[ns++] = i;
    char stepbuf[32];
    const char *md[6] = {"format", "pt", "producer", "k3 export", "step", stepbuf};
    if (step >= 0) snprintf(stepbuf, sizeof stepbuf, "%lld", (long long)step);
    st_out_tensor *out = xcalloc(ns ? ns : 1, sizeof *out);
    for (size_t s = 0; s < ns; s++) {
        const tex_tensor *t = &l->t[seq[s]];
        st_dtype d = !strcmp(t->dtype, "F32") ? ST_F32 : !strcmp(t->dtype, "BF16") ? ST_BF16 : ST_U8;
        out[s] = (st_out_tensor){.name = t->name, .dtype = d, .rank = t->rank, .data = t->data, .nbytes = t->bytes};
        for (int r = 0; r < t->rank; r++) out[s].shape[r] = t->shape[r];
    }
    int rc = st_write(path, md, step >= 0 ? 3 : 2, out, ns, err);
    free(out);
    free(seq);
    return rc;
}

/* ---- config.json ------------------------------------------------------------------------ */

/* The released checkpoint's quantization_config (spec section 2), group 32. */
static json_t *quant_config(void) {
    json_t *w = json_object();
    json_object_set_new(w, "actorder", json_null());
    json_object_set_new(w, "block_structure", json_null());
    json_object_set_new(w, "dynamic", json_false());
    json_object_set_new(w, "group_size", json_integer(MXFP4_GROUP));
    json_object_set_new(w, "num_bits", json_integer(4));
    json_object_set_new(w, "observer", json_string("minmax"));
    json_object_set_new(w, "observer_kwargs", json_object());
    json_object_set_new(w, "scale_dtype", json_string("torch.uint8"));
    json_object_set_new(w, "strategy", json_string("group"));
    json_object_set_new(w, "symmetric", json_true());
    json_object_set_new(w, "type", json_string("float"));
    json_object_set_new(w, "zp_dtype", json_null());
    json_t *g0 = json_object();
    json_object_set_new(g0, "format", json_string("mxfp4-pack-quantized"));
    json_object_set_new(g0, "input_activations", json_null());
    json_object_set_new(g0, "output_activations", json_null());
    json_t *targets = json_array();
    json_array_append_new(targets, json_string("Linear"));
    json_object_set_new(g0, "targets", targets);
    json_object_set_new(g0, "weights", w);
    json_t *groups = json_object();
    json_object_set_new(groups, "group_0", g0);
    json_t *q = json_object();
    json_object_set_new(q, "config_groups", groups);
    json_object_set_new(q, "format", json_string("mxfp4-pack-quantized"));
    json_object_set_new(q, "global_compression_ratio", json_null());
    json_t *ign = json_array();
    const char *pats[] = {"re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                          "re:.*lm_head.*", "re:.*routed_expert_(down|up)_proj.*", "re:.*block_sparse_moe\\.gate.*"};
    for (size_t i = 0; i < sizeof pats / sizeof pats[0]; i++) json_array_append_new(ign, json_string(pats[i]));
    json_object_set_new(q, "ignore", ign);
    json_object_set_new(q, "kv_cache_scheme", json_null());
    json_object_set_new(q, "quant_method", json_string("compressed-tensors"));
    json_object_set_new(q, "quantization_status", json_string("compressed"));
    return q;
}

static int write_config(const char *path, const char *config_json, const texport_opts *o, int bos, int eos,
                        k3_err *err) {
    json_error_t je;
    json_t *root = json_loads(config_json, JSON_REJECT_DUPLICATES, &je);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return k3_fail(err, K3_EXIT_DATA, "%s: the model config is not a JSON object", path);
    }
    json_t *tc = json_object_get(root, "text_config");
    json_t *where = json_is_object(tc) ? tc : root;
    json_object_del(root, "quantization_config");
    json_object_del(where, "quantization_config");
    if (o->experts == TEX_MXFP4) json_object_set_new(where, "quantization_config", quant_config());
    json_object_set_new(root, "dtype", json_string(o->dtype == TEX_BF16 ? "bfloat16" : "float32"));
    if (bos >= 0) json_object_set_new(root, "bos_token_id", json_integer(bos));
    if (eos >= 0) json_object_set_new(root, "eos_token_id", json_integer(eos));
    if (where != root) { /* one spelling only: the root's ids (config.c refuses two different values) */
        json_object_del(where, "bos_token_id");
        json_object_del(where, "eos_token_id");
    }
    char *text = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9));
    json_decref(root);
    if (!text) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot serialise the config", path);
    size_t n = strlen(text);
    text = xrealloc(text, n + 2);
    text[n] = '\n';
    int rc = k3_write_file_atomic(path, text, n + 1, err);
    free(text);
    return rc;
}

/* ---- export ----------------------------------------------------------------------------- */

static bool is_routed_expert(const char *name) {
    const char *s = strstr(name, "." K3N_EXPERTS);
    size_t n = strlen(name);
    return s && n > 7 && !strcmp(name + n - 7, ".weight");
}

static int copy_file(const char *from, const char *to, bool optional, k3_err *err) {
    char *data;
    size_t len;
    struct stat st;
    if (optional && stat(from, &st) != 0 && errno == ENOENT) return K3_OK;
    int rc = k3_read_file(from, &data, &len, err);
    if (rc) return rc;
    rc = k3_write_file_atomic(to, data, len, err);
    free(data);
    return rc;
}

/* from_dir/name copied to to_dir/name (the tokenizer files beside the weights) */
static int copy_named(const char *from_dir, const char *to_dir, const char *name, bool optional, k3_err *err) {
    char *from = k3_path_join(from_dir, name), *to = k3_path_join(to_dir, name);
    int rc = copy_file(from, to, optional, err);
    free(from);
    free(to);
    return rc;
}

int texport_write(const tmodel *m, const char *config_json, const char *out_dir, const texport_opts *o,
                  k3_err *err) {
    const k3_config *c = &m->cfg;
    if (o->experts == TEX_MXFP4 && c->num_experts > 0 && (c->latent_dim % MXFP4_GROUP || c->moe_inter % MXFP4_GROUP))
        return k3_fail(err, K3_EXIT_USAGE,
                       "%s: MXFP4 experts need routed_expert_hidden_size (%d) and moe_intermediate_size (%d) "
                       "divisible by %d (use --experts bf16)",
                       out_dir, c->latent_dim, c->moe_inter, MXFP4_GROUP);
    /* the tokenizer first: a bad one stops the export before anything is written */
    k3_tokenizer *tok = NULL;
    int bos = -1, eos = -1, rc;
    if (o->tok_dir) {
        if ((rc = tok_load(o->tok_dir, &tok, err))) return rc;
        int tv = tok_vocab_size(tok);
        eos = tok_eos_id(tok);
        bos = tok_bos_id(tok);
        if (eos < 0) eos = tok_special_id(tok, "<|endoftext|>");
        tok_free(tok);
        if (tv != c->vocab_size)
            return k3_fail(err, K3_EXIT_USAGE, "%s: tokenizer has %d ids but the model's vocab_size is %d", o->tok_dir,
                           tv, c->vocab_size);
    }
    int mrc = k3_mkdir_p(out_dir, err);
    if (mrc) return mrc;

    /* the engine reads every *.safetensors of a directory (and an index): a
     * stale shard from another model would be loaded beside ours */
    DIR *d = opendir(out_dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        bool shard = n > 12 && !strcmp(e->d_name + n - 12, ".safetensors") && strcmp(e->d_name, "model.safetensors");
        if (shard || !strcmp(e->d_name, "model.safetensors.index.json")) {
            int rc2 = k3_fail(err, K3_EXIT_USAGE, "%s: holds %s from another model (export into an empty directory)",
                              out_dir, e->d_name);
            closedir(d);
            return rc2;
        }
    }
    if (d) closedir(d);
    tex_list l = {0};
    for (int i = 0; i < m->np; i++) {
        const tparam *p = &m->params[i];
        const float *x = m->w + p->off;
        int64_t sh[3] = {p->shape[0], p->shape[1], p->shape[2]};
        if (p->rank == 2 && is_routed_expert(p->name)) {
            if (o->experts == TEX_MXFP4) {
                const int rows = p->shape[0], cols = p->shape[1];
                size_t pb = (size_t)rows * (size_t)(cols / 2), sb = (size_t)rows * (size_t)(cols / MXFP4_GROUP);
                uint8_t *packed = xmalloc(pb), *scales = xmalloc(sb);
                mxfp4_quantize(x, rows, cols, packed, scales);
                char base[160], nm[192];
                size_t bl = strlen(p->name) - 7; /* drop ".weight" */
                memcpy(base, p->name, bl);
                base[bl] = 0;
                int64_t ps[2] = {rows, cols / 2}, ss[2] = {rows, cols / MXFP4_GROUP};
                snprintf(nm, sizeof nm, "%s" K3N_PACKED, base);
                add(&l, nm, "U8", 2, ps, packed, pb);
                snprintf(nm, sizeof nm, "%s" K3N_SCALE, base);
                add(&l, nm, "U8", 2, ss, scales, sb);
            } else if (o->experts == TEX_BF16) add_bf16(&l, p->name, 2, sh, x, p->numel);
            else add_f32(&l, p->name, 2, sh, x, p->numel);
        } else if (p->rank == 2 && o->dtype == TEX_BF16) add_bf16(&l, p->name, 2, sh, x, p->numel);
        else add_f32(&l, p->name, p->rank, sh, x, p->numel);
    }
    for (int q = 0; q < m->n_moe; q++) {
        char name[160];
        tm_bias_name(m->moe_layer[q], name, sizeof name);
        int64_t sh[1] = {c->num_experts};
        add_f32(&l, name, 1, sh, m->bias + (size_t)q * c->num_experts, (size_t)c->num_experts);
    }
    char *path = k3_path_join(out_dir, "model.safetensors");
    rc = write_safetensors(path, &l, o->step, err);
    free(path);
    list_free(&l);
    if (!rc && o->tok_dir) {
        rc = copy_named(o->tok_dir, out_dir, "tiktoken.model", false, err);
        if (!rc) rc = copy_named(o->tok_dir, out_dir, "tokenizer_config.json", true, err);
    }
    if (rc) return rc;
    path = k3_path_join(out_dir, "config.json");
    rc = write_config(path, config_json, o, bos, eos, err);
    free(path);
    return rc;
}

/* ---- validation loss: training forward vs the engine ------------------------------------ */

int texport_evaluate(tmodel *m, const char *model_dir, const char *data_dir, int T, int64_t max_tokens,
                     texport_eval *ev, k3_err *err) {
    memset(ev, 0, sizeof *ev);
    const int V = m->cfg.vocab_size;
    k3_tokenizer *tok = NULL;
    k3_shard sh;
    int rc = tok_load(data_dir, &tok, err);
    if (rc) return rc;
    if ((rc = data_open_split(data_dir, "val", (uint32_t)V, &sh, err))) {
        tok_free(tok);
        return rc;
    }
    int64_t W = (int64_t)((sh.info.n_tokens - 1) / (uint64_t)T);
    if (max_tokens / T < W) W = max_tokens / T;
    if (W < 1) {
        shard_close(&sh);
        tok_free(tok);
        return k3_fail(err, K3_EXIT_USAGE, "%s/val.bin: fewer than %d tokens (one window)", data_dir, T + 1);
    }
    k3_model *km = NULL;
    k3_state *st = NULL;
    if ((rc = k3_model_open(model_dir, NULL, &km, err)) || (rc = k3_state_new(km, T, &st, err))) {
        if (km) k3_model_free(km);
        shard_close(&sh);
        tok_free(tok);
        return rc;
    }
    const int nbase = tok_n_base(tok);
    int32_t *ids = xmalloc_array((size_t)T + 1, sizeof(int32_t));
    int *tg = xmalloc_array((size_t)T, sizeof(int));
    float *logits = xmalloc_array((size_t)T * (size_t)V, sizeof(float));
    tmodel view;
    tm_view(&view, m);
    double lt = 0, le = 0;
    k3_progress pr;
    k3_progress_start(&pr, "validation", (uint64_t)W, false);
    for (int64_t w = 0; w < W && !rc; w++) {
        shard_read(&sh, (uint64_t)w * (uint64_t)T, (size_t)T + 1, ids);
        for (int t = 0; t < T; t++) {
            tg[t] = ids[t + 1];
            size_t len = 0;
            if (ids[t + 1] < nbase && tok_token_bytes(tok, ids[t + 1], &len)) ev->bytes += (int64_t)len;
        }
        double s;
        tm_forward(&view, ids, 1, T);
        t_cross_entropy(view.logits, tg, T, V, &s, NULL, 0.0f);
        lt += s;
        k3_state_reset(st);
        if ((rc = k3_forward(km, st, ids, T, logits, true, err))) break;
        t_cross_entropy(logits, tg, T, V, &s, NULL, 0.0f);
        le += s;
        ev->tokens += T;
        k3_progress_update(&pr, (uint64_t)w + 1);
    }
    k3_progress_finish(&pr);
    tm_view_free(&view);
    free(logits);
    free(tg);
    free(ids);
    k3_state_free(st);
    k3_model_free(km);
    shard_close(&sh);
    tok_free(tok);
    if (rc) return rc;
    ev->train_loss = lt / (double)ev->tokens;
    ev->engine_loss = le / (double)ev->tokens;
    double b = ev->bytes ? (double)ev->bytes * log(2.0) : NAN;
    ev->train_bpb = lt / b;
    ev->engine_bpb = le / b;
    return K3_OK;
}
