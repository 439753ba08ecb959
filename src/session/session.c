/* session.c: sessions, the shared state cache and session files (session.h). */
#include "session/session.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---- the state cache ------------------------------------------------------------------
 * A segment holds the ids and MLA rows of positions [start, end) of one
 * conversation; its parent holds [parent->start, start), down to 0. A snapshot
 * at p is its KDA part plus the segment chain ending at p. Segments are
 * reference counted (by snapshots, child segments and sessions) and freed, with
 * their bytes taken off the cache's count, when the last reference goes. */
typedef struct seg {
    int refs;
    struct seg *parent;
    int start, end;
    int32_t *ids;   /* [end - start] */
    float *rows;    /* [n_mla][end - start][W], as k3_state_rows_get writes them */
} seg;

typedef struct {
    uint64_t hash;  /* of ids[0..pos) */
    int pos;
    float *kda;     /* the KDA part */
    float *logits;  /* [vocab] the logits of ids[pos-1], or NULL (a snapshot taken without them) */
    seg *tail;      /* ends at pos */
    uint64_t used;  /* LRU clock */
} snap;

struct k3_state_cache {
    pthread_mutex_t mu;
    uint64_t kda_floats, row_floats;
    uint64_t vocab;   /* floats of a snapshot's logits */
    uint64_t budget, bytes;
    int grid;
    snap *v;
    int n, cap;
    uint64_t clock, taken, hits, evicted;
};

static uint64_t seg_bytes(const k3_state_cache *c, const seg *g) {
    return (uint64_t)(g->end - g->start) * (c->row_floats * sizeof(float) + sizeof(int32_t)) + sizeof *g;
}

static uint64_t kda_bytes(const k3_state_cache *c) { return c->kda_floats * sizeof(float); }
static uint64_t logit_bytes(const k3_state_cache *c) { return c->vocab * sizeof(float); }

static seg *seg_ref(seg *g) {
    if (g) g->refs++;
    return g;
}

/* Drops one reference (cache lock held); frees the chain as far as it is unused. */
static void seg_unref(k3_state_cache *c, seg *g) {
    while (g && --g->refs == 0) {
        seg *p = g->parent;
        c->bytes -= seg_bytes(c, g);
        free(g->ids);
        free(g->rows);
        free(g);
        g = p;
    }
}

static uint64_t hash_step(uint64_t h, int32_t id) {
    h ^= (uint32_t)id;
    h *= 0x100000001b3ULL;
    return h ^ (h >> 31);
}

static uint64_t hash_ids(const int32_t *ids, size_t n) {
    uint64_t h = K3_FNV_OFFSET;
    for (size_t i = 0; i < n; i++) h = hash_step(h, ids[i]);
    return h;
}

/* Whether the chain ending in g holds exactly ids[0..pos). */
static bool chain_matches(const seg *g, const int32_t *ids, int pos) {
    int want = pos;
    for (; g; g = g->parent) {
        if (g->end != want) return false;
        if (memcmp(g->ids, ids + g->start, (size_t)(g->end - g->start) * sizeof *ids) != 0) return false;
        want = g->start;
    }
    return want == 0;
}

int k3_state_cache_parse_gb(const char *cmd, const char *v, uint64_t *bytes, k3_err *err) {
    double gb;
    if (!k3_parse_f64(v, &gb) || gb < 0)
        return k3_fail(err, K3_EXIT_USAGE, "%s: --state-cache-gb: '%s' is not a size in GB >= 0 (see 'k3 help %s')",
                       cmd, v, cmd);
    if (gb > 1e6) /* past a petabyte: a typo, and past it the byte count would not fit */
        return k3_fail(err, K3_EXIT_USAGE, "%s: --state-cache-gb: %s is over the largest budget, 1000000 GB", cmd, v);
    *bytes = (uint64_t)(gb * 1e9);
    return K3_OK;
}

k3_state_cache *k3_state_cache_new(const k3_config *cfg, uint64_t budget_bytes, int grid) {
    k3_state_cache *c = xcalloc(1, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    c->kda_floats = k3_state_kda_floats(cfg);
    c->row_floats = k3_state_row_floats(cfg);
    c->vocab = (uint64_t)cfg->vocab_size;
    c->budget = budget_bytes;
    c->grid = grid > 0 ? grid : K3_STATE_CACHE_GRID;
    return c;
}

static void drop_snap(k3_state_cache *c, int i) {
    free(c->v[i].kda);
    if (c->v[i].logits) c->bytes -= logit_bytes(c);
    free(c->v[i].logits);
    seg_unref(c, c->v[i].tail);
    c->bytes -= kda_bytes(c);
    c->v[i] = c->v[--c->n];
}

void k3_state_cache_clear(k3_state_cache *c) {
    pthread_mutex_lock(&c->mu);
    while (c->n) drop_snap(c, c->n - 1);
    pthread_mutex_unlock(&c->mu);
}

void k3_state_cache_free(k3_state_cache *c) {
    if (!c) return;
    k3_state_cache_clear(c);
    pthread_mutex_destroy(&c->mu);
    free(c->v);
    free(c);
}

k3_state_cache_stats k3_state_cache_get_stats(k3_state_cache *c) {
    pthread_mutex_lock(&c->mu);
    k3_state_cache_stats st = {.bytes = c->bytes, .budget = c->budget, .grid = c->grid, .snapshots = c->n,
                               .taken = c->taken, .hits = c->hits, .evicted = c->evicted,
                               .kda_bytes = kda_bytes(c), .row_bytes = c->row_floats * sizeof(float)};
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* Evicts least recently used snapshots until `need` more bytes fit the budget
 * (or none is left); whether they fit. */
static bool make_room(k3_state_cache *c, uint64_t need) {
    while (c->bytes + need > c->budget && c->n > 0) {
        int lru = 0;
        for (int i = 1; i < c->n; i++)
            if (c->v[i].used < c->v[lru].used) lru = i;
        drop_snap(c, lru);
        c->evicted++;
    }
    return c->bytes + need <= c->budget;
}

/* ---- sessions ------------------------------------------------------------------------------ */
struct k3_session {
    k3_engine *e;      /* NULL: fed with k3_forward on m */
    k3_model *m;
    k3_state *st;
    k3_state_cache *c;
    int V;
    int32_t *ids;
    size_t n, cap;
    float *logits;     /* logits of ids[n-1] when have_logits */
    bool have_logits;
    seg *chain;        /* a cache chain holding ids[0..chain->end) of this session (end <= n) */
    int source;
    bool (*cancelled)(const void *ctx); /* k3_session_set_cancel, or NULL */
    const void *cancel_ctx;
    bool in_pass;      /* k3_session_pass_begin .. _end */
    size_t pass_n0;    /* ids held at pass_begin */
    size_t prompt_from, prompt_n; /* the prefill in progress: reused ids, prompt length (its cancel message) */
};

k3_session *k3_session_new(k3_model *m, k3_state *st, k3_state_cache *cache) {
    k3_session *s = xcalloc(1, sizeof *s);
    s->m = m;
    s->st = st;
    /* a cache made for another shape of state would hand out wrong-sized
     * snapshots: such a session keeps none */
    const k3_config *cfg = k3_model_config(m);
    if (cache && (cache->kda_floats != k3_state_kda_floats(cfg) || cache->row_floats != k3_state_row_floats(cfg)))
        cache = NULL;
    s->c = cache;
    s->V = k3_model_config(m)->vocab_size;
    s->cap = 256;
    s->ids = xmalloc_array(s->cap, sizeof *s->ids);
    s->logits = xmalloc_array((size_t)s->V, sizeof *s->logits);
    k3_state_reset(st);
    return s;
}

k3_session *k3_session_open(k3_engine *e, k3_state *st, k3_state_cache *cache) {
    k3_session *s = k3_session_new(k3_engine_model(e), st, cache);
    s->e = e;
    return s;
}

static void set_chain(k3_session *s, seg *g) {
    if (!s->c) return;
    pthread_mutex_lock(&s->c->mu);
    seg_ref(g);
    seg_unref(s->c, s->chain);
    s->chain = g;
    pthread_mutex_unlock(&s->c->mu);
}

void k3_session_reset(k3_session *s) {
    s->in_pass = false; /* k3_state_reset ends the state's pass too */
    set_chain(s, NULL);
    k3_state_reset(s->st);
    s->n = 0;
    s->have_logits = false;
    s->source = 0;
}

void k3_session_free(k3_session *s) {
    if (!s) return;
    set_chain(s, NULL);
    free(s->ids);
    free(s->logits);
    free(s);
}

size_t k3_session_len(const k3_session *s) { return s->n; }
const int32_t *k3_session_ids(const k3_session *s) { return s->ids; }
k3_state *k3_session_state(k3_session *s) { return s->st; }
int k3_session_last_source(const k3_session *s) { return s->source; }

static void append_ids(k3_session *s, const int32_t *ids, size_t n) {
    if (s->n + n > s->cap) {
        while (s->n + n > s->cap) s->cap *= 2;
        s->ids = xrealloc_array(s->ids, s->cap, sizeof *s->ids);
    }
    memcpy(s->ids + s->n, ids, n * sizeof *ids);
    s->n += n;
}

void k3_session_snapshot(k3_session *s) {
    k3_state_cache *c = s->c;
    if (!c || s->n == 0 || c->budget == 0) return;
    int p = (int)s->n;
    uint64_t h = hash_ids(s->ids, s->n);
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n; i++) {
        snap *x = &c->v[i];
        if (x->pos == p && x->hash == h && chain_matches(x->tail, s->ids, p)) {
            /* already held: refresh it, and grow later snapshots from its chain */
            x->used = ++c->clock;
            seg *tail = seg_ref(x->tail);
            seg_unref(c, s->chain);
            s->chain = tail;
            if (!x->logits && s->have_logits && make_room(c, logit_bytes(c))) {
                /* it now keeps the logits too; make_room moved entries (the
                 * session's reference keeps its chain): find it again */
                for (int k = 0; k < c->n; k++) {
                    snap *y = &c->v[k];
                    if (y->pos != p || y->tail != tail || y->logits) continue;
                    y->logits = xmalloc_array(c->vocab, sizeof *y->logits);
                    memcpy(y->logits, s->logits, c->vocab * sizeof *y->logits);
                    c->bytes += logit_bytes(c);
                    break;
                }
            }
            pthread_mutex_unlock(&c->mu);
            return;
        }
    }
    int q = s->chain ? s->chain->end : 0;
    uint64_t need = kda_bytes(c) + (s->have_logits ? logit_bytes(c) : 0);
    if (q < p) need += (uint64_t)(p - q) * (c->row_floats * sizeof(float) + sizeof(int32_t)) + sizeof(seg);
    if (!make_room(c, need)) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    seg *tail = s->chain;
    if (q < p) {
        seg *g = xcalloc(1, sizeof *g);
        g->refs = 0;
        g->parent = seg_ref(s->chain);
        g->start = q;
        g->end = p;
        g->ids = xmalloc_array((size_t)(p - q), sizeof *g->ids);
        memcpy(g->ids, s->ids + q, (size_t)(p - q) * sizeof *g->ids);
        g->rows = xmalloc_array((size_t)(p - q) * c->row_floats + 1, sizeof *g->rows);
        k3_err e;
        if (k3_state_rows_get(s->st, q, p - q, g->rows, &e)) { /* cannot happen: the state is at p */
            free(g->ids);
            free(g->rows);
            seg_unref(c, g->parent);
            free(g);
            pthread_mutex_unlock(&c->mu);
            return;
        }
        c->bytes += seg_bytes(c, g);
        tail = g;
    }
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 16;
        c->v = xrealloc_array(c->v, (size_t)c->cap, sizeof *c->v);
    }
    snap *x = &c->v[c->n++];
    x->hash = h;
    x->pos = p;
    x->kda = xmalloc_array(c->kda_floats + 1, sizeof *x->kda);
    k3_state_kda_get(s->st, x->kda);
    x->logits = NULL;
    if (s->have_logits) {
        x->logits = xmalloc_array(c->vocab, sizeof *x->logits);
        memcpy(x->logits, s->logits, c->vocab * sizeof *x->logits);
        c->bytes += logit_bytes(c);
    }
    x->tail = seg_ref(tail);
    x->used = ++c->clock;
    c->bytes += kda_bytes(c);
    c->taken++;
    seg_ref(tail);
    seg_unref(c, s->chain);
    s->chain = tail;
    pthread_mutex_unlock(&c->mu);
}

/* Feeds ids[0..n) at the session's position, stopping at every grid position
 * to snapshot; logits of the last token into logits (and the session's copy),
 * or, all_rows, every token's row into logits[n][V]. A prefill with a cancel
 * hook goes one engine chunk at a time and asks the hook before each (the
 * same forward calls as one k3_engine_feed makes, so the same bits);
 * cancelled, the session keeps what it consumed. prompt: the calls count as
 * prompt work in the run report. */
static int feed(k3_session *s, const int32_t *ids, size_t n, float *logits, bool all_rows, bool prompt, bool polled,
                k3_err *err) {
    int G = s->c && s->c->budget > 0 ? s->c->grid : 0;
    polled = polled && s->cancelled;
    size_t done = 0, V = (size_t)s->V;
    s->have_logits = false;
    while (n > 0) {
        if (polled && s->cancelled(s->cancel_ctx))
            return k3_fail(err, K3_EXIT_RUNTIME, "cancelled after %zu of %zu prompt tokens (%zu reused)", s->n,
                           s->prompt_n, s->prompt_from);
        size_t t = n;
        if (G > 0) {
            size_t to_grid = (size_t)G - s->n % (size_t)G;
            if (t > to_grid) t = to_grid;
        }
        if (polled && s->e && t > (size_t)k3_engine_chunk(s->e)) t = (size_t)k3_engine_chunk(s->e);
        if (t > INT_MAX / 2) t = INT_MAX / 2;
        bool last = t == n;
        float *lg = all_rows && logits ? logits + done * V : last && logits ? s->logits : NULL;
        bool rows = all_rows && logits;
        int rc = s->e ? k3_engine_feed(s->e, s->st, ids, t, lg, rows, prompt, NULL, err)
                      : k3_forward(s->m, s->st, ids, (int)t, lg, rows, err);
        if (rc) {
            k3_session_reset(s);
            return rc;
        }
        append_ids(s, ids, t);
        ids += t;
        n -= t;
        done += t;
        if (G > 0 && s->n % (size_t)G == 0 && !s->in_pass) k3_session_snapshot(s);
    }
    if (logits) {
        if (all_rows) memcpy(s->logits, logits + (done - 1) * V, V * sizeof *logits);
        else memcpy(logits, s->logits, V * sizeof *logits);
        s->have_logits = true;
    }
    return K3_OK;
}

int k3_session_pass_begin(k3_session *s, int max_T, k3_err *err) {
    if (s->in_pass) return k3_fail(err, K3_EXIT_USAGE, "a pass is already open");
    int rc = k3_state_pass_reserve(s->st, max_T, err);
    if (!rc) rc = k3_state_pass_begin(s->st, err);
    if (rc) return rc;
    s->in_pass = true;
    s->pass_n0 = s->n;
    return K3_OK;
}

bool k3_session_in_pass(const k3_session *s) { return s->in_pass; }

int k3_session_pass_end(k3_session *s, size_t keep, k3_err *err) {
    if (!s->in_pass) return k3_fail(err, K3_EXIT_USAGE, "no pass is open");
    size_t fed = s->n - s->pass_n0;
    if (keep > fed) return k3_fail(err, K3_EXIT_USAGE, "cannot keep %zu ids of a pass of %zu", keep, fed);
    int rc = k3_state_pass_end(s->st, (int)keep, err);
    if (rc) return rc;
    s->in_pass = false;
    if (keep < fed) {
        s->n = s->pass_n0 + keep;
        s->have_logits = false;
        if (s->chain && (size_t)s->chain->end > s->n) set_chain(s, NULL); /* (none is taken in a pass) */
    }
    int G = s->c && s->c->budget > 0 ? s->c->grid : 0;
    if (G > 0 && s->n / (size_t)G > s->pass_n0 / (size_t)G) k3_session_snapshot(s);
    return K3_OK;
}

int k3_session_feed(k3_session *s, const int32_t *ids, size_t n, float *logits, k3_err *err) {
    if (n == 0) return k3_fail(err, K3_EXIT_USAGE, "no tokens to feed");
    return feed(s, ids, n, logits, false, false, false, err);
}

int k3_session_feed_rows(k3_session *s, const int32_t *ids, size_t n, float *logits, bool all_rows, bool prompt,
                         k3_err *err) {
    if (n == 0) return k3_fail(err, K3_EXIT_USAGE, "no tokens to feed");
    return feed(s, ids, n, logits, all_rows, prompt, false, err);
}

int k3_session_feed_batch_rows(k3_session *const *ss, int n, const int *counts, const int32_t *ids,
                               float *const *rows, k3_err *err) {
    if (n < 1) return k3_fail(err, K3_EXIT_USAGE, "no sessions to feed");
    k3_session *s0 = ss[0];
    bool want = false;
    size_t total = 0, V = (size_t)s0->V;
    for (int q = 0; q < n; q++) {
        k3_session *s = ss[q];
        size_t c = counts ? (size_t)counts[q] : 1;
        if (s->e != s0->e || s->m != s0->m)
            return k3_fail(err, K3_EXIT_USAGE, "batch: session %d belongs to another model", q);
        for (int r = 0; r < q; r++)
            if (ss[r] == s) return k3_fail(err, K3_EXIT_USAGE, "batch: sessions %d and %d are one session", r, q);
        if (counts && counts[q] < 1) return k3_fail(err, K3_EXIT_USAGE, "batch: no ids for session %d", q);
        if (s->n + c > (size_t)k3_state_max_pos(s->st))
            return k3_fail(err, K3_EXIT_USAGE, "batch: session %d is full (%d positions)", q, k3_state_max_pos(s->st));
        /* feed() would stop at a grid line to snapshot there: several ids
         * outside a pass must not cross one */
        int G = s->c && s->c->budget > 0 ? s->c->grid : 0;
        if (c > 1 && !s->in_pass && G > 0 && s->n % (size_t)G + c > (size_t)G)
            return k3_fail(err, K3_EXIT_USAGE, "batch: session %d's %zu ids cross a snapshot line (every %d)", q, c, G);
        for (size_t i = 0; i < c; i++)
            if (ids[total + i] < 0 || ids[total + i] >= s->V)
                return k3_fail(err, K3_EXIT_USAGE, "batch: token id %d is outside the vocabulary [0, %d)",
                               ids[total + i], s->V);
        total += c;
        want = want || (rows && rows[q]);
    }
    k3_state **st = xmalloc_array((size_t)n, sizeof *st);
    for (int q = 0; q < n; q++) st[q] = ss[q]->st;
    float *all = want ? xmalloc_array(total * V, sizeof *all) : NULL;
    int rc;
    if (s0->e) rc = k3_engine_feed_batch_rows(s0->e, st, n, counts, ids, all, err);
    else rc = counts ? k3_forward_batch_rows(s0->m, st, n, counts, ids, all, err) : k3_forward_batch(s0->m, st, n, ids, all, err);
    free(st);
    size_t at = 0;
    for (int q = 0; q < n; q++) {
        k3_session *s = ss[q];
        size_t c = counts ? (size_t)counts[q] : 1;
        if (rc) {
            k3_session_reset(s);
            continue;
        }
        append_ids(s, ids + at, c);
        s->have_logits = rows && rows[q];
        if (s->have_logits) {
            memcpy(rows[q], all + at * V, c * V * sizeof *all);
            memcpy(s->logits, all + (at + c - 1) * V, V * sizeof *all);
        }
        at += c;
        int G = s->c && s->c->budget > 0 ? s->c->grid : 0;
        if (G > 0 && s->n % (size_t)G == 0 && !s->in_pass) k3_session_snapshot(s);
    }
    free(all);
    return rc;
}

int k3_session_feed_batch(k3_session *const *ss, int n, const int32_t *ids, float *const *logits, k3_err *err) {
    return k3_session_feed_batch_rows(ss, n, NULL, ids, logits, err);
}

int k3_session_recompute(k3_session *s, int32_t id, float *logits, k3_err *err) {
    if (s->n + 1 > (size_t)k3_state_max_pos(s->st))
        return k3_fail(err, K3_EXIT_USAGE, "%zu tokens do not fit the state's %d positions", s->n + 1,
                       k3_state_max_pos(s->st));
    append_ids(s, &id, 1);
    s->have_logits = false;
    int rc;
    if (s->e) {
        rc = k3_engine_recompute(s->e, s->st, s->ids, s->n, s->logits, err);
    } else {
        k3_state_reset(s->st);
        rc = K3_OK;
        for (size_t i = 0; !rc && i < s->n; i += INT_MAX / 2) {
            size_t t = s->n - i < INT_MAX / 2 ? s->n - i : INT_MAX / 2;
            rc = k3_forward(s->m, s->st, s->ids + i, (int)t, i + t == s->n ? s->logits : NULL, false, err);
        }
    }
    if (rc) {
        k3_session_reset(s);
        return rc;
    }
    if (logits) memcpy(logits, s->logits, (size_t)s->V * sizeof *logits);
    s->have_logits = true;
    return K3_OK;
}

/* Puts snapshot x (found and referenced under the lock) into the session's
 * state: the KDA part, the MLA rows the state does not already hold (rows
 * [0, d) are the session's own and equal, since ids[0..d) agree), position. */
static void restore(k3_session *s, const float *kda, seg *tail, int pos, size_t d, const int32_t *ids) {
    k3_err e;
    k3_state_kda_set(s->st, kda);
    for (seg *g = tail; g && (size_t)g->end > d; g = g->parent)
        (void)k3_state_rows_set(s->st, g->start, g->end - g->start, g->rows, &e);
    (void)k3_state_set_pos(s->st, pos, &e);
    s->n = 0;
    append_ids(s, ids, (size_t)pos);
    s->have_logits = false;
}

int k3_session_prefill(k3_session *s, const int32_t *ids, size_t n, float *logits, size_t *reused, k3_err *err) {
    return k3_session_prefill_marked(s, ids, n, NULL, 0, logits, reused, err);
}

int k3_session_prefill_marked(k3_session *s, const int32_t *ids, size_t n, const size_t *marks, size_t nmarks,
                              float *logits, size_t *reused, k3_err *err) {
    if (reused) *reused = 0;
    if (n == 0) return k3_fail(err, K3_EXIT_USAGE, "empty prompt");
    for (size_t i = 0; i < nmarks; i++)
        if (marks[i] == 0 || marks[i] > n || (i > 0 && marks[i] <= marks[i - 1]))
            return k3_fail(err, K3_EXIT_USAGE, "prefill mark %zu (%zu): want increasing offsets in 1..%zu", i,
                           marks[i], n);
    if (s->in_pass) return k3_fail(err, K3_EXIT_USAGE, "a prefill inside an open pass (end it first)");
    if (n > (size_t)k3_state_max_pos(s->st))
        return k3_fail(err, K3_EXIT_USAGE, "prompt of %zu tokens does not fit the state's %d positions", n,
                       k3_state_max_pos(s->st));
    size_t d = 0; /* tokens the session's state and ids agree on */
    while (d < s->n && d < n && s->ids[d] == ids[d]) d++;
    if (d == s->n && d == n && s->have_logits) {
        if (logits) memcpy(logits, s->logits, (size_t)s->V * sizeof *logits);
        if (reused) *reused = n;
        s->source = 1;
        return K3_OK;
    }
    /* the session's own state serves when it is a prefix with something to feed */
    size_t own = d == s->n && d < n ? d : 0;
    k3_state_cache *c = s->c;
    bool resumed = false;
    if (c) {
        pthread_mutex_lock(&c->mu);
        int best = -1;
        if (c->n > 0) {
            /* prefix hashes of ids[0..p) for every p a snapshot could have;
             * one at n itself serves only with the logits of ids[n-1] */
            uint64_t *H = xmalloc_array(n + 1, sizeof *H);
            H[0] = K3_FNV_OFFSET;
            for (size_t p = 1; p <= n; p++) H[p] = hash_step(H[p - 1], ids[p - 1]);
            for (int i = 0; i < c->n; i++) {
                snap *x = &c->v[i];
                if (x->pos < 1 || (size_t)x->pos > n || (size_t)x->pos <= own) continue;
                if ((size_t)x->pos == n && !x->logits) continue;
                if (best >= 0 && x->pos <= c->v[best].pos) continue;
                if (x->hash != H[x->pos] || !chain_matches(x->tail, ids, x->pos)) continue;
                best = i;
            }
            free(H);
        }
        if (best >= 0) {
            snap *x = &c->v[best];
            x->used = ++c->clock;
            c->hits++;
            seg *tail = seg_ref(x->tail);
            restore(s, x->kda, tail, x->pos, d, ids);
            if ((size_t)x->pos == n) {
                memcpy(s->logits, x->logits, (size_t)s->V * sizeof *s->logits);
                s->have_logits = true;
            }
            seg_unref(c, s->chain);
            s->chain = tail;
            resumed = true;
        }
        pthread_mutex_unlock(&c->mu);
    }
    if (resumed) {
        s->source = 2;
    } else if (own > 0) {
        s->source = 1;
    } else {
        k3_session_reset(s);
    }
    /* a chain longer than the kept ids cannot happen (chains only grow from
     * positions the session held), but a cold start drops it */
    size_t from = s->n;
    if (reused) *reused = from;
    s->prompt_from = from;
    s->prompt_n = n;
    if (from == n) { /* a snapshot of the whole prompt, with its logits */
        if (logits) memcpy(logits, s->logits, (size_t)s->V * sizeof *logits);
        return K3_OK;
    }
    /* each marked boundary past the resume point ends one feed and is
     * snapshotted (a split the model's arithmetic contract makes invisible in
     * the bits); cancelled, the session holds ids[0..k) for some k < n, a true
     * state of that prefix, and the prompt's end is not snapshotted */
    for (size_t i = 0; i < nmarks; i++) {
        if (marks[i] <= s->n || marks[i] >= n) continue;
        int rc = feed(s, ids + s->n, marks[i] - s->n, NULL, false, true, true, err);
        if (rc) return rc;
        k3_session_snapshot(s);
    }
    int rc = feed(s, ids + s->n, n - s->n, logits, false, true, true, err);
    if (rc) return rc;
    k3_session_snapshot(s);
    return K3_OK;
}

void k3_session_set_cancel(k3_session *s, bool (*cancelled)(const void *ctx), const void *ctx) {
    s->cancelled = cancelled;
    s->cancel_ctx = ctx;
}

/* ---- session files --------------------------------------------------------------------------- */
#define SESS_MAGIC "K3SESSN\n"
#define SESS_VERSION 1u
#define SESS_HEADER 64u

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

int k3_session_save(const k3_session *s, const char *path, uint64_t model_id, const void *extra, size_t extra_len,
                    k3_err *err) {
    const k3_config *cfg = k3_model_config(s->m);
    uint64_t sbytes = k3_state_snapshot_bytes(cfg, (int64_t)s->n);
    uint8_t *state = xmalloc(sbytes ? sbytes : 1);
    k3_state_save(s->st, state);
    uint32_t crc = k3_crc32c(0, s->ids, s->n * sizeof *s->ids);
    crc = k3_crc32c(crc, state, sbytes);
    if (extra_len) crc = k3_crc32c(crc, extra, extra_len);
    uint8_t h[SESS_HEADER] = {0};
    memcpy(h, SESS_MAGIC, 8);
    put32(h + 8, SESS_VERSION);
    put32(h + 12, SESS_HEADER);
    put64(h + 16, model_id);
    put64(h + 24, s->n);
    put64(h + 32, sbytes);
    put64(h + 40, extra_len);
    put32(h + 48, crc);
    put32(h + 60, k3_crc32c(0, h, 60));
    k3_atomic_file af;
    int rc = k3_atomic_open(&af, path, err);
    if (!rc) rc = k3_atomic_write(&af, h, sizeof h, err);
    if (!rc) rc = k3_atomic_write(&af, s->ids, s->n * sizeof *s->ids, err);
    if (!rc) rc = k3_atomic_write(&af, state, sbytes, err);
    if (!rc && extra_len) rc = k3_atomic_write(&af, extra, extra_len, err);
    if (!rc) rc = k3_atomic_commit(&af, err);
    else k3_atomic_abort(&af);
    free(state);
    return rc;
}

int k3_session_load(k3_session *s, const char *path, uint64_t model_id, char **extra, size_t *extra_len,
                    k3_err *err) {
    char *data = NULL;
    size_t len = 0;
    if (extra) *extra = NULL;
    if (extra_len) *extra_len = 0;
    /* a regular file, any size (its header says what it must hold) */
    int rc = k3_read_file_max(path, UINT64_MAX, true, &data, &len, err);
    if (rc) return rc;
    const uint8_t *h = (const uint8_t *)data;
    const k3_config *cfg = k3_model_config(s->m);
    rc = K3_EXIT_DATA;
    if (len < SESS_HEADER || memcmp(h, SESS_MAGIC, 8) != 0) {
        k3_fail(err, rc, "%s: not a k3 session file", path);
        goto out;
    }
    if (get32(h + 60) != k3_crc32c(0, h, 60)) {
        k3_fail(err, rc, "%s: session header is corrupt (checksum mismatch)", path);
        goto out;
    }
    if (get32(h + 8) != SESS_VERSION || get32(h + 12) != SESS_HEADER) {
        k3_fail(err, rc, "%s: session file version %u, this build reads version %u", path, get32(h + 8),
                SESS_VERSION);
        goto out;
    }
    if (get64(h + 16) != model_id) {
        k3_fail(err, rc, "%s: session was saved with another model (identity %016llx, this model %016llx)", path,
                (unsigned long long)get64(h + 16), (unsigned long long)model_id);
        goto out;
    }
    uint64_t n = get64(h + 24), sbytes = get64(h + 32), xbytes = get64(h + 40);
    if (n > (uint64_t)k3_state_max_pos(s->st)) {
        k3_fail(err, rc, "%s: session holds %llu tokens, more than the state's %d positions", path,
                (unsigned long long)n, k3_state_max_pos(s->st));
        goto out;
    }
    if (sbytes != k3_state_snapshot_bytes(cfg, (int64_t)n)) {
        k3_fail(err, rc, "%s: session state is %llu bytes, this model's state at %llu tokens is %llu", path,
                (unsigned long long)sbytes, (unsigned long long)n,
                (unsigned long long)k3_state_snapshot_bytes(cfg, (int64_t)n));
        goto out;
    }
    uint64_t want = SESS_HEADER + n * 4;
    if (want + sbytes < want || want + sbytes + xbytes < want + sbytes || len != want + sbytes + xbytes) {
        k3_fail(err, rc, "%s: session file is %zu bytes, its header says %llu (truncated or corrupt)", path, len,
                (unsigned long long)(want + sbytes + xbytes));
        goto out;
    }
    if (k3_crc32c(0, h + SESS_HEADER, len - SESS_HEADER) != get32(h + 48)) {
        k3_fail(err, rc, "%s: session payload is corrupt (checksum mismatch)", path);
        goto out;
    }
    const int32_t *ids = (const int32_t *)(data + SESS_HEADER);
    for (uint64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= s->V) {
            k3_fail(err, rc, "%s: token id %d is outside the vocabulary", path, ids[i]);
            goto out;
        }
    k3_session_reset(s);
    /* the payload is 4-byte aligned in the buffer only by luck: copy the state */
    float *state = xmalloc(sbytes ? sbytes : 1);
    memcpy(state, data + want, sbytes);
    rc = k3_state_load(s->st, state, (int)n, err);
    free(state);
    if (rc) goto out;
    append_ids(s, ids, n);
    if (extra) {
        *extra = xmalloc(xbytes + 1);
        memcpy(*extra, data + want + sbytes, xbytes);
        (*extra)[xbytes] = 0;
    }
    if (extra_len) *extra_len = xbytes;
    rc = K3_OK;
out:
    free(data);
    return rc;
}
