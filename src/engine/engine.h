/* engine.h: the one way to open a model for inference.
 *
 * `k3 run`, `k3 chat`, `k3 serve`, `k3 eval` and the benches all go through
 * here, so the flags, the memory plan and the errors are the same everywhere:
 *
 *     k3_engine_opts o;  k3_engine_opts_init(&o);
 *     ... k3_engine_parse_flag(&o, argc, argv, &i, &used, &err) for each argument ...
 *     o.model_dir = dir;  o.max_pos = longest sequence a state will hold;
 *     k3_engine *e;      k3_engine_open(&o, &e, &err);     // plan, weights, tokenizer
 *     k3_state *s;       k3_engine_state_new(e, max_pos, &s, &err);
 *     k3_engine_feed(e, s, ids, n, logits, &err);          // prefill, then one id at a time
 *     k3_state_free(s);  k3_engine_free(e);
 *
 * Invariants:
 *   - the memory plan is made before any weight byte is read: a run that cannot
 *     fit is refused with K3_EXIT_BUDGET and one line naming the sizes;
 *   - the layers and routed experts come from the plan's weight source
 *     (resident, or streamed under --trunk / --cache-gb); the output bits do
 *     not depend on which (model.h's arithmetic contract);
 *   - k3_engine_feed splits long inputs into the plan's prefill chunk, which
 *     never changes the logits bits either. */
#ifndef K3_ENGINE_ENGINE_H
#define K3_ENGINE_ENGINE_H

#include "dist/dist.h"
#include "memory/runmem.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

typedef struct {
    const char *model_dir;
    const char *tok_dir;     /* NULL: MODEL_DIR, where a missing tokenizer is fine */
    bool need_tokenizer;     /* refuse (K3_EXIT_USAGE) a model without one */
    int layers;              /* --layers (0: all) */
    int kda_chunk;           /* --kda-chunk (0: recurrent KDA in prefill) */
    int threads;             /* --threads (0: OpenMP's default) */
    bool peer_mla_eps;       /* --peer-mla-eps */
    uint64_t max_memory;     /* --max-memory bytes (0: MemAvailable) */
    int64_t max_pos;         /* longest sequence one state will hold (for the plan) */
    const char *expert_placement; /* --expert-placement FILE (under mpirun); NULL: contiguous */
    bool layout_ep;          /* --parallel-layout ep: under mpirun only the routed experts are
                                split, every rank runs the whole trunk (default tp+ep: the trunk's
                                matrices are split by output rows too, dist/tensor_par.h) */
    bool layout_tp;          /* --parallel-layout tp: the routed experts' matrices are split by
                                output rows like the trunk's (every rank holds and reads its
                                rows of every expert); no expert exchange */
    k3_runmem_args mem;      /* --preset, --trunk, --trunk-gb, --cache-gb, --chunk, ... */
    bool alone;              /* this process alone, even under mpirun: the whole model here and no
                                call exchanges anything with the other ranks (a draft model: every
                                rank runs its own copy, and the same history gives every rank the
                                same drafts, as the logits bits do not depend on the machine) */
} k3_engine_opts;

void k3_engine_opts_init(k3_engine_opts *o);

/* If argv[*i] is one of the shared model flags (K3_ENGINE_HELP), consumes it
 * and its value (moving *i) and sets *used. cmd names the command in usage
 * errors, which return K3_EXIT_USAGE with err filled. */
int k3_engine_parse_flag(k3_engine_opts *o, const char *cmd, int argc, char **argv, int *i, bool *used,
                         k3_err *err);

#define K3_ENGINE_HELP \
    "model:\n" \
    "  --tok DIR            tokenizer directory (tiktoken.model); default MODEL_DIR\n" \
    "  --threads N          OpenMP threads (the logits do not depend on N)\n" \
    "  --layers N           run only the first N layers (partial checkpoints)\n" \
    "  --max-memory SIZE    memory budget, e.g. 8G (default: MemAvailable), never\n" \
    "                       above a memory cgroup limit's headroom; refused up\n" \
    "                       front (exit 3) if weights + state do not fit\n" \
    "  --kda-chunk C        prefill KDA in the chunkwise form, chunk length C\n" \
    "                       (faster for long prompts; equal to fp32 rounding, not\n" \
    "                       bit-identical to token-by-token decoding)\n" \
    "  --peer-mla-eps       MLA latent norms use rms_norm_eps (the peer engine's\n" \
    "                       reading) instead of the released fixed 1e-6\n" \
    "  --expert-placement FILE   under mpirun: which rank holds which routed expert\n" \
    "                       (k3 cache-sim TRACE --placement R --placement-out FILE);\n" \
    "                       default: contiguous, balanced (docs/mpi.md)\n" \
    "  --parallel-layout L  under mpirun: tp+ep (default: the trunk's matrices split\n" \
    "                       over the ranks by output rows, the routed experts by\n" \
    "                       expert), tp (the experts' matrices split by rows too:\n" \
    "                       every rank computes a share of every selected expert)\n" \
    "                       or ep (the experts only; every rank runs the whole\n" \
    "                       trunk); the logits are the same bits in every layout\n" \
    "\n" K3_RUNMEM_HELP

/* The sampling flags of the commands that generate from the command line
 * (k3 run, k3 chat; k3 serve takes the same settings per request), parsed
 * like the model flags: k3_sample_opts_init, then k3_sample_parse_flag for
 * each argument, then k3_sample_opts_check once. */
typedef struct {
    float temperature;      /* --temperature (0: greedy argmax) */
    int top_k;              /* --top-k (0: off) */
    float top_p, min_p;     /* --top-p (1: off), --min-p (0: off) */
    uint64_t seed;          /* --seed */
    bool filtered;          /* --top-k, --top-p or --min-p given: they need a temperature */
} k3_sample_opts;

void k3_sample_opts_init(k3_sample_opts *o);
/* As k3_engine_parse_flag, for the flags of K3_SAMPLE_HELP. */
int k3_sample_parse_flag(k3_sample_opts *o, const char *cmd, int argc, char **argv, int *i, bool *used,
                         k3_err *err);
/* After every flag: filters without --temperature > 0 are a usage error. */
int k3_sample_opts_check(const k3_sample_opts *o, const char *cmd, k3_err *err);
/* k3_sampler_init with these settings and seed + seed_offset. */
void k3_sample_opts_sampler(const k3_sample_opts *o, int vocab, uint64_t seed_offset, k3_sampler *sp);

#define K3_SAMPLE_HELP \
    "  --temperature T      sample at temperature T (default 0: greedy argmax)\n" \
    "  --top-k K, --top-p P, --min-p P   sampling filters (need --temperature > 0)\n" \
    "  --seed S             sampling seed (default 0); same seed, same tokens\n"

/* The engine is opaque: callers reach the model, the plan and the ranks only
 * through the functions below, so what a run does is decided here once. */
typedef struct k3_engine k3_engine;

/* What a caller may read of an open engine. The model is for a session
 * (session.h) and the blocks' sizing helpers; feeding goes through
 * k3_engine_feed, never k3_forward on it (the plan's report and the ranks'
 * exchanges are kept there). */
k3_model *k3_engine_model(const k3_engine *e);
const k3_config *k3_engine_config(const k3_engine *e);  /* --layers applied */
k3_tokenizer *k3_engine_tokenizer(const k3_engine *e);  /* NULL: ids only */
int k3_engine_vocab(const k3_engine *e);
int k3_engine_chunk(const k3_engine *e);     /* prefill positions per forward call (the plan's) */
int k3_engine_threads(const k3_engine *e);   /* what OpenMP will use */
int k3_engine_eos_id(const k3_engine *e);    /* config eos_token_id, else the tokenizer's, else -1 */
const char *k3_engine_model_dir(const k3_engine *e);
/* The options it was opened with (a draft model opens its own engine alike). */
const k3_engine_opts *k3_engine_options(const k3_engine *e);
/* Under mpirun: this process is rank k3_engine_rank of k3_engine_ranks (one
 * process, or an engine opened alone: 0 of 1); only rank 0 should talk to
 * the user. */
int k3_engine_rank(const k3_engine *e);
int k3_engine_ranks(const k3_engine *e);
/* A line per forward call on f (--verbose), or none (NULL, the default). */
void k3_engine_set_step_log(k3_engine *e, FILE *f);

/* The run report of the plan (memory/runmem.h): the plan before the first
 * feed, the summary after the last, the weight bytes the decode calls read,
 * the plan's fields into a JSON object (k3 run --out). */
void k3_engine_print_plan(const k3_engine *e, FILE *f);
void k3_engine_print_summary(const k3_engine *e, FILE *f);
k3_runmem_reads k3_engine_decode_reads(const k3_engine *e);
struct json_t;
void k3_engine_report_json(const k3_engine *e, struct json_t *o);

/* The checkpoint's identity (formats/identity.h: config.json, the open
 * index's shards, the tokenizer files), salted with what changes the decode
 * states (--layers, --peer-mla-eps): a saved session names it. */
int k3_engine_identity(const k3_engine *e, uint64_t *out, k3_err *err);

/* Memory plan (K3_EXIT_BUDGET when it cannot fit), then the model (top
 * tensors; layers from the plan's source), then the tokenizer. */
int k3_engine_open(const k3_engine_opts *o, k3_engine **out, k3_err *err);
void k3_engine_free(k3_engine *e);

/* A decode state for max_pos positions. extra_bytes: other memory the caller
 * is about to hold (logit rows, a state cache), counted against the budget.
 * Refused (K3_EXIT_BUDGET, one line with every part's size) when weights +
 * live states + this state + extra exceed --max-memory (or MemAvailable). */
int k3_engine_state_new(k3_engine *e, int64_t max_pos, uint64_t extra_bytes, k3_state **out, k3_err *err);
/* Frees a state made by k3_engine_state_new (and forgets its bytes). */
void k3_engine_state_free(k3_engine *e, k3_state *s);

/* Feeds ids[0..n) at the state's position in the plan's chunks. Under
 * expert parallelism a failure ends the whole job (one line naming the rank):
 * the other ranks wait in this call's exchanges. logits: the
 * last token's [V] logits (NULL: none). all_logits: logits holds [n][V] rows
 * instead (the caller sizes it). prefill marks the calls as prompt work in the
 * run report. progress: a bar for long inputs (NULL: none). */
int k3_engine_feed(k3_engine *e, k3_state *s, const int32_t *ids, size_t n, float *logits, bool all_logits,
                   bool prefill, k3_progress *progress, k3_err *err);

/* Batched decoding: ids[q] fed to states[q] (n distinct states, each at its
 * own position) in one pass over the weights (model.h's k3_forward_batch);
 * logits: [n][V] rows (NULL: none), row q with exactly the bits
 * k3_engine_feed of ids[q] alone on states[q] gives, whatever the other rows
 * are. The run report counts one decode call of n tokens. */
int k3_engine_feed_batch(k3_engine *e, k3_state *const *states, int n, const int32_t *ids, float *logits,
                         k3_err *err);
/* The same with counts[q] >= 1 ids of state q (model.h's
 * k3_forward_batch_rows; counts NULL: one each): ids and the [rows][V]
 * logits (every row) one state after another. With counts, a batch of more
 * rows than the plan's chunk (k3_engine_chunk) is refused (K3_EXIT_USAGE, nothing fed):
 * streamed weights hold one chunk's experts. The run report counts one decode
 * call of every row. */
int k3_engine_feed_batch_rows(k3_engine *e, k3_state *const *states, int n, const int *counts, const int32_t *ids,
                              float *logits, k3_err *err);

/* Resets s and feeds ids[0..n) again in the plan's chunks; the run report
 * counts it as one decode step of one token (k3 run --full recomputes the
 * whole prefix for every generated token). logits: the last token's [V]. */
int k3_engine_recompute(k3_engine *e, k3_state *s, const int32_t *ids, size_t n, float *logits, k3_err *err);

/* Under expert parallelism every rank passes its status here after its own
 * preparations (prompt, states, output files) and before the first feed, so
 * that a rank that cannot start stops the job here instead of leaving the
 * others waiting in an exchange: all return the lowest failing rank's code,
 * err naming it. One process: returns rc. After this point a failure on any
 * rank must end the job (k3_dist_abort). */
int k3_engine_ready(k3_engine *e, int rc, k3_err *err);
/* The same agreement over any later step every rank takes together (a chat
 * turn): all return the lowest failing rank's code, err naming it, what
 * naming the step; one process: returns rc. */
int k3_engine_agree(k3_engine *e, int rc, k3_err *err, const char *what);
/* An interactive command under mpirun (k3 chat): rank 0 reads the input and
 * talks, every rank computes the same turns. k3_engine_getline: rank 0's
 * next line of f on every rank (getline's contract: the length, -1 at the
 * end or on an error); the other ranks do not read f, and they wait without
 * a bound (a person types). k3_engine_silence_others: on the ranks after the
 * first, stdout and stderr go to /dev/null (the job's error lines still come
 * out); rank 0 and one process: nothing. */
long long k3_engine_getline(k3_engine *e, char **line, size_t *cap, FILE *f);
void k3_engine_silence_others(const k3_engine *e);
/* After k3_engine_ready: a failure on this rank (rc != 0) ends the whole job
 * under mpirun (one line naming the rank; the others would wait in the next
 * exchange); one process: returns rc. */
int k3_engine_fail(k3_engine *e, int rc, k3_err *err);

/* The exchange counters of this process at one moment (the start or end of
 * a phase of the run), for k3_engine_dist_report. */
typedef struct {
    k3_dist_stats d;
    uint64_t trunk_disk;  /* streamed trunk bytes read from disk so far (k3_runmem_trunk_read) */
} k3_engine_mark;
k3_engine_mark k3_engine_mark_now(const k3_engine *e);

/* Under expert parallelism, the cost of the exchanges over one phase of the
 * run (e.g. the decode), from every rank: a collective every rank calls with
 * its own marks taken at the phase's start and end, the phase's
 * seconds and tokens. Prints one line on f (rank 0, f not NULL) and
 * returns a JSON object (rank 0; NULL elsewhere and for one process):
 * {"ranks", "experts_held": [per rank], "exchanges_per_token", "bytes_sent_per_token":
 * [per rank], "exchange_share": [per rank], ..., "layout" ("tp+ep", "tp" or "ep"),
 * "split_gathers_per_token" (of the exchanges, the split products' gathers),
 * "split_bytes_sent_per_token", "split_share", "trunk_bytes_read_per_token":
 * [per rank] (weight bytes the split products read: the trunk's matrices, and
 * under tp the routed experts' too), "trunk_bytes_one_process_per_token",
 * and with a packed trunk (--trunk) "trunk_disk_bytes_per_token": [per rank] (the
 * streamed layers' bytes each rank read from disk, its share under tp+ep)}.
 * Under tp+ep a second line gives the split trunk's figures, with --trunk a
 * third the disk's. */
struct json_t *k3_engine_dist_report(k3_engine *e, const char *phase, const k3_engine_mark *from,
                                     const k3_engine_mark *to, double secs, uint64_t steps, FILE *f);

/* Encodes text with the engine's tokenizer (allow_special as tok_encode) and
 * checks every id against the model's vocabulary. what names the input. */
int k3_engine_encode(const k3_engine *e, const char *what, const char *text, size_t len, bool allow_special,
                     int32_t **ids, size_t *n, k3_err *err);

#endif
