/* expert_par.c: placements and the expert-parallel weight source (expert_par.h). */
#include "dist/expert_par.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"

/* ---- placements ------------------------------------------------------------ */

void k3_placement_contiguous(int ranks, int layers, int experts, k3_placement *p) {
    p->ranks = ranks;
    p->layers = layers;
    p->experts = experts;
    p->owner = xmalloc_array((size_t)layers * (size_t)(experts > 0 ? experts : 1), sizeof *p->owner);
    for (int L = 0; L < layers; L++)
        for (int r = 0; r < ranks; r++) {
            int e0 = (int)((int64_t)r * experts / ranks), e1 = (int)((int64_t)(r + 1) * experts / ranks);
            for (int e = e0; e < e1; e++) p->owner[(size_t)L * experts + e] = r;
        }
}

typedef struct { int64_t n; int e; } hot;
static int cmp_hot(const void *a, const void *b) {
    const hot *x = a, *y = b;
    if (x->n != y->n) return x->n > y->n ? -1 : 1;
    return x->e - y->e;
}

static int64_t *counts_of(int layers, int experts, const xc_request *reqs, size_t n) {
    int64_t *cnt = xcalloc((size_t)layers * (size_t)experts, sizeof *cnt);
    for (size_t i = 0; i < n; i++)
        if (reqs[i].layer >= 0 && reqs[i].layer < layers && reqs[i].expert >= 0 && reqs[i].expert < experts)
            cnt[(size_t)reqs[i].layer * experts + reqs[i].expert]++;
    return cnt;
}

void k3_placement_from_trace(int ranks, int layers, int experts, const xc_request *reqs, size_t n, k3_placement *p) {
    k3_placement_contiguous(ranks, layers, experts, p);
    int64_t *cnt = counts_of(layers, experts, reqs, n);
    hot *h = xmalloc_array((size_t)experts, sizeof *h);
    int64_t *load = xmalloc_array((size_t)ranks, sizeof *load);
    int *held = xmalloc_array((size_t)ranks, sizeof *held);
    int cap = (experts + ranks - 1) / ranks;
    for (int L = 0; L < layers; L++) {
        for (int e = 0; e < experts; e++) h[e] = (hot){cnt[(size_t)L * experts + e], e};
        qsort(h, (size_t)experts, sizeof *h, cmp_hot);
        memset(load, 0, (size_t)ranks * sizeof *load);
        memset(held, 0, (size_t)ranks * sizeof *held);
        for (int i = 0; i < experts; i++) {
            int best = -1;
            for (int r = 0; r < ranks; r++)
                if (held[r] < cap && (best < 0 || load[r] < load[best] || (load[r] == load[best] && held[r] < held[best])))
                    best = r;
            p->owner[(size_t)L * experts + h[i].e] = best;
            load[best] += h[i].n;
            held[best]++;
        }
    }
    free(cnt);
    free(h);
    free(load);
    free(held);
}

double k3_placement_imbalance(const k3_placement *p, const xc_request *reqs, size_t n) {
    int64_t *cnt = counts_of(p->layers, p->experts, reqs, n);
    int64_t *load = xmalloc_array((size_t)p->ranks, sizeof *load);
    double maxsum = 0, meansum = 0;
    for (int L = 0; L < p->layers; L++) {
        memset(load, 0, (size_t)p->ranks * sizeof *load);
        int64_t tot = 0;
        for (int e = 0; e < p->experts; e++) {
            int64_t c = cnt[(size_t)L * p->experts + e];
            load[p->owner[(size_t)L * p->experts + e]] += c;
            tot += c;
        }
        int64_t mx = 0;
        for (int r = 0; r < p->ranks; r++)
            if (load[r] > mx) mx = load[r];
        maxsum += (double)mx;
        meansum += (double)tot / p->ranks;
    }
    free(cnt);
    free(load);
    return meansum > 0 ? maxsum / meansum : 1.0;
}

double k3_placement_step_load(const k3_placement *p, const xc_request *reqs, size_t n) {
    int *load = xcalloc((size_t)p->ranks, sizeof *load);
    double sum = 0;
    size_t groups = 0;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        memset(load, 0, (size_t)p->ranks * sizeof *load);
        int mx = 0;
        for (; j < n && reqs[j].step == reqs[i].step && reqs[j].layer == reqs[i].layer; j++) {
            const xc_request *q = &reqs[j];
            if (q->layer < 0 || q->layer >= p->layers || q->expert < 0 || q->expert >= p->experts) continue;
            int r = p->owner[(size_t)q->layer * p->experts + q->expert];
            if (++load[r] > mx) mx = load[r];
        }
        sum += mx;
        groups++;
        i = j;
    }
    free(load);
    return groups ? sum / (double)groups : 0;
}

int k3_placement_save(const k3_placement *p, const char *path, k3_err *err) {
    json_t *o = json_object(), *own = json_array();
    json_object_set_new(o, "format", json_string("k3-expert-placement"));
    json_object_set_new(o, "version", json_integer(1));
    json_object_set_new(o, "ranks", json_integer(p->ranks));
    json_object_set_new(o, "num_layers", json_integer(p->layers));
    json_object_set_new(o, "num_experts", json_integer(p->experts));
    for (int L = 0; L < p->layers; L++) {
        json_t *row = json_array();
        for (int e = 0; e < p->experts; e++) json_array_append_new(row, json_integer(p->owner[(size_t)L * p->experts + e]));
        json_array_append_new(own, row);
    }
    json_object_set_new(o, "owner", own);
    char *txt = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!txt) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot serialise the placement", path);
    size_t n = strlen(txt);
    char *buf = xmalloc(n + 2);
    memcpy(buf, txt, n);
    buf[n] = '\n';
    free(txt);
    int rc = k3_write_file_atomic(path, buf, n + 1, err);
    free(buf);
    return rc;
}

static int get_int(json_t *o, const char *key, const char *path, int64_t *v, k3_err *err) {
    json_t *x = json_object_get(o, key);
    if (!json_is_integer(x)) return k3_fail(err, K3_EXIT_USAGE, "%s: not a k3 expert placement (no integer \"%s\")", path, key);
    *v = json_integer_value(x);
    return K3_OK;
}

int k3_placement_load(const char *path, int ranks, const k3_config *c, k3_placement *p, k3_err *err) {
    memset(p, 0, sizeof *p);
    json_error_t je;
    json_t *o = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!o) return k3_fail(err, K3_EXIT_USAGE, "%s: %s", path, je.text);
    int rc = K3_OK;
    int64_t R = 0, NL = 0, N = 0;
    json_t *fmt = json_object_get(o, "format"), *own = json_object_get(o, "owner");
    if (!json_is_string(fmt) || strcmp(json_string_value(fmt), "k3-expert-placement")) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: not a k3 expert placement (format is not \"k3-expert-placement\")", path);
        goto done;
    }
    if ((rc = get_int(o, "ranks", path, &R, err)) || (rc = get_int(o, "num_layers", path, &NL, err)) ||
        (rc = get_int(o, "num_experts", path, &N, err)))
        goto done;
    if (R != ranks) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: made for %lld ranks, this job has %d", path, (long long)R, ranks);
        goto done;
    }
    if (N != c->num_experts) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: made for %lld experts per layer, the model has %d", path, (long long)N,
                     c->num_experts);
        goto done;
    }
    if (NL < c->num_layers || NL > K3_MAX_LAYERS) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: covers %lld layers, the run has %d", path, (long long)NL, c->num_layers);
        goto done;
    }
    if (!json_is_array(own) || (int64_t)json_array_size(own) != NL) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: \"owner\" is not an array of %lld layers", path, (long long)NL);
        goto done;
    }
    p->ranks = ranks;
    p->layers = c->num_layers;
    p->experts = (int)N;
    p->owner = xmalloc_array((size_t)p->layers * (size_t)(N > 0 ? N : 1), sizeof *p->owner);
    for (int L = 0; L < p->layers && !rc; L++) {
        json_t *row = json_array_get(own, (size_t)L);
        if (!json_is_array(row) || (int64_t)json_array_size(row) != N) {
            rc = k3_fail(err, K3_EXIT_USAGE, "%s: owner[%d] is not an array of %lld ranks", path, L, (long long)N);
            break;
        }
        for (int e = 0; e < N; e++) {
            json_t *x = json_array_get(row, (size_t)e);
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= ranks) {
                rc = k3_fail(err, K3_EXIT_USAGE, "%s: owner[%d][%d] is not a rank in 0..%d", path, L, e, ranks - 1);
                break;
            }
            p->owner[(size_t)L * N + e] = (int32_t)json_integer_value(x);
        }
    }
done:
    json_decref(o);
    if (rc) k3_placement_free(p);
    return rc;
}

uint64_t k3_placement_hash(const k3_placement *p) {
    uint64_t h = k3_fnv1a64(1469598103934665603ull, &p->ranks, sizeof p->ranks);
    h = k3_fnv1a64(h, &p->layers, sizeof p->layers);
    h = k3_fnv1a64(h, &p->experts, sizeof p->experts);
    return k3_fnv1a64(h, p->owner, (size_t)p->layers * (size_t)p->experts * sizeof *p->owner);
}

void k3_placement_free(k3_placement *p) {
    free(p->owner);
    memset(p, 0, sizeof *p);
}

/* ---- the source ------------------------------------------------------------ */

#define EP_MAGIC 0x4B335850u /* "K3XP" */

typedef struct {
    uint32_t magic;
    int32_t layer, n, nrows;
    uint64_t route;              /* the chunk's routing: ids and row counts */
} blk_hdr;

struct k3_ep {
    k3_weight_source src, in;
    k3_placement p;
    int rank, size;
    size_t *cnt, *sizes, *pos;
    char *send;
    size_t send_cap;
    char **recv;
    size_t *recv_cap;
};

static int ep_layer_get(void *c, int L, const k3_layer_w **w, k3_err *err) {
    k3_ep *ep = c;
    return ep->in.layer_get(ep->in.ctx, L, w, err);
}
static void ep_layer_put(void *c, int L) {
    k3_ep *ep = c;
    if (ep->in.layer_put) ep->in.layer_put(ep->in.ctx, L);
}
static int ep_experts_get(void *c, int L, const int *ids, int n, k3_expert_w *ex, k3_err *err) {
    k3_ep *ep = c;
    if (n == 0) return K3_OK;
    if (!ep->in.experts_get) return k3_fail(err, K3_EXIT_RUNTIME, "layer %d: the weight source serves no experts", L);
    return ep->in.experts_get(ep->in.ctx, L, ids, n, ex, err);
}
static void ep_experts_put(void *c, int L, const int *ids, int n) {
    k3_ep *ep = c;
    if (n && ep->in.experts_put) ep->in.experts_put(ep->in.ctx, L, ids, n);
}
static int ep_experts_start(void *c, int L, const int *ids, int n, k3_expert_w *ex, k3_err *err) {
    k3_ep *ep = c;
    return ep->in.experts_start(ep->in.ctx, L, ids, n, ex, err);
}
static int ep_experts_next(void *c, int L, int *i, k3_err *err) {
    k3_ep *ep = c;
    return ep->in.experts_next(ep->in.ctx, L, i, err);
}
static bool ep_owned(void *c, int L, int e) {
    k3_ep *ep = c;
    return ep->p.owner[(size_t)L * ep->p.experts + e] == ep->rank;
}

static void *grow(void *p, size_t *cap, size_t need) {
    if (need <= *cap) return p;
    *cap = need > 2 * *cap ? need : 2 * *cap;
    free(p);
    return xmalloc(*cap);
}

static int ep_combine(void *c, int L, const int *ids, const int *rows, int n, float *out, int width, k3_err *err) {
    k3_ep *ep = c;
    int R = ep->size, me = ep->rank;
    if (k3_dist_fault_error())
        return k3_fail(err, K3_EXIT_RUNTIME, "layer %d: expert outputs: injected fault (K3_DIST_FAULT)", L);
    const int32_t *own = ep->p.owner + (size_t)L * ep->p.experts;
    size_t rowb = (size_t)width * sizeof(float);
    memset(ep->cnt, 0, (size_t)R * sizeof *ep->cnt);
    blk_hdr h = {.magic = EP_MAGIC, .layer = L, .n = n, .nrows = rows[n]};
    h.route = k3_fnv1a64(1469598103934665603ull, ids, (size_t)n * sizeof *ids);
    h.route = k3_fnv1a64(h.route, rows, (size_t)(n + 1) * sizeof *rows);
    for (int u = 0; u < n; u++) ep->cnt[own[ids[u]]] += (size_t)(rows[u + 1] - rows[u]);
    size_t mine = sizeof h + ep->cnt[me] * rowb;
    ep->send = grow(ep->send, &ep->send_cap, mine);
    memcpy(ep->send, &h, sizeof h);
    size_t at = sizeof h;
    for (int u = 0; u < n; u++)
        if (own[ids[u]] == me) {
            size_t b = (size_t)(rows[u + 1] - rows[u]) * rowb;
            memcpy(ep->send + at, out + (size_t)rows[u] * width, b);
            at += b;
        }
    for (int r = 0; r < R; r++) {
        ep->sizes[r] = sizeof h + ep->cnt[r] * rowb;
        if (r != me) ep->recv[r] = grow(ep->recv[r], &ep->recv_cap[r], ep->sizes[r]);
        ep->pos[r] = sizeof h;
    }
    char what[64];
    snprintf(what, sizeof what, "layer %d's expert outputs", L);
    k3_dist_exchange(ep->send, mine, (void *const *)ep->recv, ep->sizes, what);
    for (int r = 0; r < R; r++) {
        if (r == me) continue;
        blk_hdr g;
        memcpy(&g, ep->recv[r], sizeof g);
        if (g.magic != EP_MAGIC || g.layer != L)
            return k3_fail(err, K3_EXIT_RUNTIME, "%s: rank %d (%s) is at another step (its layer %d): the ranks ran "
                           "different forward calls", what, r, k3_dist_host(r), g.layer);
        if (g.n != n || g.nrows != h.nrows || g.route != h.route)
            return k3_fail(err, K3_EXIT_RUNTIME,
                           "%s: rank %d (%s) routed the tokens to other experts than rank %d: the ranks compute other "
                           "bits (another build, or different inputs)", what, r, k3_dist_host(r), me);
    }
    for (int u = 0; u < n; u++) {
        int r = own[ids[u]];
        if (r == me) continue;
        size_t b = (size_t)(rows[u + 1] - rows[u]) * rowb;
        memcpy(out + (size_t)rows[u] * width, ep->recv[r] + ep->pos[r], b);
        ep->pos[r] += b;
    }
    return K3_OK;
}

k3_ep *k3_ep_new(const k3_weight_source *inner, const k3_placement *p, int rank, int size) {
    k3_ep *ep = xcalloc(1, sizeof *ep);
    ep->in = *inner;
    ep->p = *p;
    ep->p.owner = xmalloc_array((size_t)p->layers * (size_t)p->experts, sizeof *ep->p.owner);
    memcpy(ep->p.owner, p->owner, (size_t)p->layers * (size_t)p->experts * sizeof *ep->p.owner);
    ep->rank = rank;
    ep->size = size;
    ep->cnt = xcalloc((size_t)size, sizeof *ep->cnt);
    ep->sizes = xcalloc((size_t)size, sizeof *ep->sizes);
    ep->pos = xcalloc((size_t)size, sizeof *ep->pos);
    ep->recv = xcalloc((size_t)size, sizeof *ep->recv);
    ep->recv_cap = xcalloc((size_t)size, sizeof *ep->recv_cap);
    ep->src = (k3_weight_source){.ctx = ep, .layer_get = ep_layer_get, .layer_put = ep_layer_put,
                                 .experts_get = ep_experts_get, .experts_put = ep_experts_put,
                                 .expert_owned = ep_owned, .experts_combine = ep_combine};
    if (inner->experts_start && inner->experts_next) {
        ep->src.experts_start = ep_experts_start;
        ep->src.experts_next = ep_experts_next;
    }
    return ep;
}

const k3_weight_source *k3_ep_source(k3_ep *ep) { return &ep->src; }

void k3_ep_free(k3_ep *ep) {
    if (!ep) return;
    for (int r = 0; r < ep->size; r++) free(ep->recv[r]);
    free(ep->recv);
    free(ep->recv_cap);
    free(ep->send);
    free(ep->cnt);
    free(ep->sizes);
    free(ep->pos);
    free(ep->p.owner);
    free(ep);
}
