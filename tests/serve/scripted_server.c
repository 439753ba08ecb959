/* scripted_server.c: k3 serve's HTTP server (src/serve/, unchanged) in front
 * of a test double of the model: every request's reply is a fixed id
 * sequence, given as one-hot logits, so sampling at any temperature returns
 * exactly those ids. Built and run by tests/cli/test_serve_e2e.sh only (it is
 * not part of k3), to show what clients receive when the model's ids hold a
 * tool call: the ids are the chat template's own rendering of an assistant
 * tool call, so the server's id-level parser must turn them back into the
 * same OpenAI tool_calls.
 *
 *   scripted_server TOK_DIR IDS      IDS: comma-separated reply ids
 * Prints "http://127.0.0.1:PORT/" and serves until SIGTERM. */
#include "chat/chat.h"
#include "serve/serve.h"
#include "web/http.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t *ids;
    size_t n, pos;
    int vocab;
} script;

static void one_hot(script *s, float *logits) {
    for (int v = 0; v < s->vocab; v++) logits[v] = 0.0f;
    int32_t id = s->pos < s->n ? s->ids[s->pos] : s->ids[s->n - 1];
    logits[id] = 200.0f; /* exp(-200) of the rest underflows: the id is drawn at any temperature <= 2 */
}

static int sc_prefill(void *ctx, int slot, const int32_t *ids, size_t n, const size_t *marks, size_t nmarks,
                      float *logits, size_t *reused, const atomic_int *cancel, int speculate, k3_err *err) {
    (void)slot; (void)ids; (void)n; (void)marks; (void)nmarks; (void)cancel; (void)speculate; (void)err;
    script *s = ctx;
    s->pos = 0;
    *reused = 0;
    one_hot(s, logits);
    return K3_OK;
}

static int sc_step(void *ctx, int slot, int32_t id, float *logits, int64_t limit, k3_err *err) {
    (void)slot; (void)id; (void)limit; (void)err;
    script *s = ctx;
    s->pos++;
    if (logits) one_hot(s, logits);
    return K3_OK;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: scripted_server TOK_DIR IDS\n");
        return 2;
    }
    sigset_t stop;
    k3_http_block_stop_signals(&stop);
    k3_err err = {0};
    k3_tokenizer *tok;
    k3_chat *chat;
    if (tok_load(argv[1], &tok, &err) || k3_chat_new(tok, &chat, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return 1;
    }
    script s = {.vocab = tok_vocab_size(tok)};
    if (k3_parse_ids(argv[2], s.vocab, &s.ids, &s.n, &err) || s.n == 0) {
        fprintf(stderr, "k3: IDS: %s\n", err.msg);
        return 2;
    }
    k3_serve_model m = {.ctx = &s, .vocab = s.vocab, .eos = -1, .ctx_len = 8192, .tok = tok, .chat = chat,
                        .threads = 1, .slots = 1, .prefill = sc_prefill, .step = sc_step};
    k3_serve_opts o = {.host = "127.0.0.1", .port = 0, .model_id = "scripted", .queue = 4, .max_tokens = 1024};
    k3_serve *srv;
    if (k3_serve_start(&o, &m, &srv, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return 1;
    }
    printf("scripted server: http://127.0.0.1:%d/\n", k3_serve_port(srv));
    fflush(stdout);
    k3_http_wait_stop(&stop);
    k3_serve_stop(srv);
    k3_chat_free(chat);
    tok_free(tok);
    free(s.ids);
    return 0;
}
