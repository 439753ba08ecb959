/* serve.h: `k3 serve`, an OpenAI-compatible HTTP server for one model.
 *
 * Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
 * GET /health, and the chat page at / (docs/serve.md has the API surface).
 *
 * Threads. libmicrohttpd runs one thread per connection; those threads parse
 * and validate a request, tokenize its prompt (the tokenizer and the chat
 * template are read-only and safe to share) and put a job on a bounded queue
 * (full: 429). Each model slot (k3 serve --parallel N) has a worker thread;
 * a waiting job goes to the free slot whose state holds most of its prompt.
 * A worker writes the response bytes (a JSON body, or server-sent events)
 * into the job, and the connection's thread copies them to the socket. Every
 * wait is a timed wait that also watches the client's socket and the server's
 * stop flag: a client that goes away cancels its job (queued: dropped;
 * running: its worker stops at the next token or prefill chunk), and no
 * thread waits on a job that can no longer finish.
 *
 * Invariants: a request is refused with its error (400/404/405/413/429) before
 * it reaches a worker whenever that can be known from the request alone
 * (shape, types, prompt length against the context); the model is only touched
 * through the model calls of the slots' workers; a job's output is append-only
 * and the connection sends it in order, so a stream is exactly the events the
 * worker produced; a request's response does not depend on which other
 * requests computed beside it (the batched decode gives each row its own bits,
 * each request samples with its own sampler). */
#ifndef K3_SERVE_SERVE_H
#define K3_SERVE_SERVE_H

#include "chat/chat.h"
#include "constrain/constrain.h"
#include "draft/draft.h"
#include "engine/engine.h"
#include "tokenizer/tokenizer.h"
#include "util/common.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

/* ---- the model side, called on the slots' worker threads ---- */

/* How decoding shared forward passes (/metrics): the decode passes (each
 * feeds the next id, or the id and its drafts, of every slot whose step it
 * takes; prefills are not counted), the sequences (slots) summed over them,
 * the ids they fed, and the passes by sequences: by_seqs[i] counts those of
 * 2^(i-1) < sequences <= 2^i (i 0: one). The draft model's (--draft): its
 * forward passes and the slots' drafters fed in them, summed. */
#define K3_BATCH_HIST_N 9
typedef struct {
    uint64_t passes, seqs, rows;
    uint64_t by_seqs[K3_BATCH_HIST_N];
    uint64_t draft_passes, draft_seqs;
} k3_serve_batch_stats;

typedef struct {
    void *ctx;
    int vocab;                 /* the model's vocabulary (ids < vocab) */
    int eos;                   /* /v1/completions stops here (config eos_token_id, else the tokenizer's); -1 none */
    int64_t ctx_len;           /* positions one conversation may hold (prompt + generated) */
    const k3_tokenizer *tok;   /* required */
    const k3_chat *chat;       /* NULL: no XTML ids, /v1/chat/completions answers 400 */
    int threads;               /* OpenMP threads of a slot's worker (0: default): the model's
                                  when the workers compute, 1 when another thread does */
    /* Requests that may compute at once (>= 1), each on its own slot: a
     * slot is one conversation state, and every call below names the slot
     * its request runs on. A slot is used by one thread at a time. */
    int slots;
    /* Speculative decoding (docs/speculation.md): the drafts per pass a
     * request gets when it names none, and the most it may ask for (its
     * "speculate" field; the memory plan counts a pass of spec_max + 1 ids).
     * 0: the model does not speculate. */
    int spec_default, spec_max;
    /* Makes slot's state hold exactly ids[0..n) and puts the logits of the
     * last one in logits[vocab]; *reused: how many leading ids were not
     * recomputed (taken from a saved state). marks[0..nmarks): increasing
     * offsets in 1..n where the prompt's messages end (chat; none for
     * completions), kept so that another prompt sharing ids[0..mark) resumes
     * there. *cancel is polled between prefill chunks (then K3_EXIT_RUNTIME,
     * err saying how far the prefill got, which the log repeats). speculate:
     * drafts per pass at most (0..spec_max) for the steps that follow, until
     * the next prefill. */
    int (*prefill)(void *ctx, int slot, const int32_t *ids, size_t n, const size_t *marks, size_t nmarks,
                   float *logits, size_t *reused, const atomic_int *cancel, int speculate, k3_err *err);
    /* Feeds one more id (the state then holds one more) and fills logits
     * (NULL: none wanted, a stop id the next prompt's history will hold).
     * The generation loop (generate.h) makes every such call; limit: ids it
     * may still feed after this one (drafts past it are never verified).
     * With speculation the id may end a verifying pass and open the next
     * (k3_spec_feed): the logits are bit for bit those of one id per pass. */
    int (*step)(void *ctx, int slot, int32_t id, float *logits, int64_t limit, k3_err *err);
    /* Called when a reply ends (not after an error or a cancel), the state
     * holding the prompt and the reply as the next prompt will render it.
     * NULL: none. */
    void (*end)(void *ctx, int slot);
    /* The speculation counters since the model opened (passes, ids fed,
     * drafts proposed and accepted). NULL: none. */
    void (*spec_stats)(void *ctx, k3_spec_stats *out);
    /* The batching counters since the model opened. NULL: none. */
    void (*batch_stats)(void *ctx, k3_serve_batch_stats *out);
    /* How many leading ids of ids[0..n) slot's own state holds; asked only
     * of a free slot, so that a request goes to the free slot that already
     * holds most of its prompt (a retried request finds the slot its cut
     * prefill left). NULL: every slot is as good. */
    size_t (*holds)(void *ctx, int slot, const int32_t *ids, size_t n);
    /* A request starts (busy) or has ended (!busy) on slot: between the two
     * it makes the calls above. With several slots one pass decodes the next
     * id of every busy slot, so the model side waits for each busy slot's
     * next call (NULL: none). */
    void (*busy)(void *ctx, int slot, bool busy);
} k3_serve_model;

/* ---- the model on the engine (backend.c) ----
 * One session and state per slot, all on one state cache shared by every
 * request. With several slots the decode steps of the busy slots go through
 * one forward pass (k3_session_feed_batch_rows: each row the bits it has
 * alone; speculating, each slot's verifying pass of its id and drafts),
 * and a prefill is fed one engine chunk at a time with the others' decode
 * passes between its chunks. Under mpirun every rank opens the same slots;
 * rank 0 serves and announces each model call (a batched pass included) to
 * the other ranks, which make the same calls on their own
 * (k3_serve_backend_follow). */
typedef struct k3_serve_backend k3_serve_backend;

/* Speculation (docs/speculation.md): up to spec_max drafts per pass, a
 * request's default spec_default, drafted by n-gram lookup over the whole
 * rendered conversation or, with draft_dir, by that model (the same
 * tokenizer, else K3_EXIT_USAGE; not under several ranks), its drafts
 * stopped below p_min (draft.h). */
typedef struct {
    int spec_default, spec_max;
    const char *draft_dir;
    double p_min;
} k3_serve_spec_opts;

/* Opens eo's model (with its tokenizer, max_pos ctx), slots states of ctx
 * positions and a state cache of cache_bytes, and fills m with the calls on
 * them; so: speculation (NULL: none). slots 0: as many as the memory budget
 * holds, up to K3_SERVE_AUTO_SLOTS (under several ranks the fewest any
 * rank holds). A slot count that
 * cannot fit: K3_EXIT_BUDGET. Under several ranks a rank that cannot fit
 * stops every rank here. */
#define K3_SERVE_AUTO_SLOTS 8
int k3_serve_backend_open(const k3_engine_opts *eo, int64_t ctx, uint64_t cache_bytes, int slots,
                          const k3_serve_spec_opts *so,
                          k3_serve_backend **out, k3_serve_model *m, k3_err *err);
int k3_serve_backend_rank(const k3_serve_backend *b);
/* A rank after the first: makes rank 0's calls until rank 0 quits. */
int k3_serve_backend_follow(k3_serve_backend *b);
/* Rank 0 of several: lets the followers go (code: rank 0's exit code). */
void k3_serve_backend_quit(k3_serve_backend *b, int code);
void k3_serve_backend_free(k3_serve_backend *b);

typedef struct {
    const char *host;          /* numeric address or "localhost"; NULL = 127.0.0.1 */
    int port;                  /* 0 = any free port (see k3_serve_port) */
    const char *model_id;      /* the name /v1/models lists and requests may give */
    size_t max_body;           /* request body bytes; larger: 413 */
    int queue;                 /* jobs that may wait while every slot computes; more: 429 */
    int64_t max_tokens;        /* the largest max_tokens a request may ask for */
    double keepalive_s;        /* a stream silent this long gets an SSE comment line; 0: never */
    const char *api_key;       /* NULL: none; else the API routes need "Authorization: Bearer KEY" (401) */
    const char *const *cors;   /* origins a browser page may call from ("*": any); besides the server's own */
    size_t ncors;
    double request_timeout_s;  /* a request's headers and body must arrive within this; 0: 30 */
    unsigned client_connections; /* open connections one client address may hold; 0: 32 */
    bool verbose;              /* log every request */
} k3_serve_opts;

typedef struct k3_serve k3_serve;

/* Binds, starts the slots' workers and the HTTP server. The model must outlive the server. */
int k3_serve_start(const k3_serve_opts *o, const k3_serve_model *m, k3_serve **out, k3_err *err);
int k3_serve_port(const k3_serve *s);
/* Cancels what runs and waits, refuses what waits (503), stops, frees. */
void k3_serve_stop(k3_serve *s);

/* ---- requests (exposed for the unit tests) ---- */

enum { K3_REQ_COMPLETION = 1, K3_REQ_CHAT = 2 };
#define K3_SERVE_MAX_STOP 4
#define K3_SERVE_MAX_N 8          /* choices one request may ask for (n) */
#define K3_SERVE_MAX_LOGPROBS 20  /* top_logprobs (chat) / logprobs (completions) */
#define K3_SERVE_MAX_BIAS 1024    /* logit_bias entries */

/* An OpenAI error: HTTP status, type, the offending parameter (or ""), code, message. */
typedef struct {
    int status;
    const char *type;          /* invalid_request_error, rate_limit_error, server_error, ... */
    const char *code;          /* NULL: JSON null */
    char param[128];           /* "" : JSON null */
    char message[1280];
} k3_serve_error;
/* Fills e (its type follows from the status: 429 rate_limit_error, 5xx
 * server_error, else invalid_request_error; param NULL: none); returns status. */
int k3_serve_error_set(k3_serve_error *e, int status, const char *code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

typedef struct {
    int kind;
    char *model;               /* as given, or NULL */
    bool stream, include_usage;
    float temperature, top_p, min_p;
    int top_k;
    uint64_t seed;
    int64_t max_tokens;        /* -1: not given */
    char *stop[K3_SERVE_MAX_STOP];
    size_t nstop;
    int n;                     /* choices, computed one after another (choice i samples with seed + i) */
    int speculate;             /* drafts per pass (k3's "speculate", 0..K3_SPEC_MAX); -1: the server's default */
    bool logprobs;             /* return each sampled token's log-probability */
    int top_logprobs;          /* and this many most likely alternatives (0..K3_SERVE_MAX_LOGPROBS) */
    /* logit processing before sampling (docs/serve.md); all off: the logits
     * reach the sampler untouched */
    float presence_penalty, frequency_penalty; /* 0: off; over the generated ids */
    float repetition_penalty;  /* 1: off; over the prompt and the generated ids */
    int32_t *bias_ids;         /* logit_bias, sorted by id (ids checked against the vocabulary by the server) */
    float *bias;
    size_t nbias;
    /* completions */
    char *prompt;              /* text prompt, or NULL when ids were given */
    size_t prompt_len;
    int32_t *prompt_ids;       /* token-id prompt (the legacy endpoint's array form) */
    size_t nprompt_ids;
    /* chat */
    bool thinking;             /* default true; reasoning_effort "none" turns it off */
    json_t *chat;              /* the template's request: messages (role developer
                                  renamed system), tools, tool_choice,
                                  response_format, thinking, thinking_effort */
    k3_jschema *schema;        /* response_format json_object/json_schema: the reply
                                  is held to it (constrain.h); NULL: free text */
    k3_callspec *call;         /* the reply's calls as enforced (constrain.h):
                                  tool_choice "required" or a named function (it
                                  takes the place of schema), or "auto" with strict
                                  tools or parallel_tool_calls false; NULL: none */
} k3_serve_req;

/* Parses and validates a request body for kind. Returns 0, or the HTTP status
 * with e filled (every wrong field named in e->param). */
int k3_serve_parse(const char *body, size_t len, int kind, k3_serve_req *r, k3_serve_error *e);
void k3_serve_req_free(k3_serve_req *r);

/* Logit processing for one choice: repetition_penalty over the distinct ids
 * of the prompt and the reply so far (a positive logit divided by it, a
 * negative one multiplied), then frequency_penalty x count and
 * presence_penalty over the reply's ids, then logit_bias; each id's logit is
 * changed by the same operations in the same order whatever the others, so
 * the result is deterministic. With all of them off, apply returns its input
 * pointer: the sampler sees the model's logits bit for bit. */
typedef struct {
    const k3_serve_req *r;
    int vocab;
    bool on;
    float *work;            /* [vocab] */
    uint8_t *mark;          /* [vocab]: bit 0 in rep (prompt or reply), bit 1 in gen */
    int32_t *rep; size_t nrep, crep;  /* distinct ids for the repetition penalty */
    int32_t *gen; size_t ngen, cgen;  /* distinct ids of the reply */
    int32_t *count;         /* [vocab] times each id was generated */
} k3_logit_proc;
void k3_logit_proc_init(k3_logit_proc *p, const k3_serve_req *r, int vocab, const int32_t *prompt, size_t n);
const float *k3_logit_proc_apply(k3_logit_proc *p, const float *logits);
void k3_logit_proc_accept(k3_logit_proc *p, int32_t id);  /* a sampled id joins the reply */
void k3_logit_proc_free(k3_logit_proc *p);

/* Log-probabilities: log-softmax of logits[vocab] (f64 sums in index order)
 * at id, and the k most likely ids (k <= K3_SERVE_MAX_LOGPROBS; the larger
 * logit first, the lower id among equals) into top[k]. */
typedef struct {
    int32_t id;
    float logprob;
} k3_logprob;
float k3_logprobs(const float *logits, int vocab, int32_t id, int k, k3_logprob *top);

/* Stop strings over a stream of text: text is held back while it could still
 * become a stop string, the text before a stop string is released and the rest
 * is dropped. */
typedef struct {
    char *const *stop;
    size_t nstop;
    char *held;
    size_t nheld, cap;
    bool hit;                  /* a stop string was found: everything after is dropped */
} k3_stopper;
void k3_stopper_init(k3_stopper *s, char *const *stop, size_t nstop);
/* Appends text; *out, *nout: the text that may be released now (valid until the next call). */
void k3_stopper_feed(k3_stopper *s, const char *text, size_t n, const char **out, size_t *nout);
/* At the end: what is still held (no stop string can complete any more). */
void k3_stopper_flush(k3_stopper *s, const char **out, size_t *nout);
void k3_stopper_free(k3_stopper *s);

#endif
