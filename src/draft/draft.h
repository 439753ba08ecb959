/* draft.h: drafts for speculative decoding, and how many to ask for.
 *
 * A drafter guesses the ids that follow a history (every id the target
 * model consumed, then the id just sampled and not yet fed). The generation
 * loop feeds the sampled id and the drafts in one pass and keeps the drafts
 * the target itself samples (docs/speculation.md); a draft is only ever a
 * guess, so nothing a drafter does can change the generated ids, only how
 * many forward passes they take.
 *
 *  - n-gram (prompt lookup): the continuation of the most recent earlier
 *    occurrence of the history's longest suffix of max_n..min_n ids. An
 *    index of the history's n-grams grows with it (O(1) per id); a history
 *    that is not an extension of the last one is indexed afresh. Its drafts
 *    stop where they become too likely to be rejected too (the gate; a
 *    short match is kept less often than a long one).
 *  - draft model (--draft DIR): any checkpoint k3 runs with the target's
 *    tokenizer (the same data_tokenizer_hash: tiktoken.model and
 *    tokenizer_config.json; another is refused, K3_EXIT_USAGE), decoded
 *    greedily in its own session. Its state follows the history with the
 *    model's cut-back passes (k3_session_pass_*): the drafts it fed and the
 *    target rejected are taken back, never re-prefilled. A pass's drafts
 *    stop where they become too likely to be rejected (the gate, below;
 *    --draft-p-min): a doomed guess costs a verifying row and, in a mixture
 *    of experts, the experts that row selects.
 *
 * The controller (k3_spec_ctl) picks the drafts per pass. A drafter with
 * p_min > 0 stops its own drafts, so it is asked for K every pass (what made
 * a draft predicts its rejection better than the last passes do). With
 * p_min 0, from the acceptance alone (never from timings, so every rank of
 * an MPI job makes the same passes): up by one after a pass that accepted every draft, to
 * the accepted count + 1 after a partial one, halved after one that
 * accepted none; at zero it drafts nothing for a back-off of 1, 2, 4 ... 64
 * passes, then probes again with one draft. A run whose drafts keep failing
 * thus spends about one extra position per 64 passes on them.
 *
 * Invariants: a drafter returns ids inside [0, vocab) of the target; the
 * same history gives the same drafts (deterministic, any thread count). */
#ifndef K3_DRAFT_DRAFT_H
#define K3_DRAFT_DRAFT_H

#include "engine/engine.h"
#include "session/session.h"
#include "util/common.h"

/* Most drafts per pass (--speculate K, k3 serve's "speculate"). */
#define K3_SPEC_MAX 16
/* --draft-p-min's defaults: the chance of a pass's drafts all being kept
 * below which they stop (the gate, below; docs/speculation.md: how they were
 * chosen). A draft model's: its drafts are worth their rows when streamed. An
 * n-gram's: a verifying row costs about 0.3 of a pass where the weights are
 * resident (models/default, 1 thread), so a draft must be kept at least that
 * often to pay; streamed, a row costs less still. */
#define K3_DRAFT_P_MIN 0.2
#define K3_NGRAM_P_MIN 0.3

typedef struct k3_drafter k3_drafter;

/* An n-gram drafter for a target of vocab ids (n-grams of max_n down to
 * min_n ids, 1 <= min_n <= max_n <= 8), its drafts gated at p_min (in
 * [0, 1]; 0: no gate). */
k3_drafter *k3_drafter_ngram(int vocab, int min_n, int max_n, double p_min);

/* A draft-model drafter: opens dir with o (the caller's engine flags;
 * model_dir is replaced by dir, the memory flags should be the resident
 * defaults), after checking that dir's tokenizer equals tok_dir's
 * (K3_EXIT_USAGE naming both otherwise, or when either has no
 * tiktoken.model). vocab: the target's; max_pos: the longest history;
 * max_k: drafts per pass at most; p_min: in [0, 1] (else K3_EXIT_USAGE),
 * the gate's threshold (0: no gate). */
int k3_drafter_model(const k3_engine_opts *o, const char *dir, const char *tok_dir, int vocab, int64_t max_pos,
                     int max_k, double p_min, k3_drafter **out, k3_err *err);

void k3_drafter_free(k3_drafter *d);
/* A drafter like d for another history (k3 serve: one per slot): a fresh
 * n-gram index, or the same draft model (d's engine, shared: the drafters'
 * calls must not overlap, and d is freed after it) with its own state and
 * session for histories of max_pos. */
int k3_drafter_sibling(k3_drafter *d, int64_t max_pos, k3_drafter **out, k3_err *err);

/* Up to k drafts following hist[0..n) (n >= 1) into out; *got: how many
 * (0 when the drafter has none). Errors: the draft model's. */
int k3_drafter_propose(k3_drafter *d, const int32_t *hist, size_t n, int k, int32_t *out, int *got, k3_err *err);

/* One drafter's part of k3_drafter_propose_batch: k3_drafter_propose's
 * arguments, got its answer. */
typedef struct {
    k3_drafter *d;
    const int32_t *hist;
    size_t n;
    int k;          /* drafts wanted (0: none; got is then 0) */
    int32_t *out;   /* [k] */
    int got;
} k3_draft_ask;
/* k3_drafter_propose for several drafters at once (distinct drafters, else
 * K3_EXIT_USAGE before anything is fed; k3 serve --parallel: one per slot).
 * Draft-model drafters of one model (k3_drafter_sibling) draft together:
 * the ids that catch each one's state up with its history go through one
 * forward pass, then each drafted position of all of them through one more
 * (k3_session_feed_batch_rows, each drafter its own state), so drafting K
 * ids costs K passes however many drafters ask, not K per drafter. A row's
 * bits never depend on the other rows of its pass: every ask gets exactly
 * the drafts k3_drafter_propose gives it alone. An error of a shared forward
 * fails the whole call (err says which); each drafter's next call starts
 * from what its state then holds. */
int k3_drafter_propose_batch(k3_draft_ask *const *asks, int n, k3_err *err);

/* A draft model's work, for the drafter and its siblings together (zeros for
 * n-gram): forward passes it made, and the drafters fed in them summed (more
 * than the passes when drafters of several slots shared passes). */
typedef struct {
    uint64_t passes, seqs;
} k3_draft_stats;
k3_draft_stats k3_drafter_stats(const k3_drafter *d);

/* The draft model's engine (NULL for an n-gram drafter), for its report. */
k3_engine *k3_drafter_engine(k3_drafter *d);

/* A draft model behind a new history (a prompt) feeds at most ids of it per
 * ask and drafts nothing until it has caught up (0, the default: all at
 * once). For drafters of sequences that share steps (k3 serve --parallel):
 * one request's long prompt then costs the others' steps a chunk of the
 * draft model at a time, as the target's own prefill is split, instead of
 * the whole prompt at once. The drafts, once caught up, are the same.
 * Siblings made after it take the bound too. No effect on n-gram. */
void k3_drafter_set_catchup(k3_drafter *d, int ids);

/* ---- how likely a draft is kept --------------------------------------------
 * How likely the target keeps a draft depends on the pair of models and the
 * text. Each drafter that stops its own drafts (p_min > 0) keeps a gate:
 * per bucket of what made a draft, the drafts the target verified and those
 * it kept (learnt from the histories that follow, so from ids alone: the
 * same on any machine, rank or thread count). A draft model's bucket is the
 * tenth of its probability for its id (k3_draft_gate_bucket); an n-gram
 * draft's, the length of the n-gram that matched. A draft's chance is
 * (kept + 1) / (verified + 1), so an untried bucket starts at 1 (an
 * n-gram's at 1/2: its gate starts as if one draft of each length had been
 * rejected, since a short run cannot afford to learn otherwise). A pass's
 * drafts stop where the product of their chances falls below p_min; after
 * 64 asks that could have drafted and did not, one is drafted anyway, so the
 * counts keep learning. */
#define K3_DRAFT_GATE_BUCKETS 10
typedef struct {
    uint32_t seen[K3_DRAFT_GATE_BUCKETS], kept[K3_DRAFT_GATE_BUCKETS];
} k3_draft_gate;
/* The bucket of a draft model's probability p (its tenth; 1 in the top). */
int k3_draft_gate_bucket(double p);
double k3_draft_gate_chance(const k3_draft_gate *g, int bucket);
void k3_draft_gate_record(k3_draft_gate *g, int bucket, bool kept);

/* ---- drafts per pass ----------------------------------------------------- */
typedef struct {
    int kmax;       /* --speculate K */
    bool fixed;     /* always kmax: the drafter stops its drafts itself */
    int k;          /* drafts to ask for next */
    int skip;       /* plain passes left before the next probe */
    int backoff;    /* the next skip after a failed probe */
} k3_spec_ctl;

void k3_spec_ctl_init(k3_spec_ctl *c, int kmax, bool fixed);
/* Drafts to ask for in the next pass (0: a plain pass). */
int k3_spec_ctl_want(k3_spec_ctl *c);
/* After a pass that proposed `proposed` drafts and accepted `accepted`. */
void k3_spec_ctl_update(k3_spec_ctl *c, int proposed, int accepted);

/* ---- the verifying feed ---------------------------------------------------
 * What the generation loop calls instead of feeding a sampled id itself.
 * k3_spec_feed(sp, s, id, logits, limit): when id is the next draft of the
 * open pass, its row (computed by that pass) goes to logits and no forward
 * runs: the draft is accepted. Otherwise the open pass ends, keeping what
 * was consumed (the ids accepted so far), and a new pass feeds id followed
 * by up to min(controller, limit, room) drafts in one forward with every
 * row; logits gets id's row. The loop samples each id, as plain decoding
 * does, from bit-identical rows, with the same sampler draws in the same
 * order: the ids are exactly plain decoding's, greedy or sampled (the
 * rejection rule with draft probabilities is not used: it keeps the
 * distribution, not the ids). k3_spec_finish ends an open pass when the loop
 * stops (EOS, length, a stop string): the session then holds exactly what
 * plain decoding's would. */
typedef struct k3_spec k3_spec;
typedef struct {
    uint64_t passes;     /* forward passes made by k3_spec_feed */
    uint64_t fed;        /* ids those passes fed (sampled ids and drafts) */
    uint64_t proposed;   /* drafts fed */
    uint64_t accepted;   /* drafts the sampler agreed with */
} k3_spec_stats;
k3_spec *k3_spec_new(k3_drafter *d, int kmax, int vocab);
void k3_spec_free(k3_spec *sp);
/* limit: drafts worth verifying (ids the loop may still feed after id). */
int k3_spec_feed(k3_spec *sp, k3_session *s, int32_t id, float *logits, int64_t limit, k3_err *err);
/* k3_spec_feed in two halves around its forward, for a caller that feeds
 * several sessions' passes in one (k3_session_feed_batch_rows; k3 serve
 * --parallel with --speculate): begin does everything before the forward
 * (the accepted draft's row, the end of the open pass, the drafts, the new
 * pass's begin) and says in pass what to feed: nothing (n 0: id was
 * accepted, logits holds its row), or ids[0..n) to s with every row to
 * rows ([n][V]); after that feed k3_spec_fed finishes (logits gets id's
 * row). k3_spec_feed is begin, k3_session_feed_rows, fed. A failed feed
 * resets the session (session.h) and leaves no pass open. */
typedef struct {
    const int32_t *ids;  /* the sampled id, then the drafts (the verifier's until k3_spec_fed) */
    int n;               /* ids to feed; 0: none */
    float *rows;         /* where the forward writes the n rows */
} k3_spec_pass;
int k3_spec_begin(k3_spec *sp, k3_session *s, int32_t id, float *logits, int64_t limit, k3_spec_pass *pass,
                  k3_err *err);
/* k3_spec_begin in two halves around its drafter call, for a caller that
 * drafts for several slots at once (k3_drafter_propose_batch): ask does what
 * comes before the drafter. pass->n 0: id was an accepted draft (logits holds
 * its row), nothing more to do. Otherwise ask->k > 0 asks for drafts (ask
 * points into sp until k3_spec_answer); after the drafter answered (or with
 * ask->k 0 at once), k3_spec_answer(sp, s, ask->got, pass) finishes as
 * k3_spec_begin does. k3_spec_begin is ask, k3_drafter_propose, answer. A
 * failed drafter call needs no answer: the open pass was already closed. */
int k3_spec_ask(k3_spec *sp, k3_session *s, int32_t id, float *logits, int64_t limit, k3_spec_pass *pass,
                k3_draft_ask *ask, k3_err *err);
int k3_spec_answer(k3_spec *sp, k3_session *s, int got, k3_spec_pass *pass, k3_err *err);
void k3_spec_fed(k3_spec *sp);
int k3_spec_finish(k3_spec *sp, k3_session *s, k3_err *err);
k3_spec_stats k3_spec_get_stats(const k3_spec *sp);

/* ---- the flags ----------------------------------------------------------
 * --speculate K, --draft DIR and --draft-p-min P, the same in k3 run, chat
 * and serve: k3_spec_flags_init, k3_spec_parse_flag for each argument (as
 * k3_engine_parse_flag), k3_spec_flags_check once after them (--draft
 * alone means K 4; --draft-p-min's default is the drafter's:
 * K3_DRAFT_P_MIN or K3_NGRAM_P_MIN). */
typedef struct {
    int speculate;       /* --speculate K (0: none) */
    const char *draft;   /* --draft DIR */
    double p_min;         /* --draft-p-min P */
    bool p_min_given;
} k3_spec_flags;
void k3_spec_flags_init(k3_spec_flags *f);
int k3_spec_parse_flag(k3_spec_flags *f, const char *cmd, int argc, char **argv, int *i, bool *used, k3_err *err);
int k3_spec_flags_check(k3_spec_flags *f, const char *cmd, k3_err *err);
/* The --draft line of run, chat and serve's help */
#define K3_DRAFT_HELP \
    "  --draft DIR          draft with the model in DIR (same tokenizer, else exit 2);\n" \
    "                       --speculate defaults to 4 with it; under mpirun every\n" \
    "                       rank loads a whole copy of it.\n"
#define K3_DRAFT_P_MIN_HELP \
    "  --draft-p-min P      a pass's drafts stop where the chance of all being\n" \
    "                       kept falls below P, each draft's chance learnt from\n" \
    "                       how often drafts like it were kept (a draft model's:\n" \
    "                       as sure of its id; n-gram: as long a match); default\n" \
    "                       0.2 with --draft, 0.3 for n-gram drafts; 0: K drafts,\n" \
    "                       fewer while they are rejected\n"

/* The drafter a command's flags ask for: --draft DIR (a draft model) or,
 * with --speculate K alone, n-gram; its drafts stopped below p_min. NULL
 * *out when kmax is 0. */
int k3_drafter_for(const k3_engine *target, const char *draft_dir, double p_min, int kmax, int64_t max_pos,
                   k3_drafter **out, k3_err *err);

#endif
