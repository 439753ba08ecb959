/* draft.c: n-gram and draft-model drafters, the drafts-per-pass controller
 * (draft.h). */
#include "draft/draft.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "train/data.h" /* data_tokenizer_hash: the one tokenizer identity */

struct k3_drafter {
    int vocab;
    /* n-gram: hist[0..n) indexed; slot keys are hashes of (g, ids) with the
     * n-gram's end (exclusive) as value; 0 marks an empty slot */
    int min_n, max_n;
    int32_t *hist;
    size_t n, cap;
    uint64_t *key;
    int64_t *end;
    size_t slots, used;
    /* draft model */
    k3_engine *e;
    bool sibling;      /* e is another drafter's (k3_drafter_sibling) */
    struct k3_drafter *root; /* the drafter that opened e (itself, or the one a sibling was made from) */
    k3_state *st;
    k3_session *s;
    float *logits;
    float *rows;       /* [max_k + 1][V]: a batched catch-up's rows (made at first use) */
    int max_k;
    double p_min;       /* drafting stops where the chance the drafts so far are all kept falls below it */
    k3_draft_gate gate;
    /* the last drafts proposed (and the gate's bucket of each), after a
     * history of last_at ids: the next history says which were kept */
    int32_t last[K3_SPEC_MAX + 1];
    int last_b[K3_SPEC_MAX + 1];
    int last_n;
    size_t last_at;
    int idle;          /* asks in a row the gate drafted nothing for */
    int catchup;       /* ids of a new history fed per ask at most (0: all) */
    /* the root's: the draft model's forward passes and the drafters fed in
     * them (read by another thread: k3 serve's /metrics) */
    _Atomic uint64_t passes, seqs;
};

/* ---- n-gram -------------------------------------------------------------------------- */

static uint64_t gram_hash(const int32_t *ids, int g) {
    uint64_t h = k3_fnv1a64(K3_FNV_OFFSET, &g, sizeof g);
    h = k3_fnv1a64(h, ids, (size_t)g * sizeof *ids);
    return h ? h : 1;
}

static void table_put(k3_drafter *d, uint64_t h, int64_t end) {
    size_t i = (size_t)(h & (d->slots - 1));
    while (d->key[i] && d->key[i] != h) i = (i + 1) & (d->slots - 1);
    if (!d->key[i]) d->used++;
    d->key[i] = h;
    d->end[i] = end; /* the latest occurrence wins */
}

static int64_t table_get(const k3_drafter *d, uint64_t h) {
    size_t i = (size_t)(h & (d->slots - 1));
    while (d->key[i]) {
        if (d->key[i] == h) return d->end[i];
        i = (i + 1) & (d->slots - 1);
    }
    return -1;
}

static void table_grow(k3_drafter *d) {
    uint64_t *ok = d->key;
    int64_t *oe = d->end;
    size_t on = d->slots;
    d->slots = on ? 2 * on : 1024;
    d->key = xcalloc(d->slots, sizeof *d->key);
    d->end = xmalloc_array(d->slots, sizeof *d->end);
    d->used = 0;
    for (size_t i = 0; i < on; i++)
        if (ok[i]) table_put(d, ok[i], oe[i]);
    free(ok);
    free(oe);
}

/* Indexes the n-grams ending at e (exclusive) for every e up to n - 1: each
 * has a following id. */
static void index_to(k3_drafter *d, size_t from, size_t n) {
    for (size_t e = from; e < n; e++) {
        for (int g = d->min_n; g <= d->max_n && (size_t)g <= e; g++) {
            if (2 * (d->used + 1) > d->slots) table_grow(d);
            table_put(d, gram_hash(d->hist + e - g, g), (int64_t)e);
        }
    }
}

k3_drafter *k3_drafter_ngram(int vocab, int min_n, int max_n, double p_min) {
    k3_drafter *d = xcalloc(1, sizeof *d);
    d->vocab = vocab;
    d->p_min = p_min > 0.0 && p_min <= 1.0 ? p_min : 0.0;
    /* a match starts at even odds (as if one draft of each length had been
     * rejected): a run of a few hundred ids cannot afford to learn from
     * chains of untried drafts at every length */
    for (int b = 0; b < K3_DRAFT_GATE_BUCKETS; b++) d->gate.seen[b] = 1;
    d->min_n = min_n < 1 ? 1 : min_n > 8 ? 8 : min_n;
    d->max_n = max_n < d->min_n ? d->min_n : max_n > 8 ? 8 : max_n;
    d->cap = 256;
    d->hist = xmalloc_array(d->cap, sizeof *d->hist);
    table_grow(d);
    return d;
}

/* What the target did with d's last drafts, told by the history that
 * follows them (hist[0..n), sharing its first `same` ids with what d holds
 * (its n-gram index's history, its draft model's session), extends the one
 * they were drafted after): each draft up to the first
 * rejected one is recorded in the gate; drafts past the history's end were
 * never verified and count for nothing. */
static void learn(k3_drafter *d, const int32_t *hist, size_t n, size_t same) {
    size_t n0 = d->last_at;
    int m = d->last_n;
    d->last_n = 0;
    d->last_at = n;
    if (m == 0 || n <= n0 || same < n0) return;
    for (int i = 0; i < m && n0 + (size_t)i < n; i++) {
        bool kept = hist[n0 + (size_t)i] == d->last[i];
        k3_draft_gate_record(&d->gate, d->last_b[i], kept);
        if (!kept) break;
    }
}

static void ngram_propose(k3_drafter *d, const int32_t *hist, size_t n, int k, int32_t *out, int *got) {
    /* follow the history: extend the index, or index afresh after a change */
    size_t same = 0;
    while (same < d->n && same < n && d->hist[same] == hist[same]) same++;
    learn(d, hist, n, same);
    if (same < d->n) {
        d->n = 0;
        memset(d->key, 0, d->slots * sizeof *d->key);
        d->used = 0;
        same = 0;
    }
    if (n > d->cap) {
        while (n > d->cap) d->cap *= 2;
        d->hist = xrealloc_array(d->hist, d->cap, sizeof *d->hist);
    }
    memcpy(d->hist + same, hist + same, (n - same) * sizeof *hist);
    /* n-grams ending at e < n have a continuation; the suffix ending at n
     * itself is looked up, then indexed on the next call */
    size_t from = d->n;
    d->n = n;
    index_to(d, from, n);
    *got = 0;
    for (int g = d->max_n; g >= d->min_n; g--) {
        if ((size_t)g > n) continue;
        const int32_t *suf = hist + n - g;
        int64_t e = table_get(d, gram_hash(suf, g));
        if (e < g || (size_t)e >= n || memcmp(hist + e - g, suf, (size_t)g * sizeof *suf)) continue;
        /* the continuation of that occurrence; past the history's end it
         * repeats what was just drafted (a loop continues as a loop) */
        double surv = 1.0; /* the chance the drafts so far are all kept */
        int c = 0;
        for (; c < k; c++) {
            size_t at = (size_t)e + (size_t)c;
            int32_t id = at < n ? hist[at] : out[at - n];
            if (id < 0 || id >= d->vocab) break;
            if (d->p_min > 0.0) {
                surv *= k3_draft_gate_chance(&d->gate, g);
                if (surv < d->p_min && !(c == 0 && d->idle >= 64)) break;
            }
            out[c] = id;
            d->last[d->last_n] = id;
            d->last_b[d->last_n++] = g;
        }
        *got = c;
        d->idle = c ? 0 : d->idle + 1;
        return;
    }
}

/* ---- draft model ------------------------------------------------------------------------ */

static int tok_hash(const char *dir, uint64_t *h, k3_err *err) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/tiktoken.model", dir) >= (int)sizeof path)
        return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    if (access(path, R_OK) != 0)
        return k3_fail(err, K3_EXIT_USAGE, "--draft: %s has no tokenizer (tiktoken.model) to compare", dir);
    return data_tokenizer_hash(dir, h, err);
}

/* The draft model's own state and session on d->e, for histories of max_pos. */
static int model_session(k3_drafter *d, int64_t max_pos, k3_err *err) {
    /* a pass's record, the logits row, and a batched catch-up's rows */
    int rc = k3_engine_state_new(d->e, max_pos, k3_state_pass_bytes(k3_engine_config(d->e), d->max_k) +
                                                 (uint64_t)(d->max_k + 2) * (uint64_t)k3_engine_vocab(d->e) *
                                                     sizeof(float), &d->st, err);
    if (rc) return rc;
    d->s = k3_session_open(d->e, d->st, NULL);
    d->logits = xmalloc_array((size_t)k3_engine_vocab(d->e), sizeof *d->logits);
    return K3_OK;
}

int k3_drafter_model(const k3_engine_opts *o, const char *dir, const char *tok_dir, int vocab, int64_t max_pos,
                     int max_k, double p_min, k3_drafter **out, k3_err *err) {
    *out = NULL;
    if (!(p_min >= 0.0 && p_min <= 1.0))
        return k3_fail(err, K3_EXIT_USAGE, "--draft-p-min: %g is not a probability in [0, 1]", p_min);
    uint64_t a, b;
    int rc = tok_hash(tok_dir, &a, err);
    if (!rc) rc = tok_hash(dir, &b, err);
    if (rc) return rc == K3_EXIT_USAGE ? rc : k3_fail(err, K3_EXIT_USAGE, "--draft %s: %s", dir, err->msg);
    if (a != b)
        return k3_fail(err, K3_EXIT_USAGE,
                       "--draft %s: its tokenizer differs from the model's (%s): drafts must be ids of the same "
                       "tokenizer", dir, tok_dir);
    k3_engine_opts eo = *o;
    k3_runmem_args_init(&eo.mem); /* resident: the target's streaming flags name its own files */
    eo.model_dir = dir;
    eo.tok_dir = NULL;
    eo.need_tokenizer = false;
    eo.layers = 0;
    eo.kda_chunk = 0;
    eo.expert_placement = NULL;
    eo.max_pos = max_pos;
    eo.alone = true; /* under mpirun each rank drafts with its own copy */
    k3_drafter *d = xcalloc(1, sizeof *d);
    d->vocab = vocab;
    d->max_k = max_k < 1 ? 1 : max_k;
    d->p_min = p_min;
    d->root = d;
    rc = k3_engine_open(&eo, &d->e, err);
    if (!rc) rc = model_session(d, max_pos, err);
    if (rc) {
        k3_drafter_free(d);
        return rc;
    }
    *out = d;
    return K3_OK;
}

int k3_drafter_sibling(k3_drafter *d, int64_t max_pos, k3_drafter **out, k3_err *err) {
    *out = NULL;
    if (!d->e) {
        *out = k3_drafter_ngram(d->vocab, d->min_n, d->max_n, d->p_min);
        return K3_OK;
    }
    k3_drafter *x = xcalloc(1, sizeof *x);
    x->vocab = d->vocab;
    x->max_k = d->max_k;
    x->p_min = d->p_min;
    x->catchup = d->catchup;
    x->e = d->e;
    x->sibling = true;
    x->root = d->root;
    int rc = model_session(x, max_pos, err);
    if (rc) {
        k3_drafter_free(x);
        return rc;
    }
    *out = x;
    return K3_OK;
}

/* How many leading ids d's session shares with hist[0..n). */
static size_t shared_ids(const k3_drafter *d, const int32_t *hist, size_t n) {
    size_t len = k3_session_len(d->s), same = 0;
    const int32_t *own = k3_session_ids(d->s);
    while (same < len && same < n && own[same] == hist[same]) same++;
    return same;
}

/* Ends d's open pass at the `same` ids its session shares with the
 * history: the drafts the target kept stay, the others are taken back. */
static int take_back(k3_drafter *d, size_t same, k3_err *err) {
    if (!k3_session_in_pass(d->s)) return K3_OK;
    size_t n0 = k3_session_len(d->s) - (size_t)k3_state_pass_len(d->st);
    return k3_session_pass_end(d->s, same > n0 ? same - n0 : 0, err);
}

/* Ids d must feed to hold hist[0..n) with its logits when its state holds a
 * prefix of it and misses 1..max_k + 1 ids (what a verifying pass leaves);
 * 0 otherwise (nothing to feed, or a longer or other history: a prefill of
 * its own). */
static size_t tail_ids(k3_drafter *d, const int32_t *hist, size_t n) {
    size_t len = k3_session_len(d->s);
    if (len >= n || n - len > (size_t)d->max_k + 1) return 0;
    return memcmp(k3_session_ids(d->s), hist, len * sizeof *hist) ? 0 : n - len;
}

static void count_pass(k3_drafter *d, int seqs) {
    atomic_fetch_add(&d->root->passes, 1);
    atomic_fetch_add(&d->root->seqs, (uint64_t)seqs);
}

/* x's drafter catches up with hist[0..n) alone (counted as one pass when it
 * feeds anything). */
static int prefill(const k3_draft_ask *x, size_t n, k3_err *err) {
    size_t reused = 0;
    int rc = k3_session_prefill(x->d->s, x->hist, n, x->d->logits, &reused, err);
    if (!rc && reused < n) count_pass(x->d, 1);
    return rc;
}

/* How far into x's history a prefill may go this ask: all of it, or with a
 * catch-up bound, that many ids past what the session holds of it (its ids
 * a prefix of the history, else a cold start). */
static size_t prefill_end(const k3_draft_ask *x) {
    const k3_drafter *d = x->d;
    if (d->catchup <= 0) return x->n;
    size_t len = k3_session_len(d->s);
    size_t from = len <= x->n && !memcmp(k3_session_ids(d->s), x->hist, len * sizeof *x->hist) ? len : 0;
    return x->n - from > (size_t)d->catchup ? from + (size_t)d->catchup : x->n;
}

/* Feeds each drafter a[w[i]] (i < m) the last cnt[i] ids of its history in
 * one forward pass (m >= 2; their sum within the engine's chunk), each
 * drafter's last row to its logits. */
static int catch_up(k3_draft_ask *const *a, const int *w, const int *cnt, int m, k3_session **ss, int32_t *ids,
                    float **rows, k3_err *err) {
    size_t at = 0, V = (size_t)k3_engine_vocab(a[w[0]]->d->e);
    for (int i = 0; i < m; i++) {
        k3_drafter *d = a[w[i]]->d;
        if (!d->rows) d->rows = xmalloc_array(((size_t)d->max_k + 1) * V, sizeof *d->rows);
        ss[i] = d->s;
        rows[i] = d->rows;
        memcpy(ids + at, a[w[i]]->hist + a[w[i]]->n - (size_t)cnt[i], (size_t)cnt[i] * sizeof *ids);
        at += (size_t)cnt[i];
    }
    int rc = k3_session_feed_batch_rows(ss, m, cnt, ids, rows, err);
    if (rc) return rc;
    count_pass(a[w[0]]->d, m);
    for (int i = 0; i < m; i++) {
        k3_drafter *d = a[w[i]]->d;
        memcpy(d->logits, d->rows + ((size_t)cnt[i] - 1) * V, V * sizeof *d->logits);
    }
    return K3_OK;
}

/* Drafts for a[0..n), draft-model drafters of one engine: each drafter
 * takes back the drafts its target rejected and catches up with its history
 * (a prefill alone, or the short tails of several in one pass), then decodes
 * greedily, the drafters still drafting at a position in one pass. One ask
 * gets exactly k3_drafter_propose's path: a prefill, then one id per feed. */
static int model_propose(k3_draft_ask *const *a, int n, k3_err *err) {
    k3_engine *e = a[0]->d->e;
    const int V = k3_engine_vocab(e), chunk = k3_engine_chunk(e);
    int *k = xcalloc((size_t)n, sizeof *k), *w = xmalloc_array((size_t)n, sizeof *w);
    int *cnt = xmalloc_array((size_t)n, sizeof *cnt);
    k3_session **ss = xmalloc_array((size_t)n, sizeof *ss);
    size_t per = 1; /* ids a drafter feeds in one pass at most */
    for (int i = 0; i < n; i++)
        if ((size_t)a[i]->d->max_k + 1 > per) per = (size_t)a[i]->d->max_k + 1;
    int32_t *ids = xmalloc_array((size_t)n * per, sizeof *ids);
    float **lg = xmalloc_array((size_t)n, sizeof *lg);
    double *surv = xmalloc_array((size_t)n, sizeof *surv); /* the chance a drafter's drafts so far are all kept */
    bool *asked = xcalloc((size_t)n, sizeof *asked);        /* asked and caught up: an ask the gate answers */
    int rc = K3_OK, m = 0, rows = 0;
    for (int i = 0; i < n; i++) {
        k3_drafter *d = a[i]->d;
        surv[i] = 1.0;
        size_t same = shared_ids(d, a[i]->hist, a[i]->n);
        learn(d, a[i]->hist, a[i]->n, same);
        int kk = a[i]->k < d->max_k ? a[i]->k : d->max_k;
        if (kk <= 0 || a[i]->n >= (size_t)k3_state_max_pos(d->st)) continue; /* no room to draft */
        if ((rc = take_back(d, same, err))) goto out;
        size_t room = (size_t)k3_state_max_pos(d->st) - a[i]->n;
        k[i] = (size_t)kk > room + 1 ? (int)(room + 1) : kk;
    }
    /* the state holds the history, the logits of its last id */
    for (int i = 0; i < n; i++) {
        if (!k[i]) continue;
        int c = (int)tail_ids(a[i]->d, a[i]->hist, a[i]->n);
        if (c > 0 && c <= chunk) {
            w[m] = i;
            cnt[m++] = c;
            continue;
        }
        size_t upto = prefill_end(a[i]);
        if ((rc = prefill(a[i], upto, err))) goto out;
        if (upto < a[i]->n) k[i] = 0; /* still behind: no drafts this ask, nor a count against the gate */
    }
    for (int i = 0, g = 0; i <= m; i++) { /* in passes of at most the chunk */
        if (i < m && rows + cnt[i] <= chunk) {
            rows += cnt[i];
            continue;
        }
        if (i - g == 1) { /* alone: its own prefill, as k3_drafter_propose does */
            if ((rc = prefill(a[w[g]], a[w[g]]->n, err))) goto out;
        } else if (i > g && (rc = catch_up(a, w + g, cnt + g, i - g, ss, ids, lg, err))) {
            goto out;
        }
        g = i;
        rows = i < m ? cnt[i] : 0;
    }
    for (int i = 0; i < n; i++)
        if (k[i] > 1 && (rc = k3_session_pass_begin(a[i]->d->s, k[i] - 1, err))) goto out;
    for (int i = 0; i < n; i++) asked[i] = k[i] > 0;
    for (int pos = 0;; pos++) {
        m = 0;
        for (int i = 0; i < n; i++) {
            if (k[i] <= pos) continue;
            k3_drafter *d = a[i]->d;
            int32_t id = k3_argmax(d->logits, V);
            /* how sure the draft model is of it (only ever a count in the gate) */
            double p = d->p_min > 0.0 ? exp((double)d->logits[id] - k3_log_sum_exp(d->logits, V)) : 1.0;
            int b = k3_draft_gate_bucket(p);
            if (d->p_min > 0.0) surv[i] *= k3_draft_gate_chance(&d->gate, b);
            /* after 64 asks with no draft one goes anyway, so the gate keeps learning */
            bool probe = pos == 0 && d->idle >= 64;
            if (id >= d->vocab || (surv[i] < d->p_min && !probe)) {
                k[i] = pos; /* not the target's, or too likely to be rejected: no more drafts */
                continue;
            }
            d->last[d->last_n] = id;
            d->last_b[d->last_n++] = b;
            a[i]->out[a[i]->got++] = id;
            if (pos + 1 == k[i]) continue;
            ss[m] = d->s;
            ids[m] = id;
            lg[m++] = d->logits;
        }
        if (m == 0) break;
        rc = m == 1 ? k3_session_feed(ss[0], ids, 1, lg[0], err) : k3_session_feed_batch(ss, m, ids, lg, err);
        if (rc) goto out;
        count_pass(a[0]->d, m);
    }
    for (int i = 0; i < n; i++)
        if (asked[i]) a[i]->d->idle = a[i]->got ? 0 : a[i]->d->idle + 1;
out:
    free(asked);
    free(surv);
    free(k);
    free(w);
    free(cnt);
    free(ss);
    free(ids);
    free(lg);
    return rc;
}

/* ---- common ---------------------------------------------------------------------------- */

void k3_drafter_free(k3_drafter *d) {
    if (!d) return;
    free(d->hist);
    free(d->key);
    free(d->end);
    k3_session_free(d->s);
    if (d->e && d->st) k3_engine_state_free(d->e, d->st);
    if (d->e && !d->sibling) k3_engine_free(d->e);
    free(d->logits);
    free(d->rows);
    free(d);
}

int k3_drafter_propose(k3_drafter *d, const int32_t *hist, size_t n, int k, int32_t *out, int *got, k3_err *err) {
    k3_draft_ask a = {.d = d, .hist = hist, .n = n, .k = k, .out = out}, *pa = &a;
    int rc = k3_drafter_propose_batch(&pa, 1, err);
    *got = a.got;
    return rc;
}

int k3_drafter_propose_batch(k3_draft_ask *const *asks, int n, k3_err *err) {
    for (int i = 0; i < n; i++) {
        asks[i]->got = 0;
        for (int j = 0; j < i; j++)
            if (asks[j]->d == asks[i]->d) return k3_fail(err, K3_EXIT_USAGE, "drafts: asks %d and %d of one drafter", j, i);
    }
    /* n-gram drafters each on their own; the draft-model ones a model at a time */
    k3_draft_ask **grp = xmalloc_array((size_t)n, sizeof *grp);
    bool *done = xcalloc((size_t)n, sizeof *done);
    int rc = K3_OK;
    for (int i = 0; !rc && i < n; i++) {
        k3_draft_ask *x = asks[i];
        if (done[i] || x->n == 0 || x->k <= 0) continue;
        if (!x->d->e) {
            ngram_propose(x->d, x->hist, x->n, x->k, x->out, &x->got);
            continue;
        }
        int m = 0;
        for (int j = i; j < n; j++)
            if (!done[j] && asks[j]->d->e == x->d->e && asks[j]->n > 0 && asks[j]->k > 0) {
                grp[m++] = asks[j];
                done[j] = true;
            }
        rc = model_propose(grp, m, err);
    }
    free(grp);
    free(done);
    return rc;
}

k3_draft_stats k3_drafter_stats(const k3_drafter *d) {
    k3_draft_stats st = {0};
    if (d && d->e) {
        st.passes = atomic_load(&d->root->passes);
        st.seqs = atomic_load(&d->root->seqs);
    }
    return st;
}

k3_engine *k3_drafter_engine(k3_drafter *d) { return d ? d->e : NULL; }

void k3_drafter_set_catchup(k3_drafter *d, int ids) { d->catchup = ids > 0 ? ids : 0; }

int k3_drafter_for(const k3_engine *target, const char *draft_dir, double p_min, int kmax, int64_t max_pos,
                   k3_drafter **out, k3_err *err) {
    *out = NULL;
    if (kmax <= 0) return K3_OK;
    if (!draft_dir) {
        *out = k3_drafter_ngram(k3_engine_vocab(target), 2, 4, p_min);
        return K3_OK;
    }
    const k3_engine_opts *o = k3_engine_options(target);
    const char *tok = o->tok_dir ? o->tok_dir : o->model_dir;
    return k3_drafter_model(o, draft_dir, tok, k3_engine_vocab(target), max_pos, kmax, p_min, out, err);
}

/* ---- the flags ---------------------------------------------------------------------------- */

void k3_spec_flags_init(k3_spec_flags *f) { *f = (k3_spec_flags){0}; }

int k3_spec_parse_flag(k3_spec_flags *f, const char *cmd, int argc, char **argv, int *i, bool *used, k3_err *err) {
    const char *o = argv[*i];
    *used = !strcmp(o, "--speculate") || !strcmp(o, "--draft") || !strcmp(o, "--draft-p-min");
    if (!*used) return K3_OK;
    if (*i + 1 >= argc) return k3_fail(err, K3_EXIT_USAGE, "%s: %s needs a value (see 'k3 help %s')", cmd, o, cmd);
    const char *v = argv[++*i];
    int64_t n;
    double d;
    if (!strcmp(o, "--speculate")) {
        if (!k3_parse_i64(v, 0, K3_SPEC_MAX, &n))
            return k3_fail(err, K3_EXIT_USAGE, "%s: --speculate: '%s' is not a count in [0, %d] (see 'k3 help %s')",
                           cmd, v, K3_SPEC_MAX, cmd);
        f->speculate = (int)n;
    } else if (!strcmp(o, "--draft")) {
        if (!*v) return k3_fail(err, K3_EXIT_USAGE, "%s: --draft needs a model directory", cmd);
        f->draft = v;
    } else {
        if (!k3_parse_f64(v, &d) || !(d >= 0 && d <= 1))
            return k3_fail(err, K3_EXIT_USAGE, "%s: --draft-p-min: '%s' is not a probability in [0, 1] (see 'k3 help %s')",
                           cmd, v, cmd);
        f->p_min = d;
        f->p_min_given = true;
    }
    return K3_OK;
}

int k3_spec_flags_check(k3_spec_flags *f, const char *cmd, k3_err *err) {
    if (f->p_min_given && !f->draft && !f->speculate)
        return k3_fail(err, K3_EXIT_USAGE, "%s: --draft-p-min applies to drafts: give --speculate K or --draft DIR", cmd);
    if (!f->p_min_given) f->p_min = f->draft ? K3_DRAFT_P_MIN : K3_NGRAM_P_MIN;
    if (f->draft && !f->speculate) f->speculate = 4;
    return K3_OK;
}

/* ---- how likely a draft is kept ------------------------------------------------------------ */

int k3_draft_gate_bucket(double p) {
    int b = (int)(p * K3_DRAFT_GATE_BUCKETS);
    return b < 0 ? 0 : b >= K3_DRAFT_GATE_BUCKETS ? K3_DRAFT_GATE_BUCKETS - 1 : b;
}

double k3_draft_gate_chance(const k3_draft_gate *g, int b) {
    return ((double)g->kept[b] + 1.0) / ((double)g->seen[b] + 1.0);
}

void k3_draft_gate_record(k3_draft_gate *g, int b, bool kept) {
    if (g->seen[b] == UINT32_MAX) { /* halve both: the ratio stays, the counts go on */
        g->seen[b] /= 2;
        g->kept[b] /= 2;
    }
    g->seen[b]++;
    g->kept[b] += kept;
}

/* ---- drafts per pass ---------------------------------------------------------------------- */

#define BACKOFF_MAX 64

void k3_spec_ctl_init(k3_spec_ctl *c, int kmax, bool fixed) {
    c->kmax = kmax < 0 ? 0 : kmax > K3_SPEC_MAX ? K3_SPEC_MAX : kmax;
    c->fixed = fixed;
    c->k = c->kmax;
    c->skip = 0;
    c->backoff = 1;
}

int k3_spec_ctl_want(k3_spec_ctl *c) {
    if (c->kmax == 0) return 0;
    if (c->skip > 0) {
        c->skip--;
        return 0;
    }
    return c->k > 0 ? c->k : 1; /* a probe */
}

void k3_spec_ctl_update(k3_spec_ctl *c, int proposed, int accepted) {
    if (c->kmax == 0 || c->fixed || proposed <= 0) return; /* nothing was risked, or the drafter stops itself */
    if (accepted >= proposed) {
        c->k = proposed + 1 < c->kmax ? proposed + 1 : c->kmax;
        c->backoff = 1;
    } else if (accepted > 0) {
        c->k = accepted + 1;
        c->backoff = 1;
    } else {
        c->k = proposed / 2;
        if (c->k == 0) {
            c->skip = c->backoff;
            c->backoff = c->backoff * 2 < BACKOFF_MAX ? c->backoff * 2 : BACKOFF_MAX;
        }
    }
}

/* ---- the verifying feed ----------------------------------------------------------------------- */

struct k3_spec {
    k3_drafter *d;
    k3_spec_ctl ctl;
    int V;
    float *rows;       /* [kmax + 1][V] the open pass's logits */
    int32_t *draft;    /* [kmax] its drafts */
    int k;             /* drafts in the open pass */
    int j;             /* ids of the open pass consumed (the sampled id, then accepted drafts) */
    bool open;
    int32_t *hist;     /* the session's ids and the id to feed, for the drafter */
    size_t hcap;
    float *logits;     /* between k3_spec_begin and k3_spec_fed: where the sampled id's row goes */
    k3_spec_stats st;
};

k3_spec *k3_spec_new(k3_drafter *d, int kmax, int vocab) {
    k3_spec *sp = xcalloc(1, sizeof *sp);
    sp->d = d;
    k3_spec_ctl_init(&sp->ctl, kmax, d->p_min > 0.0);
    sp->V = vocab;
    sp->rows = xmalloc_array(((size_t)sp->ctl.kmax + 1) * (size_t)vocab, sizeof *sp->rows);
    sp->draft = xmalloc_array((size_t)sp->ctl.kmax + 1, sizeof *sp->draft);
    return sp;
}

void k3_spec_free(k3_spec *sp) {
    if (!sp) return;
    free(sp->rows);
    free(sp->draft);
    free(sp->hist);
    free(sp);
}

k3_spec_stats k3_spec_get_stats(const k3_spec *sp) { return sp->st; }

int k3_spec_finish(k3_spec *sp, k3_session *s, k3_err *err) {
    if (!sp->open) return K3_OK;
    sp->open = false;
    k3_spec_ctl_update(&sp->ctl, sp->k, sp->j - 1);
    return k3_session_pass_end(s, (size_t)sp->j, err);
}

int k3_spec_ask(k3_spec *sp, k3_session *s, int32_t id, float *logits, int64_t limit, k3_spec_pass *out,
                k3_draft_ask *ask, k3_err *err) {
    const size_t V = (size_t)sp->V;
    memset(out, 0, sizeof *out);
    memset(ask, 0, sizeof *ask);
    if (sp->open && sp->j <= sp->k && id == sp->draft[sp->j - 1]) { /* accepted: its row is there */
        memcpy(logits, sp->rows + (size_t)sp->j * V, V * sizeof *logits);
        sp->j++;
        sp->st.accepted++;
        return K3_OK;
    }
    int rc = k3_spec_finish(sp, s, err);
    if (rc) return rc;
    sp->draft[0] = id;
    sp->logits = logits;
    out->ids = sp->draft;
    out->n = 1; /* until the answer: id, then the drafts */
    /* drafts: as many as the controller wants, the loop can use and the state holds */
    size_t n = k3_session_len(s);
    int64_t room = (int64_t)k3_state_max_pos(k3_session_state(s)) - (int64_t)n - 1;
    int64_t want = k3_spec_ctl_want(&sp->ctl);
    if (want > limit) want = limit;
    if (want > room) want = room;
    if (want <= 0) return K3_OK;
    if (n + 1 > sp->hcap) {
        sp->hcap = 2 * (n + 1);
        sp->hist = xrealloc_array(sp->hist, sp->hcap, sizeof *sp->hist);
    }
    memcpy(sp->hist, k3_session_ids(s), n * sizeof *sp->hist);
    sp->hist[n] = id;
    *ask = (k3_draft_ask){.d = sp->d, .hist = sp->hist, .n = n + 1, .k = (int)want, .out = sp->draft + 1};
    return K3_OK;
}

int k3_spec_answer(k3_spec *sp, k3_session *s, int got, k3_spec_pass *out, k3_err *err) {
    sp->st.passes++;
    sp->st.fed += (uint64_t)got + 1;
    sp->k = got;
    out->ids = sp->draft;
    out->n = got + 1;
    /* no drafts: a plain feed of id, its row straight to the caller */
    out->rows = got ? sp->rows : sp->logits;
    return got ? k3_session_pass_begin(s, got + 1, err) : K3_OK;
}

int k3_spec_begin(k3_spec *sp, k3_session *s, int32_t id, float *logits, int64_t limit, k3_spec_pass *out,
                  k3_err *err) {
    k3_draft_ask ask;
    int rc = k3_spec_ask(sp, s, id, logits, limit, out, &ask, err);
    if (rc || out->n == 0) return rc;
    if (ask.k > 0 && (rc = k3_drafter_propose(ask.d, ask.hist, ask.n, ask.k, ask.out, &ask.got, err))) return rc;
    return k3_spec_answer(sp, s, ask.got, out, err);
}

void k3_spec_fed(k3_spec *sp) {
    if (sp->k == 0) return;
    const size_t V = (size_t)sp->V;
    memmove(sp->draft, sp->draft + 1, (size_t)sp->k * sizeof *sp->draft); /* draft[i]: the (i+1)-th draft */
    memcpy(sp->logits, sp->rows, V * sizeof *sp->logits);
    sp->j = 1;
    sp->open = true;
    sp->st.proposed += (uint64_t)sp->k;
}

int k3_spec_feed(k3_spec *sp, k3_session *s, int32_t id, float *logits, int64_t limit, k3_err *err) {
    k3_spec_pass p;
    int rc = k3_spec_begin(sp, s, id, logits, limit, &p, err);
    if (rc || p.n == 0) return rc;
    if ((rc = k3_session_feed_rows(s, p.ids, (size_t)p.n, p.rows, true, false, err))) return rc;
    k3_spec_fed(sp);
    return K3_OK;
}
