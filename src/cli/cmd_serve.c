/* cmd_serve.c: `k3 serve MODEL_DIR`, an OpenAI-compatible HTTP server. This
 * file parses the flags, handles the stop signals and starts src/serve/: the
 * model backend (src/serve/backend.c: the engine, one session per slot on a state
 * cache shared by every request, the ranks that follow rank 0 under mpirun),
 * then the HTTP server, the queue and the slots' workers. */
#include "cli/commands.h"
#include "dist/dist.h"
#include "draft/draft.h"
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
    "GET /health, GET /metrics (Prometheus), POST /tokenize and /detokenize, and a\n"
    "chat page at /. Up to --parallel requests compute together (their next\n"
    "tokens in one pass; each gets the bytes it gets alone); more wait in a\n"
    "bounded queue.\n"
    "docs/serve.md has the API, the limits and the error codes.\n"
    "\n"
    "server:\n"
    "  --host ADDR          address to listen on (default 127.0.0.1). Any other\n"
    "                       address than loopback makes the model reachable from\n"
    "                       the network: without --api-key a warning is printed\n"
    "  --api-key KEY        requests need 'Authorization: Bearer KEY' (else 401);\n"
    "                       the page and /health stay open\n"
    "  --api-key-file F     the key is F's first line (keeps it out of `ps`)\n"
    "  --cors-origin ORIGIN a page of ORIGIN (e.g. http://localhost:3000; '*': any)\n"
    "                       may call the API from a browser; repeat for several.\n"
    "                       Default: only the server's own page; other origins 403\n"
    "  --port N             TCP port (default 8000; 0 picks a free one)\n"
    "  --model-name NAME    the model id in /v1/models and requests (default: the\n"
    "                       last component of MODEL_DIR)\n"
    "  --ctx N              positions one conversation may hold, prompt plus reply\n"
    "                       (default 4096); counted in the memory plan\n"
    "  --max-tokens N       the largest max_tokens a request may ask (default: --ctx);\n"
    "                       also the default when a request gives none\n"
    "  --parallel N         requests that compute at once, each on its own state\n"
    "                       (a slot): their decode steps go through one forward\n"
    "                       pass and a new prompt's prefill goes chunk by chunk\n"
    "                       (--chunk) between them. Default: as many states of\n"
    "                       --ctx positions as the memory budget holds, up to 8\n"
    "                       (under mpirun: the fewest any rank's budget holds)\n"
    "  --queue N            requests that may wait while every slot computes\n"
    "                       (default 16); more get 429; 0: none waits\n"
    "  --max-body BYTES     largest request body (default 8M); larger get 413\n"
    "  --request-timeout S  a request's line and headers must arrive within S\n"
    "                       seconds of the connection opening, its body within S\n"
    "                       of its headers; a slower client is disconnected\n"
    "                       (default 30)\n"
    "  --client-connections N  connections one client address may hold while\n"
    "                       their requests arrive (default 32; 256 in all), and\n"
    "                       as many being answered; more are closed at once\n"
    "  --sse-keepalive S    a stream without an event for S seconds gets an SSE\n"
    "                       comment line, so read timeouts do not close it during\n"
    "                       a long prefill or wait (default 5; 0: never)\n"
    "  --state-cache-gb GB  memory for saved conversation states, shared by all\n"
    "                       requests (default 2; 0 keeps none: then only a request\n"
    "                       that extends the previous one reuses its work)\n"
    "  --verbose            log every request and every generation on stderr\n"
    "\n"
    "speculative decoding (docs/speculation.md):\n"
    "  --speculate K        up to K drafted ids (1-16) verified per forward pass;\n"
    "                       drafts from the whole rendered conversation (n-gram\n"
    "                       lookup) unless --draft is given. K is a request's\n"
    "                       default and the most its \"speculate\" field may ask\n"
    "                       (0 turns it off for the request). Replies are exactly\n"
    "                       those without it; /metrics counts the drafts. With\n"
    "                       --parallel every slot drafts and verifies; the slots'\n"
    "                       verifying passes share one forward pass\n"
    K3_DRAFT_HELP
    "                       With --parallel the slots that draft in one step\n"
    "                       share its forward passes\n"
    K3_DRAFT_P_MIN_HELP
    "\n"
    K3_ENGINE_HELP
    "\n"
    "Under mpirun (docs/mpi.md) rank 0 serves and the other ranks make the same\n"
    "model calls on their share of the model (every slot's batched passes and\n"
    "speculation too, with the answers of one process); stop the job with SIGTERM\n"
    "to rank 0 or SIGUSR1 to mpirun (also stops rank 0: every rank then exits 0).\n"
    "\n"
    "Prints the address, then serves until Ctrl-C (SIGINT) or SIGTERM.\n"
    "exit codes: 0 stopped by a signal, 1 runtime/I-O (cannot listen), 2 usage or\n"
    "bad model directory, 3 cannot fit the memory budget, 4 checkpoint data error\n";

#define MAX_CORS 16

typedef struct {
    const char *host, *model_name;
    const char *api_key;
    char key_buf[4096];    /* --api-key-file's key */
    const char *cors[MAX_CORS];
    size_t ncors;
    int port, queue;
    int parallel;          /* --parallel (0: what the budget holds) */
    bool verbose;
    int64_t ctx, max_tokens;
    uint64_t max_body;
    uint64_t state_cache_bytes;  /* --state-cache-gb */
    double keepalive_s;
    double request_timeout_s;      /* --request-timeout (0: the server's default) */
    unsigned client_connections;   /* --client-connections (0: the server's default) */
    k3_spec_flags sf;              /* --speculate, --draft, --draft-p-min */
    k3_engine_opts eo;     /* model, threads and memory flags (engine/engine.h) */
} serve_args;

/* '*' or scheme://host[:port] as a browser sends it in Origin (no path, no slash at the end) */
static bool cors_origin_ok(const char *v) {
    if (!strcmp(v, "*")) return true;
    const char *sep = strstr(v, "://");
    if (!sep || sep == v || !sep[3] || strlen(v) > 200) return false;
    for (const char *p = sep + 3; *p; p++)
        if (*p == '/' || *p == ' ' || (unsigned char)*p < 0x21) return false;
    return true;
}

/* The key is the file's first line, without its line end; a regular file of
 * at most buf bytes, and not empty. */
static int read_key_file(const char *path, char *buf, size_t cap, k3_err *err) {
    struct stat st;
    if (stat(path, &st) != 0) return k3_fail(err, K3_EXIT_USAGE, "serve: --api-key-file %s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size >= cap)
        return k3_fail(err, K3_EXIT_USAGE, "serve: --api-key-file %s: not a regular file under %zu bytes", path, cap);
    FILE *f = fopen(path, "r");
    if (!f) return k3_fail(err, K3_EXIT_USAGE, "serve: --api-key-file %s: %s", path, strerror(errno));
    size_t n = fread(buf, 1, cap - 1, f);
    fclose(f);
    buf[n] = 0;
    buf[strcspn(buf, "\r\n")] = 0;
    if (!*buf) return k3_fail(err, K3_EXIT_USAGE, "serve: --api-key-file %s: the first line is empty", path);
    return K3_OK;
}

static int parse_args(int argc, char **argv, serve_args *a) {
    memset(a, 0, sizeof *a);
    k3_spec_flags_init(&a->sf);
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
        } else if (!strcmp(o, "--parallel")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 1, 256, &n)) return k3_usage_error("serve", "--parallel: '%s' is not in 1..256", v);
            a->parallel = (int)n;
        } else if (!strcmp(o, "--queue")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 0, 100000, &n)) return k3_usage_error("serve", "--queue: '%s' is not in 0..100000", v);
            a->queue = (int)n;
        } else if (!strcmp(o, "--request-timeout")) {
            NEED_VALUE();
            double d;
            if (!k3_parse_f64(v, &d) || !(d >= 0.5 && d <= 3600))
                return k3_usage_error("serve", "--request-timeout: '%s' is not a number of seconds in [0.5, 3600]", v);
            a->request_timeout_s = d;
        } else if (!strcmp(o, "--client-connections")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 1, 256, &n)) return k3_usage_error("serve", "--client-connections: '%s' is not in 1..256", v);
            a->client_connections = (unsigned)n;
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
        } else if (!strcmp(o, "--api-key")) {
            NEED_VALUE();
            if (!*v) return k3_usage_error("serve", "--api-key needs a key");
            a->api_key = v;
        } else if (!strcmp(o, "--api-key-file")) {
            NEED_VALUE();
            k3_err e = {0};
            if (read_key_file(v, a->key_buf, sizeof a->key_buf, &e)) return k3_report(&e);
            a->api_key = a->key_buf;
        } else if (!strcmp(o, "--cors-origin")) {
            NEED_VALUE();
            if (!cors_origin_ok(v))
                return k3_usage_error("serve", "--cors-origin: '%s' is not '*' or an origin such as http://localhost:3000 "
                                      "(scheme://host[:port], no path)", v);
            if (a->ncors == MAX_CORS) return k3_usage_error("serve", "--cors-origin: at most %d origins", MAX_CORS);
            a->cors[a->ncors++] = v;
        } else if (!strcmp(o, "--verbose")) {
            a->verbose = true;
        } else {
            bool used;
            k3_err e = {0};
            if (k3_spec_parse_flag(&a->sf, "serve", argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used && k3_engine_parse_flag(&a->eo, "serve", argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used) return k3_usage_error("serve", "unknown option '%s'", o);
        }
#undef NEED_VALUE
    }
    if (a->eo.mem.list_presets) return K3_OK;
    if (!a->eo.model_dir) return k3_usage_error("serve", "no MODEL_DIR given");
    {
        k3_err e = {0};
        if (k3_spec_flags_check(&a->sf, "serve", &e)) return k3_report(&e);
    }
    if (a->max_tokens > a->ctx) return k3_usage_error("serve", "--max-tokens %lld is over --ctx %lld",
                                                      (long long)a->max_tokens, (long long)a->ctx);
    return K3_OK;
}

static const char *base_name(const char *dir, char *buf, size_t n) {
    snprintf(buf, n, "%s", dir);
    size_t len = strlen(buf);
    while (len > 1 && buf[len - 1] == '/') buf[--len] = 0;
    const char *b = strrchr(buf, '/') ? strrchr(buf, '/') + 1 : buf;
    return *b && strcmp(b, ".") && strcmp(b, "..") ? b : "k3";
}

static pthread_t main_thread;
/* (pthread_kill is async-signal-safe) */
static void to_main_thread(int sig) { pthread_kill(main_thread, sig); }

int cmd_serve(int argc, char **argv) {
    serve_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc;
    if (a.eo.mem.list_presets) {
        k3_presets_print(stdout);
        return K3_OK;
    }
    /* before any thread exists (http.h); under mpirun the ranks after the
     * first keep them blocked for good: they end when rank 0 says so */
    sigset_t stop;
    k3_http_block_stop_signals(&stop);
    if (k3_dist_active()) {
        /* mpirun forwards SIGUSR1 to every rank as it is: rank 0 stops on it
         * too. Open MPI's own threads, started before this mask, do not block
         * these signals: one that lands there is handed on to the main
         * thread's wait (rank 0) or ignored (the other ranks end when rank 0
         * tells them, so a signal mpirun forwards to every rank must not end
         * them first) */
        sigaddset(&stop, SIGUSR1);
        pthread_sigmask(SIG_BLOCK, &stop, NULL);
        main_thread = pthread_self();
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = k3_dist_rank() == 0 ? to_main_thread : SIG_IGN;
        sigemptyset(&sa.sa_mask);
        const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1};
        for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++) sigaction(sigs[i], &sa, NULL);
    }

    k3_err err = {0};
    int ranks = k3_dist_size();
    if (ranks > 1 && !k3_dist_any_thread())
        return k3_report(&(k3_err){.code = K3_EXIT_USAGE,
                                   .msg = "serve: this Open MPI does not grant MPI_THREAD_SERIALIZED, which k3 serve's "
                                          "model worker needs under mpirun"});
    k3_serve_backend *b;
    k3_serve_model sm;
    k3_serve_spec_opts so = {.spec_default = a.sf.speculate, .spec_max = a.sf.speculate, .draft_dir = a.sf.draft,
                              .p_min = a.sf.p_min};
    if ((rc = k3_serve_backend_open(&a.eo, a.ctx, a.state_cache_bytes, a.parallel, &so, &b, &sm, &err)))
        return k3_report(&err);
    if (k3_serve_backend_rank(b) > 0) {
        rc = k3_serve_backend_follow(b);
        k3_serve_backend_free(b);
        return rc;
    }
    char nbuf[4096];
    k3_serve_opts o = {.host = a.host, .port = a.port,
                       .model_id = a.model_name ? a.model_name : base_name(a.eo.model_dir, nbuf, sizeof nbuf),
                       .max_body = (size_t)a.max_body, .queue = a.queue,
                       .max_tokens = a.max_tokens ? a.max_tokens : a.ctx, .keepalive_s = a.keepalive_s,
                       .api_key = a.api_key, .cors = a.cors, .ncors = a.ncors, .verbose = a.verbose,
                       .request_timeout_s = a.request_timeout_s, .client_connections = a.client_connections};
    k3_serve *s;
    if ((rc = k3_serve_start(&o, &sm, &s, &err))) {
        k3_serve_backend_quit(b, rc);
        k3_serve_backend_free(b);
        return k3_report(&err);
    }
    if (!k3_http_is_loopback(a.host) && !a.api_key)
        fprintf(stderr, "k3 serve: warning: listening on %s, not loopback, without --api-key: anyone who can reach "
                "this machine can use the model\n", a.host);
    bool v6 = strchr(a.host, ':') != NULL;
    char par[64] = "";
    if (ranks > 1)
        snprintf(par, sizeof par,
                 a.eo.layout_tp ? ", trunk and experts split over %d ranks" : ", expert parallel over %d ranks", ranks);
    printf("k3 serve: model '%s' (%s%s, %d slot%s), http://%s%s%s:%d/ (Ctrl-C stops)\n", o.model_id,
           sm.chat ? "chat and completions" : "completions only: the tokenizer has no XTML ids", par, sm.slots,
           sm.slots == 1 ? "" : "s", v6 ? "[" : "",
           a.host, v6 ? "]" : "", k3_serve_port(s));
    fflush(stdout);
    int sig = k3_http_wait_stop(&stop);
    /* the worker stops at its next token or prefill chunk (a cancel the
     * other ranks see too) and is joined: then the followers can be let go */
    k3_serve_stop(s);
    k3_serve_backend_quit(b, 0);
    k3_serve_backend_free(b);
    printf("k3 serve: stopped (%s)\n", strsignal(sig));
    return K3_OK;
}
