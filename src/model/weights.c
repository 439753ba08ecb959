/* weights.c: binds checkpoint tensors to the model's weight structs.
 *
 * Two sources feed the same binder:
 *  - a model directory in the released layout (spec section 3): every tensor
 *    under "language_model.model." and the head at "language_model.lm_head.weight"
 *    (a plain "model." / "lm_head.weight" spelling is accepted too);
 *  - the peer oracle's flat f32 blob (tiny_k3.json + tiny_k3.bin), whose names
 *    are the reference module's with '.' -> '_'.
 * The binder asks for tensors by their relative released name and checks every
 * shape and dtype against the config, so a missing tensor, a wrong shape or a
 * wrong dtype is one line naming the tensor (K3_EXIT_DATA).
 *
 * Memory: BF16 and F32 matrices are used in place (mmap of the shard, or the
 * blob) when suitably aligned, copied otherwise; F16 matrices are widened to
 * F32 (exact; the kernels have no F16 path). Small vectors (norm gains, biases,
 * conv taps, A_log) are always widened to f32 copies. MXFP4 experts stay packed. */
#include "formats/names.h"
#include "model/model_impl.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

/* ---- ownership ----------------------------------------------------------- */

void *k3_own(k3_owned *o, void *p, uint64_t bytes) {
    if (o->n == o->cap) {
        o->cap = o->cap ? 2 * o->cap : 64;
        o->ptrs = xrealloc_array(o->ptrs, o->cap, sizeof *o->ptrs);
    }
    o->ptrs[o->n++] = p;
    o->bytes += bytes;
    return p;
}

void k3_owned_free(k3_owned *o) {
    for (size_t i = 0; i < o->n; i++) free(o->ptrs[i]);
    free(o->ptrs);
    memset(o, 0, sizeof *o);
}

/* ---- the binder ------------------------------------------------------------ */

typedef struct {
    const k3_config *cfg;
    int L;
    k3_lookup_fn fn;
    void *ctx;
    k3_owned *owned;
    uint64_t mapped;   /* bytes used in place */
    k3_err *err;
    bool no_experts;   /* k3_bind_layer_no_experts: leave the routed experts out */
} binder;

static const char *dtname(k3_tdtype d) {
    switch (d) {
    case KT_F32: return "F32";
    case KT_F16: return "F16";
    case KT_BF16: return "BF16";
    case KT_U8: return "U8";
    }
    return "?";
}

static void shape_str(const k3_tensor *t, char *buf, size_t n) {
    size_t k = 0;
    buf[0] = 0;
    k += (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < t->rank && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

/* Looks a tensor up; absent -> K3_EXIT_DATA "missing tensor" unless optional
 * (then returns 1). */
static int find(binder *b, const char *name, k3_tensor *t, bool optional) {
    memset(t, 0, sizeof *t);
    t->where = name;
    int rc = b->fn(b->ctx, b->L, name, t, b->err);
    if (rc == 1) {
        if (optional) return 1;
        return k3_fail(b->err, K3_EXIT_DATA, "missing tensor %s", t->where ? t->where : name);
    }
    return rc;
}

/* Checks that t has exactly the shape dims[0..rank). */
static int check_shape(binder *b, const k3_tensor *t, int rank, const int64_t *dims) {
    bool ok = t->rank == rank;
    for (int i = 0; ok && i < rank; i++) ok = t->shape[i] == dims[i];
    if (ok) return K3_OK;
    char got[128], want[128];
    k3_tensor w = {.rank = rank};
    for (int i = 0; i < rank; i++) w.shape[i] = dims[i];
    shape_str(t, got, sizeof got);
    shape_str(&w, want, sizeof want);
    return k3_fail(b->err, K3_EXIT_DATA, "%s: shape %s, expected %s", t->where, got, want);
}

static int not_float(binder *b, const k3_tensor *t) {
    return k3_fail(b->err, K3_EXIT_DATA, "%s: dtype %s, expected BF16, F16 or F32", t->where,
                   dtname(t->dtype));
}

/* A float matrix [rows][cols] as a k3_mat: BF16/F32 in place when aligned. */
static int bind_mat(binder *b, const char *name, int64_t rows, int64_t cols, k3_mat *m) {
    k3_tensor t;
    int rc = find(b, name, &t, false);
    if (rc) return rc;
    int64_t dims[2] = {rows, cols};
    if ((rc = check_shape(b, &t, 2, dims))) return rc;
    size_t n = (size_t)rows * (size_t)cols;
    memset(m, 0, sizeof *m);
    m->rows = (int)rows;
    m->cols = (int)cols;
    switch (t.dtype) {
    case KT_F32:
        m->type = KW_F32;
        if ((uintptr_t)t.data % 4 == 0) {
            m->data = t.data;
            b->mapped += n * 4;
        } else {
            float *c = k3_own(b->owned, xmalloc_array(n, 4), n * 4);
            memcpy(c, t.data, n * 4);
            m->data = c;
        }
        return K3_OK;
    case KT_BF16:
        m->type = KW_BF16;
        if ((uintptr_t)t.data % 2 == 0) {
            m->data = t.data;
            b->mapped += n * 2;
        } else {
            uint16_t *c = k3_own(b->owned, xmalloc_array(n, 2), n * 2);
            memcpy(c, t.data, n * 2);
            m->data = c;
        }
        return K3_OK;
    case KT_F16: {
        /* exact widening: the kernels have no F16 path */
        float *c = k3_own(b->owned, xmalloc_array(n, 4), n * 4);
        const uint8_t *p = t.data;
        for (size_t i = 0; i < n; i++) c[i] = k3_f16_to_f32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
        m->type = KW_F32;
        m->data = c;
        return K3_OK;
    }
    case KT_U8: break;
    }
    return not_float(b, &t);
}

/* Widens any float tensor's first n elements into a new f32 array. */
static float *widen(binder *b, const k3_tensor *t, size_t n) {
    float *c = k3_own(b->owned, xmalloc_array(n, 4), n * 4);
    const uint8_t *p = t->data;
    for (size_t i = 0; i < n; i++) {
        if (t->dtype == KT_F32) memcpy(&c[i], p + 4 * i, 4);
        else {
            uint16_t h = (uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
            c[i] = t->dtype == KT_BF16 ? k3_bf16_to_f32(h) : k3_f16_to_f32(h);
        }
    }
    return c;
}

/* A small float tensor of exact shape dims, widened to f32. */
static int bind_vec_shape(binder *b, const char *name, int rank, const int64_t *dims, float **out) {
    k3_tensor t;
    int rc = find(b, name, &t, false);
    if (rc) return rc;
    if ((rc = check_shape(b, &t, rank, dims))) return rc;
    if (t.dtype == KT_U8) return not_float(b, &t);
    size_t n = 1;
    for (int i = 0; i < rank; i++) n *= (size_t)dims[i];
    *out = widen(b, &t, n);
    return K3_OK;
}

static int bind_vec(binder *b, const char *name, int64_t n, float **out) {
    return bind_vec_shape(b, name, 1, &n, out);
}

/* An AttnRes pseudo-query [1][E] with its key-norm gain [E] folded in:
 * <gamma*v/rms, w> = <v, gamma*w>/rms (spec section 7). */
static int bind_res_query(binder *b, const char *norm, const char *proj, int64_t E, float **out) {
    float *g = NULL, *w = NULL;
    int64_t dims[2] = {1, E};
    int rc = bind_vec(b, norm, E, &g);
    if (!rc) rc = bind_vec_shape(b, proj, 2, dims, &w);
    if (rc) return rc;
    for (int64_t i = 0; i < E; i++) w[i] *= g[i];
    *out = w;
    return K3_OK;
}

/* ShortConv taps: [P][1][K] as stored (a [P][K] spelling is accepted too). */
static int bind_conv(binder *b, const char *name, int64_t P, int64_t K, float **out) {
    k3_tensor t;
    int rc = find(b, name, &t, false);
    if (rc) return rc;
    int64_t d3[3] = {P, 1, K}, d2[2] = {P, K};
    if (t.rank == 2) rc = check_shape(b, &t, 2, d2);
    else rc = check_shape(b, &t, 3, d3);
    if (rc) return rc;
    if (t.dtype == KT_U8) return not_float(b, &t);
    *out = widen(b, &t, (size_t)(P * K));
    return K3_OK;
}

/* One routed expert matrix [rows][cols]: MXFP4 (NAME.weight_packed U8
 * [rows][cols/2] + NAME.weight_scale U8 [rows][cols/group]) or a plain float
 * NAME.weight. The packed form is decided per tensor from the names present. */
static int bind_expert_mat(binder *b, const char *base, int64_t rows, int64_t cols, k3_mat *m) {
    char pn[256], sn[256];
    int k1 = snprintf(pn, sizeof pn, "%s" K3N_PACKED, base);
    int k2 = snprintf(sn, sizeof sn, "%s" K3N_SCALE, base);
    if (k1 < 0 || k2 < 0 || (size_t)k1 >= sizeof pn || (size_t)k2 >= sizeof sn)
        return k3_fail(b->err, K3_EXIT_RUNTIME, "%s: name too long", base);
    k3_tensor tp, ts;
    int rc = find(b, pn, &tp, true);
    if (rc == 1) { /* unquantised expert */
        char wn[256];
        int k3 = snprintf(wn, sizeof wn, "%s" K3N_WEIGHT, base);
        if (k3 < 0 || (size_t)k3 >= sizeof wn) return k3_fail(b->err, K3_EXIT_RUNTIME, "%s: name too long", base);
        k3_tensor tw;
        rc = find(b, wn, &tw, true);
        if (rc == 1) /* name the form the released checkpoint uses */
            return k3_fail(b->err, K3_EXIT_DATA, "missing tensor %s", tp.where ? tp.where : pn);
        if (rc) return rc;
        return bind_mat(b, wn, rows, cols, m);
    }
    if (rc) return rc;
    if ((rc = find(b, sn, &ts, false))) return rc;
    int group = b->cfg->mxfp4_group > 0 ? b->cfg->mxfp4_group : 32;
    if (cols % 2 || cols % group)
        return k3_fail(b->err, K3_EXIT_DATA, "%s: %lld inputs is not a multiple of the MXFP4 group %d",
                       tp.where, (long long)cols, group);
    int64_t dp[2] = {rows, cols / 2}, ds[2] = {rows, cols / group};
    if (tp.dtype != KT_U8)
        return k3_fail(b->err, K3_EXIT_DATA, "%s: dtype %s, expected U8", tp.where, dtname(tp.dtype));
    if (ts.dtype != KT_U8)
        return k3_fail(b->err, K3_EXIT_DATA, "%s: dtype %s, expected U8", ts.where, dtname(ts.dtype));
    if ((rc = check_shape(b, &tp, 2, dp)) || (rc = check_shape(b, &ts, 2, ds))) return rc;
    memset(m, 0, sizeof *m);
    m->type = KW_MXFP4;
    m->rows = (int)rows;
    m->cols = (int)cols;
    m->data = tp.data;
    m->scales = ts.data;
    m->group = group;
    b->mapped += (uint64_t)(rows * cols / 2 + rows * cols / group);
    return K3_OK;
}

static int bind_mlp(binder *b, const char *pre, int64_t E, int64_t I, k3_mlp_w *w) {
    char g[160], u[160], d[160];
    snprintf(g, sizeof g, "%s" K3N_GATE_PROJ, pre);
    snprintf(u, sizeof u, "%s" K3N_UP_PROJ, pre);
    snprintf(d, sizeof d, "%s" K3N_DOWN_PROJ, pre);
    int rc = bind_mat(b, g, I, E, &w->gate);
    if (!rc) rc = bind_mat(b, u, I, E, &w->up);
    if (!rc) rc = bind_mat(b, d, E, I, &w->down);
    return rc;
}

static int bind_kda(binder *b, k3_kda_w *w) {
    const k3_config *c = b->cfg;
    int64_t E = c->hidden_size, H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
    int rc;
    if ((rc = bind_mat(b, K3N_Q_PROJ, P, E, &w->q)) ||
        (rc = bind_mat(b, K3N_K_PROJ, P, E, &w->k)) ||
        (rc = bind_mat(b, K3N_V_PROJ, P, E, &w->v)) ||
        (rc = bind_conv(b, K3N_Q_CONV, P, K, &w->conv[0])) ||
        (rc = bind_conv(b, K3N_K_CONV, P, K, &w->conv[1])) ||
        (rc = bind_conv(b, K3N_V_CONV, P, K, &w->conv[2])) ||
        (rc = bind_mat(b, K3N_F_A, D, E, &w->f_a)) ||
        (rc = bind_mat(b, K3N_F_B, P, D, &w->f_b)) ||
        (rc = bind_vec(b, K3N_DT_BIAS, P, &w->dt_bias)) ||
        (rc = bind_mat(b, K3N_B_PROJ, H, E, &w->b)) ||
        (rc = bind_mat(b, K3N_G_PROJ, P, E, &w->g)) ||
        (rc = bind_vec(b, K3N_O_NORM, D, &w->o_norm)) ||
        (rc = bind_mat(b, K3N_O_PROJ, E, P, &w->o)))
        return rc;
    /* A_log is per head; the release stores D_k values with a zero tail, the
     * reference declares H_k (spec section 3.3): accept any length >= H. */
    k3_tensor t;
    if ((rc = find(b, K3N_A_LOG, &t, false))) return rc;
    if (t.dtype == KT_U8) return not_float(b, &t);
    if (t.rank != 1 || t.shape[0] < H)
        return k3_fail(b->err, K3_EXIT_DATA, "%s: expected a vector of at least %lld values (one per KDA head)",
                       t.where, (long long)H);
    w->A_log = widen(b, &t, (size_t)H);
    return K3_OK;
}

static int bind_mla(binder *b, k3_mla_w *w) {
    const k3_config *c = b->cfg;
    int64_t E = c->hidden_size, H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim,
            dv = c->v_head_dim, rq = c->q_lora_rank, rkv = c->kv_lora_rank;
    int rc;
    memset(w, 0, sizeof *w);
    if (rq > 0) {
        if ((rc = bind_mat(b, K3N_Q_A, rq, E, &w->q_a)) ||
            (rc = bind_vec(b, K3N_Q_A_NORM, rq, &w->q_a_norm)) ||
            (rc = bind_mat(b, K3N_Q_B, H * (dn + dr), rq, &w->q_b)))
            return rc;
    } else if ((rc = bind_mat(b, K3N_Q_PROJ, H * (dn + dr), E, &w->q_b))) {
        return rc;
    }
    if ((rc = bind_mat(b, K3N_KV_A, rkv + dr, E, &w->kv_a)) ||
        (rc = bind_vec(b, K3N_KV_A_NORM, rkv, &w->kv_a_norm)) ||
        (rc = bind_mat(b, K3N_KV_B, H * (dn + dv), rkv, &w->kv_b)) ||
        (rc = bind_mat(b, K3N_O_PROJ, E, H * dv, &w->o)))
        return rc;
    if (c->mla_output_gate && (rc = bind_mat(b, K3N_G_PROJ, H * dv, E, &w->g))) return rc;
    return K3_OK;
}

static int bind_moe(binder *b, k3_moe_w *w) {
    const k3_config *c = b->cfg;
    int64_t E = c->hidden_size, N = c->num_experts, l = c->latent_dim, I = c->moe_inter,
            S = (int64_t)c->num_shared_experts * I;
    int rc;
    memset(w, 0, sizeof *w);
    if ((rc = bind_mat(b, K3N_ROUTER, N, E, &w->router)) ||
        (rc = bind_vec(b, K3N_ROUTER_BIAS, N, &w->router_bias)) ||
        (rc = bind_mat(b, K3N_LAT_DOWN, l, E, &w->down)) ||
        (rc = bind_mat(b, K3N_LAT_UP, E, l, &w->up)))
        return rc;
    if (c->latent_moe_use_norm &&
        (rc = bind_vec(b, K3N_LAT_NORM, l, &w->norm)))
        return rc;
    if (S > 0 && (rc = bind_mlp(b, K3N_SHARED, E, S, &w->shared))) return rc;
    if (b->no_experts) return K3_OK; /* a weight source serves them (experts_get) */
    w->experts = k3_own(b->owned, xcalloc((size_t)N, sizeof *w->experts), (uint64_t)N * sizeof *w->experts);
    for (int64_t e = 0; e < N; e++) {
        char base[3][96];
        for (int j = 0; j < 3; j++)
            snprintf(base[j], sizeof base[j], K3N_EXPERT_FMT, (int)e, j + 1);
        k3_expert_w *x = &w->experts[e];
        if ((rc = bind_expert_mat(b, base[0], I, l, &x->w1)) ||
            (rc = bind_expert_mat(b, base[2], I, l, &x->w3)) ||
            (rc = bind_expert_mat(b, base[1], l, I, &x->w2)))
            return rc;
    }
    return K3_OK;
}

static int bind_layer(binder *b, k3_layer_w *w) {
    const k3_config *cfg = b->cfg;
    int L = b->L;
    int64_t E = cfg->hidden_size;
    int rc;
    memset(w, 0, sizeof *w);
    w->kind = cfg->layer_kind[L];
    w->dense = cfg->layer_dense[L];
    if ((rc = bind_vec(b, K3N_IN_NORM, E, &w->input_norm)) ||
        (rc = bind_vec(b, K3N_POST_NORM, E, &w->post_norm)) ||
        (rc = bind_res_query(b, K3N_ATTN_RES_NORM, K3N_ATTN_RES_PROJ, E,
                             &w->attn_res_q)) ||
        (rc = bind_res_query(b, K3N_MLP_RES_NORM, K3N_MLP_RES_PROJ, E, &w->mlp_res_q)))
        return rc;
    rc = w->kind == 'K' ? bind_kda(b, &w->kda) : bind_mla(b, &w->mla);
    if (rc) return rc;
    if (w->dense) rc = bind_mlp(b, K3N_MLP, E, cfg->dense_inter, &w->mlp);
    else rc = bind_moe(b, &w->moe);
    return rc;
}

int k3_bind_layer(const k3_config *cfg, int L, k3_lookup_fn fn, void *ctx, k3_layer_w *w,
                  k3_owned *owned, k3_err *err) {
    binder b = {.cfg = cfg, .L = L, .fn = fn, .ctx = ctx, .owned = owned, .err = err};
    return bind_layer(&b, w);
}

int k3_bind_layer_no_experts(const k3_config *cfg, int L, k3_lookup_fn fn, void *ctx, k3_layer_w *w,
                             k3_owned *owned, k3_err *err) {
    binder b = {.cfg = cfg, .L = L, .fn = fn, .ctx = ctx, .owned = owned, .err = err, .no_experts = true};
    return bind_layer(&b, w);
}

/* Model-level tensors (layer -1). */
static int bind_top(k3_model *m, k3_lookup_fn fn, void *ctx, k3_err *err) {
    binder b = {.cfg = &m->cfg, .L = -1, .fn = fn, .ctx = ctx, .owned = &m->owned, .err = err};
    int64_t E = m->cfg.hidden_size, V = m->cfg.vocab_size;
    int rc;
    if ((rc = bind_mat(&b, K3N_EMBED, V, E, &m->embed)) ||
        (rc = bind_mat(&b, K3N_HEAD, V, E, &m->lm_head)) ||
        (rc = bind_vec(&b, K3N_NORM, E, &m->norm)) ||
        (rc = bind_res_query(&b, K3N_OUT_RES_NORM, K3N_OUT_RES_PROJ, E, &m->out_res_q)))
        return rc;
    m->mapped_bytes += b.mapped;
    return K3_OK;
}

int k3_model_bind_top(k3_model *m, k3_lookup_fn fn, void *ctx, k3_err *err) {
    k3_model saved = *m;
    if (!m->layers) m->mapped_bytes = 0; /* a top-only model maps nothing else */
    int rc = bind_top(m, fn, ctx, err);
    if (rc) { /* keep the tensors it had */
        m->embed = saved.embed;
        m->lm_head = saved.lm_head;
        m->norm = saved.norm;
        m->out_res_q = saved.out_res_q;
        m->mapped_bytes = saved.mapped_bytes;
    }
    return rc;
}

static int bind_all(k3_model *m, k3_lookup_fn fn, void *ctx, bool top_only, k3_err *err) {
    int rc = bind_top(m, fn, ctx, err);
    if (rc || top_only) return rc;
    m->layers = k3_own(&m->owned, xcalloc((size_t)m->cfg.num_layers, sizeof *m->layers),
                       (uint64_t)m->cfg.num_layers * sizeof *m->layers);
    for (int L = 0; L < m->cfg.num_layers; L++) {
        binder b = {.cfg = &m->cfg, .L = L, .fn = fn, .ctx = ctx, .owned = &m->owned, .err = err};
        if ((rc = bind_layer(&b, &m->layers[L]))) return rc;
        m->mapped_bytes += b.mapped;
    }
    return K3_OK;
}

/* ---- model lifetime (shared by both openers) ------------------------------- */

/* The one place a model applies --layers (every opener comes here before
 * binding, so too many layers is refused before a tensor is looked up). */
static int apply_opts(k3_model *m, const k3_model_opts *opts, const char *what, k3_err *err) {
    m->mla_eps = m->cfg.mla_latent_eps > 0 ? m->cfg.mla_latent_eps : 1e-6f;
    if (opts && opts->peer_mla_eps) m->mla_eps = m->cfg.rms_eps;
    if (opts && opts->kda_chunk > 0) m->kda_chunk = opts->kda_chunk;
    m->chunk = opts && opts->prefill_chunk > 0 ? opts->prefill_chunk : K3_PREFILL_CHUNK;
    return k3_config_first_layers(&m->cfg, opts ? opts->layers : 0, what, err);
}

void k3_model_free(k3_model *m) {
    if (!m) return;
    k3_owned_free(&m->owned);
    if (m->ix) st_close(m->ix);
    free(m->blob);
    free(m);
}

const k3_config *k3_model_config(const k3_model *m) { return &m->cfg; }

uint64_t k3_model_weight_bytes(const k3_model *m) { return m->mapped_bytes + m->owned.bytes; }

/* ---- safetensors directory -------------------------------------------------- */

typedef struct {
    st_index *ix;
    const char *prefix;   /* K3N_PREFIX or K3N_PREFIX_PLAIN */
    const char *head;     /* K3N_HEAD_FULL or K3N_HEAD */
    char name[512];
} st_ctx;

static int st_lookup(void *vctx, int layer, const char *name, k3_tensor *t, k3_err *err) {
    st_ctx *c = vctx;
    int k;
    if (layer < 0 && !strcmp(name, K3N_HEAD)) k = snprintf(c->name, sizeof c->name, "%s", c->head);
    else if (layer < 0) k = snprintf(c->name, sizeof c->name, "%s%s", c->prefix, name);
    else k = snprintf(c->name, sizeof c->name, "%slayers.%d.%s", c->prefix, layer, name);
    if (k < 0 || (size_t)k >= sizeof c->name) return k3_fail(err, K3_EXIT_RUNTIME, "tensor name too long");
    t->where = c->name;
    const st_tensor *s = st_find(c->ix, c->name);
    if (!s) return 1;
    switch (s->dtype) {
    case ST_F32: t->dtype = KT_F32; break;
    case ST_F16: t->dtype = KT_F16; break;
    case ST_BF16: t->dtype = KT_BF16; break;
    case ST_U8: t->dtype = KT_U8; break;
    default:
        return k3_fail(err, K3_EXIT_DATA, "%s: dtype %s is not used by K3 (BF16, F16, F32, or U8 for MXFP4)",
                       c->name, st_dtype_name(s->dtype));
    }
    if (s->rank > 4) return k3_fail(err, K3_EXIT_DATA, "%s: rank %d is not used by K3", c->name, s->rank);
    t->rank = s->rank;
    for (int i = 0; i < s->rank; i++) t->shape[i] = s->shape[i];
    t->data = st_data(c->ix, s, err);
    if (!t->data && s->nbytes) return err->code ? err->code : K3_EXIT_RUNTIME;
    return K3_OK;
}

int k3_model_open(const char *dir, const k3_model_opts *opts, k3_model **out, k3_err *err) {
    k3_config cfg;
    int rc = k3_config_load(dir, &cfg, err);
    if (rc) return rc;
    st_index *ix;
    if ((rc = st_open(dir, &ix, err))) return rc;
    rc = k3_model_open_index(dir, &cfg, ix, opts, out, err);
    st_close(ix);
    return rc;
}

int k3_model_open_index(const char *dir, const k3_config *cfg, st_index *ix, const k3_model_opts *opts,
                        k3_model **out, k3_err *err) {
    k3_model *m = xcalloc(1, sizeof *m);
    m->cfg = *cfg;
    int rc = apply_opts(m, opts, dir, err);
    if (rc) goto fail;
    m->ix = st_retain(ix);
    st_ctx c = {.ix = m->ix, .prefix = k3_names_prefix(m->ix)};
    c.head = k3_names_head(c.prefix);
    if ((rc = bind_all(m, st_lookup, &c, opts && opts->top_only, err))) goto fail;
    k3_model_set_source(m, NULL);
    *out = m;
    return K3_OK;
fail:
    k3_model_free(m);
    return rc;
}

/* ---- any lookup (the trainer's parameters in memory) -------------------------------- */

int k3_model_open_lookup(const k3_config *cfg, k3_lookup_fn fn, void *ctx, const k3_model_opts *opts,
                         k3_model **out, k3_err *err) {
    k3_model *m = xcalloc(1, sizeof *m);
    m->cfg = *cfg;
    int rc = apply_opts(m, opts, "the model", err);
    if (!rc) rc = bind_all(m, fn, ctx, opts && opts->top_only, err);
    if (rc) {
        k3_model_free(m);
        return rc;
    }
    k3_model_set_source(m, NULL);
    *out = m;
    return K3_OK;
}

/* ---- the peer blob ------------------------------------------------------------ */

bool k3_peer_name(int layer, bool with_layer_prefix, const char *name, char *buf, size_t n) {
    static const struct { const char *from, *to; } moe[] = {
        {K3N_ROUTER, "mlp.gate.weight"},
        {K3N_ROUTER_BIAS, "mlp.e_score_correction_bias"},
        {K3N_LAT_DOWN, "mlp.down.weight"},
        {K3N_LAT_UP, "mlp.up.weight"},
        {K3N_LAT_NORM, "mlp.norm.weight"},
        {K3N_SHARED K3N_GATE_PROJ, "mlp.shared.w1.weight"},
        {K3N_SHARED K3N_UP_PROJ, "mlp.shared.w3.weight"},
        {K3N_SHARED K3N_DOWN_PROJ, "mlp.shared.w2.weight"},
    };
    char tmp[256];
    const char *src = name;
    for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++)
        if (!strcmp(name, moe[i].from)) src = moe[i].to;
    const size_t nx = strlen(K3N_EXPERTS);
    if (src == name && !strncmp(name, K3N_EXPERTS, nx)) {
        int k = snprintf(tmp, sizeof tmp, "mlp.experts.%s", name + nx);
        if (k < 0 || (size_t)k >= sizeof tmp) return false;
        src = tmp;
    }
    int k = (layer >= 0 && with_layer_prefix) ? snprintf(buf, n, "layers_%d_%s", layer, src)
                                              : snprintf(buf, n, "%s", src);
    if (k < 0 || (size_t)k >= n) return false;
    for (char *p = buf; *p; p++)
        if (*p == '.') *p = '_';
    return true;
}

typedef struct {
    json_t *tensors;
    const float *blob;
    size_t nfloats;
    char name[512];
} blob_ctx;

static int blob_lookup(void *vctx, int layer, const char *name, k3_tensor *t, k3_err *err) {
    blob_ctx *c = vctx;
    if (!k3_peer_name(layer, true, name, c->name, sizeof c->name))
        return k3_fail(err, K3_EXIT_RUNTIME, "tensor name too long");
    t->where = c->name;
    json_t *e = json_object_get(c->tensors, c->name);
    if (!e) return 1;
    json_t *off = json_object_get(e, "offset"), *shape = json_object_get(e, "shape");
    if (!json_is_integer(off) || !json_is_array(shape) || json_array_size(shape) > 4)
        return k3_fail(err, K3_EXIT_DATA, "%s: bad blob index entry", c->name);
    t->dtype = KT_F32;
    t->rank = (int)json_array_size(shape);
    uint64_t numel = 1;
    for (int i = 0; i < t->rank; i++) {
        json_t *d = json_array_get(shape, (size_t)i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return k3_fail(err, K3_EXIT_DATA, "%s: bad shape in blob index", c->name);
        t->shape[i] = json_integer_value(d);
        if (!k3_mul_ok(numel, (uint64_t)t->shape[i], &numel))
            return k3_fail(err, K3_EXIT_DATA, "%s: shape overflows", c->name);
    }
    json_int_t o = json_integer_value(off);
    if (o < 0 || (uint64_t)o > c->nfloats || numel > c->nfloats - (uint64_t)o)
        return k3_fail(err, K3_EXIT_DATA, "%s: extends past the end of the blob", c->name);
    t->data = c->blob + o;
    return K3_OK;
}

int k3_model_open_blob(const char *json_path, const char *bin_path, const k3_model_opts *opts,
                       k3_model **out, k3_err *err) {
    k3_model *m = xcalloc(1, sizeof *m);
    json_error_t je;
    json_t *root = json_load_file(json_path, 0, &je);
    char *cfg_text = NULL, *bin = NULL;
    size_t bin_len = 0;
    int rc;
    if (!root) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: %s (line %d)", json_path, je.text, je.line);
        goto done;
    }
    json_t *cfg = json_object_get(root, "config"), *tensors = json_object_get(root, "tensors");
    if (!json_is_object(cfg) || !json_is_object(tensors)) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: expected members \"config\" and \"tensors\"", json_path);
        goto done;
    }
    cfg_text = json_dumps(cfg, 0);
    if (!cfg_text) { rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot re-serialise config", json_path); goto done; }
    if ((rc = k3_config_parse(cfg_text, json_path, &m->cfg, err))) goto done;
    if ((rc = apply_opts(m, opts, json_path, err))) goto done;
    if ((rc = k3_read_file(bin_path, &bin, &bin_len, err))) goto done;
    /* the blob must be float-aligned in memory: copy it into an f32 array */
    size_t nf = bin_len / 4;
    m->blob = xmalloc_array(nf ? nf : 1, sizeof(float));
    memcpy(m->blob, bin, nf * 4);
    m->mapped_bytes = nf * 4;
    blob_ctx c = {.tensors = tensors, .blob = m->blob, .nfloats = nf};
    if ((rc = bind_all(m, blob_lookup, &c, opts && opts->top_only, err))) goto done;
    m->mapped_bytes = nf * 4; /* the whole blob is resident */
    k3_model_set_source(m, NULL);
done:
    free(bin);
    free(cfg_text);
    json_decref(root);
    if (rc) k3_model_free(m);
    else *out = m;
    return rc;
}
