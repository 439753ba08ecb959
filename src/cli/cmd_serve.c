/* cmd_serve.c: `k3 serve MODEL_DIR`, an OpenAI-compatible HTTP server. The
 * model is opened here (the memory plan and flags of `k3 run`); the HTTP
 * side, the queue and the worker are src/serve/. */
#include "cli/commands.h"
#include "memory/runmem.h"
#include "model/model.h"
#include "serve/serve.h"
#include "tokenizer/tokenizer.h"
#include "web/dashboard.h"

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
    "  --state-cache-gb GB  memory for saved conversation states (default 1)\n"
    "  --verbose            log every request and every generation on stderr\n"
    "\n"
    "model:\n"
    "  --tok DIR            tokenizer directory (default MODEL_DIR)\n"
    "  --threads N          OpenMP threads (the output does not depend on N)\n"
    "  --layers N           run only the first N layers\n"
    "  --max-memory SIZE    memory budget, e.g. 8G (default: MemAvailable); refused\n"
    "                       up front (exit 3) if weights + state at --ctx do not fit\n"
    "  --kda-chunk C        chunkwise KDA prefill (see k3 help run)\n"
    "  --peer-mla-eps       MLA latent norms use rms_norm_eps\n"
    "\n"
    K3_RUNMEM_HELP
    "\n"
    "Prints the address, then serves until Ctrl-C (SIGINT) or SIGTERM.\n"
    "exit codes: 0 stopped by a signal, 1 runtime/I-O (cannot listen), 2 usage or\n"
    "bad model directory, 3 cannot fit the memory budget, 4 checkpoint data error\n";

typedef struct {
    const char *model_dir, *tok_dir, *host, *model_name;
    int port, threads, layers, kda_chunk, queue;
    bool peer_eps, verbose;
    int64_t ctx, max_tokens;
    uint64_t max_memory, max_body;
    double state_cache_gb;
    k3_runmem_args mem;
} serve_args;

static bool parse_size(const char *s, uint64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || v < 0 || !isfinite(v)) return false;
    double mul = 1;
    if (*end) {
        switch (*end) {
        case 'k': case 'K': mul = 1024.0; break;
        case 'm': case 'M': mul = 1024.0 * 1024; break;
        case 'g': case 'G': mul = 1024.0 * 1024 * 1024; break;
        default: return false;
        }
        end++;
        if (*end == 'B' || *end == 'b') end++;
        if (*end) return false;
    }
    double b = v * mul;
    if (b >= 1.8e19) return false;
    *out = (uint64_t)b;
    return true;
}

static int parse_args(int argc, char **argv, serve_args *a) {
    memset(a, 0, sizeof *a);
    k3_runmem_args_init(&a->mem);
    a->host = "127.0.0.1";
    a->port = 8000;
    a->ctx = 4096;
    a->queue = 16;
    a->max_body = (uint64_t)8 << 20;
    a->state_cache_gb = 1;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE() \
    do { if (!v) return k3_usage_error("serve", "%s needs a value", o); i++; } while (0)
        int64_t n;
        if (o[0] != '-' || !o[1]) {
            if (a->model_dir) return k3_usage_error("serve", "unexpected argument '%s'", o);
            a->model_dir = o;
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
            if (!parse_size(v, &a->max_body) || a->max_body < 1024 || a->max_body > ((uint64_t)1 << 32))
                return k3_usage_error("serve", "--max-body: '%s' is not a size between 1K and 4G", v);
        } else if (!strcmp(o, "--state-cache-gb")) {
            NEED_VALUE();
            char *end;
            errno = 0;
            double d = strtod(v, &end);
            if (errno || *end || !*v || !(d >= 0 && d < 1e6))
                return k3_usage_error("serve", "--state-cache-gb: '%s' is not a size in GB >= 0", v);
            a->state_cache_gb = d;
        } else if (!strcmp(o, "--verbose")) {
            a->verbose = true;
        } else if (!strcmp(o, "--tok")) {
            NEED_VALUE();
            a->tok_dir = v;
        } else if (!strcmp(o, "--threads")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 1, 4096, &n)) return k3_usage_error("serve", "--threads: '%s' is not in 1..4096", v);
            a->threads = (int)n;
        } else if (!strcmp(o, "--layers")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 1, K3_MAX_LAYERS, &n)) return k3_usage_error("serve", "--layers: '%s' is not a layer count >= 1", v);
            a->layers = (int)n;
        } else if (!strcmp(o, "--kda-chunk")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 1, 4096, &n)) return k3_usage_error("serve", "--kda-chunk: '%s' is not in 1..4096", v);
            a->kda_chunk = (int)n;
        } else if (!strcmp(o, "--peer-mla-eps")) {
            a->peer_eps = true;
        } else if (!strcmp(o, "--max-memory")) {
            NEED_VALUE();
            if (!parse_size(v, &a->max_memory) || !a->max_memory)
                return k3_usage_error("serve", "--max-memory: '%s' is not a size like 512M or 8G", v);
        } else {
            bool used;
            k3_err e = {0};
            if (k3_runmem_parse(&a->mem, argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used) return k3_usage_error("serve", "unknown option '%s'", o);
        }
#undef NEED_VALUE
    }
    if (a->mem.list_presets) return K3_OK;
    if (!a->model_dir) return k3_usage_error("serve", "no MODEL_DIR given");
    if (a->max_tokens > a->ctx) return k3_usage_error("serve", "--max-tokens %lld is over --ctx %lld",
                                                      (long long)a->max_tokens, (long long)a->ctx);
    return K3_OK;
}

/* ---- the model backend: one decode state, reused when a prompt extends it ---- */

typedef struct {
    k3_model *m;
    k3_runmem *rm;
    k3_state *st;
    k3_tokenizer *tok;
    int chunk;
    int32_t *hist;     /* the ids the state holds */
    size_t nhist;
} backend;

static int be_prefill(void *ctx, const int32_t *ids, size_t n, float *logits, size_t *reused, const atomic_int *cancel,
                      k3_err *err) {
    backend *b = ctx;
    size_t start = 0;
    if (b->nhist > 0 && b->nhist < n && !memcmp(b->hist, ids, b->nhist * sizeof *ids)) start = b->nhist;
    else k3_state_reset(b->st), b->nhist = 0;
    for (size_t i = start; i < n; i += (size_t)b->chunk) {
        if (atomic_load(cancel)) return k3_fail(err, K3_EXIT_RUNTIME, "cancelled");
        size_t k = n - i < (size_t)b->chunk ? n - i : (size_t)b->chunk;
        int rc = k3_forward(b->m, b->st, ids + i, (int)k, i + k == n ? logits : NULL, false, err);
        if (rc) {
            k3_state_reset(b->st);
            b->nhist = 0;
            return rc;
        }
        memcpy(b->hist + i, ids + i, k * sizeof *ids);
        b->nhist = i + k;
        k3_runmem_step(b->rm, true, (int)k, NULL);
    }
    *reused = start;
    return K3_OK;
}

static int be_step(void *ctx, int32_t id, float *logits, k3_err *err) {
    backend *b = ctx;
    int rc = k3_forward(b->m, b->st, &id, 1, logits, false, err);
    if (rc) {
        k3_state_reset(b->st);
        b->nhist = 0;
        return rc;
    }
    b->hist[b->nhist++] = id;
    k3_runmem_step(b->rm, false, 1, NULL);
    return K3_OK;
}

static bool is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int open_backend(const serve_args *a, backend *b, k3_serve_model *sm, k3_err *err) {
    memset(b, 0, sizeof *b);
    int rc;
    if ((rc = k3_runmem_begin(&a->mem, a->model_dir, a->layers, a->ctx, a->max_memory, &b->rm, err))) return rc;
    k3_model_opts mo = {.layers = a->layers, .peer_mla_eps = a->peer_eps, .kda_chunk = a->kda_chunk,
                        .top_only = true, .prefill_chunk = k3_runmem_chunk(b->rm)};
    if ((rc = k3_model_open(a->model_dir, &mo, &b->m, err))) return rc;
    if ((rc = k3_runmem_attach(b->rm, b->m, err))) return rc;
    const char *tdir = a->tok_dir ? a->tok_dir : a->model_dir;
    char path[4096];
    snprintf(path, sizeof path, "%s/tiktoken.model", tdir);
    if (!a->tok_dir && !is_file(path))
        return k3_fail(err, K3_EXIT_USAGE, "%s: no tokenizer (tiktoken.model): k3 serve needs one (--tok DIR)",
                       a->model_dir);
    if ((rc = tok_load(tdir, &b->tok, err))) return rc;
    const k3_config *c = k3_model_config(b->m);
    k3_state_plan plan = k3_state_size(b->m, a->ctx);
    uint64_t need = plan.total + k3_model_weight_bytes(b->m) + (uint64_t)c->vocab_size * 8;
    uint64_t budget = a->max_memory ? a->max_memory : k3_mem_available_bytes();
    if (budget && need > budget)
        return k3_fail(err, K3_EXIT_BUDGET, "%s: --ctx %lld needs %.3f GiB (state %.3f) but %s is %.3f GiB",
                       a->model_dir, (long long)a->ctx, need / 1073741824.0, plan.total / 1073741824.0,
                       a->max_memory ? "--max-memory" : "MemAvailable", budget / 1073741824.0);
    if ((rc = k3_state_new(b->m, (int)a->ctx, &b->st, err))) return rc;
    b->chunk = k3_runmem_chunk(b->rm);
    b->hist = xmalloc_array((size_t)a->ctx, sizeof *b->hist);
    memset(sm, 0, sizeof *sm);
    sm->ctx = b;
    sm->vocab = c->vocab_size;
    sm->eos = c->eos_token_id >= 0 ? c->eos_token_id : tok_eos_id(b->tok);
    sm->ctx_len = a->ctx;
    sm->tok = b->tok;
    sm->chat = NULL;
    sm->prefill = be_prefill;
    sm->step = be_step;
    return K3_OK;
}

static void close_backend(backend *b) {
    free(b->hist);
    k3_state_free(b->st);
    if (b->tok) tok_free(b->tok);
    k3_model_free(b->m);
    k3_runmem_free(b->rm);
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
    if (a.mem.list_presets) {
        k3_presets_print(stdout);
        return K3_OK;
    }
    /* The stop signals are blocked before any thread exists, so every thread
     * inherits the mask and they reach this thread's sigwait only. */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    signal(SIGPIPE, SIG_IGN);

    k3_err err = {0};
    backend b;
    k3_serve_model sm;
    if ((rc = open_backend(&a, &b, &sm, &err))) {
        close_backend(&b);
        return k3_report(&err);
    }
    char nbuf[4096];
    k3_serve_opts o = {.host = a.host, .port = a.port,
                       .model_id = a.model_name ? a.model_name : base_name(a.model_dir, nbuf, sizeof nbuf),
                       .max_body = (size_t)a.max_body, .queue = a.queue,
                       .max_tokens = a.max_tokens ? a.max_tokens : a.ctx, .threads = a.threads,
                       .verbose = a.verbose};
    k3_serve *s;
    if ((rc = k3_serve_start(&o, &sm, &s, &err))) {
        close_backend(&b);
        return k3_report(&err);
    }
    if (!k3_dashboard_is_loopback(a.host))
        fprintf(stderr, "k3 serve: warning: listening on %s, not loopback: anyone who can reach this machine can "
                "use the model (there is no authentication)\n", a.host);
    bool v6 = strchr(a.host, ':') != NULL;
    printf("k3 serve: model '%s' (%s), http://%s%s%s:%d/ (Ctrl-C stops)\n", o.model_id,
           sm.chat ? "chat and completions" : "completions only: the tokenizer has no XTML ids", v6 ? "[" : "", a.host,
           v6 ? "]" : "", k3_serve_port(s));
    fflush(stdout);
    int sig = 0;
    while (sigwait(&stop, &sig) != 0) {}
    k3_serve_stop(s);
    close_backend(&b);
    printf("k3 serve: stopped (%s)\n", strsignal(sig));
    return K3_OK;
}
