/* Tests for the output parser (chat/parser.c) on scripted id sequences.
 *
 * Each script is what a model writes after the generation prefix, written
 * out by hand as XTML segments: the template's own markup ids (from
 * k3_chat_markup) and text segments encoded by the tokenizer. Expected
 * reasoning, content and tool calls are written out literally. */
#include "chat/chat.h"
#include "harness.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    k3_tokenizer *t;
    k3_chat *c;
} fix_t;

static bool fix_open(fix_t *f) {
    k3_err err = {0};
    f->t = NULL;
    f->c = NULL;
    if (tok_load(t_repo("tests/fixtures/tokenizer/kimi"), &f->t, &err) || k3_chat_new(f->t, &f->c, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return false;
    }
    return true;
}
static void fix_close(fix_t *f) {
    k3_chat_free(f->c);
    tok_free(f->t);
}

/* "\x01" open "\x02" close "\x03" sep "\x04" end_of_msg "\x05" [EOS];
 * "\x06" + one byte: the id of that single byte; else a text segment. */
#define O "\x01"
#define C "\x02"
#define S "\x03"
#define E "\x04"
#define EOS "\x05"
static int32_t byte_id(const k3_tokenizer *t, uint8_t b) {
    for (int32_t id = 0; id < tok_n_base(t); id++) {
        size_t n;
        const uint8_t *p = tok_token_bytes(t, id, &n);
        if (n == 1 && p[0] == b) return id;
    }
    return -1;
}
static int32_t *script(const fix_t *f, const char *const *segs, size_t *n) {
    k3_chat_ids m = k3_chat_markup(f->c);
    int32_t *out = NULL;
    size_t cap = 0;
    *n = 0;
    for (; *segs; segs++) {
        const char *s = *segs;
        int32_t one[1], *v = one;
        size_t k = 1;
        if (s[0] >= 1 && s[0] <= 5 && !s[1]) {
            const int32_t mk[] = {0, m.open, m.close, m.sep, m.end_of_msg, m.eos};
            one[0] = mk[(int)s[0]];
        } else if (s[0] == 6) {
            one[0] = byte_id(f->t, (uint8_t)s[1]);
        } else {
            k3_err err;
            if (tok_encode(f->t, s, strlen(s), false, &v, &k, &err)) abort();
        }
        while (*n + k > cap) out = xrealloc_array(out, cap = cap ? 2 * cap : 64, sizeof *out);
        memcpy(out + *n, v, k * sizeof *v);
        *n += k;
        if (v != one) free(v);
    }
    return out;
}

typedef struct {
    char reasoning[4096], content[4096];
    size_t rn, cn;
    int ncalls, stop_at, calls_at[8];
    bool utf8_ok;
    json_t *msg;
    const char *finish;
} run_t;

/* Feeds the script; records the concatenated deltas. */
static bool run(const fix_t *f, bool thinking, bool cut_off, const char *const *segs, run_t *r) {
    memset(r, 0, sizeof *r);
    r->stop_at = -1;
    r->utf8_ok = true;
    size_t n;
    int32_t *ids = script(f, segs, &n);
    k3_chat_parser *p = k3_chat_parser_new(f->c, thinking);
    k3_err err = {0};
    for (size_t i = 0; i < n; i++) {
        k3_chat_delta d;
        if (k3_chat_parser_feed(p, ids[i], &d, &err)) return false;
        if (d.reasoning_len && r->rn + d.reasoning_len < sizeof r->reasoning) {
            r->utf8_ok &= tok_utf8_check((const uint8_t *)d.reasoning, d.reasoning_len) == d.reasoning_len;
            memcpy(r->reasoning + r->rn, d.reasoning, d.reasoning_len);
            r->rn += d.reasoning_len;
        }
        if (d.content_len && r->cn + d.content_len < sizeof r->content) {
            r->utf8_ok &= tok_utf8_check((const uint8_t *)d.content, d.content_len) == d.content_len;
            memcpy(r->content + r->cn, d.content, d.content_len);
            r->cn += d.content_len;
        }
        if (d.tool_call && r->ncalls < 8) r->calls_at[r->ncalls++] = (int)i;
        if (d.stop && r->stop_at < 0) r->stop_at = (int)i;
    }
    k3_chat_delta d;
    k3_chat_parser_flush(p, &d);
    memcpy(r->reasoning + r->rn, d.reasoning, d.reasoning_len);
    r->rn += d.reasoning_len;
    memcpy(r->content + r->cn, d.content, d.content_len);
    r->cn += d.content_len;
    r->msg = k3_chat_parser_message(p, cut_off, &r->finish);
    k3_chat_parser_free(p);
    free(ids);
    return r->msg != NULL;
}

static const char *str_of(const json_t *m, const char *k) { return json_string_value(json_object_get(m, k)); }

#define RUN(thinking, cut, r, ...)                                       \
    const char *const segs_##r[] = {__VA_ARGS__, NULL};                  \
    run_t r;                                                             \
    CHECK(run(&f, thinking, cut, segs_##r, &r))

#define END C, "message", S, E

TEST(chat_parser_reasoning_then_response) {
    fix_t f;
    CHECK(fix_open(&f));
    RUN(true, false, r, "Two plus two", " is four.", C, "think", S, O, "response", S, "It is 4.", C, "response",
        S, END);
    CHECK(r.rn == 21 && memcmp(r.reasoning, "Two plus two is four.", 21) == 0);
    CHECKF(strcmp(str_of(r.msg, "reasoning_content"), "Two plus two is four.") == 0, "%s",
           str_of(r.msg, "reasoning_content"));
    CHECK(strcmp(str_of(r.msg, "content"), "It is 4.") == 0);
    CHECK(r.cn == 8 && memcmp(r.content, "It is 4.", 8) == 0);
    CHECK(!json_object_get(r.msg, "tool_calls") && strcmp(r.finish, "stop") == 0);
    CHECK(strcmp(str_of(r.msg, "role"), "assistant") == 0);
    json_decref(r.msg);
    fix_close(&f);
}

TEST(chat_parser_thinking_off) {
    fix_t f;
    CHECK(fix_open(&f));
    RUN(false, false, r, "Hello", " there.", C, "response", S, END);
    CHECK(strcmp(str_of(r.msg, "content"), "Hello there.") == 0 && r.rn == 0);
    CHECK(!json_object_get(r.msg, "reasoning_content") && strcmp(r.finish, "stop") == 0);
    json_decref(r.msg);
    fix_close(&f);
}

#define ARG(key, type, ...) O, "argument", " key", "=\"", key, "\"", " type", "=\"", type, "\"", S, __VA_ARGS__, C, "argument", S
#define CALL(name, idx) O, "call", " tool", "=\"", name, "\"", " index", "=\"", idx, "\"", S

/* Typed arguments back to an OpenAI arguments string; the JSON fallback
 * block passes through as it is; each call is reported when it closes. */
TEST(chat_parser_tool_calls) {
    fix_t f;
    CHECK(fix_open(&f));
    RUN(true, false, r, "Need tools.", C, "think", S, O, "response", S, C, "response", S, O, "tools", S,
        CALL("get_weather", "1"), ARG("city", "string", "Paris"), ARG("n", "number", "3"),
        ARG("x", "number", "-2.50e3"), ARG("ok", "boolean", "true"), ARG("z", "null", "null"),
        ARG("arr", "array", "[1, \"two\"]"), ARG("obj", "object", "{\"a\": {\"b\": null}}"),
        ARG("s", "string", "he said \"hi\"\n", "\\path"), ARG("bad", "number", "about 3"),
        C, "call", S,
        CALL("a&quot;b&amp;c", "2"), O, "json", " type", "=\"", "object", "\"", S, "{\"q\": unquoted", C, "json",
        S, C, "call", S,
        CALL("ping", "3"), C, "call", S, C, "tools", S, END);
    CHECK(r.ncalls == 3 && r.cn == 0 && strcmp(r.finish, "tool_calls") == 0);
    CHECK(json_is_null(json_object_get(r.msg, "content")));
    const json_t *calls = json_object_get(r.msg, "tool_calls");
    CHECK(json_array_size(calls) == 3);
    const json_t *c0 = json_array_get(calls, 0), *fn0 = json_object_get(c0, "function");
    CHECK(strcmp(str_of(c0, "type"), "function") == 0 && strcmp(str_of(c0, "id"), "call_1") == 0);
    CHECK(strcmp(str_of(fn0, "name"), "get_weather") == 0);
    /* the numbers keep the model's own spelling */
    const char *want0 = "{\"city\": \"Paris\", \"n\": 3, \"x\": -2.50e3, \"ok\": true, \"z\": null, \"arr\": [1, \"two\"], "
                        "\"obj\": {\"a\": {\"b\": null}}, \"s\": \"he said \\\"hi\\\"\\n\\\\path\", \"bad\": \"about 3\"}";
    CHECKF(strcmp(str_of(fn0, "arguments"), want0) == 0, "%s", str_of(fn0, "arguments"));
    json_t *parsed = json_loads(str_of(fn0, "arguments"), 0, NULL);
    CHECK(json_is_object(parsed) && json_object_size(parsed) == 9);
    json_decref(parsed);
    const json_t *fn1 = json_object_get(json_array_get(calls, 1), "function");
    CHECK(strcmp(str_of(fn1, "name"), "a\"b&c") == 0 && strcmp(str_of(fn1, "arguments"), "{\"q\": unquoted") == 0);
    const json_t *fn2 = json_object_get(json_array_get(calls, 2), "function");
    CHECK(strcmp(str_of(fn2, "name"), "ping") == 0 && strcmp(str_of(fn2, "arguments"), "{}") == 0);
    CHECK(strcmp(str_of(json_array_get(calls, 2), "id"), "call_3") == 0);
    CHECK(r.calls_at[0] < r.calls_at[1] && r.calls_at[1] < r.calls_at[2]);
    json_decref(r.msg);
    fix_close(&f);
}

/* The parsed message, put back into the history, renders as the prompt plus
 * exactly the generated ids: the next turn extends what the model saw. */
TEST(chat_parser_message_renders_back_to_the_generated_ids) {
    fix_t f;
    CHECK(fix_open(&f));
    const char *const gen[] = {"Look it up.", C, "think", S, O, "response", S, "Checking.", C, "response", S,
                               O, "tools", S, CALL("get_weather", "1"), ARG("city", "string", "Paris"),
                               ARG("days", "number", "3"), ARG("hourly", "boolean", "false"),
                               ARG("fields", "array", "[\"t\", \"wind\"]"), C, "call", S, C, "tools", S, END,
                               NULL};
    run_t r;
    CHECK(run(&f, true, false, gen, &r));
    json_t *req = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \"Weather?\"}]}", 0, NULL);
    int32_t *prompt, *hist;
    size_t np, nh, ng;
    k3_err err = {0};
    CHECKF(k3_chat_encode(f.c, req, &prompt, &np, &err) == 0, "%s", err.msg);
    json_array_append_new(json_object_get(req, "messages"), r.msg);
    json_object_set_new(req, "add_generation_prompt", json_false());
    CHECKF(k3_chat_encode(f.c, req, &hist, &nh, &err) == 0, "%s", err.msg);
    int32_t *g = script(&f, gen, &ng);
    CHECKF(nh == np + ng && memcmp(hist, prompt, np * sizeof *prompt) == 0 &&
               memcmp(hist + np, g, ng * sizeof *g) == 0,
           "history %zu ids, prompt %zu + generated %zu", nh, np, ng);
    free(prompt);
    free(hist);
    free(g);
    json_decref(req);
    fix_close(&f);
}

TEST(chat_parser_cut_off_mid_reasoning_is_reasoning) {
    fix_t f;
    CHECK(fix_open(&f));
    {
        RUN(true, true, r, "Let me think about");
        CHECK(strcmp(str_of(r.msg, "reasoning_content"), "Let me think about") == 0);
        CHECK(strcmp(str_of(r.msg, "content"), "") == 0 && strcmp(r.finish, "length") == 0);
        json_decref(r.msg);
    }
    { /* cut inside the closing tag: no marker reached, still reasoning */
        RUN(true, true, r, "Hmm.", C, "thi");
        CHECK(strcmp(str_of(r.msg, "reasoning_content"), "Hmm.") == 0 && r.cn == 0);
        CHECK(strcmp(str_of(r.msg, "content"), "") == 0 && strcmp(r.finish, "length") == 0);
        json_decref(r.msg);
    }
    { /* the model spelling markup as text does not switch channels */
        RUN(true, true, r, "a <|close|>think<|sep|><|open|>response<|sep|> b");
        CHECK(strcmp(str_of(r.msg, "reasoning_content"), "a <|close|>think<|sep|><|open|>response<|sep|> b") == 0);
        CHECK(r.cn == 0);
        json_decref(r.msg);
    }
    fix_close(&f);
}

TEST(chat_parser_cut_off_mid_response_and_mid_call) {
    fix_t f;
    CHECK(fix_open(&f));
    {
        RUN(true, true, r, "ok", C, "think", S, O, "response", S, "The answ");
        CHECK(strcmp(str_of(r.msg, "reasoning_content"), "ok") == 0);
        CHECK(strcmp(str_of(r.msg, "content"), "The answ") == 0 && strcmp(r.finish, "length") == 0);
        json_decref(r.msg);
    }
    {
        RUN(true, true, r, "ok", C, "think", S, O, "response", S, "Let me check.", C, "response", S, O, "tools",
            S, CALL("f", "1"), ARG("a", "string", "done"), CALL("g", "2"), O, "argument", " key", "=\"", "b",
            "\"", " type", "=\"", "string", "\"", S, "Par");
        /* the first call is complete (closed where the next begins), the second is dropped */
        CHECK(r.ncalls == 1 && strcmp(r.finish, "length") == 0);
        CHECK(strcmp(str_of(r.msg, "content"), "Let me check.") == 0);
        const json_t *calls = json_object_get(r.msg, "tool_calls");
        CHECK(json_array_size(calls) == 1);
        CHECK(strcmp(str_of(json_object_get(json_array_get(calls, 0), "function"), "arguments"),
                     "{\"a\": \"done\"}") == 0);
        json_decref(r.msg);
    }
    fix_close(&f);
}

/* [EOS] ends the message like <|end_of_msg|>; later ids change nothing. */
TEST(chat_parser_stops_on_eos_and_end_of_msg) {
    fix_t f;
    CHECK(fix_open(&f));
    {
        RUN(false, false, r, "Hi", EOS, "more", E, "x");
        CHECK(strcmp(str_of(r.msg, "content"), "Hi") == 0 && r.stop_at == 1 && strcmp(r.finish, "stop") == 0);
        json_decref(r.msg);
    }
    { /* a stop that comes with cut_off still reports stop */
        RUN(true, true, r, "r", C, "think", S, O, "response", S, "a", E);
        CHECK(strcmp(str_of(r.msg, "content"), "a") == 0 && strcmp(r.finish, "stop") == 0);
        json_decref(r.msg);
    }
    k3_chat_parser *p = k3_chat_parser_new(f.c, true);
    k3_chat_delta d;
    k3_err err = {0};
    CHECK(k3_chat_parser_feed(p, tok_vocab_size(f.t), &d, &err) == K3_EXIT_USAGE);
    CHECK(k3_chat_parser_feed(p, -1, &d, &err) == K3_EXIT_USAGE);
    k3_chat_parser_free(p);
    fix_close(&f);
}

/* A character split across tokens is held back until complete, in both
 * channels; one left incomplete at the end becomes U+FFFD. */
#define B(x) "\x06" x
TEST(chat_parser_utf8_split_across_tokens) {
    fix_t f;
    CHECK(fix_open(&f));
    for (int i = 0; i < 4; i++) CHECK(byte_id(f.t, (uint8_t)"\xe2\x82\xac\xf0"[i]) >= 0);
    RUN(true, false, r, "x", B("\xe2"), B("\x82"), B("\xac"), C, "think", S, O, "response", S, B("\xf0"),
        B("\x9f"), B("\x98"), B("\x80"), "!", B("\xe2"), B("\x82"));
    CHECK(r.utf8_ok);
    CHECKF(strcmp(str_of(r.msg, "reasoning_content"), "x\xe2\x82\xac") == 0, "%s",
           str_of(r.msg, "reasoning_content"));
    CHECKF(strcmp(str_of(r.msg, "content"), "\xf0\x9f\x98\x80!\xef\xbf\xbd") == 0, "%s", str_of(r.msg, "content"));
    CHECK(r.cn == strlen("\xf0\x9f\x98\x80!\xef\xbf\xbd") && memcmp(r.content, "\xf0\x9f\x98\x80!", 5) == 0);
    json_decref(r.msg);
    /* the deltas: nothing until the last byte of a character arrives */
    const char *const segs[] = {B("\xe2"), B("\x82"), B("\xac"), NULL};
    size_t n;
    int32_t *ids = script(&f, segs, &n);
    k3_chat_parser *p = k3_chat_parser_new(f.c, false);
    k3_chat_delta d;
    k3_err err = {0};
    size_t lens[3];
    for (int i = 0; i < 3; i++) {
        CHECK(k3_chat_parser_feed(p, ids[i], &d, &err) == 0);
        lens[i] = d.content_len;
    }
    CHECK(lens[0] == 0 && lens[1] == 0 && lens[2] == 3 && memcmp(d.content, "\xe2\x82\xac", 3) == 0);
    free(ids);
    k3_chat_parser_free(p);
    fix_close(&f);
}

/* Any id sequence (markup in any order, text, split characters, other
 * specials) gives whole-character deltas, and a message whose every tool
 * call has string arguments. A fixed pseudo-random script, 20,000 ids. */
TEST(chat_parser_survives_any_ids) {
    fix_t f;
    CHECK(fix_open(&f));
    k3_chat_ids m = k3_chat_markup(f.c);
    const char *const pieces[] = {"think", "response", "tools", "call", " tool", "=\"", "x", "\"", "argument",
                                  " key", " type", "string", "number", "json", "message", "[1,", " é", "{\"a\""};
    int32_t pool[64];
    size_t np = 0;
    for (size_t i = 0; i < sizeof pieces / sizeof *pieces; i++) {
        int32_t *v;
        size_t k;
        k3_err err;
        CHECK(tok_encode(f.t, pieces[i], strlen(pieces[i]), false, &v, &k, &err) == 0);
        for (size_t j = 0; j < k && np < 48; j++) pool[np++] = v[j];
        free(v);
    }
    const uint8_t bytes[] = {0xe2, 0x82, 0xac, 0xf0, 0x9f, 0xff, 0x80};
    for (size_t i = 0; i < sizeof bytes; i++) pool[np++] = byte_id(f.t, bytes[i]);
    pool[np++] = 163584; /* [BOS]: another special */
    for (int rep = 0; rep < 4; rep++) {
        pool[np++] = m.open;
        pool[np++] = m.close;
        pool[np++] = m.sep;
    }
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int round = 0; round < 20; round++) {
        k3_chat_parser *p = k3_chat_parser_new(f.c, round & 1);
        bool ok = true;
        for (int i = 0; i < 1000; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            k3_chat_delta d;
            k3_err err = {0};
            CHECK(k3_chat_parser_feed(p, pool[(s >> 33) % np], &d, &err) == 0);
            ok &= tok_utf8_check((const uint8_t *)d.reasoning, d.reasoning_len) == d.reasoning_len;
            ok &= tok_utf8_check((const uint8_t *)d.content, d.content_len) == d.content_len;
            if (d.tool_call)
                ok &= json_is_string(json_object_get(json_object_get(d.tool_call, "function"), "arguments"));
        }
        const char *fin;
        json_t *msg = k3_chat_parser_message(p, true, &fin);
        /* the pool has no stop id: every message is cut off */
        CHECK(msg && ok && strcmp(fin, "length") == 0);
        const json_t *calls = json_object_get(msg, "tool_calls");
        for (size_t j = 0; j < json_array_size(calls); j++)
            CHECK(json_is_string(json_object_get(json_object_get(json_array_get(calls, j), "function"), "arguments")));
        char *dump = json_dumps(msg, 0);
        CHECK(dump);
        free(dump);
        json_decref(msg);
        k3_chat_parser_free(p);
        CHECK(ok);
    }
    fix_close(&f);
}
