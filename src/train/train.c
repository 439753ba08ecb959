/* train.c: the training model: parameter table, initialisation, and the
 * layer-level forward/backward (embedding, Block AttnRes, norms, head,
 * cross-entropy). The attention and MLP sublayers live in tkda.c, tmla.c and
 * tmoe.c. Spec: ../shared/docs/k3-checkpoint-format.md sections 5-12. */
#include "formats/names.h"
#include "train/tinternal.h"

#include <math.h>
#include <string.h>

#include "kernels/kernels.h"

/* ---- parameter table ------------------------------------------------------- */

static size_t add_param(tmodel *m, int *cap, const char *name, int rank, int d0, int d1, int d2,
                        tgroup group, const char *component) {
    if (m->np == *cap) {
        *cap = *cap ? *cap * 2 : 256;
        m->params = xrealloc_array(m->params, (size_t)*cap, sizeof(tparam));
    }
    tparam *p = &m->params[m->np++];
    memset(p, 0, sizeof *p);
    int n = snprintf(p->name, sizeof p->name, "%s", name);
    if (n < 0 || (size_t)n >= sizeof p->name) {
        fprintf(stderr, "k3: internal: parameter name too long: %s\n", name);
        exit(K3_EXIT_RUNTIME);
    }
    p->rank = rank;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->shape[2] = d2;
    p->numel = (size_t)d0 * (size_t)(rank > 1 ? d1 : 1) * (size_t)(rank > 2 ? d2 : 1);
    p->off = m->nw;
    p->group = group;
    p->component = component;
    m->nw += p->numel;
    return p->off;
}

static void set_blocks(tmodel *m, int n, const int *rows) {
    tparam *p = &m->params[m->np - 1];
    p->nblocks = n;
    p->blocks = xmalloc_array((size_t)n, sizeof(int));
    memcpy(p->blocks, rows, sizeof(int) * (size_t)n);
}

#define PFX K3N_PREFIX

static size_t addf(tmodel *m, int *cap, int layer, const char *suffix, int rank, int d0, int d1,
                   int d2, tgroup g, const char *comp) {
    char name[160];
    int n = layer >= 0 ? snprintf(name, sizeof name, PFX "layers.%d.%s", layer, suffix)
                       : snprintf(name, sizeof name, "%s", suffix);
    if (n < 0 || (size_t)n >= sizeof name) {
        fprintf(stderr, "k3: internal: name overflow\n");
        exit(K3_EXIT_RUNTIME);
    }
    return add_param(m, cap, name, rank, d0, d1, d2, g, comp);
}

void tm_bias_name(int layer, char *buf, size_t n) {
    int r = snprintf(buf, n, PFX "layers.%d." K3N_ROUTER_BIAS, layer);
    if (r < 0 || (size_t)r >= n) buf[0] = 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp(((const tm_name *)a)->name, ((const tm_name *)b)->name);
}

int tm_build(tmodel *m, const k3_config *c, k3_err *err) {
    memset(m, 0, sizeof *m);
    m->cfg = *c;
    const int E = c->hidden_size, L = c->num_layers;
    if (c->attn_res_block_size <= 0)
        return k3_fail(err, K3_EXIT_USAGE, "config: the trainer needs attn_res_block_size > 0");
    if ((L + c->attn_res_block_size - 1) / c->attn_res_block_size + 1 > TM_MAX_ATTNRES_SOURCES)
        return k3_fail(err, K3_EXIT_USAGE, "config: more than %d AttnRes sources", TM_MAX_ATTNRES_SOURCES);
    if (!c->latent_moe_use_norm || !c->mla_output_gate)
        return k3_fail(err, K3_EXIT_USAGE,
                       "config: the trainer supports latent_moe_use_norm and mla_use_output_gate true only");
    if (c->experts_per_token < 1 || c->experts_per_token > c->num_experts || c->experts_per_token > TM_MAX_TOPK ||
        c->num_experts > TM_MAX_EXPERTS)
        return k3_fail(err, K3_EXIT_USAGE,
                       "config: the trainer needs 1 <= num_experts_per_token <= min(num_experts, %d) and "
                       "num_experts <= %d", TM_MAX_TOPK, TM_MAX_EXPERTS);
    int cap = 0;
    m->layers = xcalloc((size_t)L, sizeof(tm_layer));
    m->moe_layer = xcalloc((size_t)L, sizeof(int));
    m->embed = addf(m, &cap, -1, PFX K3N_EMBED, 2, c->vocab_size, E, 0, TG_ADAMW, "embedding");
    for (int l = 0; l < L; l++) {
        tm_layer *y = &m->layers[l];
        y->kind = c->layer_kind[l];
        y->dense = c->layer_dense[l];
        y->moe = -1;
        const char *nc = "norms+attnres";
        y->in_norm = addf(m, &cap, l, K3N_IN_NORM, 1, E, 0, 0, TG_ADAMW_ND, nc);
        y->post_norm = addf(m, &cap, l, K3N_POST_NORM, 1, E, 0, 0, TG_ADAMW_ND, nc);
        y->attn_res_norm = addf(m, &cap, l, K3N_ATTN_RES_NORM, 1, E, 0, 0, TG_ADAMW_ND, nc);
        y->mlp_res_norm = addf(m, &cap, l, K3N_MLP_RES_NORM, 1, E, 0, 0, TG_ADAMW_ND, nc);
        y->attn_res_proj = addf(m, &cap, l, K3N_ATTN_RES_PROJ, 2, 1, E, 0, TG_ADAMW, nc);
        y->mlp_res_proj = addf(m, &cap, l, K3N_MLP_RES_PROJ, 2, 1, E, 0, TG_ADAMW, nc);
        if (y->kind == 'K') {
            const int H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
            int rows[TM_MAX_BLOCKS];
            if (H > TM_MAX_BLOCKS) return k3_fail(err, K3_EXIT_USAGE, "config: too many KDA heads");
            for (int h = 0; h < H; h++) rows[h] = D;
            const char *kc = "kda";
            y->kda.qkv = addf(m, &cap, l, K3N_Q_PROJ, 2, P, E, 0, TG_MUON_HEADS, kc);
            set_blocks(m, H, rows);
            addf(m, &cap, l, K3N_K_PROJ, 2, P, E, 0, TG_MUON_HEADS, kc);
            set_blocks(m, H, rows);
            addf(m, &cap, l, K3N_V_PROJ, 2, P, E, 0, TG_MUON_HEADS, kc);
            set_blocks(m, H, rows);
            y->kda.conv = addf(m, &cap, l, K3N_Q_CONV, 3, P, 1, K, TG_ADAMW, kc);
            addf(m, &cap, l, K3N_K_CONV, 3, P, 1, K, TG_ADAMW, kc);
            addf(m, &cap, l, K3N_V_CONV, 3, P, 1, K, TG_ADAMW, kc);
            y->kda.f_a = addf(m, &cap, l, K3N_F_A, 2, D, E, 0, TG_MUON, kc);
            y->kda.f_b = addf(m, &cap, l, K3N_F_B, 2, P, D, 0, TG_MUON, kc);
            y->kda.A_log = addf(m, &cap, l, K3N_A_LOG, 1, H, 0, 0, TG_ADAMW_ND, kc);
            y->kda.dt_bias = addf(m, &cap, l, K3N_DT_BIAS, 1, P, 0, 0, TG_ADAMW_ND, kc);
            y->kda.b_proj = addf(m, &cap, l, K3N_B_PROJ, 2, H, E, 0, TG_MUON, kc);
            y->kda.g_proj = addf(m, &cap, l, K3N_G_PROJ, 2, P, E, 0, TG_MUON, kc);
            y->kda.o_norm = addf(m, &cap, l, K3N_O_NORM, 1, D, 0, 0, TG_ADAMW_ND, kc);
            y->kda.o_proj = addf(m, &cap, l, K3N_O_PROJ, 2, E, P, 0, TG_MUON, kc);
        } else {
            const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim;
            int rows[TM_MAX_BLOCKS];
            if (2 * H > TM_MAX_BLOCKS) return k3_fail(err, K3_EXIT_USAGE, "config: too many MLA heads");
            const char *mc = "mla";
            y->mla.q_a = addf(m, &cap, l, K3N_Q_A, 2, c->q_lora_rank, E, 0, TG_MUON, mc);
            y->mla.q_a_norm = addf(m, &cap, l, K3N_Q_A_NORM, 1, c->q_lora_rank, 0, 0,
                                   TG_ADAMW_ND, mc);
            y->mla.q_b = addf(m, &cap, l, K3N_Q_B, 2, H * (dn + dr), c->q_lora_rank, 0,
                              TG_MUON_HEADS, mc);
            for (int h = 0; h < H; h++) rows[h] = dn + dr;
            set_blocks(m, H, rows);
            y->mla.kv_a = addf(m, &cap, l, K3N_KV_A, 2, c->kv_lora_rank + dr, E,
                               0, TG_MUON, mc);
            y->mla.kv_a_norm = addf(m, &cap, l, K3N_KV_A_NORM, 1, c->kv_lora_rank, 0, 0,
                                    TG_ADAMW_ND, mc);
            y->mla.kv_b = addf(m, &cap, l, K3N_KV_B, 2, H * (dn + dv), c->kv_lora_rank,
                               0, TG_MUON_HEADS, mc);
            for (int h = 0; h < H; h++) { rows[2 * h] = dn; rows[2 * h + 1] = dv; }
            set_blocks(m, 2 * H, rows);
            y->mla.o_proj = addf(m, &cap, l, K3N_O_PROJ, 2, E, H * dv, 0, TG_MUON, mc);
            y->mla.g_proj = addf(m, &cap, l, K3N_G_PROJ, 2, H * dv, E, 0, TG_MUON, mc);
        }
        if (y->dense) {
            const int I = c->dense_inter;
            const char *dc = "dense mlp";
            y->mlp.gate_up = addf(m, &cap, l, K3N_MLP K3N_GATE_PROJ, 2, I, E, 0, TG_MUON, dc);
            addf(m, &cap, l, K3N_MLP K3N_UP_PROJ, 2, I, E, 0, TG_MUON, dc);
            y->mlp.down = addf(m, &cap, l, K3N_MLP K3N_DOWN_PROJ, 2, E, I, 0, TG_MUON, dc);
        } else {
            const int Ne = c->num_experts, lat = c->latent_dim, I = c->moe_inter;
            const int W = c->num_shared_experts * I;
            y->moe = m->n_moe;
            m->moe_layer[m->n_moe++] = l;
            moe_w *q = &y->moe_w;
            q->router = addf(m, &cap, l, K3N_ROUTER, 2, Ne, E, 0, TG_MUON, "router");
            q->lat_down = addf(m, &cap, l, K3N_LAT_DOWN, 2, lat, E, 0,
                               TG_MUON, "latent proj");
            q->lat_norm = addf(m, &cap, l, K3N_LAT_NORM, 1, lat, 0, 0,
                               TG_ADAMW_ND, "latent proj");
            q->lat_up = addf(m, &cap, l, K3N_LAT_UP, 2, E, lat, 0,
                             TG_MUON, "latent proj");
            const char *sc = "shared experts";
            q->shared.gate_up = addf(m, &cap, l, K3N_SHARED K3N_GATE_PROJ, 2, W, E,
                                     0, TG_MUON, sc);
            addf(m, &cap, l, K3N_SHARED K3N_UP_PROJ, 2, W, E, 0, TG_MUON, sc);
            q->shared.down = addf(m, &cap, l, K3N_SHARED K3N_DOWN_PROJ, 2, E, W, 0,
                                  TG_MUON, sc);
            q->w13 = xmalloc_array((size_t)Ne, sizeof(size_t));
            q->w2 = xmalloc_array((size_t)Ne, sizeof(size_t));
            for (int e = 0; e < Ne; e++) {
                char s[96];
                const char *rc = "routed experts";
                snprintf(s, sizeof s, K3N_EXPERT_FMT K3N_WEIGHT, e, 1);
                q->w13[e] = addf(m, &cap, l, s, 2, I, lat, 0, TG_MUON, rc);
                snprintf(s, sizeof s, K3N_EXPERT_FMT K3N_WEIGHT, e, 3);
                addf(m, &cap, l, s, 2, I, lat, 0, TG_MUON, rc);
                snprintf(s, sizeof s, K3N_EXPERT_FMT K3N_WEIGHT, e, 2);
                q->w2[e] = addf(m, &cap, l, s, 2, lat, I, 0, TG_MUON, rc);
            }
        }
    }
    const char *fc = "final norm+attnres";
    m->norm = addf(m, &cap, -1, PFX K3N_NORM, 1, E, 0, 0, TG_ADAMW_ND, fc);
    m->out_res_norm = addf(m, &cap, -1, PFX K3N_OUT_RES_NORM, 1, E, 0, 0, TG_ADAMW_ND, fc);
    m->out_res_proj = addf(m, &cap, -1, PFX K3N_OUT_RES_PROJ, 2, 1, E, 0, TG_ADAMW, fc);
    m->head = addf(m, &cap, -1, K3N_HEAD_FULL, 2, c->vocab_size, E, 0, TG_ADAMW, "lm_head");
    m->w = xcalloc(m->nw, sizeof(float));
    m->g = xcalloc(m->nw, sizeof(float));
    m->bias = xcalloc((size_t)(m->n_moe ? m->n_moe : 1) * (size_t)c->num_experts, sizeof(float));
    m->load = xcalloc((size_t)(m->n_moe ? m->n_moe : 1) * (size_t)c->num_experts, sizeof(int64_t));
    m->kda_chunk = 16;
    m->by_name = xmalloc_array((size_t)m->np, sizeof *m->by_name);
    for (int i = 0; i < m->np; i++) m->by_name[i] = (tm_name){m->params[i].name, i};
    qsort(m->by_name, (size_t)m->np, sizeof *m->by_name, by_name);
    return K3_OK;
}

static void acts_free(tmodel *m);

void tm_free(tmodel *m) {
    if (!m->params) return;
    acts_free(m);
    for (int i = 0; i < m->np; i++) free(m->params[i].blocks);
    for (int l = 0; l < m->cfg.num_layers; l++) {
        free(m->layers[l].moe_w.w13);
        free(m->layers[l].moe_w.w2);
    }
    free(m->params);
    free(m->by_name);
    free(m->layers);
    free(m->moe_layer);
    free(m->w);
    free(m->g);
    free(m->bias);
    free(m->load);
    free(m->qb_marg);
    memset(m, 0, sizeof *m);
}

void tm_view(tmodel *dst, const tmodel *src) {
    *dst = *src;
    dst->acts = NULL;
    dst->logits = NULL;
    dst->qb_record = false;
    dst->qb_marg = NULL;
    dst->qb_cap = dst->qb_n = 0;
    dst->load = xcalloc((size_t)(src->n_moe ? src->n_moe : 1) * (size_t)src->cfg.num_experts, sizeof(int64_t));
}

void tm_view_free(tmodel *v) {
    acts_free(v);
    free(v->load);
    memset(v, 0, sizeof *v);
}

bool tm_all_finite(const tmodel *m, int *bad) {
    for (int i = 0; i < m->np; i++) {
        const float *w = m->w + m->params[i].off;
        for (size_t j = 0; j < m->params[i].numel; j++)
            if (!isfinite(w[j])) {
                if (bad) *bad = i;
                return false;
            }
    }
    return true;
}

/* A binary search of the name index: the model graph binds every parameter
 * through tm_lookup on each forward, so a scan of the table per name would
 * cost np^2 comparisons a step. */
int tm_find(const tmodel *m, const char *name) {
    tm_name key = {name, -1};
    const tm_name *f = m->by_name ? bsearch(&key, m->by_name, (size_t)m->np, sizeof key, by_name) : NULL;
    return f ? f->i : -1;
}

float *tm_bias(tmodel *m, int layer) {
    int q = m->layers[layer].moe;
    return q < 0 ? NULL : m->bias + (size_t)q * m->cfg.num_experts;
}

size_t tm_print_inventory(const tmodel *m, FILE *f) {
    static const char *const order[] = {"embedding", "kda", "mla", "dense mlp", "router", "latent proj",
                                  "shared experts", "routed experts", "norms+attnres",
                                  "final norm+attnres", "lm_head"};
    size_t total = 0;
    for (size_t k = 0; k < sizeof order / sizeof order[0]; k++) {
        size_t n = 0;
        for (int i = 0; i < m->np; i++)
            if (strcmp(m->params[i].component, order[k]) == 0) n += m->params[i].numel;
        if (n) fprintf(f, "%-20s %12zu\n", order[k], n);
        total += n;
    }
    fprintf(f, "%-20s %12zu\n", "total", total);
    fprintf(f, "%-20s %12zu\n", "router biases (buf)", (size_t)m->n_moe * (size_t)m->cfg.num_experts);
    return total;
}

int tm_lookup(void *ctx, int layer, const char *name, k3_tensor *t, k3_err *err) {
    tm_lookup_ctx *lc = ctx;
    const tmodel *m = lc->m;
    char *full = lc->where;
    const size_t nfull = sizeof lc->where;
    int k = layer >= 0 ? snprintf(full, nfull, PFX "layers.%d.%s", layer, name)
            : !strcmp(name, K3N_HEAD) ? snprintf(full, nfull, K3N_HEAD_PARENT "%s", name)
                                               : snprintf(full, nfull, PFX "%s", name);
    if (k < 0 || (size_t)k >= nfull) return k3_fail(err, K3_EXIT_RUNTIME, "tensor name too long: %s", name);
    t->where = full;
    t->dtype = KT_F32;
    int i = tm_find(m, full);
    if (i >= 0) {
        const tparam *p = &m->params[i];
        t->rank = p->rank;
        for (int d = 0; d < p->rank; d++) t->shape[d] = p->shape[d];
        t->data = m->w + p->off;
        return K3_OK;
    }
    if (layer >= 0 && !strcmp(name, K3N_ROUTER_BIAS)) {
        for (int q = 0; q < m->n_moe; q++)
            if (m->moe_layer[q] == layer) {
                t->rank = 1;
                t->shape[0] = m->cfg.num_experts;
                t->data = m->bias + (size_t)q * m->cfg.num_experts;
                return K3_OK;
            }
    }
    return 1;
}

/* ---- initialisation ----------------------------------------------------------- */

/* k3_rng_next (splitmix64) is counter-based, so each tensor's stream depends
 * only on (seed, tensor index), never on the order tensors are initialised in. */
static double unif(uint64_t *s) { return k3_rng_unit(s); }
static double gauss(uint64_t *s) {
    double u1 = unif(s), u2 = unif(s);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* Distributions (report section 2.1.1 and 2.2 where it says; the rest the
 * common practice its references follow):
 *  - norm gains 1; AttnRes pseudo-queries 0 (uniform mixing at start);
 *  - A_log 0 (A = 1, report: "We initialize A_h = 0");
 *  - dt_bias = inverse softplus of dt ~ LogUniform(1e-3, 1e-1) (Mamba-2/GDN/
 *    Kimi Linear), giving initial retention exp(-5 sigmoid(dt_bias)) in about
 *    (0.64, 0.995);
 *  - ShortConv taps U(-1/sqrt(K), 1/sqrt(K)) (the depthwise conv default);
 *  - every other matrix (embeddings, projections, router, experts, head)
 *    N(0, 0.02^2), the released initializer_range. */
void tm_init(tmodel *m, uint64_t seed) {
    const int K = m->cfg.conv_kernel;
    for (int i = 0; i < m->np; i++) {
        tparam *p = &m->params[i];
        float *w = m->w + p->off;
        uint64_t s = seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(i + 1));
        if (ends_with(p->name, "norm.weight")) { /* every norm gain */
            for (size_t j = 0; j < p->numel; j++) w[j] = 1.0f;
        } else if (ends_with(p->name, "res_proj.weight") || ends_with(p->name, "A_log")) {
            memset(w, 0, sizeof(float) * p->numel);
        } else if (ends_with(p->name, "dt_bias")) {
            for (size_t j = 0; j < p->numel; j++) {
                double dt = exp(log(1e-3) + unif(&s) * (log(1e-1) - log(1e-3)));
                if (dt < 1e-4) dt = 1e-4;
                w[j] = (float)(dt + log(-expm1(-dt)));
            }
        } else if (strstr(p->name, "conv1d")) {
            double b = 1.0 / sqrt((double)K);
            for (size_t j = 0; j < p->numel; j++) w[j] = (float)((2.0 * unif(&s) - 1.0) * b);
        } else {
            for (size_t j = 0; j < p->numel; j++) w[j] = (float)(0.02 * gauss(&s));
        }
    }
    memset(m->bias, 0, sizeof(float) * (size_t)m->n_moe * (size_t)m->cfg.num_experts);
}

/* ---- activations ------------------------------------------------------------------ */

static int n_blocks(const k3_config *c) {
    return (c->num_layers + c->attn_res_block_size - 1) / c->attn_res_block_size;
}

static void acts_free(tmodel *m) {
    tm_acts *a = m->acts;
    if (!a) return;
    for (int l = 0; l < m->cfg.num_layers; l++) {
        k3_layer_rec *x = &a->rec.l[l];
        float *bufs[] = {x->a, x->al_a, x->r_a, x->xin, x->rin, x->p_mid, x->p_out, x->mm, x->al_m,
                         x->r_m, x->xm, x->rm};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
        if (m->layers[l].kind == 'K') kda_free(&x->kda); else mla_free(&x->mla);
        if (m->layers[l].dense) mlp_free(&x->mlp); else moe_free(&x->moe);
    }
    free(a->rec.l);
    free(a->ssave_cap);
    float *bufs[] = {a->rec.h0, a->rec.xf, a->rec.al_f, a->rec.r_f, a->rec.xn, a->rec.rn, a->dblk, a->d1, a->d2,
                     a->d3, a->d4, a->scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(a->tok);
    free(a->tgt);
    free(a);
    m->acts = NULL;
    free(m->logits);
    m->logits = NULL;
}

static float *fa(size_t n) { return xmalloc_array(n ? n : 1, sizeof(float)); }

static void acts_ensure(tmodel *m, int B, int T) {
    tm_acts *a = m->acts;
    if (a && a->B == B && a->T == T) return;
    acts_free(m);
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size, L = c->num_layers, S = c->attn_res_block_size;
    const size_t N = (size_t)B * T;
    a = m->acts = xcalloc(1, sizeof(tm_acts));
    a->cap = (int)N;
    a->B = B;
    a->T = T;
    a->tok = xmalloc_array(N + (size_t)B, sizeof(int32_t));
    a->tgt = xmalloc_array(N, sizeof(int));
    a->rec.h0 = fa(N * E);
    a->rec.l = xcalloc((size_t)L, sizeof(k3_layer_rec));
    a->ssave_cap = xcalloc((size_t)L, sizeof(size_t));
    size_t scr = 0;
    for (int l = 0; l < L; l++) {
        k3_layer_rec *x = &a->rec.l[l];
        const int m_a = tm_src_attn(l, S), m_m = tm_src_mlp(l, S);
        if (m_a) {
            x->a = fa(N * E);
            x->al_a = fa(N * m_a);
            x->r_a = fa(N * m_a);
        }
        x->xin = fa(N * E);
        x->rin = fa(N);
        x->p_mid = fa(N * E);
        x->p_out = fa(N * E);
        x->mm = fa(N * E);
        x->al_m = fa(N * m_m);
        x->r_m = fa(N * m_m);
        x->xm = fa(N * E);
        x->rm = fa(N);
        size_t s1, s2;
        if (m->layers[l].kind == 'K') {
            kda_alloc(m, &x->kda, (int)N);
            s1 = kda_scratch(m, (int)N);
        } else {
            mla_alloc(m, &x->mla, (int)N, B, T);
            s1 = mla_scratch(m, (int)N);
        }
        if (m->layers[l].dense) {
            mlp_alloc(&x->mlp, (int)N, c->dense_inter);
            s2 = mlp_scratch(m, (int)N, c->dense_inter);
        } else {
            moe_alloc(m, &x->moe, (int)N);
            s2 = moe_scratch(m, (int)N);
        }
        if (s1 > scr) scr = s1;
        if (s2 > scr) scr = s2;
    }
    const int m_f = n_blocks(c) + 1;
    a->rec.xf = fa(N * E);
    a->rec.al_f = fa(N * m_f);
    a->rec.r_f = fa(N * m_f);
    a->rec.xn = fa(N * E);
    a->rec.rn = fa(N);
    a->dblk = fa((size_t)n_blocks(c) * N * E);
    a->d1 = fa(N * E);
    a->d2 = fa(N * E);
    a->d3 = fa(N * E);
    a->d4 = fa(N * E);
    a->scratch = fa(scr);
    a->scratch_n = scr;
    m->logits = fa(N * (size_t)c->vocab_size);
}

/* Block pointer b: b_0 is the embedding, b_n (n >= 1) the partial sum entering
 * layer n*S, i.e. p_out of layer n*S-1. */
static float *blk(tmodel *m, int b) {
    const int S = m->cfg.attn_res_block_size;
    return b == 0 ? m->acts->rec.h0 : m->acts->rec.l[b * S - 1].p_out;
}

/* ---- forward --------------------------------------------------------------------- */

/* The model graph on the parameters: the model's binder over tm_lookup (the
 * matrices are used in place; the norm gains, taps and folded AttnRes
 * queries are bound afresh, so every forward sees the current parameters),
 * its one layer loop with training's products and records. */
double tm_forward(tmodel *m, const int32_t *tokens, int B, int T) {
    const k3_config *c = &m->cfg;
    const int L = c->num_layers, V = c->vocab_size;
    acts_ensure(m, B, T);
    tm_acts *a = m->acts;
    const int N = B * T;
    memcpy(a->tok, tokens, sizeof(int32_t) * (size_t)B * (size_t)(T + 1));
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) a->tgt[b * T + t] = tokens[(size_t)b * (T + 1) + t + 1];
    memset(m->load, 0, sizeof(int64_t) * (size_t)m->n_moe * (size_t)c->num_experts);
    if (m->qb_record && m->qb_n + N > m->qb_cap) {
        m->qb_cap = m->qb_n + N;
        m->qb_marg = xrealloc_array(m->qb_marg, (size_t)m->qb_cap * (size_t)(m->n_moe ? m->n_moe : 1),
                                    sizeof(float) * (size_t)c->num_experts);
    }
    const size_t ss = kda_ssave_floats(m, B, T);
    for (int l = 0; l < L; l++)
        if (m->layers[l].kind == 'K' && ss > a->ssave_cap[l]) {
            free(a->rec.l[l].kda.Ssave);
            a->rec.l[l].kda.Ssave = xmalloc_array(ss, sizeof(float));
            a->ssave_cap[l] = ss;
        }
    k3_model *g = NULL;
    k3_err err = {0};
    tm_lookup_ctx lc = {.m = m};
    int rc = k3_model_open_lookup(c, tm_lookup, &lc, NULL, &g, &err);
    if (!rc)
        rc = k3_forward_rec(g, t_fwd_ops(tm_gemm_mode(m)), tm_kda_chunk(m), tokens, (size_t)T + 1, B, T, m->logits,
                            &a->rec, &err);
    k3_model_free(g);
    if (rc) { /* the table's own names and shapes, or ids the data layer checked: a bug otherwise */
        fprintf(stderr, "k3: train: %s\n", err.msg);
        exit(rc);
    }
    for (int l = 0; l < L; l++)
        if (!m->layers[l].dense) moe_account(m, &m->layers[l], &a->rec.l[l].moe, N);
    double loss;
    t_cross_entropy(m->logits, a->tgt, N, V, &loss, NULL, 0.0f);
    if (m->qb_record) m->qb_n += N;
    return loss;
}

/* ---- backward -------------------------------------------------------------------- */

static void vadd(float *d, const float *s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] += s[i];
}

void tm_backward(tmodel *m, float scale) {
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size, L = c->num_layers, S = c->attn_res_block_size, V = c->vocab_size;
    tm_acts *a = m->acts;
    const int B = a->B, T = a->T, N = B * T;
    const size_t NE = (size_t)N * E;
    const int nb = n_blocks(c);
    float *g = m->g;
    double unused;
    t_cross_entropy(m->logits, a->tgt, N, V, &unused, m->logits, scale); /* logits -> dlogits */
    memset(a->dblk, 0, sizeof(float) * (size_t)nb * NE);
    float *dp = a->d1, *dx = a->d2, *dn = a->d3;
    /* head and final norm */
    const k3_model_rec *r = &a->rec;
    t_linear_dw(g + m->head, m->logits, r->xn, N, E, V, tm_gemm_mode(m));
    t_linear_dx(dx, m->logits, m->w + m->head, N, E, V, false, tm_gemm_mode(m));
    t_rmsnorm_bwd(dn, g + m->norm, dx, r->xf, r->rn, m->w + m->norm, N, E, false);
    /* final AttnRes: sources blocks + last partial */
    const float *srcs[TM_MAX_ATTNRES_SOURCES];
    float *dsrc[TM_MAX_ATTNRES_SOURCES];
    memset(dp, 0, sizeof(float) * NE);
    for (int i = 0; i < nb; i++) { srcs[i] = blk(m, i); dsrc[i] = a->dblk + (size_t)i * NE; }
    srcs[nb] = r->l[L - 1].p_out;
    dsrc[nb] = dp;
    t_attnres_bwd(dsrc, g + m->out_res_norm, g + m->out_res_proj, dn, r->al_f, r->r_f, srcs, nb + 1,
                  m->w + m->out_res_norm, m->w + m->out_res_proj, N, E, c->rms_eps);
    for (int l = L - 1; l >= 0; l--) {
        const tm_layer *y = &m->layers[l];
        k3_layer_rec *x = &a->rec.l[l];
        const float *p_in = l ? r->l[l - 1].p_out : r->h0;
        const int m_a = tm_src_attn(l, S);
        /* dp is d p_out; p_out = p_mid + f, so d p_mid = dp and d f = dp */
        if (y->dense)
            mlp_backward(m, &y->mlp, &x->mlp, c->dense_inter, x->xm, dp, dx, N, a->scratch, false);
        else
            moe_backward(m, y, &x->moe, x->xm, dp, dx, N, a->scratch);
        t_rmsnorm_bwd(dn, g + y->post_norm, dx, x->mm, x->rm, m->w + y->post_norm, N, E, false);
        int nba = l / S + 1;
        for (int i = 0; i < nba; i++) { srcs[i] = blk(m, i); dsrc[i] = a->dblk + (size_t)i * NE; }
        srcs[nba] = x->p_mid;
        dsrc[nba] = dp;
        t_attnres_bwd(dsrc, g + y->mlp_res_norm, g + y->mlp_res_proj, dn, x->al_m, x->r_m, srcs, tm_src_mlp(l, S),
                      m->w + y->mlp_res_norm, m->w + y->mlp_res_proj, N, E, c->rms_eps);
        /* dp is now d p_mid = d t */
        if (y->kind == 'K')
            kda_backward(m, y, &x->kda, x->xin, dp, dx, B, T, a->scratch);
        else
            mla_backward(m, y, &x->mla, x->xin, dp, dx, B, T, a->scratch);
        const float *ain = m_a ? x->a : p_in;
        t_rmsnorm_bwd(dn, g + y->in_norm, dx, ain, x->rin, m->w + y->in_norm, N, E, false);
        /* d p_in: at a boundary p_in is block l/S (its gradient so far sits in
         * dblk); otherwise p_mid = p_in + t passes dp through. */
        if (l % S == 0) memcpy(dp, a->dblk + (size_t)(l / S) * NE, sizeof(float) * NE);
        if (m_a) {
            int nbb = (l + S - 1) / S;
            for (int i = 0; i < nbb; i++) { srcs[i] = blk(m, i); dsrc[i] = a->dblk + (size_t)i * NE; }
            srcs[nbb] = p_in;
            dsrc[nbb] = dp;
            t_attnres_bwd(dsrc, g + y->attn_res_norm, g + y->attn_res_proj, dn, x->al_a, x->r_a, srcs, m_a,
                          m->w + y->attn_res_norm, m->w + y->attn_res_proj, N, E, c->rms_eps);
        } else {
            vadd(dp, dn, NE);
        }
    }
    /* dp = d h0: scatter into the embedding rows in token order */
    float *ge = g + m->embed;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int32_t id = a->tok[(size_t)b * (T + 1) + t];
            vadd(ge + (size_t)id * E, dp + ((size_t)b * T + t) * E, (size_t)E);
        }
}

/* ---- Quantile Balancing -------------------------------------------------------------- */

static int cmp_desc(const void *x, const void *y) {
    float a = *(const float *)x, b = *(const float *)y;
    return (a < b) - (a > b);
}

void tm_qb_update(tmodel *m) {
    const int Ne = m->cfg.num_experts, k = m->cfg.experts_per_token;
    const int n = m->qb_n;
    if (n == 0 || k >= Ne || !m->qb_marg) { m->qb_n = 0; return; }
    /* target load q = floor(n k / Ne); the bias is minus the (q+1)-th largest
     * margin, so exactly q margins stay above the threshold (report eq. 14). */
    const int q = (int)(((int64_t)n * k) / Ne);
#pragma omp parallel for schedule(static)
    for (int job = 0; job < m->n_moe * Ne; job++) {
        int ly = job / Ne, e = job % Ne;
        float *col = xmalloc_array((size_t)n, sizeof(float));
        const size_t row = (size_t)m->n_moe * Ne;
        for (int i = 0; i < n; i++) col[i] = m->qb_marg[(size_t)i * row + (size_t)ly * Ne + e];
        qsort(col, (size_t)n, sizeof(float), cmp_desc);
        m->bias[(size_t)ly * Ne + e] = -col[q];
        free(col);
    }
    for (int ly = 0; ly < m->n_moe; ly++) {
        float *b = m->bias + (size_t)ly * Ne;
        double s = 0.0;
        for (int e = 0; e < Ne; e++) s += b[e];
        float mean = (float)(s / Ne);
        for (int e = 0; e < Ne; e++) b[e] -= mean;
    }
    m->qb_n = 0;
}
