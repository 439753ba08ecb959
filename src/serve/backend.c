/* backend.c: the model side of `k3 serve` (serve.h's k3_serve_model) on the
 * engine: one session over a state cache shared by every request, so a
 * request reuses what an earlier one computed.
 *
 * Under mpirun with several ranks (expert parallel, docs/mpi.md) rank 0 alone
 * listens and runs the server; the other ranks follow it. The model work of
 * the server is three backend calls (prefill, step, end) made by its one
 * worker thread, so before each call rank 0 broadcasts a fixed-size command
 * (and a prefill's ids) and every other rank makes the same call on its own
 * session and state cache. The session's choices (its own state, a snapshot
 * to restore, a cold start, the grid snapshots, evictions) follow from the
 * calls alone, so every rank makes the same forward calls and the exchanges
 * inside the MoE layers line up. A cancelled prefill stops at the same chunk
 * on every rank: the cancel hook, asked between chunks, is itself a
 * broadcast of rank 0's flag. Sampling is rank 0's: a step carries the id.
 *
 * Speculation: a prefill carries the request's drafts per pass and opens a
 * verifying feed (draft.h) for the steps that follow; each step goes through
 * it (k3_spec_feed, with the step's limit), and the next prefill or the
 * reply's end closes its last pass, so the session holds exactly the ids of
 * plain decoding whenever it is snapshot or reused. The followers make the
 * same calls with the same ids, limits and drafts per pass; their n-gram
 * drafter reads the same session ids, so it drafts the same ids and every
 * rank makes the same verifying passes (a draft model runs on one rank only:
 * refused under several). */
#include "chat/chat.h"
#include "dist/dist.h"
#include "draft/draft.h"
#include "engine/engine.h"
#include "serve/serve.h"
#include "session/session.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct k3_serve_backend {
    k3_engine *e;
    k3_state *st;
    k3_state_cache *cache;
    k3_session *sess;
    k3_chat *chat;
    int64_t ctx;
    bool lead;             /* rank 0 of several: broadcasts each call before making it */
    k3_drafter *drafter;   /* speculation: n-gram or the draft model; NULL: none */
    int spec_max;
    k3_spec *spec;         /* the verifying feed of the current generation; NULL: plain steps */
    k3_spec_stats done;    /* the counters of the generations before it */
};
typedef struct k3_serve_backend backend;

/* Rank 0's word to the ranks that follow it (a fixed layout; a prefill's n ids
 * follow in a second broadcast). */
enum { CMD_PREFILL = 1, CMD_STEP = 2, CMD_END = 3, CMD_QUIT = 4 };
typedef struct {
    int32_t op;
    int32_t n;             /* CMD_PREFILL: ids that follow, 1..ctx; CMD_STEP: the limit (at most K3_SPEC_MAX) */
    int32_t id;            /* CMD_STEP: the id to feed; CMD_PREFILL: drafts per pass */
    int32_t flag;          /* CMD_STEP: no logits wanted; CMD_QUIT: rank 0's exit code */
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

/* Ends the current generation's verifying feed: its open pass keeps the ids
 * consumed (the session then holds plain decoding's), its counters join the
 * totals. */
static int spec_close(backend *b, k3_err *err) {
    if (!b->spec) return K3_OK;
    int rc = k3_spec_finish(b->spec, b->sess, err);
    k3_spec_stats st = k3_spec_get_stats(b->spec);
    b->done.passes += st.passes;
    b->done.fed += st.fed;
    b->done.proposed += st.proposed;
    b->done.accepted += st.accepted;
    k3_spec_free(b->spec);
    b->spec = NULL;
    return rc;
}

static int be_prefill(void *ctx, const int32_t *ids, size_t n, float *logits, size_t *reused, const atomic_int *cancel,
                      int speculate, k3_err *err) {
    backend *b = ctx;
    bool several = k3_engine_ranks(b->e) > 1;
    if (speculate < 0 || speculate > b->spec_max)
        return k3_fail(err, K3_EXIT_USAGE, "serve: %d drafts per pass asked, this model speculates 0..%d", speculate,
                       b->spec_max);
    if (b->lead) { /* (n <= ctx: the server checked the prompt against it) */
        send_cmd(CMD_PREFILL, (int32_t)n, speculate, 0);
        k3_dist_bcast((void *)ids, n * sizeof *ids, true, "k3 serve's prompt ids");
    }
    /* a generation that ended in an error or a cancel left its pass open */
    int rc = spec_close(b, err);
    if (rc) return rc;
    /* asked between the prefill's chunks */
    k3_session_set_cancel(b->sess, several ? is_cancelled_all : is_cancelled, cancel);
    rc = k3_session_prefill(b->sess, ids, n, logits, reused, err);
    k3_session_set_cancel(b->sess, NULL, NULL);
    if (!rc && speculate > 0) b->spec = k3_spec_new(b->drafter, speculate, k3_engine_vocab(b->e));
    return rc;
}

static int be_step(void *ctx, int32_t id, float *logits, int64_t limit, k3_err *err) {
    backend *b = ctx;
    /* drafts per pass never exceed K3_SPEC_MAX: a larger limit is the same */
    if (limit > K3_SPEC_MAX) limit = K3_SPEC_MAX;
    if (limit < 0) limit = 0;
    if (b->lead) send_cmd(CMD_STEP, (int32_t)limit, id, logits == NULL);
    if (!b->spec) return k3_session_feed(b->sess, &id, 1, logits, err);
    if (logits) return k3_spec_feed(b->spec, b->sess, id, logits, limit, err);
    int rc = k3_spec_finish(b->spec, b->sess, err); /* a kept stop id: after the ids the pass consumed */
    return rc ? rc : k3_session_feed(b->sess, &id, 1, NULL, err);
}

/* A reply ended: the state holds the prompt and the reply as the next turn's
 * prompt re-renders it (the generation loop fed a stop id): keep it as a
 * snapshot too (the prompt's end is kept by the prefill). */
static void be_end(void *ctx) {
    backend *b = ctx;
    if (b->lead) send_cmd(CMD_END, 0, 0, 0);
    k3_err e = {0};
    if (spec_close(b, &e)) { /* the next prefill starts from what the session holds */
        fprintf(stderr, "k3 serve: closing a verifying pass: %s\n", e.msg);
        return;
    }
    k3_session_snapshot(b->sess);
}

static void be_spec_stats(void *ctx, k3_spec_stats *out) {
    backend *b = ctx;
    *out = b->done;
    if (!b->spec) return;
    k3_spec_stats st = k3_spec_get_stats(b->spec);
    out->passes += st.passes;
    out->fed += st.fed;
    out->proposed += st.proposed;
    out->accepted += st.accepted;
}

void k3_serve_backend_free(k3_serve_backend *b) {
    if (!b) return;
    k3_spec_free(b->spec);
    k3_drafter_free(b->drafter);
    if (b->chat) k3_chat_free(b->chat);
    if (b->sess) k3_session_free(b->sess);
    if (b->cache) k3_state_cache_free(b->cache);
    if (b->st) k3_engine_state_free(b->e, b->st);
    k3_engine_free(b->e);
    free(b);
}

static int open_backend(const k3_engine_opts *opts, int64_t ctx, uint64_t cache_bytes, const k3_serve_spec_opts *so,
                        backend *b, k3_serve_model *sm, k3_err *err) {
    int rc;
    k3_engine_opts eo = *opts;
    eo.need_tokenizer = true;
    eo.max_pos = ctx;
    int spec_max = so ? so->spec_max : 0;
    if (spec_max) eo.mem.so.pass_tokens = spec_max + 1; /* a verifying pass in one chunk */
    if ((rc = k3_engine_open(&eo, &b->e, err))) return rc;
    if (so && so->draft_dir && k3_engine_ranks(b->e) > 1)
        return k3_fail(err, K3_EXIT_USAGE, "--draft: a draft model is not supported under mpirun (use --speculate alone)");
    if ((rc = k3_drafter_for(b->e, so ? so->draft_dir : NULL, spec_max, ctx, &b->drafter, err))) return rc;
    b->spec_max = spec_max;
    uint64_t logit_bytes = (uint64_t)k3_engine_vocab(b->e) * sizeof(float);
    if ((rc = k3_engine_state_new(b->e, ctx, cache_bytes + logit_bytes, &b->st, err))) return rc;
    b->cache = k3_state_cache_new(k3_engine_config(b->e), cache_bytes, 0);
    b->sess = k3_session_open(b->e, b->st, b->cache);
    b->ctx = ctx;
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
    sm->prefill = be_prefill;
    sm->step = be_step;
    sm->end = be_end;
    sm->spec_max = spec_max;
    sm->spec_default = so ? so->spec_default : 0;
    sm->spec_stats = be_spec_stats;
    return K3_OK;
}

int k3_serve_backend_open(const k3_engine_opts *eo, int64_t ctx, uint64_t cache_bytes, const k3_serve_spec_opts *so,
                          k3_serve_backend **out, k3_serve_model *sm, k3_err *err) {
    backend *b = xcalloc(1, sizeof *b);
    int rc = open_backend(eo, ctx, cache_bytes, so, b, sm, err);
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
    for (;;) {
        serve_cmd c;
        /* unbounded: the next command comes when a client asks */
        k3_dist_bcast(&c, sizeof c, false, "k3 serve's next command");
        k3_err e = {0};
        size_t reused;
        if (c.op == CMD_QUIT) break;
        if (c.op == CMD_PREFILL && c.n >= 1 && c.n <= b->ctx && c.id >= 0 && c.id <= b->spec_max) {
            k3_dist_bcast(ids, (size_t)c.n * sizeof *ids, true, "k3 serve's prompt ids");
            (void)be_prefill(b, ids, (size_t)c.n, logits, &reused, NULL, c.id, &e);
        } else if (c.op == CMD_STEP && c.id >= 0 && c.id < k3_engine_vocab(b->e) && c.n >= 0) {
            (void)be_step(b, c.id, c.flag ? NULL : logits, c.n, &e);
        } else if (c.op == CMD_END) {
            be_end(b);
        } else {
            k3_fail(&e, K3_EXIT_RUNTIME,
                    "serve: rank 0 sent a command this rank cannot follow (op %d, n %d, id %d): the ranks run "
                    "different k3 builds", c.op, c.n, c.id);
            free(ids);
            free(logits);
            k3_dist_abort(&e);
        }
    }
    free(ids);
    free(logits);
    return K3_OK;
}

