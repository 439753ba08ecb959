/* server.c: the HTTP side of `k3 serve`: routes, request bodies, the bounded
 * job queue, the slots' worker threads, and the hand-over of a job's bytes to its
 * connection (a whole body, or server-sent events as they are produced).
 *
 * The door (http.h) accepts each connection and checks its head before
 * libmicrohttpd reads it; libmicrohttpd then runs a thread per connection, so
 * a connection's thread may block while its job waits or computes; each wait
 * is timed (WAIT_MS) and on every wake-up also checks whether the client hung
 * up (poll POLLRDHUP on its socket), so a vanished client cancels its job
 * within WAIT_MS even while the job is still queued or prefilling. */
#include "serve/serve_impl.h"
#include "web/http.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#include "web/assets.h"

#define WAIT_MS 100
#define STOP_DRAIN_MS 2000
#define IDLE_S 60 /* MHD's timeout: a connection that sends nothing this long is closed */
#define JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(15))


/* ---- small helpers ---- */

char *k3_serve_error_json(const k3_serve_error *e) {
    json_t *err = json_object();
    json_object_set_new(err, "message", json_string(e->message[0] ? e->message : "error"));
    json_object_set_new(err, "type", json_string(e->type ? e->type : "server_error"));
    json_object_set_new(err, "param", e->param[0] ? json_string(e->param) : json_null());
    json_object_set_new(err, "code", e->code ? json_string(e->code) : json_null());
    json_t *o = json_object();
    json_object_set_new(o, "error", err);
    char *s = json_dumps(o, JSON_FLAGS);
    json_decref(o);
    if (!s) s = xstrdup("{\"error\":{\"message\":\"error\",\"type\":\"server_error\",\"param\":null,\"code\":null}}");
    return s;
}

int k3_serve_error_set(k3_serve_error *e, int status, const char *code, const char *param, const char *fmt, ...) {
    memset(e, 0, sizeof *e);
    e->status = status;
    e->type = status == 429 ? "rate_limit_error" : status >= 500 ? "server_error" : "invalid_request_error";
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return status;
}

static bool client_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

static void timed_wait(pthread_cond_t *cv, pthread_mutex_t *mu) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += WAIT_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(cv, mu, &ts);
}

static void cond_init_mono(pthread_cond_t *cv) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
}

/* ---- metrics ---- */

/* Slots whose job is still computing (a cancelled one until it stops). Under s->mu. */
static int slots_busy(const k3_serve *s) {
    int n = 0;
    for (int q = 0; q < s->m.slots; q++) n += s->slots[q].job && !s->slots[q].job->done;
    return n;
}

static double busy_seconds(const k3_serve *s) { return s->busy_s + (s->nbusy ? k3_now() - s->busy_from : 0); }


/* the histograms' upper bounds, seconds: a decode step of the smallest model
 * to a first token behind a long prefill and a queue */
static const double HIST_LE[K3_HIST_N] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                          0.25, 0.5, 1, 2.5, 5, 10, 30};

static void hist_add(k3_hist *h, double v) {
    for (int i = 0; i < K3_HIST_N; i++)
        if (v <= HIST_LE[i]) { h->le[i]++; break; }
    h->n++;
    h->sum += v;
}

void k3_serve_note_token(k3_serve *s, k3_job *j) {
    double now = k3_now();
    pthread_mutex_lock(&s->mu);
    if (j->last_token_at > 0) hist_add(&s->tpot, now - j->last_token_at);
    else hist_add(&s->ttft, now - j->queued_at);
    j->last_token_at = now;
    pthread_mutex_unlock(&s->mu);
}

static void prom_hist(k3_sbuf *b, const char *name, const char *help, const k3_hist *h) {
    k3_sb_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < K3_HIST_N; i++) {
        cum += h->le[i];
        k3_sb_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, HIST_LE[i], (unsigned long long)cum);
    }
    k3_sb_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.9g\n%s_count %llu\n", name, (unsigned long long)h->n, name,
                 h->sum, name, (unsigned long long)h->n);
}

static void prom_one(k3_sbuf *b, const char *name, const char *type, const char *help, double v) {
    k3_sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

/* GET /metrics: Prometheus' text format (version 0.0.4) */
static char *metrics_text(k3_serve *s, size_t *len) {
    k3_sbuf b = {0};
    /* the model's counters (its lock, never taken under s->mu): every
     * slot's, so concurrent requests count each pass once */
    k3_serve_batch_stats bs = {0};
    k3_spec_stats sp = {0};
    if (s->m.batch_stats) s->m.batch_stats(s->m.ctx, &bs);
    if (s->m.spec_stats) s->m.spec_stats(s->m.ctx, &sp);
    pthread_mutex_lock(&s->mu);
    k3_sb_printf(&b, "# HELP k3_http_responses_total HTTP responses by status (a stream counts when its 200 is sent)\n"
                     "# TYPE k3_http_responses_total counter\n");
    for (int st = 100; st < 600; st++)
        if (s->by_status[st]) k3_sb_printf(&b, "k3_http_responses_total{status=\"%d\"} %llu\n", st,
                                           (unsigned long long)s->by_status[st]);
    k3_sb_printf(&b, "# HELP k3_requests_total generations by outcome\n# TYPE k3_requests_total counter\n"
                     "k3_requests_total{outcome=\"completed\"} %llu\nk3_requests_total{outcome=\"cancelled\"} %llu\n"
                     "k3_requests_total{outcome=\"failed\"} %llu\nk3_requests_total{outcome=\"refused\"} %llu\n",
                 (unsigned long long)s->n_ok, (unsigned long long)s->n_cancelled, (unsigned long long)s->n_failed,
                 (unsigned long long)s->n_refused);
    prom_one(&b, "k3_prompt_tokens_total", "counter", "prompt tokens of the generations run", (double)s->n_prompt);
    prom_one(&b, "k3_prompt_tokens_cached_total", "counter", "prompt tokens a saved state held (not computed)",
             (double)s->n_cached);
    prom_one(&b, "k3_cache_hits_total", "counter", "generations that reused a saved state", (double)s->n_cache_hits);
    prom_one(&b, "k3_generation_tokens_total", "counter", "tokens generated", (double)s->n_tokens);
    prom_one(&b, "k3_speculative_passes_total", "counter",
             "forward passes of speculative generations (one per sampled id the drafts missed)", (double)sp.passes);
    prom_one(&b, "k3_drafts_proposed_total", "counter", "drafted ids fed to verifying passes", (double)sp.proposed);
    prom_one(&b, "k3_drafts_accepted_total", "counter", "drafted ids the sampler agreed with (forward passes saved)",
             (double)sp.accepted);
    prom_one(&b, "k3_batch_passes_total", "counter",
             "decode forward passes (each the next ids of every slot whose step it takes; prefills not counted)",
             (double)bs.passes);
    prom_one(&b, "k3_batch_sequences_total", "counter", "sequences (slots) fed by those passes, summed",
             (double)bs.seqs);
    prom_one(&b, "k3_batch_rows_total", "counter", "ids fed by those passes (sampled ids and drafts)", (double)bs.rows);
    k3_sb_printf(&b, "# HELP k3_batch_sequences_per_pass sequences a decode pass fed\n"
                     "# TYPE k3_batch_sequences_per_pass histogram\n");
    uint64_t cum = 0;
    for (int i = 0; i < K3_BATCH_HIST_N; i++) {
        cum += bs.by_seqs[i];
        k3_sb_printf(&b, "k3_batch_sequences_per_pass_bucket{le=\"%d\"} %llu\n", 1 << i, (unsigned long long)cum);
    }
    k3_sb_printf(&b, "k3_batch_sequences_per_pass_bucket{le=\"+Inf\"} %llu\nk3_batch_sequences_per_pass_sum %llu\n"
                     "k3_batch_sequences_per_pass_count %llu\n", (unsigned long long)bs.passes,
                 (unsigned long long)bs.seqs, (unsigned long long)bs.passes);
    prom_one(&b, "k3_draft_passes_total", "counter", "forward passes of the draft model (--draft)",
             (double)bs.draft_passes);
    prom_one(&b, "k3_draft_sequences_total", "counter",
             "slots' drafters fed by those passes, summed (more than the passes: drafting shared passes)",
             (double)bs.draft_seqs);
    prom_hist(&b, "k3_time_to_first_token_seconds", "from the queue to the first sampled token", &s->ttft);
    prom_hist(&b, "k3_time_per_output_token_seconds", "between two sampled tokens of a request", &s->tpot);
    prom_one(&b, "k3_queue_waiting", "gauge", "requests waiting for a slot", s->nwaiting);
    prom_one(&b, "k3_queue_capacity", "gauge", "places in the queue (k3 serve --queue)", s->o.queue);
    prom_one(&b, "k3_slots_busy", "gauge", "requests computing", slots_busy(s));
    prom_one(&b, "k3_slots_total", "gauge", "requests that can compute at once (k3 serve --parallel)", s->m.slots);
    prom_one(&b, "k3_busy_seconds_total", "counter", "seconds some slot computed", busy_seconds(s));
    pthread_mutex_unlock(&s->mu);
    *len = b.n;
    return b.p ? b.p : xstrdup("");
}

/* ---- jobs (all under s->mu) ---- */

static k3_job *job_new(void) {
    k3_job *j = xcalloc(1, sizeof *j);
    j->refs = 1;
    j->fd = -1;
    cond_init_mono(&j->cv);
    atomic_init(&j->cancel, 0);
    return j;
}

static void job_unref(k3_job *j) {
    if (--j->refs > 0) return;
    k3_serve_req_free(&j->req);
    free(j->ids);
    free(j->marks);
    k3_sb_free(&j->out);
    pthread_cond_destroy(&j->cv);
    free(j);
}

void k3_job_emit(k3_serve *s, k3_job *j, const char *p, size_t n) {
    pthread_mutex_lock(&s->mu);
    k3_sb_put(&j->out, p, n);
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&s->mu);
}

void k3_job_finish(k3_serve *s, k3_job *j, int status) {
    pthread_mutex_lock(&s->mu);
    j->status = status;
    j->done = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Removes a waiting job from the queue; false when it is not waiting. */
static bool dequeue(k3_serve *s, k3_job *j) {
    k3_job **pp = &s->head, *prev = NULL;
    while (*pp && *pp != j) prev = *pp, pp = &(*pp)->next;
    if (!*pp) return false;
    *pp = j->next;
    if (s->tail == j) s->tail = prev;
    j->next = NULL;
    s->nwaiting--;
    return true;
}

/* The client went away: a waiting job is dropped here, a running one is told
 * to stop (the worker then finishes it). Under s->mu. */
static void cancel_locked(k3_serve *s, k3_job *j) {
    if (j->done || atomic_load(&j->cancel)) return;
    atomic_store(&j->cancel, 1);
    if (dequeue(s, j)) {
        j->done = true;
        s->n_cancelled++;
        fprintf(stderr, "k3 serve: %s cancelled while queued: client disconnected\n", j->id);
        job_unref(j); /* the worker's reference */
    }
}

/* ---- the slots' workers ---- */

/* Hands waiting jobs to free slots, first come first served; each to the
 * free slot whose state holds most of its prompt (the lowest among equals),
 * so a conversation's next turn, or a retry of a cut prefill, finds its work
 * where it was left. Under s->mu. */
static void dispatch(k3_serve *s) {
    while (s->head) {
        k3_job *j = s->head;
        int best = -1;
        size_t held = 0;
        for (int q = 0; q < s->m.slots; q++) {
            if (s->slots[q].job) continue;
            size_t h = s->m.holds ? s->m.holds(s->m.ctx, q, j->ids, j->n) : 0;
            if (best < 0 || h > held) best = q, held = h;
        }
        if (best < 0) return;
        s->head = j->next;
        if (!s->head) s->tail = NULL;
        j->next = NULL;
        s->nwaiting--;
        j->slot = best;
        s->slots[best].job = j;
        if (s->nbusy++ == 0) s->busy_from = k3_now();
        pthread_cond_signal(&s->slots[best].cv);
    }
}

static void *worker_main(void *arg) {
    k3_serve_slot *w = arg;
    k3_serve *s = w->s;
    if (s->m.threads > 0) omp_set_num_threads(s->m.threads);
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!w->job && !s->stopping) pthread_cond_wait(&w->cv, &s->mu);
        if (!w->job) break;
        k3_job *j = w->job;
        pthread_mutex_unlock(&s->mu);
        if (s->m.busy) s->m.busy(s->m.ctx, w->index, true);
        k3_gen_run(s, j);
        if (s->m.busy) s->m.busy(s->m.ctx, w->index, false);
        pthread_mutex_lock(&s->mu);
        if (--s->nbusy == 0) s->busy_s += k3_now() - s->busy_from;
        w->job = NULL;
        job_unref(j);
        dispatch(s);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- responses ---- */

typedef struct {
    int route;
    k3_sbuf body;
    bool too_big;
} req_ctx;

enum { R_NONE, R_ASSET, R_HEALTH, R_METRICS, R_MODELS, R_MODEL, R_CHAT, R_COMPLETIONS, R_TOKENIZE, R_DETOKENIZE };

static int route_of(k3_serve *s, const char *url, size_t *asset) {
    for (size_t i = 0; i < k3_serve_nassets; i++)
        if (!strcmp(url, k3_serve_assets[i].path)) {
            *asset = i;
            return R_ASSET;
        }
    if (!strcmp(url, "/health")) return R_HEALTH;
    if (!strcmp(url, "/metrics")) return R_METRICS;
    if (!strcmp(url, "/tokenize")) return R_TOKENIZE;
    if (!strcmp(url, "/detokenize")) return R_DETOKENIZE;
    if (!strcmp(url, "/v1/models")) return R_MODELS;
    if (!strncmp(url, "/v1/models/", 11) && !strcmp(url + 11, s->model_id)) return R_MODEL;
    if (!strcmp(url, "/v1/chat/completions")) return R_CHAT;
    if (!strcmp(url, "/v1/completions")) return R_COMPLETIONS;
    return R_NONE;
}

static bool is_post_route(int route) {
    return route == R_CHAT || route == R_COMPLETIONS || route == R_TOKENIZE || route == R_DETOKENIZE;
}

/* ---- origins (CORS) ---- */

/* A browser names the page that makes a request in Origin. The server's own
 * page is "http://" + the Host it was reached by; others must be in --cors-origin. */
static bool own_origin(const char *origin, const char *host) {
    return host && !strncasecmp(origin, "http://", 7) && !strcasecmp(origin + 7, host);
}

static bool origin_allowed(const k3_serve *s, const char *origin, const char *host) {
    if (!origin || own_origin(origin, host)) return true;
    for (size_t i = 0; i < s->o.ncors; i++)
        if (!strcmp(s->o.cors[i], "*") || !strcasecmp(s->o.cors[i], origin)) return true;
    return false;
}

/* An allowed page of another origin may read the response. */
static void add_cors(const k3_serve *s, struct MHD_Connection *c, struct MHD_Response *r) {
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    const char *host = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host");
    if (!origin || own_origin(origin, host) || !origin_allowed(s, origin, host)) return;
    MHD_add_response_header(r, "Access-Control-Allow-Origin", origin);
    MHD_add_response_header(r, "Vary", "Origin");
}

static void count_status(k3_serve *s, unsigned code) {
    pthread_mutex_lock(&s->mu);
    if (code < 600) s->by_status[code]++;
    pthread_mutex_unlock(&s->mu);
}

static enum MHD_Result respond(k3_serve *s, struct MHD_Connection *c, const char *method, const char *url,
                               unsigned code, const char *type, void *body, size_t len,
                               enum MHD_ResponseMemoryMode mode) {
    struct MHD_Response *resp = k3_http_buffer(type, body, len, mode);
    if (resp && code == MHD_HTTP_METHOD_NOT_ALLOWED) {
        size_t asset;
        bool post = is_post_route(route_of(s, url, &asset));
        MHD_add_response_header(resp, "Allow", post ? "POST, OPTIONS" : "GET, HEAD, OPTIONS");
    }
    if (resp && (code == 429 || code == 503)) MHD_add_response_header(resp, "Retry-After", "1");
    if (resp && code == 401) MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    if (resp) add_cors(s, c, resp);
    count_status(s, code);
    enum MHD_Result ret = k3_http_queue(c, code, resp);
    if (s->o.verbose) fprintf(stderr, "k3 serve: %u %s %s\n", code, method, url);
    return ret;
}

static enum MHD_Result respond_error(k3_serve *s, struct MHD_Connection *c, const char *method, const char *url,
                                     const k3_serve_error *e) {
    char *j = k3_serve_error_json(e);
    if (!s->o.verbose && (!e->type || !strcmp(e->type, "server_error"))) fprintf(stderr, "k3 serve: %d %s %s: %s\n", e->status, method, url, e->message);
    return respond(s, c, method, url, (unsigned)e->status, "application/json; charset=utf-8", j, strlen(j),
                   MHD_RESPMEM_MUST_FREE);
}

static enum MHD_Result respond_json(k3_serve *s, struct MHD_Connection *c, const char *method, const char *url,
                                    json_t *o) {
    char *j = json_dumps(o, JSON_FLAGS);
    json_decref(o);
    if (!j) {
        k3_serve_error e;
        k3_serve_error_set(&e, 500, "internal_error", NULL, "cannot serialise the response");
        return respond_error(s, c, method, url, &e);
    }
    return respond(s, c, method, url, 200, "application/json; charset=utf-8", j, strlen(j), MHD_RESPMEM_MUST_FREE);
}

static json_t *model_object(k3_serve *s) {
    return json_pack("{s:s, s:s, s:I, s:s, s:I}", "id", s->model_id, "object", "model", "created",
                     (json_int_t)s->started, "owned_by", "k3", "context_length", (json_int_t)s->m.ctx_len);
}

static json_t *health(k3_serve *s) {
    pthread_mutex_lock(&s->mu);
    json_t *o = json_pack("{s:s, s:s, s:b, s:{s:i, s:i}, s:b, s:{s:I, s:I, s:I, s:I}, s:I, s:f}", "status",
                          s->stopping ? "stopping" : "ok", "model", s->model_id, "chat", s->m.chat != NULL, "queue",
                          "waiting", s->nwaiting, "capacity", s->o.queue, "running", slots_busy(s) > 0, "requests",
                          "completed", (json_int_t)s->n_ok, "cancelled", (json_int_t)s->n_cancelled, "refused",
                          (json_int_t)s->n_refused, "failed", (json_int_t)s->n_failed, "generated_tokens",
                          (json_int_t)s->n_tokens, "busy_s", busy_seconds(s));
    json_object_set_new(o, "slots", json_pack("{s:i, s:i}", "busy", slots_busy(s), "total", s->m.slots));
    pthread_mutex_unlock(&s->mu);
    return o;
}

/* ---- streaming: the job's bytes as they come ---- */

typedef struct {
    k3_serve *s;
    k3_job *j;
} stream_ctx;

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream_ctx *x = cls;
    k3_serve *s = x->s;
    k3_job *j = x->j;
    double since = k3_now();
    pthread_mutex_lock(&s->mu);
    for (;;) {
        /* An SSE comment line after keepalive_s without an event (a long
         * prefill on a big model, a wait in the queue), so that clients and
         * proxies with read timeouts keep the stream open; clients ignore
         * comments. The worker appends whole events, so sent == out.n is an
         * event boundary. */
        if (j->sent == j->out.n && !j->done && s->o.keepalive_s > 0 && k3_now() - since >= s->o.keepalive_s &&
            max >= 14) {
            pthread_mutex_unlock(&s->mu);
            memcpy(buf, ": keep-alive\n\n", 14);
            return 14;
        }
        if (j->sent < j->out.n) {
            size_t k = j->out.n - j->sent;
            if (k > max) k = max;
            memcpy(buf, j->out.p + j->sent, k);
            j->sent += k;
            pthread_mutex_unlock(&s->mu);
            return (ssize_t)k;
        }
        if (j->done) {
            /* cut: the client went away; a stop (503) ended it well-formed */
            bool cut = atomic_load(&j->cancel) && j->status != 503;
            pthread_mutex_unlock(&s->mu);
            return cut ? MHD_CONTENT_READER_END_WITH_ERROR : MHD_CONTENT_READER_END_OF_STREAM;
        }
        timed_wait(&j->cv, &s->mu);
        if (!j->done && j->sent == j->out.n && client_gone(j->fd)) cancel_locked(s, j);
    }
}

static void stream_free(void *cls) {
    stream_ctx *x = cls;
    pthread_mutex_lock(&x->s->mu);
    if (!x->j->done) cancel_locked(x->s, x->j); /* the connection ended before the job */
    job_unref(x->j);
    pthread_mutex_unlock(&x->s->mu);
    free(x);
}

/* ---- the completion endpoints ---- */

static void err_from_k3(k3_serve_error *e, const k3_err *err, const char *fallback_param) {
    /* the template names the field first: "messages[2].role: want ..." */
    char param[128] = "";
    const char *colon = strstr(err->msg, ": ");
    if (colon && (size_t)(colon - err->msg) < sizeof param && !memchr(err->msg, ' ', (size_t)(colon - err->msg)))
        snprintf(param, sizeof param, "%.*s", (int)(colon - err->msg), err->msg);
    else if (fallback_param)
        snprintf(param, sizeof param, "%s", fallback_param);
    k3_serve_error_set(e, 400, "invalid_value", param, "%s", err->msg);
}

/* Encodes the job's prompt into its ids (each inside the vocabulary); 0 or
 * an HTTP status with e set. */
static int encode_prompt(k3_serve *s, k3_job *j, k3_serve_error *e) {
    const k3_serve_req *r = &j->req;
    k3_err err = {0};
    if (r->kind == K3_REQ_CHAT) {
        if (!s->m.chat) {
            k3_serve_error_set(e, 400, "model_not_chat", "messages",
                    "model '%s' has no chat template: its tokenizer lacks the XTML ids (<|open|>, <|close|>, "
                    "<|sep|>, <|end_of_msg|>); use /v1/completions with a text prompt",
                    s->model_id);
            return 400;
        }
        if (k3_chat_encode_marked(s->m.chat, r->chat, &j->ids, &j->n, &j->marks, &j->nmarks, &err)) {
            err_from_k3(e, &err, "messages");
            /* the template calls the request's reasoning_effort thinking_effort */
            if (!strcmp(e->param, "thinking_effort")) {
                snprintf(e->param, sizeof e->param, "reasoning_effort");
                char msg[sizeof e->message];
                snprintf(msg, sizeof msg, "reasoning_effort%s", e->message + strlen("thinking_effort"));
                snprintf(e->message, sizeof e->message, "%s", msg);
            }
            return 400;
        }
    } else if (r->prompt_ids) {
        j->n = r->nprompt_ids;
        j->ids = xmalloc_array(j->n, sizeof *j->ids);
        memcpy(j->ids, r->prompt_ids, j->n * sizeof *j->ids);
    } else {
        /* as `k3 run --prompt`: the prompt is the model's raw input, named specials included */
        if (r->prompt_len == 0) {
            k3_serve_error_set(e, 400, "invalid_value", "prompt", "prompt: empty");
            return 400;
        }
        if (tok_encode(s->m.tok, r->prompt, r->prompt_len, true, &j->ids, &j->n, &err)) {
            k3_serve_error_set(e, 400, "invalid_value", "prompt", "prompt: %s", err.msg);
            return 400;
        }
    }
    const char *param = r->kind == K3_REQ_CHAT ? "messages" : "prompt";
    if (j->n == 0) {
        k3_serve_error_set(e, 400, "invalid_value", param, "%s: encodes to no tokens", param);
        return 400;
    }
    for (size_t i = 0; i < j->n; i++)
        if (j->ids[i] < 0 || j->ids[i] >= s->m.vocab) {
            k3_serve_error_set(e, 400, "invalid_value", param, "%s: token id %d is outside the model's vocabulary [0, %d)", param,
                    j->ids[i], s->m.vocab);
            return 400;
        }
    return 0;
}

/* Builds the job's prompt ids and resolves max_tokens against the limits; 0
 * or an HTTP status with e set. */
static int prompt_of(k3_serve *s, k3_job *j, k3_serve_error *e) {
    int st = encode_prompt(s, j, e);
    if (st) return st;
    const k3_serve_req *r = &j->req;
    const char *param = r->kind == K3_REQ_CHAT ? "messages" : "prompt";
    for (size_t i = 0; i < r->nbias; i++)
        if (r->bias_ids[i] >= s->m.vocab) {
            char where[64];
            snprintf(where, sizeof where, "logit_bias.%d", r->bias_ids[i]);
            k3_serve_error_set(e, 400, "invalid_value", where, "%s: token id %d is outside the model's vocabulary [0, %d)",
                               where, r->bias_ids[i], s->m.vocab);
            return 400;
        }
    int64_t room = s->m.ctx_len - (int64_t)j->n;
    if (room < 1) {
        k3_serve_error_set(e, 400, "context_length_exceeded", param,
                "%s: the prompt is %zu tokens, which leaves no room in the context of %lld tokens (k3 serve --ctx)",
                param, j->n, (long long)s->m.ctx_len);
        return 400;
    }
    if (r->speculate > s->m.spec_max) {
        k3_serve_error_set(e, 400, "invalid_value", "speculate", "speculate: %d is over this server's bound of %d "
                "(k3 serve --speculate K)", r->speculate, s->m.spec_max);
        return 400;
    }
    if (r->max_tokens > s->o.max_tokens) {
        k3_serve_error_set(e, 400, "invalid_value", "max_tokens", "max_tokens: %lld is over this server's limit of %lld "
                "(k3 serve --max-tokens)", (long long)r->max_tokens, (long long)s->o.max_tokens);
        return 400;
    }
    if (r->max_tokens > room) {
        k3_serve_error_set(e, 400, "context_length_exceeded", "max_tokens",
                "the prompt (%zu tokens) plus max_tokens (%lld) is over the context of %lld tokens (k3 serve --ctx)",
                j->n, (long long)r->max_tokens, (long long)s->m.ctx_len);
        return 400;
    }
    j->max_tokens = r->max_tokens > 0 ? r->max_tokens : (s->o.max_tokens < room ? s->o.max_tokens : room);
    return 0;
}

static unsigned long long next_id(void) {
    static atomic_ullong counter;
    return atomic_fetch_add(&counter, 1) + 1;
}

static enum MHD_Result completion(k3_serve *s, struct MHD_Connection *c, const char *method, const char *url,
                                  req_ctx *rc) {
    k3_serve_error e;
    k3_job *j = job_new();
    int st = k3_serve_parse(rc->body.p ? rc->body.p : "", rc->body.n, rc->route == R_CHAT ? K3_REQ_CHAT
                                                                                           : K3_REQ_COMPLETION,
                            &j->req, &e);
    if (!st && j->req.model && strcmp(j->req.model, s->model_id)) {
        k3_serve_error_set(&e, 404, "model_not_found", "model", "model '%.200s' does not exist: this server serves '%s'",
                j->req.model, s->model_id);
        st = 404;
    }
    if (!st) st = prompt_of(s, j, &e);
    if (st) {
        pthread_mutex_lock(&s->mu);
        job_unref(j);
        pthread_mutex_unlock(&s->mu);
        return respond_error(s, c, method, url, &e);
    }
    snprintf(j->id, sizeof j->id, "%s-%llx%06llx", rc->route == R_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)s->started, next_id());
    j->created = (int64_t)time(NULL);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    j->fd = ci ? ci->connect_fd : -1;

    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        job_unref(j);
        pthread_mutex_unlock(&s->mu);
        k3_serve_error_set(&e, 503, "server_stopping", NULL, "the server is stopping");
        return respond_error(s, c, method, url, &e);
    }
    /* --queue places wait while every slot computes (a free slot takes the
     * job at once), so --queue 0 means none waits */
    if (s->nbusy >= s->m.slots && s->nwaiting >= s->o.queue) {
        s->n_refused++;
        int q = s->o.queue, nw = s->nwaiting, nb = s->nbusy;
        job_unref(j);
        pthread_mutex_unlock(&s->mu);
        k3_serve_error_set(&e, 429, "queue_full", NULL,
                "the server is busy: %d request%s computing and %d waiting (k3 serve --parallel %d --queue %d); "
                "retry later", nb, nb == 1 ? "" : "s", nw, s->m.slots, q);
        return respond_error(s, c, method, url, &e);
    }
    j->refs++; /* the worker's */
    j->queued_at = k3_now();
    if (s->tail) s->tail->next = j;
    else s->head = j;
    s->tail = j;
    s->nwaiting++;
    dispatch(s);

    if (j->req.stream) {
        pthread_mutex_unlock(&s->mu);
        stream_ctx *x = xmalloc(sizeof *x);
        x->s = s;
        x->j = j; /* takes the connection's reference */
        struct MHD_Response *resp =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, x, stream_free);
        if (!resp) {
            stream_free(x);
            return MHD_NO;
        }
        k3_http_headers(resp, "text/event-stream; charset=utf-8");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
        add_cors(s, c, resp);
        count_status(s, 200);
        enum MHD_Result ret = k3_http_queue(c, 200, resp);
        if (s->o.verbose) fprintf(stderr, "k3 serve: 200 %s %s (stream %s)\n", method, url, j->id);
        return ret;
    }
    while (!j->done) {
        timed_wait(&j->cv, &s->mu);
        if (!j->done && client_gone(j->fd)) cancel_locked(s, j);
    }
    int status = j->status;
    bool cancelled = atomic_load(&j->cancel) && status != 503; /* a stop's 503 is answered */
    char *body = NULL;
    size_t len = j->out.n;
    if (!cancelled) {
        body = xmalloc(len + 1);
        memcpy(body, j->out.p ? j->out.p : "", len);
    }
    job_unref(j);
    pthread_mutex_unlock(&s->mu);
    if (cancelled) return MHD_NO; /* nobody to answer */
    return respond(s, c, method, url, (unsigned)status, "application/json; charset=utf-8", body, len,
                   MHD_RESPMEM_MUST_FREE);
}

/* ---- /tokenize and /detokenize ---- */

/* POST /tokenize: {"prompt": ...} encoded as /v1/completions encodes it, or
 * {"messages": ..., "tools": ...} rendered as /v1/chat/completions renders it
 * (the same validation); {"tokens", "count", "max_model_len"}. */
static enum MHD_Result tokenize(k3_serve *s, struct MHD_Connection *c, const char *method, const char *url,
                                const req_ctx *rc) {
    k3_serve_error e;
    json_t *o = json_loadb(rc->body.p ? rc->body.p : "", rc->body.n, JSON_REJECT_DUPLICATES, NULL);
    int kind = json_object_get(o, "messages") ? K3_REQ_CHAT : K3_REQ_COMPLETION;
    json_decref(o);
    k3_job *j = job_new();
    int st = k3_serve_parse(rc->body.p ? rc->body.p : "", rc->body.n, kind, &j->req, &e);
    if (!st) st = encode_prompt(s, j, &e);
    json_t *ids = st ? NULL : json_array();
    for (size_t i = 0; ids && i < j->n; i++) json_array_append_new(ids, json_integer(j->ids[i]));
    size_t n = j->n;
    pthread_mutex_lock(&s->mu);
    job_unref(j);
    pthread_mutex_unlock(&s->mu);
    if (st) return respond_error(s, c, method, url, &e);
    return respond_json(s, c, method, url, json_pack("{s:o, s:I, s:I}", "tokens", ids, "count", (json_int_t)n,
                                                     "max_model_len", (json_int_t)s->m.ctx_len));
}

/* POST /detokenize: {"tokens": [ids]} -> {"prompt": text} (bytes that are no
 * valid UTF-8 as U+FFFD). */
static enum MHD_Result detokenize(k3_serve *s, struct MHD_Connection *c, const char *method, const char *url,
                                  const req_ctx *rc) {
    k3_serve_error e;
    json_error_t jerr;
    json_t *o = json_loadb(rc->body.p ? rc->body.p : "", rc->body.n, JSON_REJECT_DUPLICATES, &jerr);
    json_t *t = json_object_get(o, "tokens");
    const char *k;
    json_t *v;
    int st = 0;
    if (!json_is_object(o)) {
        st = k3_serve_error_set(&e, 400, "invalid_json", NULL, "request body: expected a JSON object%s%s",
                                o ? "" : ": ", o ? "" : jerr.text);
    } else {
        json_object_foreach(o, k, v)
            if (strcmp(k, "tokens") && strcmp(k, "model")) {
                st = k3_serve_error_set(&e, 400, "unknown_parameter", k, "%.100s: unrecognized field (known: tokens, model)", k);
                break;
            }
        if (!st && !json_is_array(t))
            st = k3_serve_error_set(&e, 400, t ? "invalid_type" : "missing_required_parameter", "tokens",
                                    "tokens: expected an array of token ids");
    }
    size_t n = st ? 0 : json_array_size(t);
    int32_t *ids = xmalloc_array(n ? n : 1, sizeof *ids);
    for (size_t i = 0; !st && i < n; i++) {
        json_t *x = json_array_get(t, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= s->m.vocab)
            st = k3_serve_error_set(&e, 400, "invalid_value", "tokens", "tokens[%zu]: expected a token id in [0, %d)", i,
                                    s->m.vocab);
        else ids[i] = (int32_t)json_integer_value(x);
    }
    json_decref(o);
    uint8_t *text = NULL;
    size_t len = 0;
    k3_err err = {0};
    if (!st && tok_decode(s->m.tok, ids, n, &text, &len, &err))
        st = k3_serve_error_set(&e, 400, "invalid_value", "tokens", "tokens: %s", err.msg);
    free(ids);
    if (st) return respond_error(s, c, method, url, &e);
    json_t *out = json_pack("{s:o}", "prompt", k3_serve_json_text(text ? (const char *)text : "", len));
    free(text);
    return respond_json(s, c, method, url, out);
}

/* ---- routing ---- */

/* An OPTIONS request: what the route accepts, and for an allowed page of
 * another origin (the browser's preflight) that it may send it. */
static enum MHD_Result preflight(k3_serve *s, struct MHD_Connection *c, const char *method, const char *url, bool post) {
    struct MHD_Response *r = k3_http_buffer("text/plain; charset=utf-8", (void *)"", 0, MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    const char *methods = post ? "POST, OPTIONS" : "GET, HEAD, OPTIONS";
    MHD_add_response_header(r, "Allow", methods);
    if (MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin")) {
        add_cors(s, c, r);
        MHD_add_response_header(r, "Access-Control-Allow-Methods", methods);
        /* the headers it asks for (the openai client adds its own x-stainless-*
         * ones); the origin is allowed, so what it sends is up to it */
        const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
        MHD_add_response_header(r, "Access-Control-Allow-Headers", h && strlen(h) < 2048 ? h : "Authorization, Content-Type");
        MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    }
    count_status(s, 204);
    enum MHD_Result ret = k3_http_queue(c, 204, r);
    if (s->o.verbose) fprintf(stderr, "k3 serve: 204 %s %s\n", method, url);
    return ret;
}

/* "Authorization: Bearer KEY" with this server's key, compared in a time
 * that does not depend on where they differ. */
static bool key_ok(const k3_serve *s, struct MHD_Connection *c) {
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7)) return false;
    h += 7;
    while (*h == ' ') h++;
    size_t n = strlen(h), m = strlen(s->o.api_key);
    unsigned diff = n != m;
    for (size_t i = 0; i < m; i++) diff |= (unsigned char)s->o.api_key[i] ^ (unsigned char)(i < n ? h[i] : 0);
    return diff == 0;
}

/* application/json, with or without parameters; none given is taken as JSON
 * too (a program's request), but a browser always names its body's type */
static bool json_content(const char *ct) {
    if (!ct) return true;
    while (*ct == ' ') ct++;
    if (strncasecmp(ct, "application/json", 16)) return false;
    return ct[16] == 0 || ct[16] == ';' || ct[16] == ' ';
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload_data, size_t *upload_data_size,
                              void **con_cls) {
    k3_serve *s = cls;
    req_ctx *rc = *con_cls;
    k3_serve_error e;
    (void)version; /* the door let only HTTP/1.0 and HTTP/1.1 in */
    if (!rc) {
        size_t asset = 0;
        int route = route_of(s, url, &asset);
        if (s->loopback && !k3_http_host_allowed(MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host"))) {
            k3_serve_error_set(&e, 403, "forbidden_host", NULL, "the Host header names no loopback address");
            return respond_error(s, c, method, url, &e);
        }
        if (route == R_NONE) {
            k3_serve_error_set(&e, 404, "not_found", NULL, "no route %.200s %.300s (see docs/serve.md)", method, url);
            return respond_error(s, c, method, url, &e);
        }
        /* a page of another origin reaches no route unless --cors-origin allows it:
         * a browser sends a simple (text/plain, form) POST without asking first */
        const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
        if (!origin_allowed(s, origin, MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host"))) {
            k3_serve_error_set(&e, 403, "forbidden_origin", NULL, "requests from the origin '%.200s' are not allowed "
                    "(k3 serve --cors-origin)", origin);
            return respond_error(s, c, method, url, &e);
        }
        bool post = is_post_route(route);
        if (!strcmp(method, "OPTIONS")) return preflight(s, c, method, url, post);
        bool ok = post ? !strcmp(method, "POST") : (!strcmp(method, "GET") || !strcmp(method, "HEAD"));
        if (!ok) {
            k3_serve_error_set(&e, 405, "method_not_allowed", NULL, "%.300s accepts %s, not %.100s", url, post ? "POST" : "GET",
                    method);
            return respond_error(s, c, method, url, &e);
        }
        /* the page and /health stay open: a health check carries no key */
        if (s->o.api_key && route != R_ASSET && route != R_HEALTH && !key_ok(s, c)) {
            bool given = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization") != NULL;
            k3_serve_error_set(&e, 401, "invalid_api_key", NULL, given ? "incorrect API key provided"
                    : "no API key: send the header 'Authorization: Bearer KEY' (k3 serve --api-key)");
            return respond_error(s, c, method, url, &e);
        }
        if (post && !json_content(MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Type"))) {
            k3_serve_error_set(&e, 415, "unsupported_media_type", NULL, "the body must be sent as Content-Type: "
                    "application/json, not %.100s", MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Type"));
            return respond_error(s, c, method, url, &e);
        }
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (post && cl) {
            char *end;
            unsigned long long v = strtoull(cl, &end, 10);
            if (*end == 0 && v > s->o.max_body) {
                k3_serve_error_set(&e, 413, "request_too_large", NULL, "the request body is %llu bytes, over the limit of %zu "
                        "(k3 serve --max-body)", v, s->o.max_body);
                return respond_error(s, c, method, url, &e);
            }
        }
        rc = xcalloc(1, sizeof *rc);
        rc->route = route;
        *con_cls = rc;
        atomic_fetch_add(&s->n_open, 1);
        return MHD_YES;
    }
    if (*upload_data_size) {
        if (rc->body.n + *upload_data_size > s->o.max_body) rc->too_big = true;
        if (!rc->too_big) k3_sb_put(&rc->body, upload_data, *upload_data_size);
        *upload_data_size = 0;
        return MHD_YES;
    }
    k3_http_guard_arrived(c); /* headers and body are in: computing is not slow input */
    if (rc->too_big) {
        k3_serve_error_set(&e, 413, "request_too_large", NULL, "the request body is over the limit of %zu bytes "
                "(k3 serve --max-body)", s->o.max_body);
        return respond_error(s, c, method, url, &e);
    }
    size_t asset = 0;
    switch (rc->route) {
    case R_ASSET:
        route_of(s, url, &asset);
        return respond(s, c, method, url, 200, k3_serve_assets[asset].type, (void *)k3_serve_assets[asset].data,
                       k3_serve_assets[asset].len, MHD_RESPMEM_PERSISTENT);
    case R_HEALTH: return respond_json(s, c, method, url, health(s));
    case R_METRICS: {
        size_t len;
        char *text = metrics_text(s, &len);
        return respond(s, c, method, url, 200, "text/plain; version=0.0.4; charset=utf-8", text, len,
                       MHD_RESPMEM_MUST_FREE);
    }
    case R_TOKENIZE: return tokenize(s, c, method, url, rc);
    case R_DETOKENIZE: return detokenize(s, c, method, url, rc);
    case R_MODELS: {
        json_t *o = json_pack("{s:s, s:[o]}", "object", "list", "data", model_object(s));
        return respond_json(s, c, method, url, o);
    }
    case R_MODEL: return respond_json(s, c, method, url, model_object(s));
    default: return completion(s, c, method, url, rc);
    }
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)c; (void)toe;
    k3_serve *s = cls;
    req_ctx *rc = *con_cls;
    if (!rc) return;
    atomic_fetch_sub(&s->n_open, 1);
    k3_sb_free(&rc->body);
    free(rc);
    *con_cls = NULL;
}

/* the door's refusals (a head libmicrohttpd would answer with HTML) */
static char *door_error(void *cls, unsigned status, const char *code, const char *msg) {
    k3_serve *s = cls;
    k3_serve_error e;
    k3_serve_error_set(&e, (int)status, code, NULL, "%s", msg);
    /* 501 and 505 too are the client's request, not a server fault */
    e.type = status == 503 ? "server_error" : "invalid_request_error";
    count_status(s, status);
    if (s->o.verbose) fprintf(stderr, "k3 serve: %u (the request's head): %s\n", status, msg);
    return k3_serve_error_json(&e);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    k3_serve *s = cls;
    if (!s->o.verbose) return;
    fputs("k3 serve: libmicrohttpd: ", stderr);
    vfprintf(stderr, fmt, ap);
}

/* ---- start / stop ---- */

int k3_serve_start(const k3_serve_opts *o, const k3_serve_model *m, k3_serve **out, k3_err *err) {
    *out = NULL;
    k3_serve *s = xcalloc(1, sizeof *s);
    s->o = *o;
    s->m = *m;
    s->listen_fd = -1;
    atomic_init(&s->n_open, 0);
    if (s->o.max_body == 0) s->o.max_body = (size_t)8 << 20;
    if (s->o.queue < 0) s->o.queue = 0;
    if (!(s->o.request_timeout_s > 0)) s->o.request_timeout_s = 30;
    if (s->o.client_connections == 0) s->o.client_connections = 32;
    if (s->o.max_tokens <= 0) s->o.max_tokens = m->ctx_len;
    snprintf(s->model_id, sizeof s->model_id, "%s", o->model_id && *o->model_id ? o->model_id : "k3");
    s->started = (int64_t)time(NULL);
    const char *host = o->host ? o->host : "127.0.0.1";
    s->loopback = k3_http_is_loopback(host);
    if (s->m.slots < 1) s->m.slots = 1;
    pthread_mutex_init(&s->mu, NULL);
    s->slots = xcalloc((size_t)s->m.slots, sizeof *s->slots);
    for (int q = 0; q < s->m.slots; q++) {
        s->slots[q].s = s;
        s->slots[q].index = q;
        pthread_cond_init(&s->slots[q].cv, NULL);
    }
    int rc = k3_http_listen(host, o->port, &s->listen_fd, &s->port, err);
    if (rc) {
        k3_serve_stop(s);
        return rc;
    }
    for (int q = 0; q < s->m.slots; q++) {
        if (pthread_create(&s->slots[q].thread, NULL, worker_main, &s->slots[q]) != 0) {
            k3_serve_stop(s);
            return k3_fail(err, K3_EXIT_RUNTIME, "cannot start the worker thread of slot %d", q);
        }
        s->slots[q].started = true;
    }
    if ((rc = k3_http_guard_new(s->o.request_timeout_s, &s->guard, err))) {
        k3_serve_stop(s);
        return rc;
    }
    s->mhd = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG |
                                  MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC, 0,
                              NULL, NULL, handle, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s,
                              MHD_OPTION_NOTIFY_COMPLETED, completed, s,
                              MHD_OPTION_NOTIFY_CONNECTION, k3_http_guard_notify, s->guard,
                              MHD_OPTION_CONNECTION_LIMIT, (unsigned)256,
                              MHD_OPTION_PER_IP_CONNECTION_LIMIT, s->o.client_connections,
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)IDLE_S,
                              MHD_OPTION_CONNECTION_MEMORY_LIMIT, K3_HTTP_MEMORY, MHD_OPTION_END);
    if (!s->mhd) {
        k3_serve_stop(s);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s:%d: the HTTP server did not start", host, o->port);
    }
    k3_http_door_opts door = {.listen_fd = s->listen_fd, .mhd = s->mhd, .per_client = s->o.client_connections,
                              .head_s = s->o.request_timeout_s, .max_body = s->o.max_body, .error = door_error,
                              .error_cls = s};
    if ((rc = k3_http_door_open(&door, &s->door, err))) {
        k3_serve_stop(s);
        return rc;
    }
    s->listen_fd = -1; /* the door's now */
    *out = s;
    return K3_OK;
}

int k3_serve_port(const k3_serve *s) { return s->port; }

void k3_serve_stop(k3_serve *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    for (int q = 0; q < s->m.slots; q++)
        if (s->slots[q].job) atomic_store(&s->slots[q].job->cancel, 1);
    while (s->head) {
        k3_job *j = s->head;
        dequeue(s, j);
        k3_serve_error e;
        k3_serve_error_set(&e, 503, "server_stopping", NULL, "the server is stopping");
        char *body = k3_serve_error_json(&e);
        /* a stream's 200 is sent as soon as it is queued: the error is an event */
        if (j->req.stream) k3_sb_put(&j->out, "data: ", 6);
        k3_sb_put(&j->out, body, strlen(body));
        if (j->req.stream) k3_sb_put(&j->out, "\n\ndata: [DONE]\n\n", 16);
        free(body);
        j->status = 503;
        j->done = true;
        pthread_cond_broadcast(&j->cv);
        job_unref(j);
    }
    for (int q = 0; q < s->m.slots; q++) pthread_cond_broadcast(&s->slots[q].cv);
    pthread_mutex_unlock(&s->mu);
    for (int q = 0; q < s->m.slots; q++)
        if (s->slots[q].started) pthread_join(s->slots[q].thread, NULL);
    /* MHD_stop_daemon closes every connection at once: give the connection
     * threads that were just handed a 503 (and the cut streams) up to
     * STOP_DRAIN_MS to send it, so a queued client reads "stopping", not a
     * reset */
    for (int t = 0; s->mhd && t < STOP_DRAIN_MS && atomic_load(&s->n_open) > 0; t += 10) usleep(10000);
    k3_http_door_close(s->door); /* closes the listening socket */
    if (s->listen_fd >= 0) close(s->listen_fd);
    if (s->mhd) MHD_stop_daemon(s->mhd);
    k3_http_guard_free(s->guard);
    k3_tokbytes_free(s->tb);
    pthread_mutex_destroy(&s->mu);
    for (int q = 0; q < s->m.slots; q++) pthread_cond_destroy(&s->slots[q].cv);
    free(s->slots);
    free(s);
}
