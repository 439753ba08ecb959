/* stream.c: the streaming weight source of a memory plan (stream.h; the plan
 * itself is stream_plan.c).
 *
 * Read top to bottom: binding a layer from the shards or from a trunk run,
 * the I/O thread and the ring, then open/free. The source's state is
 * stream_source.h; the routed-expert batches are stream_experts.c. */
#include "formats/names.h"
#include "memory/stream_source.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- binding a layer -------------------------------------------------------------- */

typedef struct {
    k3_stream *s;
    const k3_trunk_run *run;   /* NULL: map from the shards */
    const k3s_share *sh;       /* what of the run is in base */
    const uint8_t *base;       /* the share's bytes */
    char name[512];
} bind_ctx;

static int fill_from_st(const st_tensor *t, k3_tensor *out, k3_err *err) {
    if (k3s_tdtype(t->dtype, &out->dtype))
        return k3_fail(err, K3_EXIT_DATA, "%s: dtype %s is not used by K3", t->name, st_dtype_name(t->dtype));
    if (t->rank > 4) return k3_fail(err, K3_EXIT_DATA, "%s: rank %d is not used by K3", t->name, t->rank);
    out->rank = t->rank;
    for (int i = 0; i < t->rank; i++) out->shape[i] = t->shape[i];
    return K3_OK;
}

static int bind_lookup(void *vctx, int layer, const char *name, k3_tensor *t, k3_err *err) {
    bind_ctx *c = vctx;
    k3_stream *s = c->s;
    int k = snprintf(c->name, sizeof c->name, "%slayers.%d.%s", s->prefix, layer, name);
    if (k < 0 || (size_t)k >= sizeof c->name) return k3_fail(err, K3_EXIT_RUNTIME, "tensor name too long");
    t->where = c->name;
    if (c->run) {
        for (int i = 0; i < c->run->ntensors; i++) {
            const k3_trunk_tensor *tt = &c->run->tensors[i];
            if (strcmp(tt->name, c->name)) continue;
            if (k3s_tdtype(tt->dtype, &t->dtype))
                return k3_fail(err, K3_EXIT_DATA, "%s: dtype %s is not used by K3", c->name, st_dtype_name(tt->dtype));
            if (tt->rank > 4) return k3_fail(err, K3_EXIT_DATA, "%s: rank %d is not used by K3", c->name, tt->rank);
            t->rank = tt->rank;
            for (int d = 0; d < tt->rank; d++) t->shape[d] = tt->shape[d];
            t->data = k3s_share_at(c->sh, c->base, i);
            return K3_OK;
        }
        return 1;
    }
    const st_tensor *st = st_find(s->ix, c->name);
    if (!st) return 1;
    int rc = fill_from_st(st, t, err);
    if (rc) return rc;
    t->data = st_data(s->ix, st, err);
    if (!t->data && st->nbytes) return err->code ? err->code : K3_EXIT_RUNTIME;
    return K3_OK;
}

static int bind_from(k3_stream *s, int L, const k3_trunk_run *run, const uint8_t *base, k3_layer_w *w,
                     k3_owned *owned, k3_err *err) {
    bind_ctx c = {.s = s, .run = run, .sh = run ? &s->share[L] : NULL, .base = base};
    return k3_bind_layer_no_experts(&s->cfg, L, bind_lookup, &c, w, owned, err);
}

/* The checksum failure of a share read (k3s_share_check's tensor i). */
static int share_failed(k3_stream *s, const k3_trunk_run *run, int i, k3_err *err) {
    return k3_fail(err, K3_EXIT_DATA, "%s: layer %d: %s fails its checksum (re-pack the trunk)", s->trunk->bin_path,
                   run->layer, run->tensors[i].name);
}

/* Reads this process's share of a trunk run (s->share[L]) into buf
 * (share.need bytes, aligned) in pieces kept in flight together, then checks
 * the granules it holds (pinning at open). */
static int read_run(k3_stream *s, k3_io *io, const k3_trunk_run *run, uint8_t *buf, k3_err *err) {
    const k3s_share *sh = &s->share[run->layer];
    size_t n = (size_t)k3s_share_pieces(sh, s->piece_bytes);
    k3_io_req *rq = xcalloc(n ? n : 1, sizeof *rq);
    for (size_t i = 0; i < n; i++) {
        uint64_t off, len, pos;
        k3s_share_piece(sh, s->piece_bytes, (int)i, &off, &len, &pos);
        rq[i] = (k3_io_req){.fd = s->tfd, .offset = run->offset + off, .len = len, .buf = buf + pos};
    }
    int rc = k3_io_read(io, rq, n, err);
    free(rq);
    if (rc) {
        char m[sizeof err->msg];
        snprintf(m, sizeof m, "%s", err->msg);
        return k3_fail(err, rc, "%s: layer %d: %s", s->trunk->bin_path, run->layer, m);
    }
    int bad = k3s_share_check(run, sh, buf);
    return bad < 0 ? K3_OK : share_failed(s, run, bad, err);
}

/* ---- run 0: the model-level tensors -------------------------------------------------
 * With a packed trunk the model's head, final norm and output AttnRes come from
 * run 0 of trunk.bin, not the shards. Run 0 is read once at open (O_DIRECT, in
 * pieces through a bounce buffer) and its CRC checked over every byte, the
 * embedding table's included; every tensor but the embeddings is kept in one
 * aligned buffer (the plan's "head"; of the head's matrix, under a trunk split
 * over the ranks, only this rank's rows), and the embedding table is mapped from
 * trunk.bin, so only the rows of the tokens in use become resident (as they
 * did when it was mapped from the shards). */
#define HEAD_MAPPED INT64_MIN

static bool is_embedding(const char *name) {
    size_t n = strlen(name), k = strlen(K3N_EMBED);
    return n >= k && !strcmp(name + n - k, K3N_EMBED);
}

static int load_run0(k3_stream *s, k3_err *err) {
    const k3_trunk_run *run = k3_trunk_run_for(s->trunk, K3_TRUNK_MODEL_RUN);
    if (!run) return k3_fail(err, K3_EXIT_DATA, "%s/trunk.json: no run for the model-level tensors", s->trunk->dir);
    s->run0 = run;
    size_t nt = (size_t)(run->ntensors ? run->ntensors : 1);
    s->head_pos = xmalloc_array(nt, sizeof *s->head_pos);
    uint64_t hb = 0, *keep0 = xmalloc_array(nt, sizeof *keep0), *keep1 = xmalloc_array(nt, sizeof *keep1);
    const k3_trunk_tensor *emb = NULL;
    for (int i = 0; i < run->ntensors; i++) {
        const k3_trunk_tensor *tt = &run->tensors[i];
        if (is_embedding(tt->name) && !emb) {
            emb = tt;
            s->head_pos[i] = HEAD_MAPPED;
            continue;
        }
        int r0, r1; /* the bytes of the tensor kept: this rank's rows of a split matrix */
        keep0[i] = 0;
        keep1[i] = tt->nbytes;
        if (k3s_tp_rows(&s->o, tt->name, tt->rank, tt->shape, tt->dtype, &r0, &r1)) {
            uint64_t rb = tt->nbytes / (uint64_t)tt->shape[0];
            keep0[i] = (uint64_t)r0 * rb;
            keep1[i] = (uint64_t)r1 * rb;
        }
        hb = (hb + 63) & ~(uint64_t)63;
        s->head_pos[i] = (int64_t)hb - (int64_t)keep0[i];
        hb += keep1[i] - keep0[i];
    }
    s->head_buf = k3_dio_alloc(hb ? hb : 64);
    /* read the run in pieces, a batch at a time; CRC in order; keep the head */
    uint64_t P = s->piece_bytes, batch = 8 * P;
    if (batch > k3s_align4k(run->bytes)) batch = k3s_align4k(run->bytes);
    if (batch < P) batch = P;
    uint8_t *bounce = k3_dio_alloc(batch + K3_DIO_ALIGN);
    k3_io_req rq[8];
    uint32_t crc = 0;
    int rc = K3_OK;
    for (uint64_t at = 0; at < run->bytes && !rc; at += batch) {
        size_t n = 0;
        for (uint64_t o = at; o < at + batch && o < run->bytes; o += P, n++) {
            uint64_t len = run->bytes - o < P ? run->bytes - o : P;
            if (o + len > at + batch) len = at + batch - o;
            rq[n] = (k3_io_req){.fd = s->tfd, .offset = run->offset + o, .len = len, .buf = bounce + (o - at)};
        }
        if ((rc = k3_io_read(s->tio, rq, n, err))) {
            char m[sizeof err->msg];
            snprintf(m, sizeof m, "%s", err->msg);
            k3_fail(err, rc, "%s: model-level tensors: %s", s->trunk->bin_path, m);
            break;
        }
        for (size_t q = 0; q < n; q++) {
            const uint8_t *d = rq[q].data;
            uint64_t lo = rq[q].offset - run->offset, hi = lo + rq[q].len;
            crc = k3_crc32c(crc, d, rq[q].len);
            for (int i = 0; i < run->ntensors; i++) {
                const k3_trunk_tensor *tt = &run->tensors[i];
                if (s->head_pos[i] == HEAD_MAPPED) continue;
                uint64_t t0 = tt->offset + keep0[i], t1 = tt->offset + keep1[i];
                uint64_t a = t0 > lo ? t0 : lo, b = t1 < hi ? t1 : hi;
                if (a < b) memcpy(s->head_buf + s->head_pos[i] + (int64_t)(a - tt->offset), d + (a - lo), b - a);
            }
        }
    }
    free(bounce);
    free(keep0);
    free(keep1);
    if (!rc && crc != run->crc)
        rc = k3_fail(err, K3_EXIT_DATA, "%s: the run for the model-level tensors fails its checksum (re-pack the trunk)",
                     s->trunk->bin_path);
    if (rc || !emb) return rc;
    /* the embedding table: mapped, only the rows in use are touched */
    int fd = open(s->trunk->bin_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", s->trunk->bin_path, strerror(errno));
    uint64_t off = run->offset + emb->offset, page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t start = off / page * page;
    s->emb_map_len = (size_t)(off - start + emb->nbytes);
    s->emb_map = mmap(NULL, s->emb_map_len, PROT_READ, MAP_SHARED, fd, (off_t)start);
    int e = errno;
    close(fd);
    if (s->emb_map == MAP_FAILED) {
        s->emb_map = NULL;
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot map the embedding table: %s", s->trunk->bin_path, strerror(e));
    }
    s->emb = (const uint8_t *)s->emb_map + (off - start);
    return K3_OK;
}

/* The model-level lookup over run 0 (k3_model_bind_top). */
static int top_lookup(void *ctx, int layer, const char *name, k3_tensor *t, k3_err *err) {
    k3_stream *s = ctx;
    int k;
    if (layer >= 0) return k3_fail(err, K3_EXIT_RUNTIME, "top_lookup: layer %d", layer);
    if (!strcmp(name, K3N_HEAD)) /* beside the model, not under its prefix */
        k = snprintf(s->top_name, sizeof s->top_name, "%s", k3_names_head(s->prefix));
    else
        k = snprintf(s->top_name, sizeof s->top_name, "%s%s", s->prefix, name);
    if (k < 0 || (size_t)k >= sizeof s->top_name) return k3_fail(err, K3_EXIT_RUNTIME, "tensor name too long");
    t->where = s->top_name;
    for (int i = 0; i < s->run0->ntensors; i++) {
        const k3_trunk_tensor *tt = &s->run0->tensors[i];
        if (strcmp(tt->name, s->top_name)) continue;
        if (k3s_tdtype(tt->dtype, &t->dtype))
            return k3_fail(err, K3_EXIT_DATA, "%s: dtype %s is not used by K3", tt->name, st_dtype_name(tt->dtype));
        if (tt->rank > 4) return k3_fail(err, K3_EXIT_DATA, "%s: rank %d is not used by K3", tt->name, tt->rank);
        t->rank = tt->rank;
        for (int d = 0; d < tt->rank; d++) t->shape[d] = tt->shape[d];
        t->data = s->head_pos[i] == HEAD_MAPPED ? s->emb : s->head_buf + s->head_pos[i];
        return K3_OK;
    }
    return 1;
}

/* ---- the ring and its I/O thread ------------------------------------------------------
 * The model asks for the streamed layers in a fixed cycle (the layers not
 * pinned, in order, then the first of them again for the next forward call;
 * succ()), so the I/O thread knows what comes next:
 * it keeps the next nslots layers of the cycle from `want` (the layer the
 * model asks for next, or uses now) in the slots, reading each as soon as a
 * slot holds nothing wanted (the moment layer_put frees it), in pieces with
 * up to tdepth in flight, checking the CRC piece by piece as they arrive and
 * binding the layer before it is marked READY. The disk is shared with the
 * expert batches, which cannot wait (the model stalls on them, a trunk read
 * ahead can): while one is read (xpending) no further trunk piece is sent, so
 * a batch waits behind at most tdepth pieces instead of a whole layer.
 *
 * A one-slot plan (the smallest budgets) still keeps two slot records, over
 * one shared buffer of slot_bytes (the largest streamed run): each layer is
 * placed at the start or at the far end of the buffer, whichever overlaps the
 * other record's layer least, and a piece is only sent when its bytes are not
 * held by a layer in use or earlier in the cycle. So the part of layer L+1
 * that does not overlap layer L (the buffer's spare room: most of it when
 * layers differ in size) is read while L computes, the rest once L is put. */

static int succ(const k3_stream *s, int L) {
    int NL = s->cfg.num_layers;
    for (int i = 1; i <= NL; i++) {
        int x = (L + i) % NL;
        if (!s->plan->pin[x]) return x;
    }
    return L; /* (every layer pinned: no cycle) */
}

/* Under mu. */
static bool is_wanted(const k3_stream *s, int L) {
    int x = s->want;
    for (int i = 0; i < s->nslots; i++, x = succ(s, x))
        if (x == L) return true;
    return false;
}

static ring_slot *holding(k3_stream *s, int L) {
    for (int i = 0; i < s->nslots; i++)
        if (s->slot[i].layer == L && s->slot[i].state != SLOT_EMPTY) return &s->slot[i];
    return NULL;
}

static void slot_unbind(ring_slot *sl) {
    if (sl->bound) k3_owned_free(&sl->owned);
    memset(&sl->w, 0, sizeof sl->w);
    sl->bound = false;
}

/* Disk-busy accounting (under mu): the union of trunk reads and expert batches. */
void k3s_disk_use(k3_stream *s, int d) {
    double now = k3_now();
    if (s->active == 0 && d > 0) s->active_t0 = now;
    s->active += d;
    if (s->active == 0) s->disk_busy += now - s->active_t0;
}

/* Under mu: position of layer L in the cycle from want (nslots: not wanted). */
static int rank_of(const k3_stream *s, int L) {
    int x = s->want;
    for (int i = 0; i < s->nslots; i++, x = succ(s, x))
        if (x == L) return i;
    return s->nslots;
}

static uint64_t span_of(const ring_slot *sl) { return sl->run ? sl->sh->need : 0; }

static bool overlaps(uint64_t a0, uint64_t a1, uint64_t b0, uint64_t b1) { return a0 < b1 && b0 < a1; }

/* Under mu: a slot for every wanted layer that no slot holds. */
static void assign_reads(k3_stream *s) {
    int x = s->want;
    for (int i = 0; i < s->nslots; i++, x = succ(s, x)) {
        if (holding(s, x)) continue;
        ring_slot *f = NULL;
        for (int j = 0; j < s->nslots && !f; j++) {
            ring_slot *c = &s->slot[j];
            if (!c->in_use && c->state != SLOT_READING && (c->state == SLOT_EMPTY || !is_wanted(s, c->layer))) f = c;
        }
        if (!f) return;
        slot_unbind(f);
        const k3_trunk_run *run = k3_trunk_run_for(s->trunk, x);
        const k3s_share *sh = &s->share[x];
        uint64_t a = sh->need;
        f->base = 0;
        if (s->shared) { /* the end of the buffer that overlaps the other layer least */
            const ring_slot *o = f == &s->slot[0] ? &s->slot[1] : &s->slot[0];
            if (o->state != SLOT_EMPTY && o->run) {
                uint64_t S = s->plan->slot_bytes, o0 = o->base, o1 = o->base + span_of(o);
                uint64_t at0 = (o1 < a ? o1 : a) > o0 ? (o1 < a ? o1 : a) - o0 : 0;
                uint64_t lo = S - a > o0 ? S - a : o0, at1 = o1 > lo ? o1 - lo : 0;
                if (at1 < at0) f->base = S - a;
            }
        }
        f->layer = x;
        f->state = SLOT_READING;
        f->run = run;
        f->sh = sh;
        f->npiece = k3s_share_pieces(sh, s->piece_bytes);
        f->nsent = f->ndone = 0;
        f->failed = false;
        memset(f->piece_st, PIECE_UNSENT, (size_t)s->maxpiece);
        for (int k = 0; k < f->npiece; k++) {
            uint64_t off, len, pos;
            k3s_share_piece(sh, s->piece_bytes, k, &off, &len, &pos);
            f->piece[k] = (k3_io_req){.fd = s->tfd, .offset = run->offset + off, .len = len,
                                      .buf = f->buf + f->base + pos};
        }
    }
}

/* Under mu: may piece k of sl be written now? With a shared buffer, not over
 * bytes of the other record's layer while it is in use, being written, or
 * earlier in the cycle; a later layer there is dropped (read again later). */
static bool piece_free(k3_stream *s, ring_slot *sl, int k) {
    if (!s->shared) return true;
    ring_slot *o = sl == &s->slot[0] ? &s->slot[1] : &s->slot[0];
    if (o->state == SLOT_EMPTY || !o->run) return true;
    uint64_t p0 = (uint64_t)((uint8_t *)sl->piece[k].buf - sl->buf), p1 = p0 + k3_dio_span(0, sl->piece[k].len);
    if (!overlaps(p0, p1, o->base, o->base + span_of(o))) return true;
    if (o->in_use || o->nsent > o->ndone || rank_of(s, o->layer) < rank_of(s, sl->layer)) return false;
    slot_unbind(o);
    o->state = SLOT_EMPTY;
    o->layer = -1;
    o->run = NULL;
    return true;
}

/* Under mu: the next piece to send, from the earliest reading layer in the
 * cycle that has one it may write. */
static ring_slot *next_to_send(k3_stream *s, int *piece) {
    int x = s->want;
    for (int i = 0; i < s->nslots; i++, x = succ(s, x)) {
        ring_slot *sl = holding(s, x);
        if (!sl || sl->state != SLOT_READING || sl->failed || sl->nsent == sl->npiece) continue;
        for (int k = 0; k < sl->npiece; k++)
            if (sl->piece_st[k] == PIECE_UNSENT && piece_free(s, sl, k)) {
                *piece = k;
                return sl;
            }
    }
    return NULL;
}

static void piece_failed(ring_slot *sl, const k3_err *e) {
    if (!sl->failed) sl->err = *e;
    sl->failed = true;
}

/* Not under mu (the slot is the I/O thread's while READING): once every
 * piece has arrived, the checksums of the granules read, and the binding. */
static bool slot_progress(k3_stream *s, ring_slot *sl) {
    bool finished = sl->failed ? sl->ndone == sl->nsent : sl->ndone == sl->npiece;
    if (!finished || sl->failed) return finished;
    k3_err e = {0};
    int bad = k3s_share_check(sl->run, sl->sh, sl->buf + sl->base);
    if (bad >= 0) {
        share_failed(s, sl->run, bad, &e);
        piece_failed(sl, &e);
    } else if (bind_from(s, sl->layer, sl->run, sl->buf + sl->base, &sl->w, &sl->owned, &e)) {
        k3_owned_free(&sl->owned);
        piece_failed(sl, &e);
    } else {
        sl->bound = true;
    }
    return true;
}

static void *io_main(void *arg) {
    k3_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    while (!s->quit) {
        assign_reads(s);
        ring_slot *sl;
        int pk = 0;
        while (k3_io_inflight(s->tio) < s->tdepth && !__atomic_load_n(&s->xpending, __ATOMIC_ACQUIRE) &&
               (sl = next_to_send(s, &pk))) {
            k3_io_req *q = &sl->piece[pk];
            sl->piece_st[pk] = PIECE_SENT;
            sl->nsent++;
            k3_err e = {0};
            bool first = k3_io_inflight(s->tio) == 0;
            if (k3_io_submit(s->tio, q, &e)) {
                char m[sizeof e.msg];
                snprintf(m, sizeof m, "%s", e.msg);
                k3_fail(&e, e.code, "%s: layer %d: %s", s->trunk->bin_path, sl->layer, m);
                piece_failed(sl, &e);
                sl->piece_st[pk] = PIECE_DONE;
                sl->ndone++;
                continue;
            }
            if (first) {
                k3s_disk_use(s, 1);
                s->trunk_t0 = k3_now();
            }
        }
        /* a slot that failed with nothing in flight is finished now */
        for (int i = 0; i < s->nslots; i++) {
            ring_slot *f = &s->slot[i];
            if (f->state == SLOT_READING && f->failed && f->ndone == f->nsent) {
                f->state = SLOT_FAILED;
                pthread_cond_broadcast(&s->cv);
            }
        }
        if (k3_io_inflight(s->tio) == 0) {
            pthread_cond_wait(&s->cv, &s->mu);
            continue;
        }
        pthread_mutex_unlock(&s->mu);
        k3_io_req *d = NULL;
        k3_err e = {0};
        int rc = k3_io_complete(s->tio, &d, &e);
        ring_slot *owner = NULL;
        for (int i = 0; i < s->nslots && d; i++)
            if (d >= s->slot[i].piece && d < s->slot[i].piece + s->maxpiece) owner = &s->slot[i];
        bool finished = false;
        if (owner) {
            if (rc) {
                char m[sizeof e.msg];
                snprintf(m, sizeof m, "%s", e.msg);
                k3_fail(&e, rc, "%s: layer %d: %s", s->trunk->bin_path, owner->layer, m);
                piece_failed(owner, &e);
            }
            owner->piece_st[d - owner->piece] = PIECE_DONE;
            owner->ndone++;
            finished = slot_progress(s, owner);
        }
        pthread_mutex_lock(&s->mu);
        if (owner) s->trunk_read += k3_dio_span(d->offset, d->len);
        if (k3_io_inflight(s->tio) == 0) {
            k3s_disk_use(s, -1);
            s->trunk_busy += k3_now() - s->trunk_t0;
        }
        if (!owner && rc) { /* cannot happen: a completion that is not ours */
            s->quit = true;
            break;
        }
        if (finished) {
            owner->state = owner->failed ? SLOT_FAILED : SLOT_READY;
            pthread_cond_broadcast(&s->cv);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int k3s_poison(k3_stream *s, const k3_err *err) {
    if (!s->poisoned) {
        s->poisoned = true;
        s->poison = *err;
    }
    return s->poison.code ? s->poison.code : K3_EXIT_RUNTIME;
}

static int stream_layer_get(void *ctx, int L, const k3_layer_w **w, k3_err *err) {
    k3_stream *s = ctx;
    if (s->poisoned) {
        *err = s->poison;
        return s->poison.code;
    }
    if (L == 0) { /* a new pass over the layers: one step for the cache */
        s->step++;
        s->steps++;
        if (s->xc) xc_begin_step(s->xc);
    }
    if (s->have[L]) {
        *w = &s->lw[L];
        return K3_OK;
    }
    if (s->nslots == 0) { /* nothing streams: the experts-only source */
        *err = (k3_err){.code = K3_EXIT_RUNTIME, .msg = "this source serves the routed experts only"};
        return k3s_poison(s, err);
    }
    pthread_mutex_lock(&s->mu);
    if (s->want != L) { /* out of the cycle (never in a normal pass): read it first */
        s->want = L;
        pthread_cond_broadcast(&s->cv);
    }
    double t0 = k3_now();
    ring_slot *sl;
    while (!(sl = holding(s, L)) || sl->state == SLOT_READING) {
        if (s->quit) {
            pthread_mutex_unlock(&s->mu);
            *err = (k3_err){.code = K3_EXIT_RUNTIME, .msg = "the trunk I/O thread stopped"};
            return k3s_poison(s, err);
        }
        pthread_cond_wait(&s->cv, &s->mu);
    }
    s->trunk_stall += k3_now() - t0;
    if (sl->state == SLOT_FAILED) {
        k3_err e = sl->err;
        sl->state = SLOT_EMPTY;
        sl->layer = -1;
        pthread_mutex_unlock(&s->mu);
        *err = e;
        return k3s_poison(s, &e);
    }
    sl->in_use = true;
    pthread_mutex_unlock(&s->mu);
    *w = &sl->w;
    return K3_OK;
}

static void stream_layer_put(void *ctx, int L) {
    k3_stream *s = ctx;
    if (s->have[L]) return;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->nslots; i++)
        if (s->slot[i].layer == L) s->slot[i].in_use = false;
    s->want = succ(s, L); /* frees L's slot for the layer after the next */
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---- open / free --------------------------------------------------------------------- */

int k3_stream_open(const k3_config *cfg, st_index *ix, k3_trunk *trunk, const k3_mem_plan *plan,
                   const k3_stream_opts *o, k3_stream **out, k3_err *err) {
    k3_stream *s = xcalloc(1, sizeof *s);
    s->cfg = *cfg;
    s->plan = xmalloc(sizeof *s->plan);
    *s->plan = *plan;
    s->o = *o;
    s->ix = ix;
    s->trunk = trunk;
    s->prefix = k3_names_prefix(ix);
    s->tfd = -1;
    s->tdepth = o->trunk_depth > 0 ? o->trunk_depth : 4;
    s->piece_bytes = o->trunk_piece >= K3_DIO_ALIGN ? o->trunk_piece / K3_DIO_ALIGN * K3_DIO_ALIGN : (2u << 20);
    s->xprio = o->expert_priority ? 1 : 0;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    int NL = cfg->num_layers, rc = K3_OK;
    s->lw = xcalloc((size_t)NL, sizeof *s->lw);
    s->have = xcalloc((size_t)NL, sizeof *s->have);
    s->pin_buf = xcalloc((size_t)NL, sizeof *s->pin_buf);
    s->src = (k3_weight_source){.ctx = s, .layer_get = stream_layer_get, .layer_put = stream_layer_put};
    s->sfd = xmalloc_array((size_t)st_nshards(ix), sizeof *s->sfd);
    for (int i = 0; i < st_nshards(ix); i++) s->sfd[i] = -1;
    *out = NULL;

    /* trunk */
    if (trunk) {
        if ((rc = k3_trunk_check_source(trunk, ix, err))) goto fail;
        s->tio = k3_io_new(s->tdepth, o->direct);
        if ((rc = k3_io_open(s->tio, trunk->bin_path, &s->tfd, NULL, err))) goto fail;
        if ((rc = load_run0(s, err))) goto fail;
        s->share = xcalloc((size_t)NL, sizeof *s->share);
        for (int L = 0; L < NL; L++) {
            const k3_trunk_run *run = k3_trunk_run_for(trunk, L);
            if (!run) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s/trunk.json: no run for layer %d", trunk->dir, L);
                goto fail;
            }
            k3s_share_make(run, o, &s->share[L]);
        }
        uint64_t total = 0, done = 0;
        for (int L = 0; L < cfg->num_layers; L++)
            if (plan->pin[L]) total += plan->layer_bytes[L];
        k3_progress pr;
        k3_progress_start(&pr, "pinning trunk", total, true);
        for (int L = 0; L < cfg->num_layers; L++) {
            if (!plan->pin[L]) continue;
            const k3_trunk_run *run = k3_trunk_run_for(trunk, L);
            s->pin_buf[L] = k3_dio_alloc(s->share[L].need ? s->share[L].need : K3_DIO_ALIGN);
            if ((rc = read_run(s, s->tio, run, s->pin_buf[L], err))) goto fail;
            if ((rc = bind_from(s, L, run, s->pin_buf[L], &s->lw[L], &s->owned, err))) goto fail;
            s->have[L] = true;
            done += s->share[L].bytes;
            k3_progress_update(&pr, done);
        }
        k3_progress_finish(&pr);
        s->nslots = plan->ring_slots;
        s->want = succ(s, cfg->num_layers - 1); /* the first streamed layer */
        s->maxpiece = 1;
        for (int L = 0; L < NL; L++) {
            int np = plan->pin[L] ? 0 : k3s_share_pieces(&s->share[L], s->piece_bytes);
            if (np > s->maxpiece) s->maxpiece = np;
        }
        /* one slot in the plan: two records over one buffer, when two layers stream */
        int streamed = cfg->num_layers - plan->pinned;
        if (s->nslots == 1 && streamed >= 2) {
            s->nslots = 2;
            s->shared = true;
        }
        for (int i = 0; i < s->nslots; i++) {
            s->slot[i].layer = -1;
            s->slot[i].buf = s->shared && i == 1 ? s->slot[0].buf : k3_dio_alloc(plan->slot_bytes);
            s->slot[i].piece = xcalloc((size_t)s->maxpiece, sizeof *s->slot[i].piece);
            s->slot[i].piece_st = xcalloc((size_t)s->maxpiece, 1);
        }
        if (s->nslots) { /* the slots are read again and again: registered once */
            void *bufs[2] = {s->slot[0].buf, s->slot[1].buf};
            uint64_t lens[2] = {plan->slot_bytes, plan->slot_bytes};
            k3_io_register(s->tio, bufs, lens, s->nslots == 2 && !s->shared ? 2 : 1);
        }
        if (s->nslots) { /* it starts reading the first streamed layers now */
            if (pthread_create(&s->thr, NULL, io_main, s) != 0) {
                rc = k3_fail(err, K3_EXIT_RUNTIME, "cannot start the trunk I/O thread");
                goto fail;
            }
            s->thr_started = true;
        }
    } else if (!o->experts_only) {
        for (int L = 0; L < NL; L++) {
            if ((rc = bind_from(s, L, NULL, NULL, &s->lw[L], &s->owned, err))) goto fail;
            s->have[L] = true;
        }
    }

    /* experts */
    if (plan->total_experts > 0) {
        s->src.experts_get = k3s_experts_get;
        s->src.experts_put = k3s_experts_put;
        if (o->expert_overlap) {
            s->src.experts_start = k3s_experts_start;
            s->src.experts_next = k3s_experts_next;
        }
        const char *eo = getenv("K3_EXPERT_ORDER");
        s->xorder = eo && !strcmp(eo, "reverse") ? 1 : eo && !strcmp(eo, "shuffle") ? 2 : 0;
        s->xseed = 0;
        s->xleft = xcalloc((size_t)cfg->num_experts, sizeof *s->xleft);
        s->xready = xcalloc((size_t)cfg->num_experts, sizeof *s->xready);
        s->xio = k3_io_new(o->io_depth, o->direct);
        s->xc = xc_new(o->policy, (size_t)plan->cache_experts);
        s->npool = plan->cache_experts + plan->batch_experts;
        s->pool = k3_dio_alloc((uint64_t)s->npool * plan->expert_buf);
        void *pb = s->pool;
        uint64_t pl = (uint64_t)s->npool * plan->expert_buf;
        k3_io_register(s->xio, &pb, &pl, 1); /* (refused above 1 GiB: plain reads) */
        s->free_list = xmalloc_array((size_t)s->npool, sizeof *s->free_list);
        for (int64_t b = s->npool; b-- > 0;) k3s_free_push(s, b);
        s->inuse = xcalloc((size_t)s->npool, 1);
        size_t nk = (size_t)NL * (size_t)cfg->num_experts;
        s->buf_of = xmalloc_array(nk, sizeof *s->buf_of);
        s->lay = xcalloc((size_t)cfg->num_layers, sizeof *s->lay);
        for (size_t i = 0; i < nk; i++) s->buf_of[i] = -1;
        s->bb = xmalloc_array((size_t)cfg->num_experts, sizeof *s->bb);
        for (int i = 0; i < cfg->num_experts; i++) s->bb[i] = -1;
        if (o->trace_dir) {
            if ((rc = k3_mkdir_p(o->trace_dir, err))) goto fail;
            char path[4096];
            int k = snprintf(path, sizeof path, "%s/cache_trace.bin", o->trace_dir);
            if (k < 0 || (size_t)k >= sizeof path) {
                rc = k3_fail(err, K3_EXIT_USAGE, "--dump-cache-trace: path too long");
                goto fail;
            }
            if ((rc = xc_trace_open(&s->trace, path, err))) goto fail;
            s->tracing = true;
        }
    }
    *out = s;
    return K3_OK;
fail:
    k3_stream_free(s);
    return rc;
}

const k3_weight_source *k3_stream_source(k3_stream *s) { return &s->src; }

int k3_stream_attach(k3_stream *s, k3_model *m, k3_err *err) {
    if (s->run0) {
        int rc = k3_model_bind_top(m, top_lookup, s, err);
        if (rc) return rc;
    }
    k3_model_set_source(m, &s->src);
    return K3_OK;
}

k3_stream_stats k3_stream_get_stats(const k3_stream *s) {
    k3_stream_stats st = {0};
    pthread_mutex_lock((pthread_mutex_t *)&s->mu);
    st.trunk_read = s->trunk_read;
    st.trunk_busy_s = s->trunk_busy;
    st.disk_busy_s = s->disk_busy + (s->active ? k3_now() - s->active_t0 : 0);
    pthread_mutex_unlock((pthread_mutex_t *)&s->mu);
    st.steps = s->steps;
    st.trunk_stall_s = s->trunk_stall;
    st.expert_stall_s = s->expert_stall;
    if (s->xio) {
        st.expert_read = k3_io_bytes(s->xio);
        st.backend = k3_io_backend(s->xio);
    } else {
        st.backend = s->tio ? k3_io_backend(s->tio) : "none";
    }
    st.direct = s->xdirect;
    st.experts_reordered = s->xreordered;
    if (s->xc) {
        xc_stats x = xc_get_stats(s->xc);
        st.requests = x.requests;
        st.hits = x.hits;
        st.resident_hits = x.resident_hits;
        st.misses = x.misses;
        st.evictions = x.evictions;
    }
    return st;
}

void k3_stream_free(k3_stream *s) {
    if (!s) return;
    if (s->thr_started) {
        pthread_mutex_lock(&s->mu);
        s->quit = true;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->thr, NULL);
    }
    k3_io_free(s->tio); /* waits for pieces still in flight into the slots */
    s->tio = NULL;
    for (int i = 0; i < 2; i++) {
        slot_unbind(&s->slot[i]);
        if (!(s->shared && i == 1)) free(s->slot[i].buf);
        free(s->slot[i].piece);
        free(s->slot[i].piece_st);
    }
    if (s->tracing) {
        k3_err e = {0};
        xc_trace_close(&s->trace, &e);
    }
    k3_owned_free(&s->owned);
    free(s->head_buf);
    free(s->head_pos);
    if (s->emb_map) munmap(s->emb_map, s->emb_map_len);
    for (int L = 0; L < s->cfg.num_layers; L++) free(s->pin_buf[L]);
    free(s->pin_buf);
    for (int L = 0; s->share && L < s->cfg.num_layers; L++) k3s_share_free(&s->share[L]);
    free(s->share);
    free(s->lw);
    free(s->have);
    if (s->tfd >= 0) close(s->tfd);
    for (int i = 0; s->sfd && i < st_nshards(s->ix); i++)
        if (s->sfd[i] >= 0) close(s->sfd[i]);
    free(s->sfd);
    k3_io_free(s->tio);
    k3_io_free(s->xio);
    xc_free(s->xc);
    free(s->pool);
    free(s->free_list);
    free(s->inuse);
    free(s->buf_of);
    if (s->lay)
        for (int L = 0; L < s->cfg.num_layers; L++) free(s->lay[L]);
    free(s->lay);
    free(s->bb);
    free(s->reqs);
    free(s->xq);
    free(s->req_x);
    free(s->xleft);
    free(s->xready);
    free(s->plan);
    k3_trunk_free(s->trunk);
    st_close(s->ix);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
