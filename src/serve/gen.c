/* gen.c: one job on its slot's worker thread: prefill (reusing what the backend
 * kept), sample token by token exactly as `k3 run` does (same sampler, same
 * seed, same stop at the end-of-sequence id), and write the response in
 * OpenAI's shape into the job: a JSON body at the end, or one server-sent
 * event per piece of text as it is decoded.
 *
 * Text leaves through two filters, in order: the tokenizer's incremental
 * decoder (only complete UTF-8 characters) and the stop-string matcher (text
 * that may still turn into a stop string is held back). So a streamed reply
 * concatenates to exactly the non-streamed one.
 *
 * A request for n choices computes them one after another, each from the same
 * prompt (the second prefill resumes from the state cache) with seed + i;
 * streamed, their chunks follow each other, each with its index. */
#include "serve/serve_impl.h"
#include "generate/generate.h"
#include "model/model.h"

#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(15))

typedef struct {
    k3_serve *s;
    k3_job *j;
    bool chat, stream;
    int index;             /* the choice being computed */
    k3_stopper stop;
    k3_sbuf text;          /* completion text / chat content, after the stop filter */
    k3_sbuf reasoning;     /* chat reasoning */
    json_t *tool_calls;    /* chat: array of completed calls */
    size_t ngen, reused;   /* this choice's generated ids; the first prefill's reused ids */
    size_t ngen_all;       /* every choice's */
    size_t ncalls;         /* tool calls of the whole response (their ids) */
    bool started;          /* chat stream: the role chunk went out */
    /* logprobs: chat {"content": [entries]}, completion {"tokens", "token_logprobs",
     * "top_logprobs", "text_offset"}; pending holds what the next chunk carries */
    json_t *lp_all, *lp_pending;
    size_t text_off;       /* completion: bytes of the tokens so far */
    json_t *choices;       /* not streamed: the finished choices */
    k3_logit_proc proc;    /* the choice's penalties and biases */
    k3_constraint *con;    /* response_format or an enforced tool_choice: the reply's shape (NULL: free text) */
    bool dead;             /* con allowed no id at the last step */
    k3_chat_parser *cp;    /* chat: ids to reasoning, content, calls */
    tok_stream ts;         /* completions: ids to text */
    uint8_t *tbuf;
    size_t tcap;
} gen_ctx;

/* serve_impl.h: valid UTF-8 for JSON, invalid bytes as U+FFFD. */
json_t *k3_serve_json_text(const char *p, size_t n) {
    json_t *t = json_stringn(p, n);
    if (t) return t;
    k3_sbuf b = {0};
    while (n) {
        size_t ok = tok_utf8_check((const uint8_t *)p, n);
        k3_sb_put(&b, p, ok);
        if (ok == n) break;
        k3_sb_put(&b, "\xEF\xBF\xBD", 3);
        p += ok + 1;
        n -= ok + 1;
    }
    t = json_stringn(b.p ? b.p : "", b.n);
    k3_sb_free(&b);
    return t ? t : json_string("");
}

static json_t *usage(const gen_ctx *g) {
    return json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", (json_int_t)g->j->n, "completion_tokens",
                     (json_int_t)g->ngen_all, "total_tokens", (json_int_t)(g->j->n + g->ngen_all),
                     "prompt_tokens_details", "cached_tokens", (json_int_t)g->reused);
}

/* ---- logprobs, in OpenAI's two shapes ---- */

static json_t *lp_new(const gen_ctx *g) {
    if (g->chat) return json_pack("{s:[], s:n}", "content", "refusal");
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

static bool lp_empty(const gen_ctx *g, const json_t *lp) {
    return json_array_size(json_object_get(lp, g->chat ? "content" : "tokens")) == 0;
}

static json_t *tok_bytes_json(const uint8_t *b, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer(b[i]));
    return a;
}

/* Appends the entry of sampled id (logits: what the sampler saw) to lp. */
static void lp_put(gen_ctx *g, json_t *lp, const float *logits, int32_t id) {
    const k3_serve_model *m = &g->s->m;
    k3_logprob top[K3_SERVE_MAX_LOGPROBS];
    int k = g->j->req.top_logprobs;
    float x = k3_logprobs(logits, m->vocab, id, k, top);
    /* an id structured output masked: OpenAI's stand-in for minus infinity
     * (JSON has no infinities) */
    for (int i = 0; i < k; i++)
        if (!isfinite(top[i].logprob)) top[i].logprob = -9999.0f;
    size_t nb = 0;
    const uint8_t *b = tok_token_bytes(m->tok, id, &nb);
    if (!b) nb = 0;
    if (g->chat) {
        json_t *alts = json_array();
        for (int i = 0; i < k; i++) {
            size_t na = 0;
            const uint8_t *a = tok_token_bytes(m->tok, top[i].id, &na);
            if (!a) na = 0;
            json_array_append_new(alts, json_pack("{s:o, s:f, s:o}", "token", k3_serve_json_text((const char *)a, na), "logprob",
                                                  (double)top[i].logprob, "bytes", tok_bytes_json(a, na)));
        }
        json_array_append_new(json_object_get(lp, "content"),
                              json_pack("{s:o, s:f, s:o, s:o}", "token", k3_serve_json_text((const char *)b, nb), "logprob",
                                        (double)x, "bytes", tok_bytes_json(b, nb), "top_logprobs", alts));
        return;
    }
    json_t *alts = json_object();
    for (int i = 0; i < k; i++) {
        size_t na = 0;
        const uint8_t *a = tok_token_bytes(m->tok, top[i].id, &na);
        json_t *t = k3_serve_json_text(a ? (const char *)a : "", a ? na : 0);
        json_object_set_new(alts, json_string_value(t), json_real((double)top[i].logprob));
        json_decref(t);
    }
    json_array_append_new(json_object_get(lp, "tokens"), k3_serve_json_text((const char *)b, nb));
    json_array_append_new(json_object_get(lp, "token_logprobs"), json_real((double)x));
    json_array_append_new(json_object_get(lp, "top_logprobs"), alts);
    json_array_append_new(json_object_get(lp, "text_offset"), json_integer((json_int_t)g->text_off));
    g->text_off += nb;
}

static const char *const LP_KEYS[] = {"content", "tokens", "token_logprobs", "top_logprobs", "text_offset"};

/* The entry of a sampled id into the reply's logprobs, and into the next
 * chunk's when streaming. */
static void lp_add(gen_ctx *g, const float *logits, int32_t id) {
    lp_put(g, g->lp_all, logits, id);
    if (!g->lp_pending) return;
    for (int q = g->chat ? 0 : 1; q < (g->chat ? 1 : 5); q++) {
        json_t *all = json_object_get(g->lp_all, LP_KEYS[q]);
        json_array_append(json_object_get(g->lp_pending, LP_KEYS[q]), json_array_get(all, json_array_size(all) - 1));
    }
}

static json_t *envelope(const gen_ctx *g, bool chunk) {
    const char *obj = g->chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion";
    return json_pack("{s:s, s:s, s:I, s:s}", "id", g->j->id, "object", obj, "created", (json_int_t)g->j->created,
                     "model", g->s->model_id);
}

static void emit_event(gen_ctx *g, json_t *o) {
    char *p = json_dumps(o, JSON_FLAGS);
    json_decref(o);
    if (!p) return;
    size_t n = strlen(p);
    char *ev = xmalloc(n + 9);
    memcpy(ev, "data: ", 6);
    memcpy(ev + 6, p, n);
    memcpy(ev + 6 + n, "\n\n", 3);
    k3_job_emit(g->s, g->j, ev, n + 8);
    free(ev);
    free(p);
}

/* A streamed chunk with one choice: delta (chat) or text (completion); it
 * carries the logprobs of the ids sampled since the last chunk. */
static void emit_choice(gen_ctx *g, json_t *delta_or_text, const char *finish) {
    json_t *o = envelope(g, true);
    json_t *ch = json_object();
    json_object_set_new(ch, "index", json_integer(g->index));
    json_object_set_new(ch, g->chat ? "delta" : "text", delta_or_text);
    if (g->lp_pending && !lp_empty(g, g->lp_pending)) {
        json_object_set_new(ch, "logprobs", g->lp_pending);
        g->lp_pending = lp_new(g);
    } else {
        json_object_set_new(ch, "logprobs", json_null());
    }
    json_object_set_new(ch, "finish_reason", finish ? json_string(finish) : json_null());
    json_object_set_new(o, "choices", json_pack("[o]", ch));
    emit_event(g, o);
}

static void content(gen_ctx *g, const char *p, size_t n);

static void chat_start(gen_ctx *g) {
    if (g->started || !g->stream) return;
    g->started = true;
    emit_choice(g, json_pack("{s:s, s:s}", "role", "assistant", "content", ""), NULL);
}

/* Released text of the content channel (completion text or chat content). */
static void put_text(gen_ctx *g, const char *p, size_t n) {
    if (!n) return;
    k3_sb_put(&g->text, p, n);
    if (!g->stream) return;
    if (g->chat) {
        chat_start(g);
        emit_choice(g, json_pack("{s:o}", "content", k3_serve_json_text(p, n)), NULL);
    } else {
        emit_choice(g, k3_serve_json_text(p, n), NULL);
    }
}

static void reasoning(gen_ctx *g, const char *p, size_t n) {
    if (!n) return;
    k3_sb_put(&g->reasoning, p, n);
    if (!g->stream) return;
    chat_start(g);
    emit_choice(g, json_pack("{s:o}", "reasoning_content", k3_serve_json_text(p, n)), NULL);
}

/* The parser numbers calls within a message (call_1, ...); a conversation
 * sends every earlier call back, so the id is made unique to this response:
 * call_<the response id's serial>_<k>. */
static void tool_call(gen_ctx *g, json_t *parsed) {
    if (!g->tool_calls) g->tool_calls = json_array();
    size_t index = json_array_size(g->tool_calls);
    json_t *call = json_deep_copy(parsed);
    const char *serial = strchr(g->j->id, '-');
    char id[96];
    snprintf(id, sizeof id, "call_%s_%zu", serial ? serial + 1 : g->j->id, ++g->ncalls);
    json_object_set_new(call, "id", json_string(id));
    json_array_append_new(g->tool_calls, call);
    if (!g->stream) return;
    chat_start(g);
    json_t *c = json_deep_copy(call);
    json_object_set_new(c, "index", json_integer((json_int_t)index));
    emit_choice(g, json_pack("{s:[o]}", "tool_calls", c), NULL);
}

/* A parser delta: reasoning as it is, content through the stop strings, calls. */
static void chat_delta(gen_ctx *g, const k3_chat_delta *d) {
    reasoning(g, d->reasoning, d->reasoning_len);
    if (!g->stop.hit) content(g, d->content, d->content_len);
    if (d->tool_call && !g->stop.hit) tool_call(g, d->tool_call);
}

static void content(gen_ctx *g, const char *p, size_t n) {
    const char *out;
    size_t nout;
    k3_stopper_feed(&g->stop, p, n, &out, &nout);
    put_text(g, out, nout);
}

static void flush_text(gen_ctx *g) {
    const char *out;
    size_t nout;
    k3_stopper_flush(&g->stop, &out, &nout);
    put_text(g, out, nout);
}

/* The end of one choice (finish: stop, length, tool_calls). */
static void finish_choice(gen_ctx *g, const char *finish) {
    if (g->stream) {
        if (g->chat) {
            chat_start(g);
            emit_choice(g, json_object(), finish);
        } else {
            emit_choice(g, json_string(""), finish);
        }
        return;
    }
    json_t *ch = json_object();
    json_object_set_new(ch, "index", json_integer(g->index));
    if (g->chat) {
        json_t *msg = json_object();
        json_object_set_new(msg, "role", json_string("assistant"));
        bool calls = g->tool_calls && json_array_size(g->tool_calls) > 0;
        json_object_set_new(msg, "content", g->text.n || !calls ? k3_serve_json_text(g->text.p ? g->text.p : "", g->text.n)
                                                                : json_null());
        if (g->reasoning.n) json_object_set_new(msg, "reasoning_content", k3_serve_json_text(g->reasoning.p, g->reasoning.n));
        if (calls) json_object_set(msg, "tool_calls", g->tool_calls);
        json_object_set_new(ch, "message", msg);
    } else {
        json_object_set_new(ch, "text", k3_serve_json_text(g->text.p ? g->text.p : "", g->text.n));
    }
    json_object_set(ch, "logprobs", g->lp_all ? g->lp_all : json_null());
    json_object_set_new(ch, "finish_reason", json_string(finish));
    json_array_append_new(g->choices, ch);
}

/* The end of a job whose every choice finished. */
static void finish_response(gen_ctx *g) {
    k3_serve *s = g->s;
    k3_job *j = g->j;
    if (g->stream) {
        if (j->req.include_usage) {
            json_t *o = envelope(g, true);
            json_object_set_new(o, "choices", json_array());
            json_object_set_new(o, "usage", usage(g));
            emit_event(g, o);
        }
        k3_job_emit(s, j, "data: [DONE]\n\n", 14);
        k3_job_finish(s, j, 200);
        return;
    }
    json_t *o = envelope(g, false);
    json_object_set(o, "choices", g->choices);
    json_object_set_new(o, "usage", usage(g));
    char *p = json_dumps(o, JSON_FLAGS);
    json_decref(o);
    if (!p) p = xstrdup("{}");
    k3_job_emit(s, j, p, strlen(p));
    free(p);
    k3_job_finish(s, j, 200);
}

/* The client's socket still open (not hung up). */
static bool client_gone_now(const k3_job *j) {
    if (j->fd < 0) return false;
    struct pollfd p = {.fd = j->fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

static void finish_error(gen_ctx *g, int status, const char *code, const char *msg) {
    k3_serve_error e;
    k3_serve_error_set(&e, status, code, NULL, "%s", msg);
    char *body = k3_serve_error_json(&e);
    if (status != 503) fprintf(stderr, "k3 serve: %s failed: %s\n", g->j->id, msg);
    if (g->stream) {
        /* the 200 and earlier events are gone: the error travels as an event */
        k3_sbuf b = {0};
        k3_sb_put(&b, "data: ", 6);
        k3_sb_put(&b, body, strlen(body));
        k3_sb_put(&b, "\n\ndata: [DONE]\n\n", 16);
        k3_job_emit(g->s, g->j, b.p, b.n);
        k3_sb_free(&b);
    } else {
        k3_job_emit(g->s, g->j, body, strlen(body));
    }
    free(body);
    k3_job_finish(g->s, g->j, status);
}

/* The loop's adjust: the request's penalties and biases on a copy, then
 * the structured output's mask. Without either the loop samples from its
 * own row, bit for bit. */
static const float *adjust(void *ctx, const float *logits) {
    gen_ctx *g = ctx;
    const float *row = k3_logit_proc_apply(&g->proc, logits);
    if (!g->con) return row;
    const float *masked = k3_constraint_apply(g->con, row);
    g->dead = !masked;
    return masked ? masked : row;
}

/* The loop's on_sample: the id counts for the penalties; its log-probability
 * (from the row it was sampled from) goes out with the chunk its text makes.
 * The stop id has no entry. */
static int on_sample(void *ctx, int32_t id, const float *row, k3_err *err) {
    gen_ctx *g = ctx;
    const k3_serve_model *m = &g->s->m;
    if (g->dead) return k3_fail(err, K3_EXIT_RUNTIME, "structured output: no token of the vocabulary continues the reply");
    int rc = g->con ? k3_constraint_accept(g->con, id, err) : K3_OK;
    if (rc) return rc;
    k3_logit_proc_accept(&g->proc, id);
    bool is_stop = g->chat ? k3_chat_is_stop(m->chat, id) : id == m->eos;
    if (g->j->req.logprobs && !is_stop) lp_add(g, row, id);
    return K3_OK;
}

/* The loop's on_token: a chat id through the parser, a completion id
 * through the text decoder; then the stop strings. A chat's end-of-message id
 * stops the reply and is kept (fed) unless a stop string ended it first. */
static int on_token(void *ctx, int32_t id, k3_gen_verdict *verdict, k3_err *err) {
    gen_ctx *g = ctx;
    k3_serve_note_token(g->s, g->j);
    if (g->chat) {
        k3_chat_delta d;
        int rc = k3_chat_parser_feed(g->cp, id, &d, err);
        if (rc) return rc;
        chat_delta(g, &d);
        if (d.stop) {
            *verdict = g->stop.hit ? K3_GEN_STOP : K3_GEN_STOP_KEEP;
            return K3_OK;
        }
    } else {
        size_t nb = tok_stream_feed(&g->ts, id, g->tbuf, g->tcap);
        content(g, (const char *)g->tbuf, nb);
    }
    if (g->stop.hit) *verdict = K3_GEN_STOP;
    return K3_OK;
}

static bool job_cancelled(void *ctx) { return atomic_load(&((gen_ctx *)ctx)->j->cancel) != 0; }

static int job_feed(void *ctx, int32_t id, float *logits, int64_t limit, k3_err *err) {
    const k3_serve_model *m = &((gen_ctx *)ctx)->s->m;
    return m->step(m->ctx, ((gen_ctx *)ctx)->j->slot, id, logits, limit, err);
}

/* One choice: prefill (reusing what the backend kept), then the generation
 * loop to a stop or the limit. Returns 0, or sets *cancelled / *failed (err,
 * *fail_code) and returns 1. */
static int run_choice(gen_ctx *g, float *logits, bool *cancelled, bool *failed, bool *prefill_cut,
                      const char **fail_code, k3_err *err) {
    k3_serve *s = g->s;
    k3_job *j = g->j;
    const k3_serve_model *m = &s->m;
    const k3_serve_req *r = &j->req;
    tok_stream_init(&g->ts, m->tok);
    k3_sampler sp;
    k3_sampler_init(&sp, m->vocab, r->temperature, r->top_k, r->top_p, r->min_p, r->seed + (uint64_t)g->index);
    k3_logit_proc_init(&g->proc, r, m->vocab, j->ids, j->n);
    if ((r->schema || r->call) && g->chat) {
        /* made once, by the first slot that needs it; read-only after */
        pthread_mutex_lock(&s->mu);
        if (!s->tb) s->tb = k3_tokbytes_new(m->tok);
        const k3_tokbytes *tb = s->tb;
        pthread_mutex_unlock(&s->mu);
        g->con = r->call ? k3_constraint_new_call(r->call, tb, m->chat, m->vocab, r->thinking)
                         : k3_constraint_new(r->schema, tb, m->chat, m->vocab, r->thinking);
        g->dead = false;
    }
    g->cp = g->chat ? k3_chat_parser_new(m->chat, r->thinking) : NULL;
    k3_chat_delta d;
    k3_stopper_init(&g->stop, r->stop, r->nstop);
    g->ngen = 0;
    g->started = false;
    g->text_off = 0;
    if (r->logprobs) {
        g->lp_all = lp_new(g);
        if (g->stream) g->lp_pending = lp_new(g);
    }
    const char *finish = "length";
    bool stopped = false;
    double t0 = k3_now();
    size_t reused = 0;
    int spec = r->speculate >= 0 ? r->speculate : m->spec_default; /* (the server checked it against spec_max) */
    int rc = atomic_load(&j->cancel) ? -1
                                     : m->prefill(m->ctx, j->slot, j->ids, j->n, j->marks, j->nmarks, logits,
                                                           &reused, &j->cancel, spec, err);
    if (g->index == 0) g->reused = reused;
    /* the backend's message says how far a cancelled prefill got */
    *prefill_cut = rc > 0 && atomic_load(&j->cancel);
    if (rc || atomic_load(&j->cancel)) {
        *cancelled = atomic_load(&j->cancel);
        *failed = !*cancelled;
    }
    double t1 = k3_now();
    if (!*failed && !*cancelled) {
        k3_gen_opts go;
        k3_gen_opts_init(&go);
        go.max_tokens = j->max_tokens;
        /* completions stop at the end-of-sequence id; a chat's end is the
         * parser's. The stop id is part of the history the next prompt
         * re-renders: the state takes it too */
        go.eos_id = g->chat ? -1 : m->eos;
        go.eos_keep = true;
        go.what = s->model_id;
        go.prompt_len = j->n;
        go.max_pos = m->ctx_len;
        go.ctx = g;
        go.on_token = on_token;
        go.cancelled = job_cancelled;
        go.feed = job_feed;
        go.adjust = adjust;
        go.on_sample = on_sample;
        k3_gen_result res;
        *failed = k3_generate(NULL, &sp, logits, &go, &res, err) != K3_OK;
        if (res.end == K3_GEN_END_LOGITS) *fail_code = "non_finite_logits";
        g->ngen = res.n;
        *cancelled = res.end == K3_GEN_END_CANCEL;
        stopped = res.end == K3_GEN_END_STOP || res.end == K3_GEN_END_EOS;
        k3_gen_result_free(&res);
    }
    double t2 = k3_now();
    if (!*failed && !*cancelled) {
        /* the text held back for an incomplete character, then by the stop strings */
        if (g->chat) {
            k3_chat_parser_flush(g->cp, &d);
            chat_delta(g, &d);
        } else if (!g->stop.hit) {
            size_t nb = tok_stream_flush(&g->ts, g->tbuf, g->tcap);
            content(g, (const char *)g->tbuf, nb);
        }
        flush_text(g);
        if (g->stop.hit || (stopped && !(g->tool_calls && json_array_size(g->tool_calls)))) finish = "stop";
        else if (stopped) finish = "tool_calls";
        if (m->end) m->end(m->ctx, j->slot);
        finish_choice(g, finish);
        if (s->o.verbose)
            fprintf(stderr, "k3 serve: %s: choice %d: %zu prompt tokens (%zu reused) in %.3f s, %zu generated in %.3f s "
                    "(%.1f tok/s), finish %s\n", j->id, g->index, j->n, reused, t1 - t0, g->ngen, t2 - t1,
                    t2 > t1 && g->ngen > 1 ? (double)(g->ngen - 1) / (t2 - t1) : 0.0, finish);
    }
    g->ngen_all += g->ngen;
    if (g->cp) k3_chat_parser_free(g->cp);
    g->cp = NULL;
    k3_logit_proc_free(&g->proc);
    k3_constraint_free(g->con);
    g->con = NULL;
    k3_sampler_free(&sp);
    k3_stopper_free(&g->stop);
    k3_sb_free(&g->text);
    k3_sb_free(&g->reasoning);
    json_decref(g->tool_calls);
    g->tool_calls = NULL;
    json_decref(g->lp_all);
    json_decref(g->lp_pending);
    g->lp_all = g->lp_pending = NULL;
    return *failed || *cancelled;
}

void k3_gen_run(k3_serve *s, k3_job *j) {
    const k3_serve_model *m = &s->m;
    gen_ctx g = {.s = s, .j = j, .chat = j->req.kind == K3_REQ_CHAT, .stream = j->req.stream};
    g.choices = json_array();
    g.tcap = tok_max_token_bytes(m->tok) + 16;
    g.tbuf = xmalloc(g.tcap);
    k3_err err = {0};
    float *logits = xmalloc_array((size_t)m->vocab, sizeof(float));
    bool cancelled = false, failed = false, prefill_cut = false;
    const char *fail_code = "internal_error";
    int n = j->req.n > 0 ? j->req.n : 1;
    for (g.index = 0; g.index < n; g.index++)
        if (run_choice(&g, logits, &cancelled, &failed, &prefill_cut, &fail_code, &err)) break;
    pthread_mutex_lock(&s->mu);
    s->n_tokens += g.ngen_all;
    s->n_prompt += j->n;
    s->n_cached += g.reused;
    if (g.reused) s->n_cache_hits++;
    /* a cancel by the server's stop, not by the client: the client is still
     * there and gets a well-formed end */
    bool stopping = cancelled && s->stopping && !client_gone_now(j);
    if (cancelled) s->n_cancelled++;
    else if (failed) s->n_failed++;
    else s->n_ok++;
    pthread_mutex_unlock(&s->mu);
    if (stopping) {
        fprintf(stderr, "k3 serve: %s stopped after %zu generated tokens: the server is stopping\n", j->id, g.ngen_all);
        finish_error(&g, 503, "server_stopping", "the server is stopping");
    } else if (cancelled && prefill_cut) {
        fprintf(stderr, "k3 serve: %s cancelled: client disconnected during the prefill: %s\n", j->id, err.msg);
        k3_job_finish(s, j, 499);
    } else if (cancelled) {
        fprintf(stderr, "k3 serve: %s cancelled: client disconnected after %zu generated tokens\n", j->id, g.ngen_all);
        k3_job_finish(s, j, 499);
    } else if (failed) {
        finish_error(&g, 500, fail_code, err.msg[0] ? err.msg : "generation failed");
    } else {
        finish_response(&g);
    }
    json_decref(g.choices);
    free(g.tbuf);
    free(logits);
}
