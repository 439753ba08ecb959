/* backend.c: the model side of `k3 serve` (serve.h's k3_serve_model) on the
 * engine: one session per slot over a state cache shared by every request,
 * so a request reuses what an earlier one computed, on any slot.
 *
 * Under mpirun with several ranks (docs/mpi.md) rank 0 alone listens and
 * runs the server; the other ranks follow it with as many slots. Every call
 * that touches a session or the shared state cache (a prefill, a step or a
 * batched pass of steps, a reply's end) is made by one thread of rank 0 (the
 * worker with one slot, the model thread with several), so before each
 * rank 0 broadcasts a fixed-size command (and a prefill's ids and message
 * marks, a pass's steps) and every other rank makes the same call on its own
 * session and state cache, in the same order. The session's choices (its
 * own state, a snapshot to restore, a cold start, the grid snapshots,
 * evictions) follow from the calls alone, so every rank makes the same
 * forward calls and the exchanges inside the MoE layers line up. The hook
 * a prefill asks between its chunks is a command too: the passes of the
 * other slots' steps made there, then rank 0's cancel flag, so every rank
 * stops at the same chunk. Sampling is rank 0's: a step carries the id.
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
 * Several slots: each slot has its own session and state, and one model
 * thread makes every call on them (a reply's end included, so that the
 * shared cache sees one order). A slot's worker posts its call
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
enum { SLOT_IDLE, SLOT_THINK, SLOT_STEP, SLOT_PREFILL, SLOT_END, SLOT_RUN };

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
    int speculate;         /* a prefill's: drafts per pass for the steps that follow */
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
    struct serve_cmd_s *bcmd; /* [nslots] (several ranks) one pass's steps as broadcast */
    k3_draft_ask **bask;   /* [nslots] the drafts the slots of one step ask for */
    /* a rank after the first: the buffers rank 0's calls are made with */
    float *flog;           /* [nslots][vocab] a logit row per slot */
    int32_t *fids;         /* [ctx] a prefill's ids */
    size_t *fmarks;        /* [ctx] its message marks */
};
typedef struct k3_serve_backend backend;

/* Rank 0's word to the ranks that follow it (a fixed layout; a prefill's n ids
 * and its marks follow in broadcasts of their own, a pass's n steps too, each
 * a CMD_STEP). */
enum { CMD_PREFILL = 1, CMD_STEP = 2, CMD_END = 3, CMD_QUIT = 4, CMD_STEPS = 5, CMD_GO = 6 };
typedef struct serve_cmd_s {
    int32_t op;
    int32_t slot;          /* the slot the call is made on (CMD_STEPS, CMD_QUIT: 0) */
    int32_t n;             /* CMD_PREFILL: ids that follow, 1..ctx; CMD_STEP: the limit (at most K3_SPEC_MAX);
                              CMD_STEPS: the steps of the pass that follow, 1..slots */
    int32_t id;            /* CMD_STEP: the id to feed; CMD_PREFILL: drafts per pass */
    int32_t flag;          /* CMD_STEP: no logits wanted; CMD_QUIT: rank 0's exit code;
                              CMD_PREFILL: message marks that follow the ids, 0..n;
                              CMD_GO (between a prefill's chunks): cancel it */
} serve_cmd;

static void send_cmd(int op, int slot, int32_t n, int32_t id, int32_t flag) {
    serve_cmd c = {.op = op, .slot = slot, .n = n, .id = id, .flag = flag};
    k3_dist_bcast(&c, sizeof c, true, "k3 serve's next command");
}

static int slot_index(const backend *b, const slot *x) { return (int)(x - b->sl); }

static bool is_cancelled(const void *flag) { return atomic_load((const atomic_int *)flag) != 0; }

/* The cancel hook of rank 0's one slot under several ranks: it hands its
 * answer to the others, so every rank stops at the same chunk. */
static bool is_cancelled_lead(const void *flag) {
    bool c = is_cancelled(flag);
    send_cmd(CMD_GO, 0, 0, 0, c);
    return c;
}

static bool follow_turn(const void *ctx);

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

/* Slot x's prefill (its ids, marks, logits, reused and speculate set), the
 * hook asked between chunks; rank 0 of several announces it first. */
static int prefill_call(backend *b, slot *x, bool (*hook)(const void *), const void *hook_ctx, k3_err *err) {
    if (b->lead) { /* (n <= ctx: the server checked the prompt against it; marks are at most one per id) */
        send_cmd(CMD_PREFILL, slot_index(b, x), (int32_t)x->n, x->speculate, (int32_t)x->nmarks);
        k3_dist_bcast((void *)x->ids, x->n * sizeof *x->ids, true, "k3 serve's prompt ids");
        if (x->nmarks) k3_dist_bcast((void *)x->marks, x->nmarks * sizeof *x->marks, true, "k3 serve's message marks");
    }
    /* a generation that ended in an error or a cancel left its pass open */
    int rc = spec_close(b, x, err);
    if (rc) return rc;
    rc = prefill_on(x->sess, x->ids, x->n, x->marks, x->nmarks, x->logits, x->reused, hook, hook_ctx, err);
    if (!rc && x->speculate > 0) x->spec = k3_spec_new(x->drafter, x->speculate, k3_engine_vocab(b->e));
    return rc;
}

static void set_prefill(slot *x, const int32_t *ids, size_t n, const size_t *marks, size_t nmarks, float *logits,
                        size_t *reused, const atomic_int *cancel, int speculate) {
    x->ids = ids;
    x->n = n;
    x->marks = marks;
    x->nmarks = nmarks;
    x->logits = logits;
    x->reused = reused;
    x->cancel = cancel;
    x->speculate = speculate;
}

/* Drafts per pass never exceed K3_SPEC_MAX: a larger limit is the same. */
static int64_t step_limit(int64_t limit) { return limit > K3_SPEC_MAX ? K3_SPEC_MAX : limit < 0 ? 0 : limit; }

static int one_step(backend *b, slot *x, int32_t id, float *logits, int64_t limit, k3_err *err) {
    limit = step_limit(limit);
    if (b->lead) send_cmd(CMD_STEP, slot_index(b, x), (int32_t)limit, id, logits == NULL);
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

/* The steps of slots bslot[0..n) (each slot's id, logits and limit set) in
 * one pass (with speculation, in passes of at most the plan's chunk of ids);
 * rank 0 of several announces them first. */
static void steps_call(backend *b, int n, k3_serve_batch_stats *st) {
    if (b->lead) {
        for (int i = 0; i < n; i++) {
            const slot *x = &b->sl[b->bslot[i]];
            b->bcmd[i] = (serve_cmd){.op = CMD_STEP, .slot = b->bslot[i], .n = (int32_t)x->limit, .id = x->id,
                                     .flag = x->logits == NULL};
        }
        send_cmd(CMD_STEPS, 0, n, 0, 0);
        k3_dist_bcast(b->bcmd, (size_t)n * sizeof *b->bcmd, true, "k3 serve's batched steps");
    }
    slot **go = b->bgo;
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
            feed_group(b, go, ng, true, st);
            ng = rows = 0;
        }
        go[ng++] = x;
        rows += x->pass.n;
    }
    if (ng > 0) feed_group(b, go, ng, multi, st);
}

/* Runs every posted step in one pass. Under mu (released while computing). */
static void run_steps(backend *b) {
    int n = 0;
    for (int q = 0; q < b->nslots; q++) {
        slot *x = &b->sl[q];
        if (x->phase != SLOT_STEP) continue;
        x->phase = SLOT_RUN;
        b->bslot[n++] = q;
    }
    pthread_mutex_unlock(&b->mu);
    k3_serve_batch_stats st = {0};
    steps_call(b, n, &st);
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

/* A reply ended on slot x: the state holds the prompt and the reply as the
 * next turn's prompt re-renders it (the generation loop fed a stop id): keep
 * it as a snapshot too (the prompt's end is kept by the prefill). Rank 0 of
 * several announces it first. */
static void end_call(backend *b, slot *x) {
    if (b->lead) send_cmd(CMD_END, slot_index(b, x), 0, 0, 0);
    k3_err e = {0};
    if (spec_close(b, x, &e)) { /* the next prefill starts from what the session holds */
        fprintf(stderr, "k3 serve: closing a verifying pass: %s\n", e.msg);
        return;
    }
    k3_session_snapshot(x->sess);
}

/* Runs every posted reply end; whether there was one. Under mu (released
 * while computing). */
static bool run_ends(backend *b) {
    bool any = false;
    for (int q = 0; q < b->nslots; q++) {
        slot *x = &b->sl[q];
        if (x->phase != SLOT_END) continue;
        x->phase = SLOT_RUN;
        pthread_mutex_unlock(&b->mu);
        end_call(b, x);
        pthread_mutex_lock(&b->mu);
        call_done(x, K3_OK, &x->err);
        any = true;
    }
    if (any) pthread_cond_broadcast(&b->done_cv);
    return any;
}

/* The prefill hook on the model thread: the other slots' reply ends and
 * steps go first (waiting for the busy ones to post theirs), then the cancel
 * flag, which rank 0 of several hands to the others. */
static bool prefill_turn(const void *ctx) {
    const slot *x = ctx;
    backend *b = x->b;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        bool think = false;
        for (int q = 0; q < b->nslots; q++) think = think || b->sl[q].phase == SLOT_THINK;
        if (think && !b->quit) {
            pthread_cond_wait(&b->work_cv, &b->mu);
            continue;
        }
        if (!run_ends(b)) break; /* (an ended slot is between calls again: wait for its next) */
    }
    if (steps_ready(b)) run_steps(b);
    pthread_mutex_unlock(&b->mu);
    bool c = is_cancelled(x->cancel);
    if (b->lead) send_cmd(CMD_GO, slot_index(b, x), 0, 0, c);
    return c;
}

/* Runs slot x's posted prefill. Under mu (released while computing). */
static void run_prefill(backend *b, slot *x) {
    x->phase = SLOT_RUN;
    pthread_mutex_unlock(&b->mu);
    k3_err err = {0};
    int rc = prefill_call(b, x, prefill_turn, x, &err);
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
        if (run_ends(b)) continue;
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
    slot *x = &b->sl[q];
    if (b->nslots == 1) {
        set_prefill(x, ids, n, marks, nmarks, logits, reused, cancel, speculate);
        return prefill_call(b, x, b->lead ? is_cancelled_lead : is_cancelled, cancel, err);
    }
    pthread_mutex_lock(&b->mu);
    set_prefill(x, ids, n, marks, nmarks, logits, reused, cancel, speculate);
    int rc = post(b, x, SLOT_PREFILL, err);
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static int be_step(void *ctx, int q, int32_t id, float *logits, int64_t limit, k3_err *err) {
    backend *b = ctx;
    if (b->nslots == 1) return one_step(b, &b->sl[0], id, logits, limit, err);
    slot *x = &b->sl[q];
    pthread_mutex_lock(&b->mu);
    x->id = id;
    x->logits = logits;
    x->limit = step_limit(limit);
    int rc = post(b, x, SLOT_STEP, err);
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static void be_end(void *ctx, int q) {
    backend *b = ctx;
    slot *x = &b->sl[q];
    if (b->nslots == 1) {
        end_call(b, x);
        return;
    }
    k3_err e = {0};
    pthread_mutex_lock(&b->mu);
    (void)post(b, x, SLOT_END, &e);
    pthread_mutex_unlock(&b->mu);
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

/* Frees slot q (its drafter after the others': slot 0's goes last, the
 * others share its model). */
static void free_slot(backend *b, int q) {
    k3_spec_free(b->sl[q].spec);
    b->sl[q].spec = NULL;
    k3_drafter_free(b->sl[q].drafter);
    b->sl[q].drafter = NULL;
    if (b->sl[q].sess) k3_session_free(b->sl[q].sess);
    b->sl[q].sess = NULL;
    if (b->sl[q].st) k3_engine_state_free(b->e, b->sl[q].st);
    b->sl[q].st = NULL;
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
    for (int q = b->nslots - 1; b->sl && q >= 0; q--) free_slot(b, q);
    free(b->sl);
    free(b->bs);
    free(b->bid);
    free(b->blog);
    free(b->bslot);
    free(b->bn);
    free(b->bgo);
    free(b->bcmd);
    free(b->bask);
    free(b->flog);
    free(b->fids);
    free(b->fmarks);
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
                        const k3_serve_spec_opts *so, backend *b, k3_err *err) {
    int rc;
    k3_engine_opts eo = *opts;
    eo.need_tokenizer = true;
    eo.max_pos = ctx;
    int spec_max = so ? so->spec_max : 0;
    if (spec_max) eo.mem.so.pass_tokens = spec_max + 1; /* a verifying pass in one chunk */
    if ((rc = k3_engine_open(&eo, &b->e, err))) return rc;
    b->spec_max = spec_max;
    b->ctx = ctx;
    b->cache = k3_state_cache_new(k3_engine_config(b->e), cache_bytes, 0);
    if ((rc = open_slots(b, slots, cache_bytes, err))) return rc;
    if ((rc = k3_drafter_for(b->e, so ? so->draft_dir : NULL, so ? so->p_min : 0.0, spec_max, ctx, &b->sl[0].drafter, err))) return rc;
    k3_engine *de = k3_drafter_engine(b->sl[0].drafter);
    if (de && b->nslots > 1) /* a prompt's drafter catches up a chunk a step, as the prefills interleave */
        k3_drafter_set_catchup(b->sl[0].drafter, k3_engine_chunk(de));
    for (int q = 1; q < b->nslots && b->sl[0].drafter; q++)
        if ((rc = k3_drafter_sibling(b->sl[0].drafter, ctx, &b->sl[q].drafter, err))) return rc;
    return K3_OK;
}

/* The smallest of every rank's `mine` (a collective: every rank calls it). */
static int least_of_ranks(backend *b, int mine, const char *what) {
    int R = k3_engine_ranks(b->e);
    int32_t v = mine, *all = xmalloc_array((size_t)R, sizeof *all);
    k3_dist_allgather(&v, sizeof v, all, what);
    for (int r = 0; r < R; r++)
        if (all[r] < mine) mine = all[r];
    free(all);
    return mine;
}

/* Under several ranks every rank keeps the fewest slots any rank's budget
 * holds (a count asked with --parallel either fits every rank or stopped the
 * job), so that rank 0's slots exist on every rank. */
static void agree_slots(backend *b) {
    if (k3_engine_ranks(b->e) <= 1) return;
    int keep = least_of_ranks(b, b->nslots, "k3 serve's slot counts");
    while (b->nslots > keep) free_slot(b, --b->nslots);
}

/* Under several ranks a new prompt's drafter catches up as many ids a step
 * on every rank, as its drafts (so the verifying passes, so the exchanges)
 * depend on it: the smallest of the ranks' draft-model chunks (each rank
 * plans its own copy of the draft model for its own memory). */
static void agree_catchup(backend *b) {
    k3_engine *de = k3_drafter_engine(b->sl[0].drafter);
    if (k3_engine_ranks(b->e) <= 1 || !de || b->nslots <= 1) return;
    int keep = least_of_ranks(b, k3_engine_chunk(de), "k3 serve's draft catch-up");
    for (int q = 0; q < b->nslots; q++) k3_drafter_set_catchup(b->sl[q].drafter, keep);
}

/* The model thread of several slots (rank 0 or one process) and the
 * arrays of a batched pass. */
static int start_batching(backend *b, k3_err *err) {
    if (b->nslots <= 1) return K3_OK;
    size_t n = (size_t)b->nslots;
    b->bs = xmalloc_array(n, sizeof *b->bs);
    b->bid = xmalloc_array(n * (size_t)(b->spec_max + 1), sizeof *b->bid);
    b->bn = xmalloc_array(n, sizeof *b->bn);
    b->bgo = xmalloc_array(n, sizeof *b->bgo);
    b->blog = xmalloc_array(n, sizeof *b->blog);
    b->bslot = xmalloc_array(n, sizeof *b->bslot);
    b->bcmd = xmalloc_array(n, sizeof *b->bcmd);
    b->bask = xmalloc_array(n, sizeof *b->bask);
    if (k3_engine_rank(b->e) > 0) return K3_OK; /* a follower makes rank 0's calls on its main thread */
    if (pthread_create(&b->model, NULL, model_main, b) != 0)
        return k3_fail(err, K3_EXIT_RUNTIME, "serve: cannot start the model thread");
    b->model_started = true;
    return K3_OK;
}

static void fill_model(backend *b, const k3_serve_spec_opts *so, k3_serve_model *sm) {
    k3_err cerr = {0};
    if (k3_chat_new(k3_engine_tokenizer(b->e), &b->chat, &cerr)) b->chat = NULL; /* no XTML ids: completions only */
    memset(sm, 0, sizeof *sm);
    sm->ctx = b;
    sm->vocab = k3_engine_vocab(b->e);
    sm->eos = k3_engine_eos_id(b->e);
    sm->ctx_len = b->ctx;
    sm->tok = k3_engine_tokenizer(b->e);
    sm->chat = b->chat;
    /* with several slots the workers never compute (the model thread does):
     * a team of their own would only add threads to libgomp's count */
    sm->threads = b->nslots > 1 ? 1 : k3_engine_threads(b->e);
    sm->slots = b->nslots;
    sm->prefill = be_prefill;
    sm->step = be_step;
    sm->end = be_end;
    sm->holds = be_holds;
    sm->busy = be_busy;
    sm->spec_max = b->spec_max;
    sm->spec_default = so ? so->spec_default : 0;
    sm->spec_stats = be_spec_stats;
    sm->batch_stats = be_batch_stats;
}

/* libgomp keeps a team of threads for each thread that ran a parallel
 * region, and once all the teams' threads outnumber the CPUs its barriers
 * stop spinning and sleep in the kernel: every parallel region of a forward
 * pass then wakes its threads through a context switch (a server with one
 * client, --threads 2 on 2 cores: about 30 switches a token, half the
 * tokens/s). The passes run on a slot's worker or on the model thread, never
 * here, so the loading (the shard index is read in parallel, the draft
 * model's too) runs on a thread of its own that ends when it is done and
 * takes its team with it. (Where MPI allows calls from the main thread only,
 * it runs here.) */
typedef struct {
    const k3_engine_opts *eo;
    int64_t ctx;
    uint64_t cache_bytes;
    int slots;
    const k3_serve_spec_opts *so;
    backend *b;
    k3_err *err;
    int rc;
} opener;

static void *open_main(void *arg) {
    opener *o = arg;
    o->rc = open_backend(o->eo, o->ctx, o->cache_bytes, o->slots, o->so, o->b, o->err);
    return NULL;
}

static int open_apart(opener *o) {
    pthread_t t;
    if ((k3_dist_active() && !k3_dist_any_thread()) || pthread_create(&t, NULL, open_main, o) != 0) {
        open_main(o);
        return o->rc;
    }
    pthread_join(t, NULL);
    return o->rc;
}

int k3_serve_backend_open(const k3_engine_opts *eo, int64_t ctx, uint64_t cache_bytes, int slots,
                          const k3_serve_spec_opts *so, k3_serve_backend **out, k3_serve_model *sm, k3_err *err) {
    backend *b = xcalloc(1, sizeof *b);
    /* one slot counts its passes under mu too (/metrics reads them) */
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->work_cv, NULL);
    pthread_cond_init(&b->done_cv, NULL);
    b->mu_made = true;
    opener o = {.eo = eo, .ctx = ctx, .cache_bytes = cache_bytes, .slots = slots, .so = so, .b = b, .err = err};
    int rc = open_apart(&o);
    /* a rank whose state or cache cannot fit stops every rank here */
    if ((rc = k3_engine_ready(b->e, rc, err))) {
        k3_serve_backend_free(b);
        *out = NULL;
        return rc;
    }
    agree_slots(b);
    agree_catchup(b);
    b->lead = k3_engine_ranks(b->e) > 1 && k3_engine_rank(b->e) == 0;
    if ((rc = start_batching(b, err))) {
        k3_serve_backend_quit(b, rc); /* the followers wait for rank 0's first command */
        k3_serve_backend_free(b);
        *out = NULL;
        return rc;
    }
    fill_model(b, so, sm);
    *out = b;
    return K3_OK;
}

int k3_serve_backend_rank(const k3_serve_backend *b) { return k3_engine_rank(b->e); }

void k3_serve_backend_quit(k3_serve_backend *b, int code) {
    if (b->lead) send_cmd(CMD_QUIT, 0, 0, 0, code);
}

static _Noreturn void cannot_follow(const serve_cmd *c) {
    k3_err e = {0};
    k3_fail(&e, K3_EXIT_RUNTIME,
            "serve: rank 0 sent a command this rank cannot follow (op %d, slot %d, n %d, id %d): the ranks run "
            "different k3 builds", c->op, c->slot, c->n, c->id);
    k3_dist_abort(&e);
}

static float *follow_row(backend *b, int q) { return b->flog + (size_t)q * (size_t)k3_engine_vocab(b->e); }

static bool step_ok(const backend *b, const serve_cmd *c) {
    return c->op == CMD_STEP && c->slot >= 0 && c->slot < b->nslots && c->id >= 0 && c->id < k3_engine_vocab(b->e) &&
           c->n >= 0;
}

/* A follower makes one of rank 0's calls (c; in_prefill: between a
 * prefill's chunks, where only other slots' steps and reply ends come). Its
 * results are dropped (rank 0's are the same bits and answer the client); a
 * failure inside a forward call ends the job (engine.h). */
static void follow_cmd(backend *b, const serve_cmd *c, bool in_prefill) {
    k3_err e = {0};
    bool slot_ok = c->slot >= 0 && c->slot < b->nslots;
    if (c->op == CMD_PREFILL && !in_prefill && slot_ok && c->n >= 1 && c->n <= b->ctx && c->id >= 0 &&
        c->id <= b->spec_max && c->flag >= 0 && c->flag <= c->n) {
        slot *x = &b->sl[c->slot];
        size_t reused;
        k3_dist_bcast(b->fids, (size_t)c->n * sizeof *b->fids, true, "k3 serve's prompt ids");
        if (c->flag) k3_dist_bcast(b->fmarks, (size_t)c->flag * sizeof *b->fmarks, true, "k3 serve's message marks");
        set_prefill(x, b->fids, (size_t)c->n, b->fmarks, (size_t)c->flag, follow_row(b, c->slot), &reused, NULL, c->id);
        (void)prefill_call(b, x, follow_turn, b, &e);
    } else if (step_ok(b, c) && b->nslots == 1) {
        (void)one_step(b, &b->sl[0], c->id, c->flag ? NULL : follow_row(b, 0), c->n, &e);
    } else if (c->op == CMD_STEPS && b->nslots > 1 && c->n >= 1 && c->n <= b->nslots) {
        k3_dist_bcast(b->bcmd, (size_t)c->n * sizeof *b->bcmd, true, "k3 serve's batched steps");
        for (int i = 0; i < c->n; i++) {
            const serve_cmd *s = &b->bcmd[i];
            if (!step_ok(b, s) || (i > 0 && s->slot <= b->bcmd[i - 1].slot)) cannot_follow(s);
            slot *x = &b->sl[s->slot];
            x->id = s->id;
            x->logits = s->flag ? NULL : follow_row(b, s->slot);
            x->limit = step_limit(s->n);
            b->bslot[i] = s->slot;
        }
        k3_serve_batch_stats st = {0}; /* (rank 0 reports them) */
        steps_call(b, c->n, &st);
    } else if (c->op == CMD_END && slot_ok) {
        end_call(b, &b->sl[c->slot]);
    } else {
        cannot_follow(c);
    }
}

/* A follower's prefill hook: rank 0's calls between two chunks, then its
 * word to go on or cancel. */
static bool follow_turn(const void *ctx) {
    backend *b = (backend *)ctx;
    for (;;) {
        serve_cmd c;
        k3_dist_bcast(&c, sizeof c, true, "k3 serve's prefill (go on or cancel)");
        if (c.op == CMD_GO) return c.flag != 0;
        follow_cmd(b, &c, true);
    }
}

/* A rank after the first: makes rank 0's calls, in its order, until it quits. */
int k3_serve_backend_follow(k3_serve_backend *b) {
    k3_dist_silence_others();
    b->flog = xmalloc_array((size_t)b->nslots * (size_t)k3_engine_vocab(b->e), sizeof *b->flog);
    b->fids = xmalloc_array((size_t)b->ctx, sizeof *b->fids);
    b->fmarks = xmalloc_array((size_t)b->ctx, sizeof *b->fmarks);
    for (;;) {
        serve_cmd c;
        /* unbounded: the next command comes when a client asks */
        k3_dist_bcast(&c, sizeof c, false, "k3 serve's next command");
        if (c.op == CMD_QUIT) break;
        follow_cmd(b, &c, false);
    }
    return K3_OK;
}
