/* generate.h: the generation loop, written once.
 *
 * Every command that generates text (k3 run, k3 chat, k3 serve, the samples
 * of k3 train) calls k3_generate after its own prefill; none of them samples,
 * checks logits or feeds a generated id itself. The caller brings a session
 * that has consumed the prompt, a sampler, the prompt's last logits and its
 * settings; it gets every sampled id through on_token and decides there what
 * the id means to it (text to print, a chat delta, an SSE event, a stop
 * string). The loop owns, for each generated id, in this order:
 *
 *   1. check: k3_logits_check on the logits it is about to sample from;
 *   2. sample: k3_sample(sampler, row), where row is logits, or what
 *      adjust(ctx, logits) returns (a request's penalties, logit biases or
 *      a mask, applied to a copy); on_sample(ctx, id, row) then sees the id
 *      and the row it came from (log-probabilities, penalty counts), also
 *      for the EOS id;
 *   3. stop at the end-of-sequence id (opts.eos_id): the id is recorded
 *      but not handed to on_token; the loop ends (fed first if eos_keep);
 *   4. emit: on_token(ctx, id, &verdict): K3_GEN_GO goes on, K3_GEN_STOP
 *      ends without feeding the id (a stop string), K3_GEN_STOP_KEEP ends
 *      after feeding it without logits (a chat's end-of-message id, which
 *      the next turn's rendered history holds) when the state has room;
 *   5. stop at max_tokens: the last id is NOT fed (nothing would read its
 *      logits), so a reply of n ids costs n-1 decode passes;
 *   6. cancel: cancelled(ctx) is asked before every forward pass; true ends
 *      the loop (K3_GEN_END_CANCEL) without that pass;
 *   7. feed: the id goes into the session (k3_session_feed, or with
 *      recompute k3_session_recompute), its logits into the caller's buffer,
 *      and on_logits(ctx, row) sees the row.
 *
 * Invariants:
 *  - the ids, logits rows and stop decisions are exactly those of the
 *    loop each command used to write for itself (k3 run --dump-logits bytes
 *    and text, greedy and seeded, are unchanged by the move);
 *  - result.ids holds every sampled id in order, including the one that
 *    ended the loop (an EOS or a stopping id); the session then holds the
 *    prompt and every id of result.ids except the last (plus the last when
 *    it was kept);
 *  - callbacks run on the caller's thread, in id order; on_token is called
 *    once per id and never for the EOS id;
 *  - an error (a failed logits check, a forward error, a callback's) ends
 *    the loop with that exit code and err; result still describes what was
 *    generated before it.
 *
 * Speculation (opts.spec, draft/draft.h): each id the loop feeds goes
 * through k3_spec_feed, which either takes the id's row from the open
 * verifying pass (the id was its next draft: no forward) or ends that pass
 * where the ids stopped agreeing and feeds the id with the next drafts in one
 * forward. The loop samples every id from the same rows with the same draws
 * as without speculation, so the ids, the rows on_logits sees and the final
 * session are those of one id per pass; only passes and fed change. It needs
 * a session the loop feeds itself (no feed, no recompute). Batching will run
 * several sessions' loops in one pass, inside k3_generate too.
 *
 * feed: a caller whose forward passes must go through something other than
 * its session (k3 serve's lead rank announces every pass to the ranks that
 * follow it; a test double scripts its logits) passes feed, and then session
 * may be NULL; prompt_len then says how many ids the model has consumed. The
 * hook is called once per id as the session would be, with the limit the
 * verifying feed takes: a hook that speculates (k3 serve's backend) calls
 * k3_spec_feed itself and closes its pass before the next prompt; the loop's
 * passes and fed then count hook calls, the hook has the speculator's. */
#ifndef K3_GENERATE_GENERATE_H
#define K3_GENERATE_GENERATE_H

#include "model/model.h"
#include "session/session.h"
#include "util/common.h"

typedef enum {
    K3_GEN_GO = 0,     /* feed the id, go on */
    K3_GEN_STOP,       /* end here; the id is not fed */
    K3_GEN_STOP_KEEP,  /* end after feeding the id (without logits) */
} k3_gen_verdict;

typedef enum {
    K3_GEN_END_LENGTH = 0, /* max_tokens sampled (or max_tokens 0) */
    K3_GEN_END_EOS,        /* the EOS id was sampled */
    K3_GEN_END_STOP,       /* on_token said stop */
    K3_GEN_END_CANCEL,     /* cancelled() said so before a forward pass */
    K3_GEN_END_LOGITS,     /* a non-finite logit (k3_logits_check); k3_generate returned its code */
    K3_GEN_END_ERROR,      /* another error; k3_generate returned its code */
} k3_gen_end;

struct k3_spec; /* draft/draft.h */

typedef struct {
    int64_t max_tokens;    /* ids to sample at most (>= 0) */
    int32_t eos_id;        /* < 0: none */
    bool eos_keep;         /* the EOS id is fed too (the history holds it), when the state has room */
    bool recompute;        /* feed by recomputing the whole prefix (k3 run --full) */
    const char *what;      /* names the model in a failed logits check */
    size_t prompt_len;     /* with feed and no session: ids the model consumed before the loop */
    int64_t max_pos;       /* with feed and no session: positions the model holds (0: no limit) */
    /* callbacks, all optional; ctx is passed to each */
    void *ctx;
    int (*on_token)(void *ctx, int32_t id, k3_gen_verdict *verdict, k3_err *err); /* verdict preset K3_GEN_GO */
    int (*on_logits)(void *ctx, const float *row, k3_err *err); /* each row a forward pass returns */
    bool (*cancelled)(void *ctx);
    const float *(*adjust)(void *ctx, const float *logits); /* the row to sample from (logits or the caller's copy) */
    int (*on_sample)(void *ctx, int32_t id, const float *row, k3_err *err); /* before on_token */
    /* NULL: the session; logits NULL: none; limit: ids the loop may still feed after this one */
    int (*feed)(void *ctx, int32_t id, float *logits, int64_t limit, k3_err *err);
    struct k3_spec *spec;  /* speculation (draft/draft.h); NULL: one id per pass */
} k3_gen_opts;

/* Defaults: nothing to generate, no EOS, no callbacks. */
void k3_gen_opts_init(k3_gen_opts *o);

typedef struct {
    int32_t *ids;          /* every sampled id (malloc'd; k3_gen_result_free) */
    size_t n;
    k3_gen_end end;
    double t_first;        /* k3_now() when the first id was sampled (0: none) */
    uint64_t passes;       /* forward passes made */
    uint64_t fed;          /* ids fed by them */
    uint64_t drafted;      /* drafts fed (0 without speculation) */
    uint64_t accepted;     /* of those, drafts the sampler agreed with */
} k3_gen_result;

void k3_gen_result_free(k3_gen_result *r);

/* Generates into session s (after the caller's prefill) with sampler sp (its
 * vocabulary is the model's), starting from logits[V], the logits of the last
 * id s consumed; logits is overwritten with each new row. result is filled
 * (also on error); returns K3_OK or an exit code with err filled. */
int k3_generate(k3_session *s, k3_sampler *sp, float *logits, const k3_gen_opts *o, k3_gen_result *result,
                k3_err *err);

/* The name of an end ("length", "eos", "stop", "cancel", "logits", "error"). */
const char *k3_gen_end_name(k3_gen_end e);

#endif
