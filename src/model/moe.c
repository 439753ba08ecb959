/* moe.c: the Stable LatentMoE block of the layer graph (spec section 10),
 * the one forward of LatentMoE: `k3 run` calls it with its experts resident
 * or served by a weight source (streamed, expert-parallel), `k3 train` with a
 * weight view onto its arena, the training GEMM as products and a record for
 * its backward (src/train/tmoe.c). The router is the kernels'
 * k_router_select; the shared experts' SiTU-GLU is the MLP block's
 * arithmetic (model.c). */
#include "model/model_impl.h"

#include <math.h>

/* The experts' products: jobs[0..ne) the routed experts' (many similar
 * ones), then nother more (the shared experts' down). Inference runs them
 * all in one thread team; a caller's expert_products (training) runs the
 * routed ones side by side, one thread each, and the others after. */
static void expert_products(const k3_fwd_ops *fo, const k_prod *jobs, int ne, int nother) {
    if (!fo->expert_products) {
        fo->products(jobs, ne + nother);
        return;
    }
    fo->expert_products(jobs, ne);
    if (nother) fo->products(jobs + ne, nother);
}

/* ---- Stable LatentMoE (section 10) -------------------------------------------------
 *   s = sigmoid(router x); T = top-k of s + bias (bias selects only)
 *   p = s_T / sum(s_T) * routed_scaling_factor
 *   z = W_down x                          [l]
 *   u = sum_j p_j * w2_j SiTU(w1_j z, w3_j z)   summed in slot order
 *   r = W_up RMSNorm(u; routed_expert_norm)
 *   y = r + shared(x)                     shared experts unweighted
 * The chunk's selected experts are fetched once (ascending ids) and each runs
 * on all the rows that chose it (all experts' products in one thread team);
 * each token then sums its slots in the router's order whatever the chunk. */

/* Decode (one position) from a source that reads experts asynchronously
 * (experts_start/next): the same products as moe() below, reordered so the reads overlap
 * compute. The router alone runs first and the batch is issued the moment it
 * has chosen; W_down and the whole shared-expert MLP run while the bytes are
 * in flight; then each routed expert is computed as its bytes arrive, in
 * completion order, into its own slot of out[]; the weighted sum runs
 * afterwards in the router's slot order, exactly as moe() does. Every product
 * is the same per-row kernel call as in moe() (k_products gives the bits of
 * k_matvec whatever the grouping), so the bits equal moe()'s and do not
 * depend on the order of arrival (test: stream_expert_arrival_order). */
K3_HOT static int moe_decode_overlapped(const k3_config *c, const k3_moe_w *w, const k3_fwd_ops *fo,
                                        const expert_access *xa, const float *x, float *y, k3_ws *ws, k3_err *err) {
    int N = c->num_experts, k = c->experts_per_token, l = c->latent_dim, I = c->moe_inter, E = c->hidden_size;
    int S = w->shared.gate.rows;
    const k3_weight_source *src = xa->src;
    float *rl = ws_f(ws, (size_t)N), *wt = ws_f(ws, (size_t)k);
    int *idx = ws_i(ws, (size_t)k), *ids = ws_i(ws, (size_t)k), *slot = ws_i(ws, (size_t)k);
    float *z = ws_f(ws, (size_t)l), *sg = S ? ws_f(ws, (size_t)S) : NULL, *su = S ? ws_f(ws, (size_t)S) : NULL;
    float *sh = S ? ws_f(ws, (size_t)E) : NULL;
    /* what reads x: W_down and the shared experts' gate and up, and the
     * router; when the products are a collective (the trunk split over the
     * ranks) all in one call, before the reads start, else the router alone
     * first and the rest while the experts are read */
    const bool batch = fo->collective;
    k_prod j1[4];
    int nj = 0;
    if (batch) j1[nj++] = (k_prod){&w->router, x, 1, rl};
    else k_matvec(&w->router, x, rl);
    j1[nj++] = (k_prod){&w->down, x, 1, z};
    if (S) {
        j1[nj++] = (k_prod){&w->shared.gate, x, 1, sg};
        j1[nj++] = (k_prod){&w->shared.up, x, 1, su};
    }
    if (batch) {
        fo->products(j1, nj);
        if (S) situ_par(c, sg, sg, su, (size_t)S);
    }
    k_router_topk(rl, w->router_bias, N, k, c->moe_renormalize, c->routed_scaling_factor, idx, wt);
    /* the union, ascending: top-k picks k distinct experts */
    for (int s = 0; s < k; s++) ids[s] = idx[s];
    for (int a = 1; a < k; a++)
        for (int b = a; b > 0 && ids[b - 1] > ids[b]; b--) {
            int t = ids[b];
            ids[b] = ids[b - 1];
            ids[b - 1] = t;
        }
    for (int s = 0; s < k; s++)
        for (int u = 0; u < k; u++)
            if (ids[u] == idx[s]) slot[s] = u;
    /* the ones this process computes (all but under expert parallelism) */
    bool ep = src->expert_owned && src->experts_combine;
    int *sel = ws_i(ws, (size_t)k), *sid = ws_i(ws, (size_t)k), ns = 0;
    for (int u = 0; u < k; u++)
        if (!ep || src->expert_owned(src->ctx, xa->layer, ids[u])) {
            sel[ns] = u;
            sid[ns++] = ids[u];
        }
    k3_expert_w *ex = ws_get(ws, (size_t)k * sizeof *ex);
    int rc = src->experts_start(src->ctx, xa->layer, sid, ns, ex, err);
    if (rc) return rc;

    /* while the experts are read: W_down and the shared experts */
    if (!batch) {
        k_products(j1, nj);
        if (S) {
            situ_par(c, sg, sg, su, (size_t)S);
            k_matvec(&w->shared.down, sg, sh);
        }
    }

    /* each expert as it arrives, into its own slot */
    float *h1 = ws_f(ws, (size_t)k * I), *h3 = ws_f(ws, (size_t)k * I), *out = ws_f(ws, (size_t)k * l);
    for (int got = 0; got < ns; got++) {
        int i = -1;
        if ((rc = src->experts_next(src->ctx, xa->layer, &i, err))) return rc;
        if (i < 0 || i >= ns)
            return k3_fail(err, K3_EXIT_RUNTIME, "layer %d: the weight source returned expert %d of %d", xa->layer,
                           i, ns);
        int u = sel[i];
        float *a1 = h1 + (size_t)u * I, *a3 = h3 + (size_t)u * I;
        k_prod jg[2] = {{&ex[i].w1, z, 1, a1}, {&ex[i].w3, z, 1, a3}};
        k_products(jg, 2);
        situ_par(c, a1, a1, a3, (size_t)I);
        k_matvec(&ex[i].w2, a1, out + (size_t)u * l);
    }
    if (src->experts_put) src->experts_put(src->ctx, xa->layer, sid, ns);
    if (ep) { /* the other ranks' experts: one output row each */
        int *rows = ws_i(ws, (size_t)k + 1);
        for (int u = 0; u <= k; u++) rows[u] = u;
        if ((rc = src->experts_combine(src->ctx, xa->layer, ids, rows, k, out, l, err))) return rc;
    }

    /* sum_j p_j e_j in the router's slot order (as moe()) */
    float *a = ws_f(ws, (size_t)l);
    memset(a, 0, (size_t)l * sizeof *a);
    for (int s = 0; s < k; s++) {
        float p = wt[s];
        const float *e = out + (size_t)slot[s] * l;
        for (int j = 0; j < l; j++) a[j] = fmaf(p, e[j], a[j]);
    }
    if (w->norm) k_rmsnorm(a, a, w->norm, l, c->rms_eps);
    k_prod jo[2] = {{&w->up, a, 1, y}}; /* batched: with the shared experts' down */
    int no = 1;
    if (S && batch) jo[no++] = (k_prod){&w->shared.down, sg, 1, sh};
    fo->products(jo, no);
    if (S) add_rows(y, sh, (size_t)E);
    return K3_OK;
}

/* One term per ws_get in moe_block below for T rows without a record (and
 * in moe_decode_overlapped for a single row), whichever is larger. */
size_t moe_ws_need(const k3_config *c, size_t T) {
    size_t N = (size_t)c->num_experts, k = (size_t)c->experts_per_token, l = (size_t)c->latent_dim,
           I = (size_t)c->moe_inter, E = (size_t)c->hidden_size, S = (size_t)c->num_shared_experts * I,
           Tk = T * k, sh = S ? 2 * wsz(T * S) + wsz(T * E) : 0;
    size_t chunk = wsz(T * N) + 2 * wsz(Tk) + wsz(T * l) + sh /* rl wt idx z sg su sh */
                   + 2 * wsz(N) + wsz(N + 1) + 2 * wsz(N) + wsb(N * sizeof(k3_expert_w)) /* cnt ids at sel sid ex */
                   + 2 * wsz(Tk * l) + 2 * wsz(Tk * I) + wsz(Tk) + wsz(N) /* zin out h1 h3 rowat fill */
                   + wsb((2 * N + 1) * sizeof(k_prod));                     /* jb */
    size_t one = wsz(N) + 4 * wsz(k) + wsz(l) + (S ? 2 * wsz(S) + wsz(E) : 0) /* rl wt idx ids slot z sg su sh */
                 + 2 * wsz(k) + wsb(k * sizeof(k3_expert_w))                  /* sel sid ex */
                 + 2 * wsz(k * I) + wsz(k * l) + wsz(k + 1) + wsz(l);         /* h1 h3 out rows a */
    return T == 1 && one > chunk ? one : chunk;
}

K3_HOT int moe_block(const k3_config *c, const k3_moe_w *w, const k3_fwd_ops *fo, const expert_access *xa,
                     const float *x, int T, float *y, k3_moe_rec *rec, k3_ws *ws, k3_err *err) {
    if (T == 1 && !rec && !fo->experts_split && xa->src && xa->src->experts_start && xa->src->experts_next)
        return moe_decode_overlapped(c, w, fo, xa, x, y, ws, err);
    int N = c->num_experts, k = c->experts_per_token, l = c->latent_dim, I = c->moe_inter, E = c->hidden_size;
    size_t Ts = (size_t)T, Tk = Ts * (size_t)k;
    int S = w->shared.gate.rows;
    float *rl = ws_f(ws, Ts * N), *wt = rec ? rec->p : ws_f(ws, Tk);
    int *idx = rec ? rec->idx : ws_i(ws, Tk);
    float *z = rec ? rec->z : ws_f(ws, Ts * l);
    float *sg = S ? (rec ? rec->sh.g : ws_f(ws, Ts * S)) : NULL, *su = S ? (rec ? rec->sh.u : ws_f(ws, Ts * S)) : NULL;
    /* everything that reads x, in one pass: router, W_down, shared gate/up */
    k_prod j1[4] = {{&w->router, x, T, rl}, {&w->down, x, T, z}};
    int nj = 2;
    if (S) {
        j1[nj++] = (k_prod){&w->shared.gate, x, T, sg};
        j1[nj++] = (k_prod){&w->shared.up, x, T, su};
    }
    fo->products(j1, nj);
#pragma omp parallel for schedule(static) if (rec) /* tokens independent: the same bits */
    for (int t = 0; t < T; t++)
        k_router_select(rl + (size_t)t * N, w->router_bias, N, k, c->moe_renormalize, c->routed_scaling_factor,
                        idx + (size_t)t * k, wt + (size_t)t * k, rec ? rec->s + (size_t)t * N : NULL,
                        rec ? rec->cut + t : NULL);

    /* union of the selections, ascending */
    int *cnt = ws_i(ws, (size_t)N), *ids = ws_i(ws, (size_t)N), *at = ws_i(ws, (size_t)N + 1);
    memset(cnt, 0, (size_t)N * sizeof *cnt);
    for (size_t i = 0; i < Tk; i++) cnt[idx[i]]++;
    int nu = 0;
    at[0] = 0;
    for (int e = 0; e < N; e++)
        if (cnt[e]) {
            ids[nu] = e;
            at[nu + 1] = at[nu] + cnt[e];
            nu++;
        }
    /* the ones this process computes (all but under expert parallelism) */
    const k3_weight_source *src = xa->src;
    bool ep = src && src->expert_owned && src->experts_combine;
    int *sel = ws_i(ws, (size_t)N), *sid = ws_i(ws, (size_t)N), ns = 0;
    for (int u = 0; u < nu; u++)
        if (!ep || src->expert_owned(src->ctx, xa->layer, ids[u])) {
            sel[ns] = u;
            sid[ns++] = ids[u];
        }
    k3_expert_w *ex = ws_get(ws, (size_t)nu * sizeof *ex);
    if (src) {
        int rc = src->experts_get(src->ctx, xa->layer, sid, ns, ex, err);
        if (rc) return rc;
    } else {
        for (int i = 0; i < ns; i++) ex[i] = xa->experts[sid[i]];
    }

    /* rows grouped by expert (ascending id; within an expert, slot order):
     * zin[at[u] ..] are expert u's inputs, slot[] where each row's result goes */
    float *zin = ws_f(ws, Tk * l), *h1 = rec ? rec->g1 : ws_f(ws, Tk * I), *h3 = rec ? rec->g3 : ws_f(ws, Tk * I);
    float *hh = rec ? rec->h : h1, *out = rec ? rec->e : ws_f(ws, Tk * l); /* SiTU-GLU output in h1 unrecorded */
    int *rowat = rec ? rec->row : ws_i(ws, Tk), *fill = ws_i(ws, (size_t)N);
    for (int u = 0; u < nu; u++) fill[ids[u]] = at[u];
    for (size_t i = 0; i < Tk; i++) {
        int r = fill[idx[i]]++;
        memcpy(zin + (size_t)r * l, z + (i / (size_t)k) * l, (size_t)l * sizeof(float));
        rowat[i] = r;
    }
    /* every selected expert's gate and up in one thread team, then every down
     * (with the shared experts' down): the experts are read once per chunk */
    k_prod *jb = ws_get(ws, (2 * (size_t)nu + 1) * sizeof *jb);
    for (int i = 0; i < ns; i++) {
        int u = sel[i], n = at[u + 1] - at[u];
        jb[2 * i] = (k_prod){&ex[i].w1, zin + (size_t)at[u] * l, n, h1 + (size_t)at[u] * I};
        jb[2 * i + 1] = (k_prod){&ex[i].w3, zin + (size_t)at[u] * l, n, h3 + (size_t)at[u] * I};
    }
    expert_products(fo, jb, 2 * ns, 0);
    situ_par(c, hh, h1, h3, Tk * I);
    float *sh = NULL, *sgo = NULL;
    nj = ns;
    for (int i = 0; i < ns; i++) {
        int u = sel[i];
        jb[i] = (k_prod){&ex[i].w2, hh + (size_t)at[u] * I, at[u + 1] - at[u], out + (size_t)at[u] * l};
    }
    if (S) { /* the shared experts' down here, or batched with W_up when the products are a collective */
        sgo = rec ? rec->sh.h : sg;
        situ_par(c, sgo, sg, su, Ts * S);
        sh = ws_f(ws, Ts * E);
        if (!fo->collective) jb[nj++] = (k_prod){&w->shared.down, sgo, T, sh};
    }
    expert_products(fo, jb, ns, nj - ns); /* the routed experts' down, then the shared experts' */
    if (src && src->experts_put) src->experts_put(src->ctx, xa->layer, sid, ns);
    if (ep) { /* the other ranks' experts' output rows */
        int rc = src->experts_combine(src->ctx, xa->layer, ids, at, nu, out, l, err);
        if (rc) return rc;
    }

    /* per token: sum_j p_j e_j in the router's slot order */
    float *agg = rec ? rec->u : zin; /* gathered inputs are consumed */
#pragma omp parallel for schedule(static) if (rec)
    for (int t = 0; t < T; t++) {
        float *a = agg + (size_t)t * l;
        memset(a, 0, (size_t)l * sizeof *a);
        for (int s = 0; s < k; s++) {
            size_t i = (size_t)t * k + s;
            float p = wt[i];
            const float *e = out + (size_t)rowat[i] * l;
            for (int j = 0; j < l; j++) a[j] = fmaf(p, e[j], a[j]);
        }
        if (w->norm && !rec) k_rmsnorm(a, a, w->norm, l, c->rms_eps);
    }
    if (w->norm && rec) { /* the same norm with the record */
        k3_rmsnorm_rows(rec->un, rec->ru, agg, w->norm, T, l, c->rms_eps);
        agg = rec->un;
    }
    k_prod up[2] = {{&w->up, agg, T, y}};
    int nup = 1;
    if (S && fo->collective) up[nup++] = (k_prod){&w->shared.down, sgo, T, sh};
    fo->products(up, nup);
    if (S) add_rows(y, sh, Ts * E);
    return K3_OK;
}

void k3_moe(const k3_config *c, const k3_moe_w *w, const k3_expert_w *experts, const float *x, int T,
            float *y) {
    k3_ws ws;
    ws_init(&ws, 0);
    expert_access xa = {.experts = experts};
    moe_block(c, w, &k3_infer_ops, &xa, x, T, y, NULL, &ws, NULL);
    ws_free(&ws);
}

int k3_moe_source(const k3_config *c, const k3_moe_w *w, const k3_weight_source *src, int L, const float *x, int T,
                  float *y, k3_err *err) {
    if (!src || !src->experts_get) return k3_fail(err, K3_EXIT_RUNTIME, "layer %d: the weight source serves no experts", L);
    k3_ws ws;
    ws_init(&ws, 0);
    expert_access xa = {.src = src, .layer = L};
    int rc = moe_block(c, w, &k3_infer_ops, &xa, x, T, y, NULL, &ws, err);
    ws_free(&ws);
    return rc;
}

void k3_moe_rec_forward(const k3_config *c, const k3_moe_w *w, const k3_fwd_ops *fo, const float *x, int N,
                        float *y, k3_moe_rec *rec) {
    k3_ws ws;
    ws_init(&ws, 0);
    expert_access xa = {.experts = w->experts};
    moe_block(c, w, fo, &xa, x, N, y, rec, &ws, NULL); /* resident experts: nothing can fail */
    ws_free(&ws);
}

