/* bench/constrain.c: the per-token cost of structured output's mask on the
 * Kimi tokenizer's 163,840-entry vocabulary: k3_jstate_mask, then the row
 * written with -INFINITY where masked (what k3_constraint_apply adds to a
 * decode step), for the states a reply passes through: before a value,
 * inside a free string (most ids allowed), at a declared key, in a number;
 * then a whole k3_constraint_apply in a tool call (tool_choice): choosing
 * among 8 or 128 tool names, and inside a raw string argument.
 * CPU time of this thread, best of 5 rounds of 50.
 *
 *   make bin/bench_constrain && bin/bench_constrain [TOK_DIR] */
#include "constrain/constrain.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "tests/fixtures/tokenizer/kimi";
    k3_tokenizer *t = NULL;
    k3_err err = {0};
    if (tok_load(dir, &t, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return K3_EXIT_USAGE;
    }
    double t0 = cpu_now();
    k3_tokbytes *tb = k3_tokbytes_new(t);
    double build = cpu_now() - t0;
    json_t *js = json_loads("{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":"
                            "\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}}},"
                            "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}", 0, NULL);
    k3_jschema *sc = NULL;
    char where[128];
    if (!js || k3_jschema_compile(js, &sc, where, sizeof where, &err)) return K3_EXIT_RUNTIME;
    int vocab = tok_vocab_size(t), nb = tok_n_base(t);
    uint8_t *allow = xmalloc((size_t)vocab);
    float *row = xmalloc_array((size_t)vocab, sizeof *row), *work = xmalloc_array((size_t)vocab, sizeof *work);
    for (int i = 0; i < vocab; i++) row[i] = (float)(i % 97) * 0.01f;
    static const struct { const char *name, *prefix; } S[] = {
        {"before the value", ""}, {"declared key", "{\""}, {"in a string", "{\"name\":\"Ann"},
        {"in a number", "{\"name\":\"Ann\",\"age\":4"}, {"string in an array", "{\"name\":\"A\",\"age\":4,\"tags\":[\"x"}};
    printf("k3 bench constrain: vocabulary %d (%d base ids), sorted token bytes built in %.1f ms\n", vocab, nb,
           build * 1e3);
    printf("%-22s %10s %12s\n", "state", "allowed", "ms/token");
    for (size_t s = 0; s < sizeof S / sizeof *S; s++) {
        k3_jstate st;
        k3_jstate_init(&st, sc);
        if (!k3_jstate_feed(&st, (const uint8_t *)S[s].prefix, strlen(S[s].prefix))) return K3_EXIT_RUNTIME;
        double best = 1e30;
        size_t count = 0;
        for (int r = 0; r < 5; r++) {
            double a = cpu_now();
            for (int k = 0; k < 50; k++) {
                count = k3_jstate_mask(&st, tb, allow);
                for (int i = 0; i < vocab; i++) work[i] = i < nb && allow[i] ? row[i] : -INFINITY;
            }
            double dt = (cpu_now() - a) / 50;
            if (dt < best) best = dt;
        }
        printf("%-22s %10zu %12.3f\n", S[s].name, count, best * 1e3);
    }
    /* tool calls: the reply driven to the state by the ids of its text */
    k3_chat *chat = NULL;
    if (k3_chat_new(t, &chat, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return K3_EXIT_USAGE;
    }
    k3_chat_ids m = k3_chat_markup(chat);
    for (int ntools = 8; ntools <= K3_CALL_MAX_TOOLS; ntools *= 16) {
        json_t *tools = json_array();
        for (int i = 0; i < ntools; i++) {
            char nm[32];
            snprintf(nm, sizeof nm, "lookup_%d", i);
            json_array_append_new(tools, json_pack("{s:s, s:{s:s, s:{s:s, s:{s:{s:s}}, s:[s]}}}", "type", "function",
                                                   "function", "name", nm, "parameters", "type", "object",
                                                   "properties", "q", "type", "string", "required", "q"));
        }
        k3_callspec *cs = NULL;
        if (k3_callspec_compile(tools, K3_CALLS_REQUIRED, NULL, true, &cs, where, sizeof where, &err)) return K3_EXIT_RUNTIME;
        k3_constraint *c = k3_constraint_new_call(cs, tb, chat, vocab, false);
        const struct { int32_t id; const char *text; } path[] = {
            {m.close, NULL}, {-1, "response"}, {m.sep, NULL}, {m.open, NULL}, {-1, "tools"}, {m.sep, NULL},
            {m.open, NULL}, {-1, "call tool=\""}, {-2, NULL}, {-1, "lookup_3\" index=\"1\""}, {m.sep, NULL},
            {m.open, NULL}, {-1, "argument key=\"q\" type=\"string\""}, {m.sep, NULL}, {-1, "Ann"}, {-2, NULL}};
        const char *const names[] = {"choosing a tool", "raw string argument"};
        int at = 0;
        for (size_t p = 0; p < sizeof path / sizeof *path; p++) {
            if (path[p].id == -2) {
                double best = 1e30;
                size_t count = 0;
                for (int r = 0; r < 5; r++) {
                    double a = cpu_now();
                    for (int k = 0; k < 50; k++) {
                        const float *w = k3_constraint_apply(c, row);
                        if (!w) return K3_EXIT_RUNTIME;
                        if (k == 0) {
                            count = 0;
                            for (int i = 0; i < vocab; i++) count += w[i] > -INFINITY;
                        }
                    }
                    double dt = (cpu_now() - a) / 50;
                    if (dt < best) best = dt;
                }
                char label[64];
                snprintf(label, sizeof label, "%s (%d tools)", names[at++], ntools);
                printf("%-36s %10zu %12.3f\n", label, count, best * 1e3);
                continue;
            }
            int32_t one = path[p].id, *v = &one;
            size_t k = 1;
            if (path[p].text && tok_encode(t, path[p].text, strlen(path[p].text), false, &v, &k, &err)) return K3_EXIT_RUNTIME;
            for (size_t i = 0; i < k; i++) {
                k3_constraint_apply(c, row);
                if (k3_constraint_accept(c, v[i], &err)) {
                    fprintf(stderr, "k3: %s\n", err.msg);
                    return K3_EXIT_RUNTIME;
                }
            }
            if (v != &one) free(v);
        }
        k3_constraint_free(c);
        k3_callspec_free(cs);
        json_decref(tools);
    }
    k3_chat_free(chat);
    free(allow);
    free(row);
    free(work);
    k3_jschema_free(sc);
    json_decref(js);
    k3_tokbytes_free(tb);
    tok_free(t);
    return 0;
}
