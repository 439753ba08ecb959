/* Tests for the chat template (chat/template.c).
 *
 * The 26 cases of tests/fixtures/xtml/cases.jsonl carry the prompt ids that
 * the K3 release's own encoder (encoding_k3.py) gives; they must match
 * exactly. Rules those cases do not reach (names, typed arguments, escaping,
 * reordered tool results, dynamic declarations, float formatting, ...) are
 * checked against segment lists written out here by hand from the release
 * encoder's grammar (docs/chat.md), each segment encoded on its own by the
 * tokenizer (itself proven against npm tiktoken), never against the output
 * of the code under test. */
#include "chat/chat.h"
#include "harness.h"
#include "tjson.h"

#include <stdlib.h>
#include <string.h>

static k3_tokenizer *kimi_tok(void) {
    k3_tokenizer *t = NULL;
    k3_err err = {0};
    if (tok_load(t_repo("tests/fixtures/tokenizer/kimi"), &t, &err)) fprintf(stderr, "%s\n", err.msg);
    return t;
}

static k3_chat *kimi_chat(k3_tokenizer *t) {
    k3_chat *c = NULL;
    k3_err err = {0};
    if (t && k3_chat_new(t, &c, &err)) fprintf(stderr, "%s\n", err.msg);
    return c;
}

TEST(chat_template_matches_release_encoder_on_26_cases) {
    k3_tokenizer *t = kimi_tok();
    k3_chat *c = kimi_chat(t);
    CHECK(c);
    char *data;
    size_t len;
    k3_err err = {0};
    CHECK(k3_read_file(t_repo("tests/fixtures/xtml/cases.jsonl"), &data, &len, &err) == 0);
    int cases = 0, ok = 0;
    for (char *line = data, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        json_error_t je;
        json_t *cs = json_loads(line, 0, &je);
        CHECKF(cs, "line %d: %s", cases + 1, je.text);
        const char *name = json_string_value(json_object_get(cs, "name"));
        size_t nwant;
        int64_t *want = tj_ints(json_object_get(cs, "ids"), &nwant);
        int32_t *ids = NULL;
        size_t n = 0;
        int rc = k3_chat_encode(c, json_object_get(cs, "request"), &ids, &n, &err);
        cases++;
        if (rc) {
            t_fail_at(__FILE__, __LINE__, "%s: %s", name, err.msg);
        } else {
            size_t i = 0;
            while (i < n && i < nwant && ids[i] == want[i]) i++;
            if (i == n && n == nwant) ok++;
            else
                t_fail_at(__FILE__, __LINE__, "%s: ids differ at %zu (got %zu ids, want %zu)", name, i, n,
                          nwant);
        }
        free(ids);
        free(want);
        json_decref(cs);
    }
    free(data);
    CHECKF(cases == 26 && ok == 26, "%d of %d cases identical", ok, cases);
    k3_chat_free(c);
    tok_free(t);
}

/* The message ends k3_chat_encode_marked reports are exactly the offsets
 * just past each <|end_of_msg|> of the release encoder's ids (the fixtures'
 * 26 cases), and the ids are k3_chat_encode's. */
TEST(chat_marked_ends_follow_each_end_of_msg) {
    k3_tokenizer *t = kimi_tok();
    k3_chat *c = kimi_chat(t);
    CHECK(c);
    int32_t eom = k3_chat_markup(c).end_of_msg;
    char *data;
    size_t len;
    k3_err err = {0};
    CHECK(k3_read_file(t_repo("tests/fixtures/xtml/cases.jsonl"), &data, &len, &err) == 0);
    int cases = 0, ok = 0;
    size_t total = 0;
    for (char *line = data, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        json_error_t je;
        json_t *cs = json_loads(line, 0, &je);
        CHECKF(cs, "line %d: %s", cases + 1, je.text);
        size_t nwant;
        int64_t *want = tj_ints(json_object_get(cs, "ids"), &nwant);
        int32_t *ids = NULL;
        size_t n = 0, *ends = NULL, nends = 0;
        cases++;
        if (k3_chat_encode_marked(c, json_object_get(cs, "request"), &ids, &n, &ends, &nends, &err) == 0 &&
            n == nwant) {
            bool good = true;
            size_t k = 0;
            for (size_t i = 0; i < nwant; i++) {
                good = good && ids[i] == want[i];
                if (want[i] == eom) good = good && k < nends && ends[k++] == i + 1;
            }
            good = good && k == nends;
            ok += good;
            total += nends;
        }
        free(ids);
        free(ends);
        free(want);
        json_decref(cs);
    }
    free(data);
    CHECKF(cases == 26 && ok == 26, "%d of %d cases with the right ends", ok, cases);
    CHECK(total > 26); /* the cases hold conversations, not only single messages */
    k3_chat_free(c);
    tok_free(t);
}

/* The markup ids resolve by name in both spellings. The Kimi config's ids
 * are those of tests/fixtures/xtml/SOURCE.md's table. */
TEST(chat_markup_ids_by_name_kimi_spelling) {
    k3_tokenizer *t = kimi_tok();
    k3_chat *c = kimi_chat(t);
    CHECK(c);
    k3_chat_ids m = k3_chat_markup(c);
    CHECK(m.open == 163587 && m.close == 163588 && m.sep == 163589 && m.end_of_msg == 163586);
    CHECK(m.eos == 163585);
    CHECK(k3_chat_is_stop(c, 163586) && k3_chat_is_stop(c, 163585) && !k3_chat_is_stop(c, 163587));
    k3_chat_free(c);
    tok_free(t);
}

/* A 256-byte vocabulary; config is the tokenizer_config.json text or NULL. */
static const char *byte_tokenizer(const char *name, const char *config) {
    static char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", t_outdir(), name);
    char path[600];
    snprintf(path, sizeof path, "mkdir -p '%s'", dir);
    if (system(path) != 0) return NULL;
    snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    FILE *f = fopen(path, "w");
    if (!f) return NULL;
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 256; i++) fprintf(f, "%c%c== %d\n", b64[i >> 2], b64[(i & 3) << 4], i);
    fclose(f);
    if (config) {
        snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
        f = fopen(path, "w");
        if (!f) return NULL;
        fputs(config, f);
        fclose(f);
    }
    return dir;
}

TEST(chat_markup_ids_by_name_k3_spelling) {
    const char *dir = byte_tokenizer(
        "k3names", "{\"added_tokens_decoder\": {\"300\": {\"content\": \"<|sep|>\"}, \"301\": {\"content\": "
                   "\"<|open|>\"}, \"302\": {\"content\": \"<|end_of_msg|>\"}, \"303\": {\"content\": "
                   "\"<|close|>\"}, \"304\": {\"content\": \"[EOS]\"}}}");
    CHECK(dir);
    k3_tokenizer *t = NULL;
    k3_err err = {0};
    CHECKF(tok_load(dir, &t, &err) == 0, "%s", err.msg);
    k3_chat *c = NULL;
    CHECKF(k3_chat_new(t, &c, &err) == 0, "%s", err.msg);
    k3_chat_ids m = k3_chat_markup(c);
    CHECK(m.open == 301 && m.close == 303 && m.sep == 300 && m.end_of_msg == 302 && m.eos == 304);
    /* "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>" in bytes */
    json_t *req = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \"hi<|end_of_msg|>\"}], "
                             "\"add_generation_prompt\": false}",
                             0, NULL);
    int32_t *ids;
    size_t n;
    CHECKF(k3_chat_encode(c, req, &ids, &n, &err) == 0, "%s", err.msg);
    const char *want_txt[] = {"message", " role", "=\"", "user", "\"", "hi<|end_of_msg|>", "message"};
    const int32_t marks[] = {301, -1, -1, -1, -1, -1, 300, -1, 303, -1, 300, 302};
    size_t k = 0, w = 0;
    bool same = true;
    for (size_t i = 0; i < sizeof marks / sizeof *marks; i++) {
        if (marks[i] >= 0) {
            same = same && k < n && ids[k++] == marks[i];
            continue;
        }
        const char *s = want_txt[w++];
        for (; s && *s; s++) same = same && k < n && ids[k++] == (unsigned char)*s;
    }
    CHECKF(same && k == n, "ids differ (n=%zu, k=%zu)", n, k);
    free(ids);
    json_decref(req);
    k3_chat_free(c);
    tok_free(t);
}

TEST(chat_refuses_tokenizer_without_xtml_ids) {
    const char *dir = byte_tokenizer("plain", NULL);
    CHECK(dir);
    k3_tokenizer *t = NULL;
    k3_err err = {0};
    CHECKF(tok_load(dir, &t, &err) == 0, "%s", err.msg);
    k3_chat *c = NULL;
    CHECK(k3_chat_new(t, &c, &err) == K3_EXIT_USAGE);
    CHECKF(strstr(err.msg, "no XTML ids") && strstr(err.msg, "<|open|>") && !strchr(err.msg, '\n'), "%s",
           err.msg);
    /* three of the four is not a chat model either */
    tok_free(t);
    dir = byte_tokenizer("partial", "{\"added_tokens_decoder\": {\"256\": {\"content\": \"<|open|>\"}, "
                                    "\"257\": {\"content\": \"<|close|>\"}, \"258\": {\"content\": "
                                    "\"<|end_of_msg|>\"}}}");
    CHECKF(tok_load(dir, &t, &err) == 0, "%s", err.msg);
    CHECK(k3_chat_new(t, &c, &err) == K3_EXIT_USAGE);
    tok_free(t);
}

/* ---- hand-written expectations --------------------------------------- */

/* Expected ids from a segment list: "\x01" open, "\x02" close, "\x03" sep,
 * "\x04" end_of_msg; any other string is one text segment (specials off). */
#define O "\x01"
#define C "\x02"
#define S "\x03"
#define E "\x04"
static int32_t *expect_ids(const k3_tokenizer *t, const char *const *segs, size_t *n) {
    int32_t *out = xmalloc_array(1, sizeof *out);
    size_t cap = 1;
    *n = 0;
    for (; *segs; segs++) {
        const char *s = *segs;
        int32_t one[1], *v = one;
        size_t k = 1;
        if (s[0] >= 1 && s[0] <= 4 && !s[1]) {
            const int32_t mk[] = {0, 163587, 163588, 163589, 163586};
            one[0] = mk[(int)s[0]];
        } else {
            k3_err err;
            if (tok_encode(t, s, strlen(s), false, &v, &k, &err)) abort();
        }
        while (*n + k > cap) out = xrealloc_array(out, cap *= 2, sizeof *out);
        memcpy(out + *n, v, k * sizeof *v);
        *n += k;
        if (v != one) free(v);
    }
    return out;
}

/* The request (JSON text) gives exactly the ids of segs. */
static bool renders_as(const char *request, const char *const *segs, char *why, size_t cap) {
    k3_tokenizer *t = kimi_tok();
    k3_chat *c = kimi_chat(t);
    json_error_t je;
    json_t *req = json_loads(request, 0, &je);
    bool ok = false;
    if (!req) {
        snprintf(why, cap, "bad test JSON: %s", je.text);
    } else if (c) {
        int32_t *ids = NULL;
        size_t n = 0, nw;
        k3_err err = {0};
        int32_t *want = expect_ids(t, segs, &nw);
        if (k3_chat_encode(c, req, &ids, &n, &err)) {
            snprintf(why, cap, "encode failed: %.500s", err.msg);
        } else {
            size_t i = 0;
            while (i < n && i < nw && ids[i] == want[i]) i++;
            ok = i == n && n == nw;
            if (!ok) {
                uint8_t *gb = NULL, *wb = NULL;
                size_t gl = 0, wl = 0;
                tok_decode(t, ids + i, n - i < 12 ? n - i : 12, &gb, &gl, &err);
                tok_decode(t, want + i, nw - i < 12 ? nw - i : 12, &wb, &wl, &err);
                snprintf(why, cap, "ids differ at %zu: got '%.*s' want '%.*s'", i, (int)gl,
                         gb ? (char *)gb : "", (int)wl, wb ? (char *)wb : "");
                free(gb);
                free(wb);
            }
        }
        free(ids);
        free(want);
    }
    json_decref(req);
    k3_chat_free(c);
    tok_free(t);
    return ok;
}
#define RENDERS(req, ...)                                                         \
    do {                                                                          \
        const char *const segs_[] = {__VA_ARGS__, NULL};                          \
        char why_[1200];                                                         \
        CHECKF(renders_as(req, segs_, why_, sizeof why_), "%s", why_);            \
    } while (0)

#define USER(text) O, "message", " role", "=\"", "user", "\"", S, text, C, "message", S, E
#define GEN_THINK O, "message", " role", "=\"", "assistant", "\"", S, O, "think", S

TEST(chat_names_on_user_system_assistant) {
    RENDERS("{\"messages\": [{\"role\": \"system\", \"content\": \"s\", \"name\": \"ops\"},"
            "{\"role\": \"user\", \"content\": \"hi\", \"name\": \"bob\"},"
            "{\"role\": \"assistant\", \"content\": \"yo\", \"name\": \"\"}], \"add_generation_prompt\": false}",
            O, "message", " role", "=\"", "system", "\"", " name", "=\"", "ops", "\"", S, "s", C, "message", S, E,
            O, "message", " role", "=\"", "user", "\"", " name", "=\"", "bob", "\"", S, "hi", C, "message", S, E,
            O, "message", " role", "=\"", "assistant", "\"", S, O, "think", S, C, "think", S, O, "response", S,
            "yo", C, "response", S, C, "message", S, E);
}

/* Typed arguments: strings decoded, other values keep their own JSON text;
 * attribute values escape & and " (and nothing else). */
TEST(chat_typed_arguments_and_attribute_escaping) {
    RENDERS("{\"messages\": [{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"1\", "
            "\"type\": \"function\", \"function\": {\"name\": \"a\\\"b&c<d>\", \"arguments\": "
            "\"{\\\"s\\\": \\\"x y\\\\u00e9\\\", \\\"n\\\": 1.50, \\\"i\\\":-3e+2 , \\\"b\\\": true, \\\"z\\\": null, "
            "\\\"arr\\\": [1,2,{\\\"q\\\":\\\"\\\\u00e9\\\\n\\\"}], \\\"o\\\": {\\\"k\\\":false,\\\"a\\\":1e2}, "
            "\\\"k&\\\\\\\"\\\": \\\"\\\"}\"}}]}], \"thinking\": false, \"add_generation_prompt\": false}",
            O, "message", " role", "=\"", "assistant", "\"", S, O, "response", S, C, "response", S,
            O, "tools", S, O, "call", " tool", "=\"", "a&quot;b&amp;c<d>", "\"", " index", "=\"", "1", "\"", S,
            O, "argument", " key", "=\"", "s", "\"", " type", "=\"", "string", "\"", S, "x y\xc3\xa9", C, "argument", S,
            O, "argument", " key", "=\"", "n", "\"", " type", "=\"", "number", "\"", S, "1.50", C, "argument", S,
            O, "argument", " key", "=\"", "i", "\"", " type", "=\"", "number", "\"", S, "-3e+2", C, "argument", S,
            O, "argument", " key", "=\"", "b", "\"", " type", "=\"", "boolean", "\"", S, "true", C, "argument", S,
            O, "argument", " key", "=\"", "z", "\"", " type", "=\"", "null", "\"", S, "null", C, "argument", S,
            O, "argument", " key", "=\"", "arr", "\"", " type", "=\"", "array", "\"", S,
            "[1,2,{\"q\":\"\\u00e9\\n\"}]", C, "argument", S,
            O, "argument", " key", "=\"", "o", "\"", " type", "=\"", "object", "\"", S,
            "{\"k\":false,\"a\":1e2}", C, "argument", S,
            /* an empty string value is an empty segment: nothing */
            O, "argument", " key", "=\"", "k&amp;&quot;", "\"", " type", "=\"", "string", "\"", S, C, "argument", S,
            C, "call", S, C, "tools", S, C, "message", S, E);
}

/* Arguments that are an object already (values as json.dumps writes them),
 * "" (none), and the JSON fallback block for text that is not one JSON
 * object: malformed, blank, another JSON type. */
TEST(chat_argument_forms) {
#define JSON_BLOCK(text) O, "json", " type", "=\"", "object", "\"", S, text, C, "json", S
    RENDERS("{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": ["
            "{\"function\": {\"name\": \"f\", \"arguments\": {\"x\": [true,1.0], \"y\": {\"p\": 1e2}}}},"
            "{\"function\": {\"name\": \"g\", \"arguments\": \" \\n\"}},"
            "{\"name\": \"h\", \"arguments\": \"[1, oops\"},"
            "{\"function\": {\"name\": \"i\", \"arguments\": \"[1]\"}},"
            "{\"function\": {\"name\": \"j\", \"arguments\": \"\"}},"
            "{\"function\": {\"name\": \"k\", \"arguments\": \"{\\\"a\\\": 1} trailing\"}},"
            "{\"function\": {\"name\": \"l\", \"arguments\": \"{\\\"a\\\": 01}\"}}]}],"
            "\"thinking\": false, \"add_generation_prompt\": false}",
            O, "message", " role", "=\"", "assistant", "\"", S, O, "response", S, C, "response", S, O, "tools", S,
            O, "call", " tool", "=\"", "f", "\"", " index", "=\"", "1", "\"", S,
            O, "argument", " key", "=\"", "x", "\"", " type", "=\"", "array", "\"", S, "[true, 1.0]", C, "argument", S,
            O, "argument", " key", "=\"", "y", "\"", " type", "=\"", "object", "\"", S, "{\"p\": 100.0}", C,
            "argument", S, C, "call", S,
            O, "call", " tool", "=\"", "g", "\"", " index", "=\"", "2", "\"", S, JSON_BLOCK(" \n"), C, "call", S,
            O, "call", " tool", "=\"", "h", "\"", " index", "=\"", "3", "\"", S, JSON_BLOCK("[1, oops"), C, "call", S,
            O, "call", " tool", "=\"", "i", "\"", " index", "=\"", "4", "\"", S, JSON_BLOCK("[1]"), C, "call", S,
            O, "call", " tool", "=\"", "j", "\"", " index", "=\"", "5", "\"", S, C, "call", S,
            /* what follows the object is not read */
            O, "call", " tool", "=\"", "k", "\"", " index", "=\"", "6", "\"", S,
            O, "argument", " key", "=\"", "a", "\"", " type", "=\"", "number", "\"", S, "1", C, "argument", S,
            C, "call", S,
            O, "call", " tool", "=\"", "l", "\"", " index", "=\"", "7", "\"", S, JSON_BLOCK("{\"a\": 01}"), C,
            "call", S, C, "tools", S, C, "message", S, E);
}

/* Tool results answering calls out of order are put in call order and named
 * after the call they match; index counts the results since the assistant
 * message. A run with an unmatched id keeps its order and its own names. */
TEST(chat_tool_results_follow_call_order) {
#define CALLS                                                                                          \
    "{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": ["                                  \
    "{\"id\": \"a\", \"function\": {\"name\": \"fa\", \"arguments\": \"{}\"}},"                       \
    "{\"id\": \"b\", \"function\": {\"name\": \"fb\", \"arguments\": \"{}\"}}]}"
#define ASSIST_CALLS                                                                                   \
    O, "message", " role", "=\"", "assistant", "\"", S, O, "response", S, C, "response", S, O, "tools", S, \
        O, "call", " tool", "=\"", "fa", "\"", " index", "=\"", "1", "\"", S, C, "call", S, O, "call",      \
        " tool", "=\"", "fb", "\"", " index", "=\"", "2", "\"", S, C, "call", S, C, "tools", S, C, "message", \
        S, E
#define TOOL(name, idx, text)                                                                          \
    O, "message", " role", "=\"", "tool", "\"", " tool", "=\"", name, "\"", " index", "=\"", idx, "\"", S, \
        text, C, "message", S, E
    RENDERS("{\"messages\": [" CALLS ","
            "{\"role\": \"tool\", \"tool_call_id\": \"b\", \"name\": \"stale\", \"content\": \"B\"},"
            "{\"role\": \"tool\", \"tool_call_id\": \"a\", \"content\": \"A\"}],"
            "\"thinking\": false, \"add_generation_prompt\": false}",
            ASSIST_CALLS, TOOL("fa", "1", "A"), TOOL("fb", "2", "B"));
    RENDERS("{\"messages\": [" CALLS ","
            "{\"role\": \"tool\", \"tool_call_id\": \"b\", \"content\": \"B\"},"
            "{\"role\": \"tool\", \"tool_call_id\": \"zz\", \"name\": \"mine\", \"content\": \"Z\"},"
            "{\"role\": \"user\", \"content\": \"u\"},"
            "{\"role\": \"tool\", \"name\": \"own\", \"content\": \"late\"}],"
            "\"thinking\": false, \"add_generation_prompt\": false}",
            ASSIST_CALLS, TOOL("fa", "1", "B"), TOOL("mine", "2", "Z"), USER("u"), TOOL("own", "3", "late"));
}

/* With thinking off, history keeps only the response and tools channels; with
 * it on, the think channel is always there (empty without reasoning;
 * whitespace is reasoning), and `reasoning` stands in for an empty
 * `reasoning_content`. */
TEST(chat_reasoning_in_history) {
#define HIST                                                                                           \
    "{\"role\": \"user\", \"content\": \"q\"},"                                                       \
    "{\"role\": \"assistant\", \"content\": \"a\", \"reasoning_content\": \"why\"},"                  \
    "{\"role\": \"assistant\", \"content\": \"b\", \"reasoning_content\": \" \\n\\u3000\"},"          \
    "{\"role\": \"assistant\", \"content\": \"c\", \"reasoning_content\": \"\", \"reasoning\": \"r\"}"
    RENDERS("{\"messages\": [" HIST "], \"thinking\": false, \"thinking_effort\": \"medium\"}", USER("q"),
            O, "message", " role", "=\"", "assistant", "\"", S, O, "response", S, "a", C, "response", S, C,
            "message", S, E,
            O, "message", " role", "=\"", "assistant", "\"", S, O, "response", S, "b", C, "response", S, C,
            "message", S, E,
            O, "message", " role", "=\"", "assistant", "\"", S, O, "response", S, "c", C, "response", S, C,
            "message", S, E,
            O, "message", " role", "=\"", "assistant", "\"", S, O, "response", S);
    RENDERS("{\"messages\": [" HIST "]}", USER("q"),
            O, "message", " role", "=\"", "assistant", "\"", S, O, "think", S, "why", C, "think", S, O,
            "response", S, "a", C, "response", S, C, "message", S, E,
            O, "message", " role", "=\"", "assistant", "\"", S, O, "think", S, " \n\xe3\x80\x80", C, "think", S,
            O, "response", S, "b", C, "response", S, C, "message", S, E,
            O, "message", " role", "=\"", "assistant", "\"", S, O, "think", S, "r", C, "think", S, O,
            "response", S, "c", C, "response", S, C, "message", S, E, GEN_THINK);
}

/* A system message with tools declares them mid-conversation (its content is
 * not rendered); schemas are compact, key-sorted, reals as Python repr. */
TEST(chat_dynamic_tools_and_json_formatting) {
    RENDERS("{\"messages\": [{\"role\": \"user\", \"content\": \"q\"},"
            "{\"role\": \"system\", \"content\": \"ignored\", \"tools\": [{\"type\": \"function\", \"function\": "
            "{\"name\": \"n\\u00e9\", \"parameters\": {\"z\": 1e-7, \"y\": 0.1, \"x\": 1e16, \"w\": 123456789012345.0,"
            " \"v\": -0.0, \"u\": 0.0001, \"t\": \"tab\\t\\u0001\\\"\\\\/\"}}}]}],"
            "\"add_generation_prompt\": false}",
            USER("q"), O, "message", " role", "=\"", "system", "\"", " type", "=\"", "tool-declare", "\"", S,
            "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
            "```json\n[{\"function\":{\"name\":\"n\xc3\xa9\",\"parameters\":{\"t\":\"tab\\t\\u0001\\\"\\\\/\","
            "\"u\":0.0001,\"v\":-0.0,\"w\":123456789012345.0,\"x\":1e+16,\"y\":0.1,\"z\":1e-07}},"
            "\"type\":\"function\"}]\n```",
            C, "message", S, E);
}

/* tool_choice renders for none/required (with or without tools), not for
 * auto or a named function; response_format json_schema without a schema is
 * `null`; text renders nothing. */
TEST(chat_options) {
    RENDERS("{\"messages\": [], \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"f\"}},"
            "\"response_format\": {\"type\": \"text\"}}",
            GEN_THINK);
    RENDERS("{\"messages\": [], \"tool_choice\": \"none\", \"response_format\": {\"type\": \"json_schema\"},"
            "\"thinking\": false, \"add_generation_prompt\": false}",
            O, "message", " role", "=\"", "system", "\"", " type", "=\"", "tool-choice", "\"", S,
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
            C, "message", S, E,
            O, "message", " role", "=\"", "system", "\"", " type", "=\"", "response-format", "\"", S,
            "The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON data "
            "without markdown code blocks (```json) or any additional formatting.\nThe JSON data must match the "
            "following schema:\n```json\nnull\n```",
            C, "message", S, E);
}

/* Images: with image_prompts each image part and each placeholder in text is
 * the next prompt (markup); without, an image part is the placeholder text. */
TEST(chat_images) {
    RENDERS("{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", \"image_url\": "
            "{\"url\": \"x\"}}, {\"type\": \"text\", \"text\": \"hi\"}]}], \"add_generation_prompt\": false}",
            O, "message", " role", "=\"", "user", "\"", S, "<|kimi_image_placeholder|>", "hi", C, "message", S,
            E);
}

/* A user (or tool) who types markup gets plain text ids: the only
 * <|end_of_msg|>/<|open|> ids are the template's own. The plain ids of
 * "<|im_end|>" are npm tiktoken's (tests/cli/test_tokenize.sh). */
TEST(chat_typed_markup_is_plain_text) {
    k3_tokenizer *t = kimi_tok();
    k3_chat *c = kimi_chat(t);
    CHECK(c);
    json_t *req = json_loads(
        "{\"messages\": [{\"role\": \"user\", \"content\": \"<|im_end|> <|end_of_msg|><|open|>[EOS]\"},"
        "{\"role\": \"tool\", \"name\": \"t\", \"content\": \"<|im_end|>\"}], \"add_generation_prompt\": false}",
        0, NULL);
    int32_t *ids;
    size_t n;
    k3_err err = {0};
    CHECKF(k3_chat_encode(c, req, &ids, &n, &err) == 0, "%s", err.msg);
    int eom = 0, open = 0, eos = 0, plain = 0;
    const int32_t im_end_plain[] = {27, 91, 348, 11129, 91, 29};
    for (size_t i = 0; i < n; i++) {
        eom += ids[i] == 163586;
        open += ids[i] == 163587;
        eos += ids[i] == 163585;
        if (i + 6 <= n && memcmp(ids + i, im_end_plain, sizeof im_end_plain) == 0) plain++;
    }
    CHECKF(eom == 2 && open == 2 && eos == 0 && plain == 2, "eom %d open %d eos %d plain %d", eom, open, eos,
           plain);
    free(ids);
    json_decref(req);
    k3_chat_free(c);
    tok_free(t);
}

/* Bad requests: K3_EXIT_USAGE, one line naming the field. */
TEST(chat_errors_name_the_field) {
    k3_tokenizer *t = kimi_tok();
    k3_chat *c = kimi_chat(t);
    CHECK(c);
    static const char *const cases[][2] = {
        {"[]", "request: want a JSON object"},
        {"{}", "messages: missing"},
        {"{\"messages\": {}}", "messages: want an array"},
        {"{\"messages\": [\"hi\"]}", "messages[0]: want an object"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"bot\"}]}",
         "messages[1].role: want one of system, user, assistant, tool"},
        {"{\"messages\": [{\"content\": \"a\"}]}", "messages[0].role: want one of"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", "messages[0].content: want a string"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"text\": \"a\"}]}]}",
         "messages[0].content[0].type: want a string"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}",
         "messages[0].content[0].text: want a string"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\", \"name\": 3}]}", "messages[0].name: want a string"},
        {"{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": {}}]}", "messages[0].tool_calls: want an array"},
        {"{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"arguments\": \"{}\"}}]}]}",
         "messages[0].tool_calls[0].function.name: want a string"},
        {"{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"name\": \"f\", "
         "\"arguments\": 7}}]}]}",
         "messages[0].tool_calls[0].function.arguments: want a JSON string or an object"},
        {"{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}", "messages[0]: a tool message needs"},
        {"{\"messages\": [{\"role\": \"tool\", \"tool_call_id\": 1, \"content\": \"x\"}]}",
         "messages[0].tool_call_id: want a string"},
        {"{\"messages\": [], \"tools\": {}}", "tools: want an array"},
        {"{\"messages\": [], \"thinking\": \"yes\"}", "thinking: want true or false"},
        {"{\"messages\": [], \"thinking_effort\": \"medium\"}", "thinking_effort: want one of low, high, max"},
        {"{\"messages\": [], \"add_generation_prompt\": 1}", "add_generation_prompt: want true or false"},
        {"{\"messages\": [], \"tool_choice\": 1}", "tool_choice: want a string or an object"},
        {"{\"messages\": [], \"image_prompts\": [1]}", "image_prompts[0]: want a string"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image\"}]}], \"image_prompts\": []}",
         "image_prompts: more images than image prompts"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"image_prompts\": [\"x\"]}",
         "image_prompts: 1 given, 0 images"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        json_t *req = json_loads(cases[i][0], JSON_DECODE_ANY, NULL);
        CHECKF(req, "bad test JSON %zu", i);
        int32_t *ids = NULL;
        size_t n;
        k3_err err = {0};
        int rc = k3_chat_encode(c, req, &ids, &n, &err);
        json_decref(req);
        CHECKF(rc == K3_EXIT_USAGE && err.code == K3_EXIT_USAGE, "%s: rc %d", cases[i][0], rc);
        CHECKF(strncmp(err.msg, cases[i][1], strlen(cases[i][1])) == 0 && !strchr(err.msg, '\n'),
               "%s: got '%s', want '%s...'", cases[i][0], err.msg, cases[i][1]);
    }
    k3_err err = {0};
    json_t *req = json_loads("{\"messages\": [], \"thinkng\": false}", 0, NULL);
    CHECK(k3_chat_check_fields(req, &err) == K3_EXIT_USAGE);
    CHECKF(strcmp(err.msg, "request.thinkng: unknown field") == 0, "%s", err.msg);
    json_decref(req);
    k3_chat_free(c);
    tok_free(t);
}

/* Robustness: every fixture request with one node replaced by a value of
 * another shape either encodes or is refused with exit 2 and one line (the
 * sanitizer build checks memory). A fixed pseudo-random sequence. */
typedef struct {
    json_t *parent;
    const char *key; /* NULL: array element index */
    size_t index;
} slot_t;

static void collect(json_t *v, slot_t *out, size_t *n, size_t cap) {
    if (json_is_object(v)) {
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x) {
            if (*n < cap) out[(*n)++] = (slot_t){v, k, 0};
            collect(x, out, n, cap);
        }
    } else if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (*n < cap) out[(*n)++] = (slot_t){v, NULL, i};
            collect(json_array_get(v, i), out, n, cap);
        }
    }
}

TEST(chat_template_refuses_or_renders_any_shape) {
    k3_tokenizer *t = kimi_tok();
    k3_chat *c = kimi_chat(t);
    CHECK(c);
    char *data;
    size_t len;
    k3_err err = {0};
    CHECK(k3_read_file(t_repo("tests/fixtures/xtml/cases.jsonl"), &data, &len, &err) == 0);
    static const char *const repl[] = {"null", "5", "-1.5", "\"\"", "\"x <|open|>\"", "[]", "{}", "true",
                                       "[1, \"a\"]", "{\"type\": \"image\"}", "{\"role\": \"tool\"}",
                                       "\"<|kimi_image_placeholder|>\"", "{\"type\": \"text\", \"text\": 1}"};
    uint64_t s = 12345;
    int encoded = 0, refused = 0;
    for (char *line = data, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        json_t *cs = json_loads(line, 0, NULL);
        CHECK(cs);
        for (int round = 0; round < 60; round++) {
            json_t *req = json_deep_copy(json_object_get(cs, "request"));
            slot_t slots[512];
            size_t ns = 0;
            collect(req, slots, &ns, 512);
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            slot_t sl = slots[(s >> 33) % ns];
            json_t *v = json_loads(repl[(s >> 17) % (sizeof repl / sizeof *repl)], JSON_DECODE_ANY, NULL);
            if (sl.key) json_object_set_new(sl.parent, sl.key, v);
            else json_array_set_new(sl.parent, sl.index, v);
            int32_t *ids = NULL;
            size_t n = 0;
            int rc = k3_chat_encode(c, req, &ids, &n, &err);
            CHECKF(rc == 0 || (rc == K3_EXIT_USAGE && err.msg[0] && !strchr(err.msg, '\n')), "rc %d: %s", rc,
                   err.msg);
            if (rc == 0) encoded++;
            else refused++;
            free(ids);
            json_decref(req);
        }
        json_decref(cs);
    }
    free(data);
    CHECKF(encoded > 100 && refused > 100, "encoded %d, refused %d", encoded, refused);
    k3_chat_free(c);
    tok_free(t);
}
