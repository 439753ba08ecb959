/* backend.c: the model side of `k3 serve` (serve.h's k3_serve_model) on the
 * engine: one session per slot over a state cache shared by every request,
 * so a request reuses what an earlier one computed, on any slot.
 *
 * Under mpirun with several ranks (expert parallel, docs/mpi.md) rank 0 alone
 * listens and runs the server with one slot; the other ranks follow it. The
 * model work of the server is three backend calls (prefill, step, end) made
 * by its one worker thread, so before each call rank 0 broadcasts a
 * fixed-size command (and a prefill's ids and message marks) and every
 * other rank makes the same call on its own session and state cache. The session's choices (its
 * own state, a snapshot to restore, a cold start, the grid snapshots,
 * evictions) follow from the calls alone, so every rank makes the same
 * forward calls and the exchanges inside the MoE layers line up. A cancelled
 * prefill stops at the same chunk on every rank: the cancel hook, asked
 * between chunks, is itself a broadcast of rank 0's flag. Sampling is rank
 * 0's: a step carries the id.
 *
 * Speculation: a prefill carries the request's drafts per pass and opens a
 * verifying feed (draft.h) on its slot for the steps that follow; each step
 * goes through it (k3_spec_feed, with the step's limit), and the next prefill
 * or the reply's end closes its last pass, so the session holds exactly the
 * ids of plain decoding whenever it is snapshot or reused. Each slot has its
 * own drafter (n-gram, or its own session of the one draft model). The
 * followers make the same calls with the same ids, limits and drafts per
 * pass; their n-gram drafter reads the same session ids, so it drafts the
 * same ids and every rank makes the same verifying passes (a draft model runs
 * on one rank only: refused under several).
 *
 * Several slots (one process): each slot has its own session and state, and
 * one model thread makes every forward call. A slot's worker posts its call
 * (a prefill or a step) and waits. The model thread runs the posted steps as
 * one batched pass once no busy slot is still between calls (sampling,
 * writing its response), so the next ids of all busy slots go together; it
 * runs a posted prefill with the hook that polls the cancel flag, and before
 * each chunk of the prefill that hook first runs the other slots' posted
 * steps: a long prompt delays their tokens by one chunk at a time. Which rows
 * share a pass never changes a row's bits (k3_session_feed_batch) and each
 * slot's calls are made in its own order, so a request gets the bytes it gets
 * alone. A cut (cancelled) prefill leaves a snapshot of what it fed in the
 * shared cache, so its retry resumes on whichever slot it lands. With
 * speculation a slot's step in that pass is its verifying feed's: the
 * model thread makes each slot's k3_spec_ask (an accepted draft needs no
 * forward), drafts for every slot that asks at once (k3_drafter_propose_batch:
 * with a draft model, one pass of it per drafted position for all of them),
 * makes each k3_spec_answer, feeds every slot's sampled id and drafts in one
 * pass (k3_session_feed_batch_rows: a row's bits never depend on its
 * neighbours, and a cut-back pass is each session's own), then k3_spec_fed;
 * passes of more ids than the plan's chunk are split. The decode passes are
 * counted for /metrics (k3_serve_batch_stats), one slot's too. */
#include "chat/chat.h"
#include "dist/dist.h"
#include "draft/draft.h"
#include "engine/engine.h"
#include "serve/serve.h"
#include "session/session.h"

#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct k3_serve_backend;

/* Where a slot is, for the model thread (under backend.mu): no request; a
 * request between model calls; a step or a prefill posted; being computed. */
enum { SLOT_IDLE, SLOT_THINK, SLOT_STEP, SLOT_PREFILL, SLOT_RUN };

typedef struct slot_s {
    struct k3_serve_backend *b;
    k3_state *st;
    k3_session *sess;
    /* under backend.mu: the phase and the call its worker posted */
    int phase;
    uint64_t ticket;       /* posting order: prefills run first come, first served */
    int32_t id;
    float *logits;
    const int32_t *ids;
    size_t n, *reused;
    const size_t *marks;   /* where the prompt's messages end */
    size_t nmarks;
    const atomic_int *cancel;
    int64_t limit;         /* a step's: ids the generation may still feed after it */
    bool done;
    int rc;
    k3_err err;
    /* speculation */
    k3_drafter *drafter;   /* this slot's; NULL: the server does not speculate */
    k3_spec *spec;         /* the verifying feed of the slot's generation; NULL: plain steps */
    k3_spec_stats seen;    /* (several slots, under mu) spec's counters after its last step */
    k3_spec_pass pass;     /* run_steps: what this slot's step feeds */
    k3_draft_ask ask;      /* run_steps: the drafts its step asks for */
} slot;

struct k3_serve_backend {
    k3_engine *e;
    k3_state_cache *cache;
    slot *sl;
    int nslots;
    k3_chat *chat;
    int64_t ctx;
    bool lead;             /* rank 0 of several: broadcasts each call before making it */
    int spec_max;          /* drafts per pass at most (0: no speculation) */
    k3_spec_stats done;    /* the counters of the closed verifying feeds (several slots: under mu) */
    k3_serve_batch_stats bst; /* the decode passes (under mu) */
    /* several slots: the model thread and the calls posted to it */
    pthread_t model;
    bool model_started, quit, mu_made;
    pthread_mutex_t mu;
    pthread_cond_t work_cv;  /* the model thread waits here */
    pthread_cond_t done_cv;  /* the workers wait here */
    uint64_t tickets;
    k3_session **bs;       /* [nslots] one batch: sessions, ids, logit rows, slots */
    int32_t *bid;
    float **blog;
    int *bslot;
    int *bn;               /* [nslots] ids per session; bid then holds (K + 1) per slot */
    struct slot_s **bgo;   /* [nslots] the slots of one pass */
    k3_draft_ask **bask;   /* [nslots] the drafts the slots of one step ask for */
};
typedef struct k3_serve_backend backend;

/* Rank 0's word to the ranks that follow it (a fixed layout; a prefill's n ids
 * follow in a second broadcast). */
enum { CMD_PREFILL = 1, CMD_STEP = 2, CMD_END = 3, CMD_QUIT = 4 };
typedef struct {
    int32_t op;
    int32_t n;             /* CMD_PREFILL: ids that follow, 1..ctx; CMD_STEP: the limit (at most K3_SPEC_MAX) */
    int32_t id;            /* CMD_STEP: the id to feed; CMD_PREFILL: drafts per pass */
    int32_t flag;          /* CMD_STEP: no logits wanted; CMD_QUIT: rank 0's exit code;
                              CMD_PREFILL: message marks that follow the ids, 0..n */
} serve_cmd;

static void send_cmd(int op, int32_t n, int32_t id, int32_t flag) {
    serve_cmd c = {.op = op, .n = n, .id = id, .flag = flag};
    k3_dist_bcast(&c, sizeof c, true, "k3 serve's next command");
}

static bool is_cancelled(const void *flag) { return atomic_load((const atomic_int *)flag) != 0; }

/* The cancel hook under several ranks: rank 0 (flag: its job's) hands its
 * answer to the others (flag NULL), so every rank stops at the same chunk. */
static bool is_cancelled_all(const void *flag) {
    int32_t c = flag ? is_cancelled(flag) : 0;
    k3_dist_bcast(&c, sizeof c, true, "k3 serve's prefill (go on or cancel)");
    return c != 0;
}

/* A prefill on one slot's session, the hook asked between its chunks; a cut
 * one leaves what it fed as a snapshot (a true state of a prefix of the
 * prompt), so the same prompt again resumes there on any slot. */
static int prefill_on(k3_session *sess, const int32_t *ids, size_t n, const size_t *marks, size_t nmarks,
                      float *logits, size_t *reused, bool (*hook)(const void *), const void *hook_ctx, k3_err *err) {
    k3_session_set_cancel(sess, hook, hook_ctx);
    int rc = k3_session_prefill_marked(sess, ids, n, marks, nmarks, logits, reused, err);
    k3_session_set_cancel(sess, NULL, NULL);
    if (rc == K3_EXIT_RUNTIME && k3_session_len(sess) > 0 && k3_session_len(sess) < n) k3_session_snapshot(sess);
    return rc;
}

/* ---- one slot: the calls made on the worker's own thread ---- */

static void stats_add(k3_spec_stats *to, const k3_spec_stats *st) {
    to->passes += st->passes;
    to->fed += st->fed;
    to->proposed += st->proposed;
    to->accepted += st->accepted;
}

/* A decode pass of seqs sequences feeding rows ids, counted (under mu). */
static void count_pass(k3_serve_batch_stats *st, int seqs, uint64_t rows) {
    int i = 0;
    while (i + 1 < K3_BATCH_HIST_N && (1 << i) < seqs) i++;
    st->passes++;
    st->seqs += (uint64_t)seqs;
    st->rows += rows;
    st->by_seqs[i]++;
}

/* Ends slot x's verifying feed: its open pass keeps the ids consumed (the
 * session then holds plain decoding's), its counters join the totals. Made
 * by the slot's own thread between its calls. */
static int spec_close(backend *b, slot *x, k3_err *err) {
    if (!x->spec) return K3_OK;
    int rc = k3_spec_finish(x->spec, x->sess, err);
    k3_spec_stats st = k3_spec_get_stats(x->spec);
    if (b->nslots > 1) pthread_mutex_lock(&b->mu);
    stats_add(&b->done, &st);
    memset(&x->seen, 0, sizeof x->seen);
    k3_spec_free(x->spec);
    x->spec = NULL;
    if (b->nslots > 1) pthread_mutex_unlock(&b->mu);
    return rc;
}

static int one_prefill(backend *b, const int32_t *ids, size_t n, const size_t *marks, size_t nmarks, float *logits,
                       size_t *reused, const atomic_int *cancel, int speculate, k3_err *err) {
    bool several = k3_engine_ranks(b->e) > 1;
    if (b->lead) { /* (n <= ctx: the server checked the prompt against it; marks are at most one per id) */
        send_cmd(CMD_PREFILL, (int32_t)n, speculate, (int32_t)nmarks);
        k3_dist_bcast((void *)ids, n * sizeof *ids, true, "k3 serve's prompt ids");
        if (nmarks) k3_dist_bcast((void *)marks, nmarks * sizeof *marks, true, "k3 serve's message marks");
    }
    /* a generation that ended in an error or a cancel left its pass open */
    int rc = spec_close(b, &b->sl[0], err);
    if (rc) return rc;
    rc = prefill_on(b->sl[0].sess, ids, n, marks, nmarks, logits, reused, several ? is_cancelled_all : is_cancelled,
                    cancel, err);
    if (!rc && speculate > 0) b->sl[0].spec = k3_spec_new(b->sl[0].drafter, speculate, k3_engine_vocab(b->e));
    return rc;
}

/* Drafts per pass never exceed K3_SPEC_MAX: a larger limit is the same. */
static int64_t step_limit(int64_t limit) { return limit > K3_SPEC_MAX ? K3_SPEC_MAX : limit < 0 ? 0 : limit; }

static int one_step(backend *b, int32_t id, float *logits, int64_t limit, k3_err *err) {
    slot *x = &b->sl[0];
    limit = step_limit(limit);
    if (b->lead) send_cmd(CMD_STEP, (int32_t)limit, id, logits == NULL);
    int rc;
    uint64_t rows = 1;
    if (x->spec && logits) {
        k3_spec_stats a = k3_spec_get_stats(x->spec);
        rc = k3_spec_feed(x->spec, x->sess, id, logits, limit, err);
        k3_spec_stats z = k3_spec_get_stats(x->spec);
        rows = z.fed - a.fed; /* 0: an accepted draft, no forward */
    } else {
        /* a kept stop id after a verifying pass: after the ids it consumed */
        rc = x->spec ? k3_spec_finish(x->spec, x->sess, err) : K3_OK;
        if (!rc) rc = k3_session_feed(x->sess, &id, 1, logits, err);
    }
    if (!rc && rows) {
        pthread_mutex_lock(&b->mu);
        count_pass(&b->bst, 1, rows);
        pthread_mutex_unlock(&b->mu);
    }
    return rc;
}

/* ---- several slots: the model thread ---- */

/* The steps are ready to go as one pass: some are posted and no busy slot is
 * still between calls (it would post its step a moment later). */
static bool steps_ready(const backend *b) {
    bool any = false;
    for (int q = 0; q < b->nslots; q++) {
        if (b->sl[q].phase == SLOT_THINK) return false;
        any = any || b->sl[q].phase == SLOT_STEP;
    }
    return any;
}

static void call_done(slot *x, int rc, const k3_err *err) {
    x->rc = rc;
    if (rc && err != &x->err) x->err = *err;
    x->done = true;
    x->phase = SLOT_THINK;
}

/* Slot x's part of a batched step before the forward: x->pass says what it
 * feeds (n 0: nothing, its step is done; x->rc set on an error). Plain, one
 * id; speculating, its verifying feed's pass (a kept stop id: the open pass
 * closed first, then the id without logits). */
static void step_begin(slot *x) {
    x->rc = K3_OK;
    x->pass = (k3_spec_pass){.ids = &x->id, .n = 1, .rows = x->logits};
    memset(&x->ask, 0, sizeof x->ask);
    if (!x->spec) return;
    if (x->logits) x->rc = k3_spec_ask(x->spec, x->sess, x->id, x->logits, x->limit, &x->pass, &x->ask, &x->err);
    else x->rc = k3_spec_finish(x->spec, x->sess, &x->err);
    if (x->rc) x->pass.n = 0;
}

/* The drafts the slots' steps ask for, drafted together (the draft model's
 * passes shared by the slots), then each verifying pass's begin. */
static void step_drafts(backend *b, slot *const *sl, int n) {
    int na = 0;
    for (int i = 0; i < n; i++)
        if (sl[i]->pass.n > 0 && sl[i]->ask.k > 0) b->bask[na++] = &sl[i]->ask;
    k3_err err = {0};
    int rc = na ? k3_drafter_propose_batch(b->bask, na, &err) : K3_OK;
    for (int i = 0; i < n; i++) {
        slot *x = sl[i];
        if (!x->spec || !x->logits || x->pass.n == 0) continue;
        if (rc && x->ask.k > 0) {
            x->rc = rc;
            x->err = err;
        } else {
            x->rc = k3_spec_answer(x->spec, x->sess, x->ask.got, &x->pass, &x->err);
        }
        if (x->rc) x->pass.n = 0;
    }
}

/* Feeds slots sl[0..n) (each with x->pass.n ids) in one pass; each slot's
 * rc says how it went. One that cannot go (K3_EXIT_USAGE, checked before
 * anything was fed) sends each alone, with its own answer and the same bits. */
static void feed_group(backend *b, slot *const *sl, int n, bool multi, k3_serve_batch_stats *st) {
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        b->bs[i] = sl[i]->sess;
        b->blog[i] = sl[i]->pass.rows;
        b->bn[i] = sl[i]->pass.n;
        memcpy(b->bid + at, sl[i]->pass.ids, (size_t)sl[i]->pass.n * sizeof *b->bid);
        at += (size_t)sl[i]->pass.n;
    }
    k3_err err = {0};
    int rc = k3_session_feed_batch_rows(b->bs, n, multi ? b->bn : NULL, b->bid, b->blog, &err);
    if (!rc) count_pass(st, n, at);
    for (int i = 0; i < n; i++) {
        slot *x = sl[i];
        if (rc == K3_EXIT_USAGE) {
            x->rc = k3_session_feed_rows(x->sess, x->pass.ids, (size_t)x->pass.n, x->pass.rows, x->pass.rows != NULL,
                                         false, &x->err);
            if (!x->rc) count_pass(st, 1, (uint64_t)x->pass.n);
        } else if ((x->rc = rc)) {
            x->err = err;
        }
        if (!x->rc && x->spec && x->logits) k3_spec_fed(x->spec);
    }
}

/* Runs every posted step in one pass (with speculation, in passes of at most
 * the plan's chunk of ids). Under mu (released while computing). */
static void run_steps(backend *b) {
    int n = 0;
    for (int q = 0; q < b->nslots; q++) {
        slot *x = &b->sl[q];
        if (x->phase != SLOT_STEP) continue;
        x->phase = SLOT_RUN;
        b->bslot[n++] = q;
    }
    pthread_mutex_unlock(&b->mu);
    slot **go = b->bgo;
    k3_serve_batch_stats st = {0};
    int ng = 0, chunk = k3_engine_chunk(b->e), rows = 0;
    bool multi = false;
    for (int i = 0; i < n; i++) {
        go[i] = &b->sl[b->bslot[i]];
        step_begin(go[i]);
    }
    step_drafts(b, go, n);
    for (int i = 0; i < n; i++) {
        slot *x = &b->sl[b->bslot[i]];
        if (x->pass.n == 0) continue; /* an accepted draft, or an error */
        multi = multi || x->pass.n > 1;
        if (multi && ng > 0 && rows + x->pass.n > chunk) {
            feed_group(b, go, ng, true, &st);
            ng = rows = 0;
        }
        go[ng++] = x;
        rows += x->pass.n;
    }
    if (ng > 0) feed_group(b, go, ng, multi, &st);
    pthread_mutex_lock(&b->mu);
    b->bst.passes += st.passes;
    b->bst.seqs += st.seqs;
    b->bst.rows += st.rows;
    for (int i = 0; i < K3_BATCH_HIST_N; i++) b->bst.by_seqs[i] += st.by_seqs[i];
    for (int i = 0; i < n; i++) {
        slot *x = &b->sl[b->bslot[i]];
        if (x->spec) x->seen = k3_spec_get_stats(x->spec);
        call_done(x, x->rc, &x->err);
    }
    pthread_cond_broadcast(&b->done_cv);
}

/* The prefill hook on the model thread: the other slots' steps go first
 * (waiting for the busy ones to post theirs), then the cancel flag. */
static bool prefill_turn(const void *ctx) {
    const slot *x = ctx;
    backend *b = x->b;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        bool think = false;
        for (int q = 0; q < b->nslots; q++) think = think || b->sl[q].phase == SLOT_THINK;
        if (!think || b->quit) break;
        pthread_cond_wait(&b->work_cv, &b->mu);
    }
    if (steps_ready(b)) run_steps(b);
    pthread_mutex_unlock(&b->mu);
    return is_cancelled(x->cancel);
}

/* Runs slot x's posted prefill. Under mu (released while computing). */
static void run_prefill(backend *b, slot *x) {
    x->phase = SLOT_RUN;
    pthread_mutex_unlock(&b->mu);
    k3_err err = {0};
    int rc = prefill_on(x->sess, x->ids, x->n, x->marks, x->nmarks, x->logits, x->reused, prefill_turn, x, &err);
    pthread_mutex_lock(&b->mu);
    call_done(x, rc, &err);
    pthread_cond_broadcast(&b->done_cv);
}

static void *model_main(void *arg) {
    backend *b = arg;
    int threads = k3_engine_threads(b->e);
    if (threads > 0) omp_set_num_threads(threads);
    pthread_mutex_lock(&b->mu);
    for (;;) {
        if (steps_ready(b)) {
            run_steps(b);
            continue;
        }
        slot *first = NULL;
        for (int q = 0; q < b->nslots; q++)
            if (b->sl[q].phase == SLOT_PREFILL && (!first || b->sl[q].ticket < first->ticket)) first = &b->sl[q];
        if (first) {
            run_prefill(b, first);
            continue;
        }
        if (b->quit) break;
        pthread_cond_wait(&b->work_cv, &b->mu);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* A worker posts its slot's call and waits for the model thread to make it. */
static int post(backend *b, slot *x, int phase, k3_err *err) {
    x->phase = phase;
    x->ticket = ++b->tickets;
    x->done = false;
    pthread_cond_broadcast(&b->work_cv);
    while (!x->done) pthread_cond_wait(&b->done_cv, &b->mu);
    if (x->rc) *err = x->err;
    return x->rc;
}

/* ---- the calls of serve.h's k3_serve_model ---- */

static int be_prefill(void *ctx, int q, const int32_t *ids, size_t n, const size_t *marks, size_t nmarks,
                      float *logits, size_t *reused, const atomic_int *cancel, int speculate, k3_err *err) {
    backend *b = ctx;
    if (speculate < 0 || speculate > b->spec_max)
        return k3_fail(err, K3_EXIT_USAGE, "serve: %d drafts per pass asked, this model speculates 0..%d", speculate,
                       b->spec_max);
    if (b->nslots == 1) return one_prefill(b, ids, n, marks, nmarks, logits, reused, cancel, speculate, err);
    slot *x = &b->sl[q];
    /* the slot is between calls: its last generation's pass is closed here */
    int rc = spec_close(b, x, err);
    if (rc) return rc;
    pthread_mutex_lock(&b->mu);
    x->ids = ids;
    x->n = n;
    x->marks = marks;
    x->nmarks = nmarks;
    x->logits = logits;
    x->reused = reused;
    x->cancel = cancel;
    rc = post(b, x, SLOT_PREFILL, err);
    pthread_mutex_unlock(&b->mu);
    if (!rc && speculate > 0) x->spec = k3_spec_new(x->drafter, speculate, k3_engine_vocab(b->e));
    return rc;
}

static int be_step(void *ctx, int q, int32_t id, float *logits, int64_t limit, k3_err *err) {
    backend *b = ctx;
    if (b->nslots == 1) return one_step(b, id, logits, limit, err);
    slot *x = &b->sl[q];
    pthread_mutex_lock(&b->mu);
    x->id = id;
    x->logits = logits;
    x->limit = step_limit(limit);
    int rc = post(b, x, SLOT_STEP, err);
    pthread_mutex_unlock(&b->mu);
    return rc;
}

/* A reply ended: the state holds the prompt and the reply as the next turn's
 * prompt re-renders it (the generation loop fed a stop id): keep it as a
 * snapshot too (the prompt's end is kept by the prefill). The slot is
 * between calls: the model thread does not touch its state now. */
static void be_end(void *ctx, int q) {
    backend *b = ctx;
    if (b->lead) send_cmd(CMD_END, 0, 0, 0);
    k3_err e = {0};
    if (spec_close(b, &b->sl[q], &e)) { /* the next prefill starts from what the session holds */
        fprintf(stderr, "k3 serve: closing a verifying pass: %s\n", e.msg);
        return;
    }
    k3_session_snapshot(b->sl[q].sess);
}

static void be_spec_stats(void *ctx, k3_spec_stats *out) {
    backend *b = ctx;
    if (b->nslots == 1) {
        *out = b->done;
        if (b->sl[0].spec) {
            k3_spec_stats st = k3_spec_get_stats(b->sl[0].spec);
            stats_add(out, &st);
        }
        return;
    }
    pthread_mutex_lock(&b->mu);
    *out = b->done;
    for (int q = 0; q < b->nslots; q++) stats_add(out, &b->sl[q].seen);
    pthread_mutex_unlock(&b->mu);
}

static void be_batch_stats(void *ctx, k3_serve_batch_stats *out) {
    backend *b = ctx;
    pthread_mutex_lock(&b->mu);
    *out = b->bst;
    pthread_mutex_unlock(&b->mu);
    k3_draft_stats d = k3_drafter_stats(b->sl[0].drafter); /* slot 0's: the draft model's, every slot's */
    out->draft_passes = d.passes;
    out->draft_seqs = d.seqs;
}

static size_t be_holds(void *ctx, int q, const int32_t *ids, size_t n) {
    backend *b = ctx;
    const k3_session *s = b->sl[q].sess;
    const int32_t *have = k3_session_ids(s);
    size_t len = k3_session_len(s), d = 0;
    while (d < len && d < n && have[d] == ids[d]) d++;
    return d;
}

static void be_busy(void *ctx, int q, bool busy) {
    backend *b = ctx;
    if (b->nslots == 1) return;
    pthread_mutex_lock(&b->mu);
    b->sl[q].phase = busy ? SLOT_THINK : SLOT_IDLE;
    pthread_cond_broadcast(&b->work_cv); /* a slot that leaves may let the others' steps go */
    pthread_mutex_unlock(&b->mu);
}

void k3_serve_backend_free(k3_serve_backend *b) {
    if (!b) return;
    if (b->model_started) {
        pthread_mutex_lock(&b->mu);
        b->quit = true;
        pthread_cond_broadcast(&b->work_cv);
        pthread_mutex_unlock(&b->mu);
        pthread_join(b->model, NULL);
    }
    if (b->mu_made) {
        pthread_mutex_destroy(&b->mu);
        pthread_cond_destroy(&b->work_cv);
        pthread_cond_destroy(&b->done_cv);
    }
    if (b->chat) k3_chat_free(b->chat);
    for (int q = b->nslots - 1; b->sl && q >= 0; q--) { /* slot 0's drafter goes last: the others share its model */
        k3_spec_free(b->sl[q].spec);
        k3_drafter_free(b->sl[q].drafter);
        if (b->sl[q].sess) k3_session_free(b->sl[q].sess);
        if (b->sl[q].st) k3_engine_state_free(b->e, b->sl[q].st);
    }
    free(b->sl);
    free(b->bs);
    free(b->bid);
    free(b->blog);
    free(b->bslot);
    free(b->bn);
    free(b->bgo);
    free(b->bask);
    if (b->cache) k3_state_cache_free(b->cache);
    k3_engine_free(b->e);
    free(b);
}

/* The slots' states: slots of them, or (slots 0) as many as the budget holds
 * up to K3_SERVE_AUTO_SLOTS, each counted with the cache and the logit rows
 * of the slots before it. */
static int open_slots(backend *b, int slots, uint64_t cache_bytes, k3_err *err) {
    uint64_t logit_bytes = (uint64_t)k3_engine_vocab(b->e) * sizeof(float);
    /* speculating, a slot past the first (the plan counts one) also keeps a
     * pass's rollback record and its rows */
    uint64_t spec_bytes = b->spec_max ? k3_state_pass_bytes(k3_engine_config(b->e), b->spec_max + 1) +
                                            (uint64_t)(b->spec_max + 1) * logit_bytes : 0;
    int want = slots > 0 ? slots : K3_SERVE_AUTO_SLOTS;
    b->sl = xcalloc((size_t)want, sizeof *b->sl);
    for (int q = 0; q < want; q++) {
        /* a slot's session keeps a row and its worker another */
        uint64_t extra = cache_bytes + 2 * (uint64_t)(q + 1) * logit_bytes + (uint64_t)q * spec_bytes;
        k3_err e = {0};
        int rc = k3_engine_state_new(b->e, b->ctx, extra, &b->sl[q].st, &e);
        if (rc == K3_EXIT_BUDGET && slots == 0 && q > 0) break; /* what fits */
        if (rc) {
            if (slots > 1 && rc == K3_EXIT_BUDGET)
                return k3_fail(err, rc, "serve: --parallel %d: slot %d of %d does not fit: %s", slots, q + 1, slots,
                               e.msg);
            *err = e;
            return rc;
        }
        b->nslots = q + 1;
    }
    for (int q = 0; q < b->nslots; q++) {
        b->sl[q].b = b;
        b->sl[q].sess = k3_session_open(b->e, b->sl[q].st, b->cache);
    }
    return K3_OK;
}

static int open_backend(const k3_engine_opts *opts, int64_t ctx, uint64_t cache_bytes, int slots,
                        const k3_serve_spec_opts *so, backend *b, k3_serve_model *sm, k3_err *err) {
    int rc;
    k3_engine_opts eo = *opts;
    eo.need_tokenizer = true;
    eo.max_pos = ctx;
    int spec_max = so ? so->spec_max : 0;
    if (spec_max) eo.mem.so.pass_tokens = spec_max + 1; /* a verifying pass in one chunk */
    if ((rc = k3_engine_open(&eo, &b->e, err))) return rc;
    if (so && so->draft_dir && k3_engine_ranks(b->e) > 1)
        return k3_fail(err, K3_EXIT_USAGE, "--draft: a draft model is not supported under mpirun (use --speculate alone)");
    b->spec_max = spec_max;
    if (k3_engine_ranks(b->e) > 1) {
        if (slots > 1)
            return k3_fail(err, K3_EXIT_USAGE, "serve: --parallel %d: under mpirun (%d ranks) k3 serve computes one "
                           "request at a time (--parallel 1, the default there)", slots, k3_engine_ranks(b->e));
        slots = 1;
    }
    b->ctx = ctx;
    b->cache = k3_state_cache_new(k3_engine_config(b->e), cache_bytes, 0);
    if ((rc = open_slots(b, slots, cache_bytes, err))) return rc;
    if ((rc = k3_drafter_for(b->e, so ? so->draft_dir : NULL, spec_max, ctx, &b->sl[0].drafter, err))) return rc;
    for (int q = 1; q < b->nslots && b->sl[0].drafter; q++)
        if ((rc = k3_drafter_sibling(b->sl[0].drafter, ctx, &b->sl[q].drafter, err))) return rc;
    k3_err cerr = {0};
    if (k3_chat_new(k3_engine_tokenizer(b->e), &b->chat, &cerr)) b->chat = NULL; /* no XTML ids: completions only */
    memset(sm, 0, sizeof *sm);
    sm->ctx = b;
    sm->vocab = k3_engine_vocab(b->e);
    sm->eos = k3_engine_eos_id(b->e);
    sm->ctx_len = ctx;
    sm->tok = k3_engine_tokenizer(b->e);
    sm->chat = b->chat;
    sm->threads = k3_engine_threads(b->e);
    sm->slots = b->nslots;
    sm->prefill = be_prefill;
    sm->step = be_step;
    sm->end = be_end;
    sm->holds = be_holds;
    sm->busy = be_busy;
    sm->spec_max = spec_max;
    sm->spec_default = so ? so->spec_default : 0;
    sm->spec_stats = be_spec_stats;
    sm->batch_stats = be_batch_stats;
    if (b->nslots > 1) {
        size_t n = (size_t)b->nslots;
        b->bs = xmalloc_array(n, sizeof *b->bs);
        b->bid = xmalloc_array(n * (size_t)(spec_max + 1), sizeof *b->bid);
        b->bn = xmalloc_array(n, sizeof *b->bn);
        b->bgo = xmalloc_array(n, sizeof *b->bgo);
        b->blog = xmalloc_array(n, sizeof *b->blog);
        b->bslot = xmalloc_array(n, sizeof *b->bslot);
        b->bask = xmalloc_array(n, sizeof *b->bask);
        if (pthread_create(&b->model, NULL, model_main, b) != 0)
            return k3_fail(err, K3_EXIT_RUNTIME, "serve: cannot start the model thread");
        b->model_started = true;
    }
    return K3_OK;
}

int k3_serve_backend_open(const k3_engine_opts *eo, int64_t ctx, uint64_t cache_bytes, int slots,
                          const k3_serve_spec_opts *so, k3_serve_backend **out, k3_serve_model *sm, k3_err *err) {
    backend *b = xcalloc(1, sizeof *b);
    /* one slot counts its passes under mu too (/metrics reads them) */
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->work_cv, NULL);
    pthread_cond_init(&b->done_cv, NULL);
    b->mu_made = true;
    int rc = open_backend(eo, ctx, cache_bytes, slots, so, b, sm, err);
    /* a rank whose state or cache cannot fit stops every rank here */
    if ((rc = k3_engine_ready(b->e, rc, err))) {
        k3_serve_backend_free(b);
        *out = NULL;
        return rc;
    }
    b->lead = k3_engine_ranks(b->e) > 1 && k3_engine_rank(b->e) == 0;
    *out = b;
    return K3_OK;
}

int k3_serve_backend_rank(const k3_serve_backend *b) { return k3_engine_rank(b->e); }

void k3_serve_backend_quit(k3_serve_backend *b, int code) {
    if (b->lead) send_cmd(CMD_QUIT, 0, 0, code);
}

/* A rank after the first: makes rank 0's calls, in its order, until it quits.
 * Its own results are dropped (rank 0's are the same bits and answer the
 * client); a failure inside a forward call ends the job (engine.h). */
int k3_serve_backend_follow(k3_serve_backend *b) {
    k3_dist_silence_others();
    float *logits = xmalloc_array((size_t)k3_engine_vocab(b->e), sizeof *logits);
    int32_t *ids = xmalloc_array((size_t)b->ctx, sizeof *ids);
    size_t *marks = xmalloc_array((size_t)b->ctx, sizeof *marks);
    for (;;) {
        serve_cmd c;
        /* unbounded: the next command comes when a client asks */
        k3_dist_bcast(&c, sizeof c, false, "k3 serve's next command");
        k3_err e = {0};
        size_t reused;
        if (c.op == CMD_QUIT) break;
        if (c.op == CMD_PREFILL && c.n >= 1 && c.n <= b->ctx && c.id >= 0 && c.id <= b->spec_max && c.flag >= 0 &&
            c.flag <= c.n) {
            k3_dist_bcast(ids, (size_t)c.n * sizeof *ids, true, "k3 serve's prompt ids");
            if (c.flag) k3_dist_bcast(marks, (size_t)c.flag * sizeof *marks, true, "k3 serve's message marks");
            (void)one_prefill(b, ids, (size_t)c.n, marks, (size_t)c.flag, logits, &reused, NULL, c.id, &e);
        } else if (c.op == CMD_STEP && c.id >= 0 && c.id < k3_engine_vocab(b->e) && c.n >= 0) {
            (void)one_step(b, c.id, c.flag ? NULL : logits, c.n, &e);
        } else if (c.op == CMD_END) {
            be_end(b, 0);
        } else {
            k3_fail(&e, K3_EXIT_RUNTIME,
                    "serve: rank 0 sent a command this rank cannot follow (op %d, n %d, id %d): the ranks run "
                    "different k3 builds", c.op, c.n, c.id);
            free(ids);
            free(marks);
            free(logits);
            k3_dist_abort(&e);
        }
    }
    free(ids);
    free(marks);
    free(logits);
    return K3_OK;
}
