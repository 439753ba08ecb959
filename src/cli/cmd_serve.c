/* cmd_serve.c: `k3 serve MODEL_DIR`, an OpenAI-compatible HTTP server. The
 * model is opened here through the engine (the memory plan and flags of
 * `k3 run`) with one session on a shared state cache, so every request reuses
 * what an earlier one computed; the HTTP side, the queue and the worker are
 * src/serve/. */
#include "chat/chat.h"
#include "cli/commands.h"
#include "engine/engine.h"
#include "serve/serve.h"
#include "session/session.h"
#include "web/http.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *const cmd_serve_help =
    "usage: k3 serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [options]\n"
    "\n"
    "Serves one model over HTTP with OpenAI's API: GET /v1/models,\n"
    "POST /v1/chat/completions (XTML chat template; reasoning_content, tools,\n"
    "streaming), POST /v1/completions (a text prompt, as `k3 run --prompt`),\n"
    "GET /health, and a chat page at /. One worker computes; requests wait in a\n"
    "bounded queue. docs/serve.md has the API, the limits and the error codes.\n"
    "\n"
    "server:\n"
    "  --host ADDR          address to listen on (default 127.0.0.1). There is no\n"
    "                       authentication: any other address than loopback makes\n"
    "                       the model usable from the network (a warning is printed)\n"
    "  --port N             TCP port (default 8000; 0 picks a free one)\n"
    "  --model-name NAME    the model id in /v1/models and requests (default: the\n"
    "                       last component of MODEL_DIR)\n"
    "  --ctx N              positions one conversation may hold, prompt plus reply\n"
    "                       (default 4096); counted in the memory plan\n"
    "  --max-tokens N       the largest max_tokens a request may ask (default: --ctx);\n"
    "                       also the default when a request gives none\n"
    "  --queue N            requests that may wait while one computes (default 16);\n"
    "                       more get 429\n"
    "  --max-body BYTES     largest request body (default 8M); larger get 413\n"
    "  --sse-keepalive S    a stream without an event for S seconds gets an SSE\n"
    "                       comment line, so read timeouts do not close it during\n"
    "                       a long prefill or wait (default 5; 0: never)\n"
    "  --state-cache-gb GB  memory for saved conversation states, shared by all\n"
    "                       requests (default 2; 0 keeps none: then only a request\n"
    "                       that extends the previous one reuses its work)\n"
    "  --verbose            log every request and every generation on stderr\n"
    "\n"
    K3_ENGINE_HELP
    "\n"
    "Prints the address, then serves until Ctrl-C (SIGINT) or SIGTERM.\n"
    "exit codes: 0 stopped by a signal, 1 runtime/I-O (cannot listen), 2 usage or\n"
    "bad model directory, 3 cannot fit the memory budget, 4 checkpoint data error\n";

typedef struct {
    const char *host, *model_name;
    int port, queue;
    bool verbose;
    int64_t ctx, max_tokens;
    uint64_t max_body;
    uint64_t state_cache_bytes;  /* --state-cache-gb */
    double keepalive_s;
    k3_engine_opts eo;     /* model, threads and memory flags (engine/engine.h) */
} serve_args;

static int parse_args(int argc, char **argv, serve_args *a) {
    memset(a, 0, sizeof *a);
    k3_engine_opts_init(&a->eo);
    a->host = "127.0.0.1";
    a->port = 8000;
    a->ctx = 4096;
    a->queue = 16;
    a->max_body = (uint64_t)8 << 20;
    a->state_cache_bytes = K3_STATE_CACHE_BYTES_DEFAULT;
    a->keepalive_s = 5;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE() \
    do { if (!v) return k3_usage_error("serve", "%s needs a value", o); i++; } while (0)
        int64_t n;
        if (o[0] != '-' || !o[1]) {
            if (a->eo.model_dir) return k3_usage_error("serve", "unexpected argument '%s'", o);
            a->eo.model_dir = o;
        } else if (!strcmp(o, "--host")) {
            NEED_VALUE();
            if (!*v) return k3_usage_error("serve", "--host needs an address");
            a->host = v;
        } else if (!strcmp(o, "--port")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 0, 65535, &n)) return k3_usage_error("serve", "--port needs an integer in [0, 65535]");
            a->port = (int)n;
        } else if (!strcmp(o, "--model-name")) {
            NEED_VALUE();
            if (!*v || strlen(v) > 100 || strchr(v, '/'))
                return k3_usage_error("serve", "--model-name needs a name of 1-100 characters without '/'");
            a->model_name = v;
        } else if (!strcmp(o, "--ctx")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 2, INT_MAX / 2, &n)) return k3_usage_error("serve", "--ctx: '%s' is not in 2..%d", v, INT_MAX / 2);
            a->ctx = n;
        } else if (!strcmp(o, "--max-tokens")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 1, INT_MAX / 2, &n)) return k3_usage_error("serve", "--max-tokens: '%s' is not a count >= 1", v);
            a->max_tokens = n;
        } else if (!strcmp(o, "--queue")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 0, 100000, &n)) return k3_usage_error("serve", "--queue: '%s' is not in 0..100000", v);
            a->queue = (int)n;
        } else if (!strcmp(o, "--max-body")) {
            NEED_VALUE();
            if (!k3_parse_size(v, &a->max_body) || a->max_body < 1024 || a->max_body > ((uint64_t)1 << 32))
                return k3_usage_error("serve", "--max-body: '%s' is not a size between 1K and 4G", v);
        } else if (!strcmp(o, "--state-cache-gb")) {
            NEED_VALUE();
            k3_err e = {0};
            if (k3_state_cache_parse_gb("serve", v, &a->state_cache_bytes, &e)) return k3_report(&e);
        } else if (!strcmp(o, "--sse-keepalive")) {
            NEED_VALUE();
            double d;
            if (!k3_parse_f64(v, &d) || !(d == 0 || (d >= 0.05 && d <= 3600)))
                return k3_usage_error("serve", "--sse-keepalive: '%s' is not 0 or a number of seconds in [0.05, 3600]", v);
            a->keepalive_s = d;
        } else if (!strcmp(o, "--verbose")) {
            a->verbose = true;
        } else {
            bool used;
            k3_err e = {0};
            if (k3_engine_parse_flag(&a->eo, "serve", argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used) return k3_usage_error("serve", "unknown option '%s'", o);
        }
#undef NEED_VALUE
    }
    if (a->eo.mem.list_presets) return K3_OK;
    if (!a->eo.model_dir) return k3_usage_error("serve", "no MODEL_DIR given");
    if (a->max_tokens > a->ctx) return k3_usage_error("serve", "--max-tokens %lld is over --ctx %lld",
                                                      (long long)a->max_tokens, (long long)a->ctx);
    return K3_OK;
}

/* ---- the model backend: one session on the shared state cache ---- */

typedef struct {
    k3_engine *e;
    k3_state *st;
    k3_state_cache *cache;
    k3_session *sess;
    k3_chat *chat;
    int64_t ctx;
} backend;

static bool is_cancelled(const void *flag) { return atomic_load((const atomic_int *)flag) != 0; }

static int be_prefill(void *ctx, const int32_t *ids, size_t n, float *logits, size_t *reused, const atomic_int *cancel,
                      k3_err *err) {
    backend *b = ctx;
    k3_session_set_cancel(b->sess, is_cancelled, cancel); /* asked between the prefill's chunks */
    int rc = k3_session_prefill(b->sess, ids, n, logits, reused, err);
    k3_session_set_cancel(b->sess, NULL, NULL);
    return rc;
}

static int be_step(void *ctx, int32_t id, float *logits, k3_err *err) {
    backend *b = ctx;
    return k3_session_feed(b->sess, &id, 1, logits, err);
}

/* A reply ended: the state holds the prompt and every generated id but the
 * last. The next turn's prompt re-renders this reply, so keep the state where
 * the reply ends as a snapshot too (the prompt's end is kept by the prefill). */
static void be_end(void *ctx, int32_t last, bool stopped) {
    backend *b = ctx;
    k3_err err = {0};
    /* the stop id is part of the rendered history: feed it so the state ends where the turn does */
    if (stopped && (int64_t)k3_session_len(b->sess) < b->ctx && k3_session_feed(b->sess, &last, 1, NULL, &err))
        return;
    k3_session_snapshot(b->sess);
}

static int open_backend(const serve_args *a, backend *b, k3_serve_model *sm, k3_err *err) {
    memset(b, 0, sizeof *b);
    int rc;
    k3_engine_opts eo = a->eo;
    eo.need_tokenizer = true;
    eo.max_pos = a->ctx;
    if ((rc = k3_engine_open(&eo, &b->e, err))) return rc;
    uint64_t cache_bytes = a->state_cache_bytes;
    uint64_t logit_bytes = (uint64_t)b->e->vocab * sizeof(float);
    if ((rc = k3_engine_state_new(b->e, a->ctx, cache_bytes + logit_bytes, &b->st, err))) return rc;
    b->cache = k3_state_cache_new(b->e->cfg, cache_bytes, 0);
    b->sess = k3_session_open(b->e, b->st, b->cache);
    b->ctx = a->ctx;
    k3_err cerr = {0};
    if (k3_chat_new(b->e->tok, &b->chat, &cerr)) b->chat = NULL; /* no XTML ids: completions only */
    memset(sm, 0, sizeof *sm);
    sm->ctx = b;
    sm->vocab = b->e->vocab;
    sm->eos = b->e->eos_id;
    sm->ctx_len = a->ctx;
    sm->tok = b->e->tok;
    sm->chat = b->chat;
    sm->threads = b->e->threads;
    sm->prefill = be_prefill;
    sm->step = be_step;
    sm->end = be_end;
    return K3_OK;
}

static void close_backend(backend *b) {
    if (b->chat) k3_chat_free(b->chat);
    if (b->sess) k3_session_free(b->sess);
    if (b->cache) k3_state_cache_free(b->cache);
    if (b->st) k3_engine_state_free(b->e, b->st);
    k3_engine_free(b->e);
}

static const char *base_name(const char *dir, char *buf, size_t n) {
    snprintf(buf, n, "%s", dir);
    size_t len = strlen(buf);
    while (len > 1 && buf[len - 1] == '/') buf[--len] = 0;
    const char *b = strrchr(buf, '/') ? strrchr(buf, '/') + 1 : buf;
    return *b && strcmp(b, ".") && strcmp(b, "..") ? b : "k3";
}

int cmd_serve(int argc, char **argv) {
    serve_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc;
    if (a.eo.mem.list_presets) {
        k3_presets_print(stdout);
        return K3_OK;
    }
    /* before any thread exists (http.h) */
    sigset_t stop;
    k3_http_block_stop_signals(&stop);

    k3_err err = {0};
    backend b;
    k3_serve_model sm;
    if ((rc = open_backend(&a, &b, &sm, &err))) {
        close_backend(&b);
        return k3_report(&err);
    }
    char nbuf[4096];
    k3_serve_opts o = {.host = a.host, .port = a.port,
                       .model_id = a.model_name ? a.model_name : base_name(a.eo.model_dir, nbuf, sizeof nbuf),
                       .max_body = (size_t)a.max_body, .queue = a.queue,
                       .max_tokens = a.max_tokens ? a.max_tokens : a.ctx, .keepalive_s = a.keepalive_s,
                       .verbose = a.verbose};
    k3_serve *s;
    if ((rc = k3_serve_start(&o, &sm, &s, &err))) {
        close_backend(&b);
        return k3_report(&err);
    }
    if (!k3_http_is_loopback(a.host))
        fprintf(stderr, "k3 serve: warning: listening on %s, not loopback: anyone who can reach this machine can "
                "use the model (there is no authentication)\n", a.host);
    bool v6 = strchr(a.host, ':') != NULL;
    printf("k3 serve: model '%s' (%s), http://%s%s%s:%d/ (Ctrl-C stops)\n", o.model_id,
           sm.chat ? "chat and completions" : "completions only: the tokenizer has no XTML ids", v6 ? "[" : "", a.host,
           v6 ? "]" : "", k3_serve_port(s));
    fflush(stdout);
    int sig = k3_http_wait_stop(&stop);
    k3_serve_stop(s);
    close_backend(&b);
    printf("k3 serve: stopped (%s)\n", strsignal(sig));
    return K3_OK;
}
