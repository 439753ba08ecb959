/* mla.c: the Gated MLA with NoPE block of the layer graph (spec section 9),
 * the one forward of MLA: `k3 run` calls it on one sequence with its latent
 * cache, `k3 train` on B sequences with a record for its backward
 * (src/train/tmla.c) and the training GEMM as its products.
 *
 *   c_q  = RMSNorm(q_a x; eps_lat)        q_h = [q_nope_h ; q_rope_h] = (q_b c_q)_h
 *   c    = kv_a x:  c_kv = RMSNorm(c[0:r_kv]; eps_lat), k_rope = c[r_kv:]  (one key for all heads)
 *   score_h(s) = (q_nope_h . Wk_h c_kv(s) + q_rope_h . k_rope(s)) / sqrt(d_n + d_r)
 *   a_h        = Wv_h sum_s softmax(score_h)_s c_kv(s)
 *   y          = o_proj(sigmoid(g_proj x) * a)
 * Wk_h / Wv_h are head h's key / value rows of kv_b_proj. No rotary anywhere.
 *
 * The attention core has two forms of the same function, as KDA's recurrence
 * has two:
 *  - absorbed (k3 run): the cache holds [c_kv ; k_rope] per position, the
 *    LATENT, never expanded keys; Wk_h is absorbed into the query
 *    (Wk_h^T q_nope_h) and Wv_h applied once to the attended latent. The
 *    decode-friendly form.
 *  - expanded (k3 train, with a record): keys and values kv_b c_kv for every
 *    position of the sequence, the T x T probabilities kept for the backward.
 * The projections, norms, gate and output around the core are one code path. */
#include "model/model_impl.h"

#include <assert.h>
#include <math.h>
#include <omp.h>


/* A view of rows [r0, r0+n) of a float matrix (never MXFP4 here). */
static k3_mat mat_rows(const k3_mat *W, int r0, int n) {
    k3_mat v = *W;
    size_t es = W->type == KW_BF16 ? 2 : 4;
    v.data = (const char *)W->data + (size_t)r0 * (size_t)W->cols * es;
    v.rows = n;
    return v;
}

/* Softmax over positions 0..n-1 of one head's scores at one position:
 * (q_abs . c_kv(p) + q_rope . k_rope(p)) * scale, two canonical dots. */
static void mla_scores(float *sc, float *sr, const float *qa, const float *qrope, const float *latent, int W, int rkv,
                       int dr, int n, float scale) {
    k_dots(sc, qa, latent, (size_t)W, n, rkv);
    k_dots(sr, qrope, latent + rkv, (size_t)W, n, dr);
    for (int p = 0; p < n; p++) sc[p] = (sc[p] + sr[p]) * scale;
    k_softmax(sc, n);
}

/* One decoded row's attention (row r of N, its sequence's n cached
 * positions in latent) for heads [h0, h1): scores, softmax and the attended
 * latents into ctx. Each head's scores, softmax and weighted sum are the ones
 * of a whole row at a time (a score is its row's own canonical dot; a ctx
 * element gets its fmas over p in order whatever the blocks), so the cache is
 * read in blocks of rows that stay in L2 while every head of the call uses
 * them: twice a layer instead of about once per head. A block is a multiple
 * of 16 rows, so the dot kernels group rows as over the whole cache.
 * score: [2][H][nmax] (the heads' own parts). */
static void attend_row(const k3_config *c, const float *latent, int n, const float *qabs, const float *q, float *ctx,
                       size_t N, size_t r, int h0, int h1, float *score, int nmax) {
    const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, rkv = c->kv_lora_rank, W = rkv + dr,
              dq = dn + dr;
    const float scale = 1.0f / sqrtf((float)dq);
    k3_mat lat_m = {.type = KW_F32, .rows = n, .cols = W, .data = latent};
    int blk = (int)((256 * 1024) / ((size_t)W * sizeof(float))) / 16 * 16;
    if (blk < 16) blk = 16;
    for (int p0 = 0; p0 < n; p0 += blk) {
        int pn = n - p0 < blk ? n - p0 : blk;
        const float *lb = latent + (size_t)p0 * W;
        for (int h = h0; h < h1; h++) {
            float *sc = score + (size_t)h * nmax + p0, *sr = score + (size_t)(H + h) * nmax + p0;
            k_dots(sc, qabs + ((size_t)h * N + r) * rkv, lb, (size_t)W, pn, rkv);
            k_dots(sr, q + r * H * dq + (size_t)h * dq + dn, lb + rkv, (size_t)W, pn, dr);
            for (int p = 0; p < pn; p++) sc[p] = (sc[p] + sr[p]) * scale;
        }
    }
    for (int h = h0; h < h1; h++) k_softmax(score + (size_t)h * nmax, n);
    /* ctx_h = sum_p s_h[p] c_kv(p): all the call's heads on each block */
    if (h1 > h0)
        for (int p0 = 0; p0 < n; p0 += blk) {
            int pn = n - p0 < blk ? n - p0 : blk;
            k_gemm_acc(ctx + ((size_t)h0 * N + r) * rkv, (int)(N * rkv), h1 - h0, rkv, score + (size_t)h0 * nmax + p0,
                       nmax, pn, &lat_m, p0);
        }
}

/* The absorbed core of nseq sequences: sequence s's rows (T each, or
 * len[s]; N in all, one sequence after another) over its cache rows
 * 0..pos0[s]+rows-1: att [N][H dv]. The absorbed queries and the values are
 * products over all N rows at once (a row's bits never depend on the
 * others); the attention is each sequence's own. */
static void core_absorbed(const k3_config *c, const k3_mla_w *w, const k3_mla_cache *cache, const int *pos0,
                          int nseq, int T, const int *len, const float *q, int N, float *att, k3_ws *ws) {
    int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim;
    int rkv = c->kv_lora_rank, dq = dn + dr, W = rkv + dr, hkv = dn + dv;
    size_t Ns = (size_t)N;
    int nmax = 1;
    bool decode = true; /* one row a sequence */
    for (int s = 0; s < nseq; s++) {
        int Ts = len ? len[s] : T;
        if (pos0[s] + Ts > nmax) nmax = pos0[s] + Ts;
        decode = decode && Ts == 1;
    }
    /* head-major: qabs[h][r][rkv], ctx[h][r][rkv], vout[h][r][dv] */
    float *qabs = ws_f(ws, (size_t)H * Ns * rkv), *ctx = ws_f(ws, (size_t)H * Ns * rkv);
    /* scores: [2][H][nmax] per thread (the rope part is summed in after) */
    int nthr = omp_get_max_threads();
    float *score = ws_f(ws, (size_t)nthr * 2 * H * nmax), *vout = ws_f(ws, (size_t)H * Ns * dv);
    float scale = 1.0f / sqrtf((float)dq);
    /* absorbed queries Wk_h^T q_nope_h for every row at once: each element
     * gets its fmas over i in increasing order (as a loop of axpy) */
    memset(qabs, 0, (size_t)H * Ns * rkv * sizeof *qabs);
    memset(ctx, 0, (size_t)H * Ns * rkv * sizeof *ctx);
    float *wk = ws_f(ws, (size_t)nthr * dn * rkv); /* head h's key rows widened, per thread */
#pragma omp parallel for schedule(static) num_threads(nthr) if ((double)N * H * dn * rkv > 262144.0)
    for (int h = 0; h < H; h++) {
        float *b = wk + (size_t)omp_get_thread_num() * dn * rkv;
        for (int i = 0; i < dn; i++) k_mat_row(&w->kv_b, h * hkv + i, b + (size_t)i * rkv);
        k3_mat bm = {.type = KW_F32, .rows = dn, .cols = rkv, .data = b};
        k_gemm_acc(qabs + (size_t)h * Ns * rkv, rkv, N, rkv, q + (size_t)h * dq, H * dq, dn, &bm, 0);
    }
    const double big = 262144.0; /* multiply-adds worth a thread team */
    double all = 0;
    for (int s = 0; s < nseq; s++) all += (double)H * (pos0[s] + 1) * (W + rkv);
    if (decode && nseq > 1 && all / nseq <= big) {
        /* a batch of short decoded rows: the threads split the sequences */
#pragma omp parallel for schedule(dynamic, 1) if (all > big)
        for (int s = 0; s < nseq; s++)
            attend_row(c, cache[s].latent, pos0[s] + 1, qabs, q, ctx, Ns, (size_t)s, 0, H,
                       score + (size_t)omp_get_thread_num() * 2 * H * nmax, nmax);
    } else {
        for (int s = 0, r0 = 0; s < nseq; r0 += len ? len[s] : T, s++) {
            const int Ts = len ? len[s] : T;
            if (Ts == 1) { /* decoding: the heads in parallel (in groups of 4), never the positions */
                int ngrp = (H + 3) / 4, n = pos0[s] + 1;
#pragma omp parallel if ((double)H * n * (W + rkv) > big)
                {
                    int nt = omp_get_num_threads(), id = omp_get_thread_num();
                    int h0 = 4 * (int)((int64_t)ngrp * id / nt), h1 = 4 * (int)((int64_t)ngrp * (id + 1) / nt);
                    if (h1 > H) h1 = H;
                    attend_row(c, cache[s].latent, n, qabs, q, ctx, Ns, (size_t)r0, h0, h1, score, nmax);
                }
                continue;
            }
            /* prefill: the positions in parallel (one thread team), all heads of a position together */
            k3_mat lat_m = {.type = KW_F32, .rows = pos0[s] + Ts, .cols = W, .data = cache[s].latent};
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthr) if ((double)H * Ts * nmax * (W + rkv) > 2 * big)
            for (int t = 0; t < Ts; t++) {
                int n = pos0[s] + t + 1; /* causal: positions 0..pos0+t */
                size_t r = (size_t)r0 + (size_t)t;
                float *sb = score + (size_t)omp_get_thread_num() * 2 * H * nmax;
                for (int h = 0; h < H; h++)
                    mla_scores(sb + (size_t)h * nmax, sb + (size_t)(H + h) * nmax, qabs + ((size_t)h * Ns + r) * rkv,
                               q + (r * H + h) * dq + dn, cache[s].latent, W, rkv, dr, n, scale);
                k_gemm_acc(ctx + r * rkv, (int)(Ns * rkv), H, rkv, sb, nmax, n, &lat_m, 0);
            }
        }
    }
    /* values: head h's value rows of kv_b on its attended latents, all heads in one batch */
    k3_mat *wv = ws_get(ws, (size_t)H * sizeof *wv);
    k_prod *vj = ws_get(ws, (size_t)H * sizeof *vj);
    for (int h = 0; h < H; h++) {
        wv[h] = mat_rows(&w->kv_b, h * hkv + dn, dv);
        vj[h] = (k_prod){&wv[h], ctx + (size_t)h * Ns * rkv, N, vout + (size_t)h * Ns * dv};
    }
    k_products(vj, H);
    for (size_t r = 0; r < Ns; r++)
        for (int h = 0; h < H; h++)
            memcpy(att + (r * H + h) * dv, vout + ((size_t)h * Ns + r) * dv, (size_t)dv * sizeof *att);
}

/* The causal softmax of one row of T scores (already scaled, mx their
 * maximum over 0..t): positions 0..t normalised, the rest zero. */
static void causal_softmax_row(float *pr, int t, int T, float mx) {
    float sum = 0.0f;
    for (int s = 0; s <= t; s++) { pr[s] = km_exp(pr[s] - mx); sum += pr[s]; }
    for (int s = 0; s <= t; s++) pr[s] /= sum;
    for (int s = t + 1; s < T; s++) pr[s] = 0.0f;
}

/* Per sequence and head: the scores (Qn Kn^T + Qr Kr^T) scale over s <= t,
 * the causal softmax row by row, O = P V. bf16 (training's BF16 mode): the
 * two products as BF16 training GEMMs over the full T x T square (the masked
 * half multiplies the zeros of P), each on one thread; otherwise a canonical
 * dot per score and one fma chain per output element. Either way the bits do
 * not depend on the thread count. */
K3_HOT void k3_mla_attend_expanded(const k3_config *c, k3_mla_rec *r, int nseq, int T, bool bf16) {
    const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim,
              rkv = c->kv_lora_rank;
    const int dq = dn + dr, dkv = dn + dv, HV = H * dv, W = rkv + dr;
    const float scale = 1.0f / sqrtf((float)dq);
#pragma omp parallel for schedule(dynamic)
    for (int bh = 0; bh < nseq * H; bh++) {
        int b = bh / H, h = bh % H;
        float *P = r->pr + (size_t)bh * T * T, *o0 = r->o + (size_t)b * T * HV + (size_t)h * dv;
        const float *q0 = r->q + (size_t)b * T * H * dq + (size_t)h * dq;
        const float *kv0 = r->kv + (size_t)b * T * H * dkv + (size_t)h * dkv;
        const float *kr0 = r->ckv + (size_t)b * T * W + rkv; /* the one rope key, shared by the heads */
        if (bf16) {
            k_gemm(P, T, T, T, dn, (k_view){q0, H * dq, 1}, (k_view){kv0, 1, H * dkv}, false, K_GEMM_BF16);
            if (dr) k_gemm(P, T, T, T, dr, (k_view){q0 + dn, H * dq, 1}, (k_view){kr0, 1, W}, true, K_GEMM_BF16);
        } else {
            for (int t = 0; t < T; t++) {
                const float *qt = q0 + (size_t)t * H * dq;
                for (int s = 0; s <= t; s++) {
                    float sc = k_dot(qt, kv0 + (size_t)s * H * dkv, dn);
                    if (dr) sc += k_dot(qt + dn, kr0 + (size_t)s * W, dr);
                    P[(size_t)t * T + s] = sc;
                }
            }
        }
        for (int t = 0; t < T; t++) {
            float *pr = P + (size_t)t * T, mx = -INFINITY;
            for (int s = 0; s <= t; s++) {
                pr[s] *= scale;
                if (pr[s] > mx) mx = pr[s];
            }
            causal_softmax_row(pr, t, T, mx);
        }
        if (bf16) {
            k_gemm(o0, HV, T, dv, T, (k_view){P, T, 1}, (k_view){kv0 + dn, H * dkv, 1}, false, K_GEMM_BF16);
            continue;
        }
        for (int t = 0; t < T; t++) {
            const float *pr = P + (size_t)t * T;
            float *o = o0 + (size_t)t * HV;
            for (int j = 0; j < dv; j++) o[j] = 0.0f;
            for (int s = 0; s <= t; s++) {
                const float *vs = kv0 + (size_t)s * H * dkv + dn;
                for (int j = 0; j < dv; j++) o[j] = fmaf(pr[s], vs[j], o[j]);
            }
        }
    }
}

/* One term per ws_get in mla_block below (q, cq, cc, gate, att) and in
 * core_absorbed (qabs, ctx, score, vout, wk, wv, vj). */
size_t mla_ws_need(const k3_config *c, size_t N, int64_t max_pos) {
    size_t H = (size_t)c->mla_heads, dn = (size_t)c->qk_nope_dim, dq = dn + (size_t)c->qk_rope_dim,
           dv = (size_t)c->v_head_dim, rkv = (size_t)c->kv_lora_rank, W = rkv + (size_t)c->qk_rope_dim,
           thr = (size_t)omp_get_max_threads(), nmax = (size_t)max_pos;
    size_t block = wsz(N * H * dq) + (c->q_lora_rank > 0 ? wsz(N * (size_t)c->q_lora_rank) : 0) + wsz(N * W) +
                   2 * wsz(N * H * dv);
    size_t core = 2 * wsz(H * N * rkv) + wsz(thr * 2 * H * nmax) + wsz(H * N * dv) + wsz(thr * dn * rkv) +
                  wsb(H * sizeof(k3_mat)) + wsb(H * sizeof(k_prod));
    return block + core;
}

K3_HOT void mla_block(const k3_config *c, float eps_lat, const k3_mla_w *w, const k3_fwd_ops *fo,
                      const k3_mla_cache *cache, const int *pos0, const float *x, int nseq, int T, const int *len,
                      float *y, k3_mla_rec *rec, k3_ws *ws) {
    int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim;
    int rq = c->q_lora_rank, rkv = c->kv_lora_rank, dq = dn + dr, W = rkv + dr;
    int N = nseq * T; /* with lengths, sequence s has len[s] rows after those before it */
    if (len)
        for (int s = N = 0; s < nseq; s++) N += len[s];
    const size_t Ns = (size_t)N, NHV = Ns * H * dv;
    assert(rec || (cache && pos0 && ws)); /* the absorbed core needs each sequence's cache */
    assert(!len || !rec);
    float *q = rec ? rec->q : ws_f(ws, Ns * H * dq);
    float *cq = rq > 0 ? (rec ? rec->cq_pre : ws_f(ws, Ns * rq)) : NULL, *cc = rec ? rec->ckv : ws_f(ws, Ns * W);
    float *gate = w->g.rows ? (rec ? rec->gate : ws_f(ws, NHV)) : NULL;
    /* the projections of x in one pass (one thread team) */
    k_prod jobs[3];
    int nj = 0;
    jobs[nj++] = rq > 0 ? (k_prod){&w->q_a, x, N, cq} : (k_prod){&w->q_b, x, N, q};
    jobs[nj++] = (k_prod){&w->kv_a, x, N, cc};
    if (gate) jobs[nj++] = (k_prod){&w->g, x, N, gate};
    fo->products(jobs, nj);
    if (rq > 0) {
        float *cqn = rec ? rec->cq : cq; /* in place without a record */
        k3_rmsnorm_rows(cqn, rec ? rec->rcq : NULL, cq, w->q_a_norm, N, rq, eps_lat);
        k_prod qb = {&w->q_b, cqn, N, q};
        fo->products(&qb, 1);
    }
    float *att;
    if (rec) { /* the latent norm on a copy the backward reads; the expanded core */
        for (int n = 0; n < N; n++) memcpy(rec->clat + (size_t)n * rkv, cc + (size_t)n * W, sizeof(float) * rkv);
        k3_rmsnorm_rows(rec->ckvn, rec->rkv, rec->clat, w->kv_a_norm, N, rkv, eps_lat);
        k_prod kv = {&w->kv_b, rec->ckvn, N, rec->kv};
        fo->products(&kv, 1);
        k3_mla_attend_expanded(c, rec, nseq, T, fo->mla_bf16);
        att = rec->o;
    } else { /* the latent norm into each sequence's cache; the absorbed core */
        att = ws_f(ws, NHV);
        size_t r0 = 0;
        for (int s = 0; s < nseq; s++) {
            const int Ts = len ? len[s] : T;
            for (int t = 0; t < Ts; t++) {
                float *lat = cache[s].latent + (size_t)(pos0[s] + t) * W;
                k_rmsnorm(lat, cc + (r0 + t) * W, w->kv_a_norm, rkv, eps_lat);
                memcpy(lat + rkv, cc + (r0 + t) * W + rkv, (size_t)dr * sizeof(float));
            }
            r0 += (size_t)Ts;
        }
        core_absorbed(c, w, cache, pos0, nseq, T, len, q, N, att, ws);
    }
    float *ya = rec ? rec->y : att; /* o_proj's input */
    if (gate)
        for (size_t i = 0; i < NHV; i++) {
            float s = km_sigmoid(gate[i]);
            if (rec) gate[i] = s;
            ya[i] = s * att[i];
        }
    else if (ya != att)
        memcpy(ya, att, NHV * sizeof *ya);
    k_prod op = {&w->o, ya, N, y};
    fo->products(&op, 1);
}

void k3_mla(const k3_config *c, float latent_eps, const k3_mla_w *w, k3_mla_cache *cache, int pos0,
            const float *x, int T, float *y) {
    k3_ws ws;
    ws_init(&ws, 0);
    mla_block(c, latent_eps, w, &k3_infer_ops, cache, &pos0, x, 1, T, NULL, y, NULL, &ws);
    ws_free(&ws);
}

void k3_mla_rec_forward(const k3_config *c, float latent_eps, const k3_mla_w *w, const k3_fwd_ops *fo,
                        const float *x, int nseq, int T, float *y, k3_mla_rec *rec) {
    mla_block(c, latent_eps, w, fo, NULL, NULL, x, nseq, T, NULL, y, rec, NULL);
}
