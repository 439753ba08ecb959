/* stream_experts.c: the routed experts of the streaming weight source: a
 * layer's batch of experts is served from the expert cache where it hits and
 * read from the shards where it misses, through the expert io_uring, handed
 * out one expert at a time as its bytes arrive. While a batch is in flight the
 * trunk's I/O thread (stream.c) sends no new piece. */
#include "memory/stream_source.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

void k3s_free_push(k3_stream *s, int64_t b) { s->free_list[s->nfree++] = b; }

static int shard_fd(k3_stream *s, int shard, k3_err *err) {
    if (s->sfd[shard] < 0) {
        bool d = false;
        int rc = k3_io_open(s->xio, st_shard_at(s->ix, shard)->path, &s->sfd[shard], &d, err);
        if (rc) return rc;
        s->xdirect = d;
    }
    return s->sfd[shard];
}

static void make_mat(const k3_stream *s, const xlayout *x, int m, const uint8_t *buf, int rows, int cols, k3_mat *out) {
    memset(out, 0, sizeof *out);
    out->rows = rows;
    out->cols = cols;
    out->data = buf + x->pos[x->data[m]];
    if (x->scale[m] >= 0) {
        out->type = KW_MXFP4;
        out->scales = buf + x->pos[x->scale[m]];
        out->group = s->cfg.mxfp4_group > 0 ? s->cfg.mxfp4_group : 32;
    } else {
        out->type = x->t[x->data[m]]->dtype == ST_BF16 ? KW_BF16 : KW_F32;
    }
}

/* A batch is issued by experts_start and handed out one expert at a time by
 * experts_next as its bytes arrive (so the model computes each expert while
 * the others are read). Hits are ready at once; every missing expert is
 * one read (or one per tensor), all sent together in offset order through
 * the expert io_uring, more as completions free depth. While the batch is in
 * flight the trunk I/O thread sends no new piece (xpending). */

static int cmp_reqp(const void *x, const void *y) {
    const k3_io_req *a = *(k3_io_req *const *)x, *b = *(k3_io_req *const *)y;
    if (a->fd != b->fd) return a->fd < b->fd ? -1 : 1;
    return a->offset < b->offset ? -1 : (a->offset > b->offset);
}

/* The batch's reads are all in (or abandoned): the trunk may read again. */
static void batch_done(k3_stream *s) {
    if (!s->xbusy) return;
    pthread_mutex_lock(&s->mu);
    __atomic_store_n(&s->xpending, 0, __ATOMIC_RELEASE);
    k3s_disk_use(s, -1);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    s->xbusy = false;
}

static int send_more(k3_stream *s, k3_err *err) {
    int room = s->o.io_depth - k3_io_inflight(s->xio);
    size_t n = s->nreq - s->nsent;
    if (room <= 0 || n == 0) return K3_OK;
    if (n > (size_t)room) n = (size_t)room;
    int rc = k3_io_submit_batch(s->xio, s->xq + s->nsent, (int)n, err);
    if (!rc) s->nsent += n;
    return rc;
}

/* A failed batch: nothing may still write into the buffers, they go back, the
 * source is poisoned (the cache may name experts whose bytes never came). */
static int batch_failed(k3_stream *s, int L, k3_err *err) {
    while (k3_io_inflight(s->xio) > 0) {
        k3_io_req *d;
        k3_err e = {0};
        k3_io_complete(s->xio, &d, &e);
    }
    batch_done(s);
    char m[sizeof err->msg];
    snprintf(m, sizeof m, "%s", err->msg);
    /* name the shard that holds this layer's first expert of the batch */
    xlayout x;
    k3_err e2 = {0};
    if (s->xn > 0 && !k3s_expert_layout(&s->cfg, s->ix, s->prefix, L, s->xid0, NULL, &x, &e2))
        k3_fail(err, err->code ? err->code : K3_EXIT_RUNTIME, "%s: routed experts of layer %d: %s",
                st_shard_at(s->ix, x.t[0]->shard)->path, L, m);
    for (int i = 0; i < s->xn; i++)
        if (s->bb[i] >= 0) s->inuse[s->bb[i]] = 0;
    s->xn = s->xgiven = 0;
    return k3s_poison(s, err);
}

int k3s_experts_start(void *ctx, int L, const int *ids, int n, k3_expert_w *ex, k3_err *err) {
    k3_stream *s = ctx;
    if (s->poisoned) {
        *err = s->poison;
        return s->poison.code;
    }
    if (s->xgiven < s->xn)
        return k3s_poison(s, &(k3_err){.code = K3_EXIT_RUNTIME,
                                    .msg = "an expert batch was started before the last one was consumed"});
    if (s->o.experts_only) { /* no pass over the layers marks the steps: each batch is one */
        s->step++;
        s->steps++;
        xc_begin_step(s->xc);
    }
    const k3_config *c = &s->cfg;
    int N = c->num_experts;
    size_t nreq = 0;
    int rc = K3_OK;
    s->xn = n;
    s->xgiven = s->nready = 0;
    s->xlayer = L;
    s->xid0 = n > 0 ? ids[0] : 0;
    for (int i = 0; i < n; i++) s->bb[i] = -1;
    for (int i = 0; i < n && !rc; i++) {
        int e = ids[i];
        int64_t key = (int64_t)L * N + e, ev = -1;
        bool res = false;
        if (!s->lay[L]) s->lay[L] = xcalloc((size_t)N, sizeof *s->lay[L]);
        xlayout *lx = &s->lay[L][e];
        if (lx->n == 0 && (rc = k3s_expert_layout(&s->cfg, s->ix, s->prefix, L, e, &s->o, lx, err))) {
            lx->n = 0; /* looked up again next time, and refused again */
            break;
        }
        const xlayout x = *lx;
        bool hit = xc_request_one(s->xc, L, e, &res, &ev);
        if (s->tracing && (rc = xc_trace_write(&s->trace, s->step, L, e, err))) break;
        s->xleft[i] = 0;
        if (hit && s->buf_of[key] >= 0) { /* (a repeat within one step with no cache would have no buffer) */
            s->bb[i] = s->buf_of[key];
            s->inuse[s->bb[i]] = 1;
        } else {
            if (ev >= 0) { /* the evicted expert's buffer goes back once nobody uses it */
                int64_t ek = (int64_t)(ev >> 32) * N + (int64_t)(uint32_t)ev;
                int64_t eb = s->buf_of[ek];
                s->buf_of[ek] = -1;
                if (eb >= 0 && !s->inuse[eb]) k3s_free_push(s, eb);
            }
            if (s->nfree == 0) {
                rc = k3_fail(err, K3_EXIT_RUNTIME,
                             "layer %d: a forward call selected %d experts, more than the plan's batch of %d (feed at "
                             "most --chunk tokens per call)",
                             L, n, s->plan->batch_experts);
                break;
            }
            int64_t b = s->free_list[--s->nfree];
            if (s->plan->cache_experts > 0) s->buf_of[key] = b;
            s->inuse[b] = 1;
            s->bb[i] = b;
            uint8_t *buf = s->pool + (uint64_t)b * s->plan->expert_buf;
            if (nreq + 6 > s->reqcap) {
                s->reqcap = 2 * s->reqcap + 6;
                s->reqs = xrealloc_array(s->reqs, s->reqcap, sizeof *s->reqs);
                s->xq = xrealloc_array(s->xq, s->reqcap, sizeof *s->xq);
                s->req_x = xrealloc_array(s->req_x, s->reqcap, sizeof *s->req_x);
            }
            if (x.one_run) {
                int fd = shard_fd(s, x.t[0]->shard, err);
                if (fd < 0) { rc = err->code; break; }
                uint64_t start = x.t[0]->offset, end = 0;
                for (int j = 0; j < x.n; j++) {
                    if (x.t[j]->offset < start) start = x.t[j]->offset;
                    if (x.t[j]->offset + x.t[j]->nbytes > end) end = x.t[j]->offset + x.t[j]->nbytes;
                }
                s->req_x[nreq] = i;
                s->reqs[nreq++] = (k3_io_req){.fd = fd, .offset = start, .len = end - start, .buf = buf};
                s->xleft[i] = 1;
            } else {
                for (int j = 0; j < x.n; j++) {
                    if (!x.len[j]) continue; /* no rows of it for this rank */
                    int f = shard_fd(s, x.t[j]->shard, err);
                    if (f < 0) { rc = err->code; break; }
                    /* the read's aligned start: where row 0 lies, plus the share's offset into the tensor */
                    int64_t at = x.pos[j] + (int64_t)(x.off[j] - x.t[j]->offset) - (int64_t)(x.off[j] & (K3_DIO_ALIGN - 1));
                    s->req_x[nreq] = i;
                    s->reqs[nreq++] = (k3_io_req){.fd = f, .offset = x.off[j], .len = x.len[j], .buf = buf + at};
                    s->xleft[i]++;
                }
                if (rc) break;
            }
        }
        /* the matrices point into the buffer now; the model reads them only
         * once experts_next has returned i */
        const uint8_t *buf = s->pool + (uint64_t)s->bb[i] * s->plan->expert_buf;
        make_mat(s, &x, XW1, buf, c->moe_inter, c->latent_dim, &ex[i].w1);
        make_mat(s, &x, XW3, buf, c->moe_inter, c->latent_dim, &ex[i].w3);
        make_mat(s, &x, XW2, buf, c->latent_dim, c->moe_inter, &ex[i].w2);
        if (s->xleft[i] == 0) s->xready[s->nready++] = i;
    }
    s->nreq = nreq;
    s->nsent = s->nrecv = 0;
    if (rc) {
        for (int i = 0; i < n; i++)
            if (s->bb[i] >= 0) s->inuse[s->bb[i]] = 0;
        s->xn = s->xgiven = 0;
        return k3s_poison(s, err);
    }
    if (nreq) {
        for (size_t q = 0; q < nreq; q++) s->xq[q] = &s->reqs[q];
        qsort(s->xq, nreq, sizeof *s->xq, cmp_reqp);
        /* the trunk I/O thread sends no new piece until this batch is in */
        pthread_mutex_lock(&s->mu);
        __atomic_store_n(&s->xpending, s->xprio, __ATOMIC_RELEASE);
        k3s_disk_use(s, 1);
        pthread_mutex_unlock(&s->mu);
        s->xbusy = true;
        if ((rc = send_more(s, err))) return batch_failed(s, L, err);
    }
    return K3_OK;
}

/* Test hook (K3_EXPERT_ORDER=reverse|shuffle, read at open): hand the batch
 * out in another order than it arrived, once all of it is in. */
static void permute_ready(k3_stream *s) {
    int n = s->nready;
    if (s->xorder == 1) {
        for (int a = 0, b = n - 1; a < b; a++, b--) {
            int t = s->xready[a];
            s->xready[a] = s->xready[b];
            s->xready[b] = t;
        }
    } else {
        for (int a = n - 1; a > 0; a--) {
            int b = (int)(k3_rng_next(&s->xseed) % (uint64_t)(a + 1)), t = s->xready[a];
            s->xready[a] = s->xready[b];
            s->xready[b] = t;
        }
    }
}

int k3s_experts_next(void *ctx, int L, int *out, k3_err *err) {
    k3_stream *s = ctx;
    *out = -1;
    if (s->poisoned) {
        *err = s->poison;
        return s->poison.code;
    }
    if (s->xgiven >= s->xn || L != s->xlayer)
        return k3s_poison(s, &(k3_err){.code = K3_EXIT_RUNTIME, .msg = "experts_next without a batch in flight"});
    double t0 = k3_now();
    while (s->xorder ? s->nready < s->xn : s->nready <= s->xgiven) {
        k3_io_req *d = NULL;
        int rc = k3_io_complete(s->xio, &d, err);
        if (rc) {
            s->expert_stall += k3_now() - t0;
            return batch_failed(s, L, err);
        }
        s->nrecv++;
        int i = s->req_x[d - s->reqs];
        if (--s->xleft[i] == 0) s->xready[s->nready++] = i;
        if (s->nrecv == s->nreq) batch_done(s);
        else if ((rc = send_more(s, err))) {
            s->expert_stall += k3_now() - t0;
            return batch_failed(s, L, err);
        }
    }
    s->expert_stall += k3_now() - t0;
    if (s->xorder && s->xgiven == 0) permute_ready(s);
    int i = s->xready[s->xgiven];
    if (i != s->xgiven) s->xreordered++;
    s->xgiven++;
    *out = i;
    return K3_OK;
}

/* The synchronous form: the whole batch, then back. */
int k3s_experts_get(void *ctx, int L, const int *ids, int n, k3_expert_w *ex, k3_err *err) {
    int rc = k3s_experts_start(ctx, L, ids, n, ex, err);
    for (int got = 0; !rc && got < n; got++) {
        int i;
        rc = k3s_experts_next(ctx, L, &i, err);
    }
    return rc;
}

void k3s_experts_put(void *ctx, int L, const int *ids, int n) {
    k3_stream *s = ctx;
    int N = s->cfg.num_experts;
    for (int i = 0; i < n; i++) {
        int64_t b = s->bb[i];
        if (b < 0) continue;
        s->inuse[b] = 0;
        if (s->buf_of[(int64_t)L * N + ids[i]] != b) k3s_free_push(s, b);
        s->bb[i] = -1;
    }
}
