/* Tests for structured output (constrain/).
 *
 * The JSON machine is checked against jansson's parser on thousands of
 * generated texts (valid ones, and the same mutated: a byte dropped,
 * inserted, replaced, the text cut), every prefix of a valid text must be
 * accepted, and schema cases are written out by hand from JSON Schema's
 * rules. The mask is checked against feeding each of the Kimi tokenizer's
 * 163,840 ids on its own. */
#include "constrain/internal.h" /* k3_jstate_hold: a raw string argument */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rnd(uint64_t *s, uint64_t n) { return k3_rng_next(s) % n; }

static void ws(k3_sbuf *b, uint64_t *s) {
    static const char W[] = " \n\t\r";
    for (uint64_t n = rnd(s, 4) == 0 ? rnd(s, 3) : 0; n; n--) k3_sb_putc(b, W[rnd(s, 4)]);
}

static void gen_string(k3_sbuf *b, uint64_t *s) {
    static const char *const PIECES[] = {"a", "Z", " ", "\\\"", "\\\\", "\\/", "\\n", "\\t", "\\u00e9", "\\uD83D\\uDE00",
                                         "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\\u0041", ",", "}", "]", ":"};
    k3_sb_putc(b, '"');
    for (uint64_t n = rnd(s, 6); n; n--) k3_sb_puts(b, PIECES[rnd(s, sizeof PIECES / sizeof *PIECES)]);
    k3_sb_putc(b, '"');
}

static void gen_number(k3_sbuf *b, uint64_t *s) {
    if (rnd(s, 3) == 0) k3_sb_putc(b, '-');
    if (rnd(s, 4) == 0) {
        k3_sb_putc(b, '0');
    } else {
        k3_sb_putc(b, (char)('1' + rnd(s, 9)));
        for (uint64_t n = rnd(s, 12); n; n--) k3_sb_putc(b, (char)('0' + rnd(s, 10)));
    }
    if (rnd(s, 3) == 0) {
        k3_sb_putc(b, '.');
        for (uint64_t n = 1 + rnd(s, 6); n; n--) k3_sb_putc(b, (char)('0' + rnd(s, 10)));
    }
    if (rnd(s, 4) == 0) {
        k3_sb_putc(b, rnd(s, 2) ? 'e' : 'E');
        if (rnd(s, 2)) k3_sb_putc(b, rnd(s, 2) ? '+' : '-');
        k3_sb_putc(b, (char)('0' + rnd(s, 10)));
    }
}

static void gen_value(k3_sbuf *b, uint64_t *s, int depth, bool object) {
    int kind = object ? 0 : (int)rnd(s, depth > 5 ? 5 : 7);
    switch (kind) {
    case 5:
    case 0: {
        k3_sb_putc(b, '{');
        ws(b, s);
        for (uint64_t i = 0, n = rnd(s, 4); i < n; i++) {
            if (i) { k3_sb_putc(b, ','); ws(b, s); }
            gen_string(b, s);
            ws(b, s);
            k3_sb_putc(b, ':');
            ws(b, s);
            gen_value(b, s, depth + 1, false);
            ws(b, s);
        }
        k3_sb_putc(b, '}');
        break;
    }
    case 6: {
        k3_sb_putc(b, '[');
        ws(b, s);
        for (uint64_t i = 0, n = rnd(s, 4); i < n; i++) {
            if (i) { k3_sb_putc(b, ','); ws(b, s); }
            gen_value(b, s, depth + 1, false);
            ws(b, s);
        }
        k3_sb_putc(b, ']');
        break;
    }
    case 1: gen_string(b, s); break;
    case 2: gen_number(b, s); break;
    case 3: k3_sb_puts(b, rnd(s, 2) ? "true" : "false"); break;
    default: k3_sb_puts(b, "null"); break;
    }
}

/* The machine's verdict on a whole text: fed and complete. */
static bool machine_ok(const k3_jschema *sc, const char *p, size_t n) {
    k3_jstate st;
    k3_jstate_init(&st, sc);
    return k3_jstate_feed(&st, (const uint8_t *)p, n) && k3_jstate_done(&st);
}

static bool jansson_object(const char *p, size_t n) {
    json_t *v = json_loadb(p, n, 0, NULL);
    bool ok = json_is_object(v);
    json_decref(v);
    return ok;
}

TEST(constrain_json_object_agrees_with_jansson) {
    k3_jschema *sc = NULL;
    k3_err err = {0};
    CHECK(k3_jschema_compile(NULL, &sc, NULL, 0, &err) == 0);
    uint64_t seed = 42;
    static const char MUT[] = "{}[]\",:\\ 0-.eE+tfnu\x01\x7f\xc3\xa9\xed\xa0\xff\xc0";
    int valid = 0, invalid = 0, agree_bad = 0;
    for (int i = 0; i < 6000; i++) {
        k3_sbuf b = {0};
        ws(&b, &seed);
        gen_value(&b, &seed, 0, true);
        k3_sb_put(&b, "", 0);
        CHECKF(machine_ok(sc, b.p, b.n), "valid text refused: %.*s", (int)b.n, b.p);
        CHECKF(jansson_object(b.p, b.n), "generator made bad JSON: %.*s", (int)b.n, b.p);
        /* every prefix is accepted */
        k3_jstate st;
        k3_jstate_init(&st, sc);
        for (size_t j = 0; j < b.n; j++) {
            CHECKF(k3_jstate_feed(&st, (const uint8_t *)b.p + j, 1), "prefix of %.*s refused at %zu", (int)b.n, b.p, j);
            CHECKF(j + 1 == b.n || !k3_jstate_done(&st), "complete before the end: %.*s", (int)b.n, b.p);
        }
        valid++;
        /* a mutation: both must agree */
        size_t at = b.n ? rnd(&seed, b.n) : 0;
        int how = (int)rnd(&seed, 4);
        k3_sbuf m = {0};
        k3_sb_put(&m, b.p, at);
        char c = MUT[rnd(&seed, sizeof MUT - 1)];
        if (how == 1) k3_sb_putc(&m, c);
        if (how == 2) { k3_sb_putc(&m, c); at++; }
        if (how == 0) at++;
        if (how != 3 && at <= b.n) k3_sb_put(&m, b.p + at, b.n - at);
        /* trailing whitespace: jansson takes it, the machine ends at the value */
        while (m.n && strchr(" \n\t\r", m.p[m.n - 1])) m.n--;
        k3_sb_put(&m, "", 0);
        bool want = jansson_object(m.p, m.n), got = machine_ok(sc, m.p, m.n);
        CHECKF(want == got, "jansson %s, machine %s: %.*s", want ? "accepts" : "refuses", got ? "accepts" : "refuses",
               (int)m.n, m.p);
        if (!want) agree_bad++;
        invalid += !want;
        k3_sb_free(&m);
        k3_sb_free(&b);
    }
    CHECKF(agree_bad > 1000, "only %d mutations were invalid JSON", agree_bad);
    (void)invalid;
    (void)valid;
    k3_jschema_free(sc);
}

TEST(constrain_json_edges) {
    k3_jschema *sc = NULL;
    k3_err err = {0};
    CHECK(k3_jschema_compile(NULL, &sc, NULL, 0, &err) == 0);
    static const struct {
        const char *text;
        bool ok;
    } C[] = {
        {"{}", true}, {" {}", true}, {"{} ", false /* nothing after the value */}, {"[]", false}, {"\"a\"", false},
        {"{\"a\":1}", true}, {"{\"a\":01}", false}, {"{\"a\":-0}", true}, {"{\"a\":1.}", false},
        {"{\"a\":1e5}", true}, {"{\"a\":1e+05}", true}, {"{\"a\":1e123}", false /* bound: 2 exponent digits */},
        {"{\"a\":123456789012345678}", true}, {"{\"a\":1234567890123456789}", false /* bound: 18 digits */},
        {"{\"a\":\"\\u0000\"}", false}, {"{\"a\":\"\\uD83D\\uDE00\"}", true}, {"{\"a\":\"\\uDE00\"}", false},
        {"{\"a\":\"\\uD83D\"}", false}, {"{\"a\":\"\\uD83Dx\"}", false}, {"{\"a\":\"\xed\xa0\x80\"}", false},
        {"{\"a\":\"\xc0\xaf\"}", false}, {"{\"a\":\"\xf4\x90\x80\x80\"}", false}, {"{\"a\":\"\xf4\x8f\xbf\xbf\"}", true},
        {"{\"a\":\"\t\"}", false}, {"{\"a\" : [ true , false , null ] }", true}, {"{\"a\":tru}", false},
        {"{\"a\":1,}", false}, {"{,}", false}, {"{\"a\"}", false},
        {"{                 }", false /* 17 spaces: bound 16 */}, {"{                }", true},
    };
    for (size_t i = 0; i < sizeof C / sizeof *C; i++)
        CHECKF(machine_ok(sc, C[i].text, strlen(C[i].text)) == C[i].ok, "%s: want %s", C[i].text,
               C[i].ok ? "accepted" : "refused");
    /* nesting beyond the bound is refused, at the bound accepted */
    k3_sbuf b = {0};
    for (int i = 0; i < K3_JSON_MAX_DEPTH; i++) k3_sb_puts(&b, i ? "[" : "{\"a\":");
    k3_jstate st;
    k3_jstate_init(&st, sc);
    CHECK(k3_jstate_feed(&st, (const uint8_t *)b.p, b.n));
    CHECK(!k3_jstate_feed(&st, (const uint8_t *)"[", 1));
    k3_sb_free(&b);
    k3_jschema_free(sc);
}

static k3_jschema *compile(const char *text, char *where, size_t nwhere, k3_err *err) {
    json_t *j = json_loads(text, 0, NULL);
    k3_jschema *sc = NULL;
    if (!j) return NULL;
    if (k3_jschema_compile(j, &sc, where, nwhere, err)) sc = NULL;
    json_decref(j);
    return sc;
}

TEST(constrain_schema_cases) {
    static const struct {
        const char *schema, *text;
        bool ok;
    } C[] = {
        {"{\"type\":\"integer\"}", "12", true},
        {"{\"type\":\"integer\"}", "1.5", false},
        {"{\"type\":\"integer\"}", "1e3", false /* the machine writes integers as digits only */},
        {"{\"type\":\"number\"}", "-1.5e3", true},
        {"{\"type\":\"string\"}", "\"x\"", true},
        {"{\"type\":\"string\"}", "1", false},
        {"{\"type\":[\"string\",\"null\"]}", "null", true},
        {"{\"type\":[\"string\",\"null\"]}", "true", false},
        {"{\"type\":\"boolean\"}", "false", true},
        {"{\"enum\":[\"red\",\"green\",1,12,null]}", "\"green\"", true},
        {"{\"enum\":[\"red\",\"green\",1,12,null]}", "\"blue\"", false},
        {"{\"enum\":[\"red\",\"green\",1,12,null]}", "1", true},
        {"{\"enum\":[\"red\",\"green\",1,12,null]}", "12", true},
        {"{\"enum\":[\"red\",\"green\",1,12,null]}", "13", false},
        {"{\"type\":\"string\",\"enum\":[\"a\",1]}", "1", false /* enum values the type refuses are dropped */},
        {"{\"const\":{\"k\":[1,2]}}", "{\"k\":[1,2]}", true},
        {"{\"const\":{\"k\":[1,2]}}", "{\"k\": [1,2]}", false /* literals are compact */},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}},"
         "\"required\":[\"a\"],\"additionalProperties\":false}", "{\"a\":1}", true},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}},"
         "\"required\":[\"a\"],\"additionalProperties\":false}", "{\"b\":\"x\"}", false},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}},"
         "\"required\":[\"a\"],\"additionalProperties\":false}", "{\"b\":\"x\",\"a\":2}", true},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}},"
         "\"required\":[\"a\"],\"additionalProperties\":false}", "{\"a\":1,\"a\":2}", false},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}},"
         "\"required\":[\"a\"],\"additionalProperties\":false}", "{\"a\":1,\"c\":2}", false},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"additionalProperties\":{\"type\":\"boolean\"}}",
         "{\"c\":true,\"a\":3}", true},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"additionalProperties\":{\"type\":\"boolean\"}}",
         "{\"c\":3}", false},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"additionalProperties\":{\"type\":\"boolean\"}}",
         "{\"a\":true}", false /* a declared name takes its own schema */},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"additionalProperties\":{\"type\":\"boolean\"}}",
         "{\"\\u0061\":true}", false /* also when escaped */},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}", "{\"a\":1,\"a\":2}", false},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}", "[1,2,3]", true},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}", "[1,\"2\"]", false},
        {"{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"n\":{\"enum\":[\"x\"]}},"
         "\"required\":[\"n\"],\"additionalProperties\":false}}", "[{\"n\":\"x\"},{\"n\":\"x\"}]", true},
        {"{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"n\":{\"enum\":[\"x\"]}},"
         "\"required\":[\"n\"],\"additionalProperties\":false}}", "[{}]", false},
        {"{\"title\":\"t\",\"description\":\"d\",\"type\":\"null\"}", "null", true},
        {"{}", "[1,{\"a\":\"b\"}]", true},
    };
    for (size_t i = 0; i < sizeof C / sizeof *C; i++) {
        char where[256];
        k3_err err = {0};
        k3_jschema *sc = compile(C[i].schema, where, sizeof where, &err);
        CHECKF(sc, "%s: %s", C[i].schema, err.msg);
        CHECKF(machine_ok(sc, C[i].text, strlen(C[i].text)) == C[i].ok, "%s on %s: want %s", C[i].schema, C[i].text,
               C[i].ok ? "accepted" : "refused");
        json_t *v = json_loads(C[i].text, JSON_DECODE_ANY, NULL);
        /* the machine is stricter than JSON Schema on a repeated name (jansson
         * keeps the last), a literal's spacing and an integer's spelling */
        if (v && !strstr(C[i].text, "\": [") && !strstr(C[i].text, ",\"a\":2") && strcmp(C[i].text, "1e3"))
            CHECKF(k3_jschema_valid(sc, v) == C[i].ok, "validator: %s on %s", C[i].schema, C[i].text);
        json_decref(v);
        k3_jschema_free(sc);
    }
}

TEST(constrain_schema_refuses_what_it_cannot_enforce) {
    static const struct {
        const char *schema, *where, *says;
    } C[] = {
        {"{\"type\":\"string\",\"pattern\":\"a+\"}", "pattern", "'pattern' is not supported"},
        {"{\"properties\":{\"age\":{\"type\":\"integer\",\"minimum\":0}}}", "properties.age.minimum", "'minimum'"},
        {"{\"items\":{\"anyOf\":[]}}", "items.anyOf", "'anyOf'"},
        {"{\"$ref\":\"#/x\"}", "$ref", "'$ref'"},
        {"{\"type\":\"date\"}", "type", "'date'"},
        {"{\"items\":[{}]}", "items", "tuple"},
        {"{\"properties\":{\"a\":{}},\"required\":[\"b\"]}", "required", "'b' is not in properties"},
        {"{\"type\":\"string\",\"enum\":[1,2]}", "enum", "no value"},
        {"{\"additionalProperties\":3}", "additionalProperties", "boolean or a schema"},
        {"{\"properties\":{\"a\":false}}", "properties.a", "matches nothing"},
    };
    for (size_t i = 0; i < sizeof C / sizeof *C; i++) {
        char where[256];
        k3_err err = {0};
        k3_jschema *sc = compile(C[i].schema, where, sizeof where, &err);
        CHECKF(!sc, "%s: accepted", C[i].schema);
        CHECKF(!strcmp(where, C[i].where), "%s: where '%s', want '%s'", C[i].schema, where, C[i].where);
        CHECKF(strstr(err.msg, C[i].says), "%s: '%s' does not say '%s'", C[i].schema, err.msg, C[i].says);
    }
    /* nesting beyond the bound */
    k3_sbuf b = {0};
    for (int i = 0; i <= K3_JSCHEMA_MAX_DEPTH; i++) k3_sb_puts(&b, "{\"items\":");
    k3_sb_puts(&b, "{}");
    for (int i = 0; i <= K3_JSCHEMA_MAX_DEPTH; i++) k3_sb_putc(&b, '}');
    k3_sb_put(&b, "", 0);
    char where[256];
    k3_err err = {0};
    CHECK(!compile(b.p, where, sizeof where, &err));
    CHECK(strstr(err.msg, "deeper"));
    k3_sb_free(&b);
}

/* The mask of st (allow, one byte per base id) against the plain
 * definition: each id's bytes fed on their own to a copy of st. */
static void mask_equals_feeding(const k3_jstate *st, const k3_tokenizer *t, const k3_tokbytes *tb, uint8_t *allow,
                                const char *label) {
    size_t count = k3_jstate_mask(st, tb, allow), want_count = 0;
    for (int32_t id = 0; id < tok_n_base(t); id++) {
        size_t n;
        const uint8_t *p = tok_token_bytes(t, id, &n);
        k3_jstate c = *st;
        bool want = p && n && k3_jstate_feed(&c, p, n);
        want_count += want;
        CHECKF(allow[id] == want, "%s: id %d ('%.*s') mask %d, feeding it %d", label, id, (int)n,
               p ? (const char *)p : "", allow[id], want);
    }
    CHECKF(count == want_count && count > 0, "%s: %zu allowed, want %zu", label, count, want_count);
}

/* The mask against the plain definition: each id fed on its own. */
TEST(constrain_mask_equals_feeding_each_id) {
    k3_tokenizer *t = NULL;
    k3_err err = {0};
    CHECKF(tok_load(t_repo("tests/fixtures/tokenizer/kimi"), &t, &err) == 0, "%s", err.msg);
    k3_tokbytes *tb = k3_tokbytes_new(t);
    char where[64];
    k3_jschema *sc = compile("{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"n\":{\"type\":"
                             "\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"bc\"]}}},"
                             "\"required\":[\"name\",\"n\"],\"additionalProperties\":false}", where, sizeof where, &err);
    CHECK(sc);
    static const char *const PREFIXES[] = {"", "{", "{\"", "{\"na", "{\"name\"", "{\"name\":", "{\"name\":\"x",
                                           "{\"name\":\"x\\", "{\"name\":\"\xc3", "{\"name\":\"x\",\"n\":1",
                                           "{\"name\":\"x\",\"n\":1,\"tags\":[", "{\"name\":\"x\",\"n\":1,\"tags\":[\"b",
                                           "{\"name\":\"x\",\"n\":-"};
    int nb = tok_n_base(t);
    uint8_t *allow = xmalloc((size_t)nb);
    for (size_t i = 0; i < sizeof PREFIXES / sizeof *PREFIXES; i++) {
        k3_jstate st;
        k3_jstate_init(&st, sc);
        CHECKF(k3_jstate_feed(&st, (const uint8_t *)PREFIXES[i], strlen(PREFIXES[i])), "%s", PREFIXES[i]);
        mask_equals_feeding(&st, t, tb, allow, PREFIXES[i]);
    }
    free(allow);
    k3_jschema_free(sc);
    k3_tokbytes_free(tb);
    tok_free(t);
}

/* The same for a tool call's string argument, written raw (quotes,
 * backslashes and control characters are its text), also when an enum
 * holds it to values that need escapes as JSON. */
TEST(constrain_raw_string_mask_equals_feeding_each_id) {
    k3_tokenizer *t = NULL;
    k3_err err = {0};
    CHECKF(tok_load(t_repo("tests/fixtures/tokenizer/kimi"), &t, &err) == 0, "%s", err.msg);
    k3_tokbytes *tb = k3_tokbytes_new(t);
    static const struct {
        const char *schema, *prefix;
    } C[] = {{"{\"type\":\"string\"}", ""},
             {"{\"type\":\"string\"}", "a\"b\\"},
             {"{\"type\":\"string\"}", "\xe2\x82"},
             {"{\"enum\":[\"a\\\"b\",\"a\\nc\",\"x\\u0001\",3]}", "a"},
             {"{\"enum\":[\"a\\\"b\",\"a\\nc\",\"x\\u0001\",3]}", "x"}};
    int nb = tok_n_base(t);
    uint8_t *allow = xmalloc((size_t)nb);
    for (size_t i = 0; i < sizeof C / sizeof *C; i++) {
        char where[64];
        k3_jschema *sc = compile(C[i].schema, where, sizeof where, &err);
        CHECK(sc);
        k3_jstate st;
        k3_jstate_init(&st, sc);
        k3_jstate_hold(&st, T_STR, true);
        CHECKF(k3_jstate_feed(&st, (const uint8_t *)C[i].prefix, strlen(C[i].prefix)), "%s", C[i].prefix);
        char label[32];
        snprintf(label, sizeof label, "case %zu", i);
        mask_equals_feeding(&st, t, tb, allow, label);
        k3_jschema_free(sc);
    }
    /* forced text: the ids whose bytes are a prefix of it, against a pass
     * over every id */
    static const char *const FORCED[] = {"call tool=\"", "get_weather\" index=\"1\"", "argument key=\"",
                                         "\xe4\xbd\xa0\xe5\xa5\xbd \"&amp;\"", "response", "x"};
    for (size_t i = 0; i < sizeof FORCED / sizeof *FORCED; i++) {
        size_t fl = strlen(FORCED[i]);
        memset(allow, 0, (size_t)nb);
        size_t count = k3_tokbytes_prefixes(tb, (const uint8_t *)FORCED[i], fl, nb, allow), want_count = 0;
        for (int32_t id = 0; id < nb; id++) {
            size_t n;
            const uint8_t *p = tok_token_bytes(t, id, &n);
            bool want = p && n && n <= fl && !memcmp(p, FORCED[i], n);
            want_count += want;
            CHECKF(allow[id] == want, "'%s': id %d ('%.*s') %d, want %d", FORCED[i], id, (int)n, (const char *)p,
                   allow[id], want);
        }
        CHECKF(count == want_count && count > 0, "'%s': %zu ids, want %zu", FORCED[i], count, want_count);
    }
    /* what the raw text spells: its JSON form is the enum value's */
    char where[64];
    k3_jschema *sc = compile("{\"enum\":[\"a\\\"b\",\"x\\u0001\",\"t\\tu\"]}", where, sizeof where, &err);
    static const struct {
        const char *raw;
        bool ok;
    } R[] = {{"a\"b", true}, {"x\x01", true}, {"t\tu", true}, {"a\\\"b", false}, {"x", false}, {"a\"bc", false}};
    for (size_t i = 0; i < sizeof R / sizeof *R; i++) {
        k3_jstate st;
        k3_jstate_init(&st, sc);
        k3_jstate_hold(&st, T_STR, true);
        bool ok = k3_jstate_feed(&st, (const uint8_t *)R[i].raw, strlen(R[i].raw)) && k3_jstate_raw_done(&st);
        CHECKF(ok == R[i].ok, "raw '%s': want %s", R[i].raw, R[i].ok ? "complete" : "refused");
    }
    k3_jschema_free(sc);
    free(allow);
    k3_tokbytes_free(tb);
    tok_free(t);
}

/* ---- tool calls ----
 *
 * The reference is the chat module's renderer: an assistant message with a
 * tool call rendered into the history gives the prompt followed by exactly
 * the ids a model writes for that call (docs/chat.md), so the constraint
 * must accept those ids, end there, and refuse the same message changed
 * where the tool's schema or the choice forbids it. Walks sampled under the
 * mask go the other way: the parser reads each back as a call whose
 * arguments are checked below against the schema by hand. */

static const char *const CALL_TOOLS =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"},\"unit\":{\"enum\":[\"c\",\"f\"]},"
    "\"hourly\":{\"type\":\"boolean\"},\"fields\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}},"
    "\"opt\":{\"type\":[\"number\",\"null\"]},\"tag\":{\"type\":[\"string\",\"integer\"],\"enum\":[\"a&b\",7]}},"
    "\"required\":[\"city\",\"days\"],\"additionalProperties\":false}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"say \\\"hi\\\" & go\",\"strict\":true,\"parameters\":{\"type\":"
    "\"object\",\"properties\":{\"q\":{\"type\":\"string\"}},\"required\":[\"q\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"noargs\"}}]";

typedef struct {
    k3_tokenizer *t;
    k3_chat *chat;
    k3_tokbytes *tb;
    json_t *tools;
    k3_callspec *any;
} call_fix;

static bool call_fix_open(call_fix *f) {
    k3_err err = {0};
    memset(f, 0, sizeof *f);
    if (tok_load(t_repo("tests/fixtures/tokenizer/kimi"), &f->t, &err) || k3_chat_new(f->t, &f->chat, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return false;
    }
    f->tb = k3_tokbytes_new(f->t);
    f->tools = json_loads(CALL_TOOLS, 0, NULL);
    char where[256];
    if (!f->tools || k3_callspec_compile(f->tools, K3_CALLS_REQUIRED, NULL, false, &f->any, where, sizeof where, &err)) {
        fprintf(stderr, "%s: %s\n", where, err.msg);
        return false;
    }
    return true;
}

static void call_fix_close(call_fix *f) {
    k3_callspec_free(f->any);
    json_decref(f->tools);
    k3_tokbytes_free(f->tb);
    k3_chat_free(f->chat);
    tok_free(f->t);
}

/* The ids the template renders for an assistant message (after the
 * generation prefix). */
static int32_t *rendered_reply(const call_fix *f, const char *assistant, bool thinking, size_t *n) {
    char body[4096];
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"Go.\"}],\"thinking\":%s}",
             thinking ? "true" : "false");
    json_t *req = json_loads(body, 0, NULL);
    json_object_set(req, "tools", f->tools);
    int32_t *prompt = NULL, *hist = NULL;
    size_t np = 0, nh = 0;
    k3_err err = {0};
    json_t *msg = json_loads(assistant, 0, NULL);
    if (!req || !msg || k3_chat_encode(f->chat, req, &prompt, &np, &err)) abort();
    json_array_append_new(json_object_get(req, "messages"), msg);
    json_object_set_new(req, "add_generation_prompt", json_false());
    if (k3_chat_encode(f->chat, req, &hist, &nh, &err) || nh < np || memcmp(hist, prompt, np * sizeof *prompt)) abort();
    *n = nh - np;
    memmove(hist, hist + np, *n * sizeof *hist);
    free(prompt);
    json_decref(req);
    return hist;
}

/* Feeds ids through c as a sampler would (each must be allowed by the mask
 * and accepted): how many were; *ended: after them no id is allowed. */
static size_t feed_reply(k3_constraint *c, const int32_t *g, size_t n, int vocab, bool *ended) {
    float *row = xcalloc((size_t)vocab, sizeof *row);
    size_t i = 0;
    k3_err err = {0};
    for (; i < n; i++) {
        const float *m = k3_constraint_apply(c, row);
        if (!m || m[g[i]] == -INFINITY || k3_constraint_accept(c, g[i], &err)) break;
    }
    *ended = i == n && !k3_constraint_apply(c, row);
    free(row);
    return i;
}

TEST(constrain_call_accepts_the_rendered_call) {
    call_fix f;
    CHECK(call_fix_open(&f));
    static const struct {
        const char *msg;
        bool thinking;
    } OK[] = {
        {"{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":"
         "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris \\\"x\\\" \\\\ a&b\\n\\t\\u0001 \\u00e9\\ud83d\\ude00\","
         "\"days\":3}}}]}", false},
        {"{\"role\":\"assistant\",\"reasoning_content\":\"Let me see.\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c1\","
         "\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":{\"unit\":\"f\",\"days\":-12,"
         "\"hourly\":false,\"fields\":[\"t\",\"wind \\\"w\\\"\"],\"opt\":null,\"city\":\"\",\"tag\":\"a&b\"}}}]}", true},
        {"{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":"
         "{\"name\":\"get_weather\",\"arguments\":{\"opt\":1.5e-07,\"days\":0,\"city\":\"x\",\"tag\":7}}}]}", false},
        {"{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":"
         "{\"name\":\"say \\\"hi\\\" & go\",\"arguments\":{\"q\":\"<|close|> spelled\"}}}]}", true},
        {"{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":"
         "{\"name\":\"noargs\",\"arguments\":{}}}]}", false},
    };
    for (size_t i = 0; i < sizeof OK / sizeof *OK; i++) {
        size_t n;
        int32_t *g = rendered_reply(&f, OK[i].msg, OK[i].thinking, &n);
        json_t *m = json_loads(OK[i].msg, 0, NULL);
        json_t *fn = json_object_get(json_array_get(json_object_get(m, "tool_calls"), 0), "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        k3_callspec *one = NULL;
        k3_err err = {0};
        CHECK(k3_callspec_compile(f.tools, K3_CALLS_NAMED, name, true, &one, NULL, 0, &err) == 0);
        for (int named = 0; named < 2; named++) {
            k3_constraint *c = k3_constraint_new_call(named ? one : f.any, f.tb, f.chat, tok_vocab_size(f.t),
                                                      OK[i].thinking);
            bool ended;
            size_t got = feed_reply(c, g, n, tok_vocab_size(f.t), &ended);
            CHECKF(got == n && ended, "case %zu (%s): refused id %zu of %zu, ended %d", i, named ? "named" : "required",
                   got, n, ended);
            k3_constraint_free(c);
        }
        /* the parser reads the ids back as that call */
        k3_chat_parser *p = k3_chat_parser_new(f.chat, OK[i].thinking);
        k3_chat_delta d;
        for (size_t j = 0; j < n; j++) CHECK(k3_chat_parser_feed(p, g[j], &d, &err) == 0);
        const char *fin;
        json_t *back = k3_chat_parser_message(p, false, &fin);
        json_t *call = json_array_get(json_object_get(back, "tool_calls"), 0);
        json_t *args = json_loads(json_string_value(json_object_get(json_object_get(call, "function"), "arguments")),
                                  0, NULL);
        CHECKF(!strcmp(fin, "tool_calls") &&
                   !strcmp(json_string_value(json_object_get(json_object_get(call, "function"), "name")), name) &&
                   json_equal(args, json_object_get(fn, "arguments")),
               "case %zu read back as %s", i, json_dumps(back, 0));
        json_decref(args);
        json_decref(back);
        k3_chat_parser_free(p);
        k3_callspec_free(one);
        json_decref(m);
        free(g);
    }
    call_fix_close(&f);
}

TEST(constrain_call_refuses_what_the_schema_or_choice_forbids) {
    call_fix f;
    CHECK(call_fix_open(&f));
    k3_callspec *weather = NULL;
    k3_err err = {0};
    CHECK(k3_callspec_compile(f.tools, K3_CALLS_NAMED, "get_weather", true, &weather, NULL, 0, &err) == 0);
#define W(args) "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\"," \
                "\"function\":{\"name\":\"get_weather\",\"arguments\":" args "}}]}"
    static const struct {
        const char *msg, *why;
        bool named;
    } BAD[] = {
        {W("{\"city\":\"x\"}"), "a required argument missing", false},
        {W("{\"city\":\"x\",\"days\":\"3\"}"), "a string for an integer", false},
        {W("{\"city\":\"x\",\"days\":1.5}"), "a real for an integer", false},
        {W("{\"city\":\"x\",\"days\":1,\"unit\":\"k\"}"), "a value not in the enum", false},
        {W("{\"city\":\"x\",\"days\":1,\"tag\":8}"), "an integer not in the enum", false},
        {W("{\"city\":\"x\",\"days\":1,\"zzz\":1}"), "an undeclared argument", false},
        {W("{\"city\":3,\"days\":1}"), "a number for a string", false},
        {W("{\"city\":\"x\",\"days\":1,\"fields\":[1]}"), "an array item of the wrong type", false},
        {"{\"role\":\"assistant\",\"content\":\"Sure.\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
         "\"function\":{\"name\":\"noargs\",\"arguments\":{}}}]}", "content before the call", false},
        {"{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
         "\"function\":{\"name\":\"noargs\",\"arguments\":{}}}]}", "another tool than the named one", true},
        {"{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
         "\"function\":{\"name\":\"nope\",\"arguments\":{}}}]}", "an undeclared tool", false},
        {"{\"role\":\"assistant\",\"content\":\"hello\"}", "no call", false},
        {"{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
         "\"function\":{\"name\":\"noargs\",\"arguments\":{}}},{\"id\":\"d\",\"type\":\"function\","
         "\"function\":{\"name\":\"noargs\",\"arguments\":{}}}]}", "a second call", false},
    };
#undef W
    for (size_t i = 0; i < sizeof BAD / sizeof *BAD; i++) {
        size_t n;
        int32_t *g = rendered_reply(&f, BAD[i].msg, false, &n);
        k3_constraint *c = k3_constraint_new_call(BAD[i].named ? weather : f.any, f.tb, f.chat, tok_vocab_size(f.t),
                                                  false);
        bool ended;
        size_t got = feed_reply(c, g, n, tok_vocab_size(f.t), &ended);
        CHECKF(got < n, "%s: accepted", BAD[i].why);
        k3_constraint_free(c);
        free(g);
    }
    k3_callspec_free(weather);
    call_fix_close(&f);
}

TEST(constrain_call_refuses_parameters_it_cannot_enforce) {
    static const struct {
        const char *tools, *name, *where, *says;
    } C[] = {
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a\",\"parameters\":{\"type\":\"object\",\"properties\":"
         "{\"age\":{\"type\":\"integer\",\"minimum\":0}}}}}]", NULL, "tools[0].function.parameters.properties.age.minimum",
         "'minimum'"},
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a\"}},{\"type\":\"function\",\"function\":{\"name\":\"b\","
         "\"parameters\":{\"type\":\"string\"}}}]", NULL, "tools[1].function.parameters", "object schema"},
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a\"}},{\"type\":\"function\",\"function\":{\"name\":\"a\"}}]",
         NULL, "tools[1].function.name", "twice"},
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a\"}},{\"type\":\"function\",\"function\":{\"name\":\"a\"}}]",
         "a", "tools[1].function.name", "twice"},
    };
    for (size_t i = 0; i < sizeof C / sizeof *C; i++) {
        json_t *tools = json_loads(C[i].tools, 0, NULL);
        k3_callspec *cs = NULL;
        char where[256];
        k3_err err = {0};
        CHECK(tools && k3_callspec_compile(tools, C[i].name ? K3_CALLS_NAMED : K3_CALLS_REQUIRED, C[i].name, true, &cs, where, sizeof where, &err) == K3_EXIT_USAGE && !cs);
        CHECKF(!strcmp(where, C[i].where) && strstr(err.msg, C[i].says), "case %zu: '%s: %s'", i, where, err.msg);
        json_decref(tools);
    }
    /* a named tool's neighbours are not compiled: their keywords do not matter */
    json_t *tools = json_loads(C[0].tools, 0, NULL);
    json_array_append_new(tools, json_pack("{s:s, s:{s:s}}", "type", "function", "function", "name", "b"));
    k3_callspec *cs = NULL;
    k3_err err = {0};
    CHECK(k3_callspec_compile(tools, K3_CALLS_NAMED, "b", true, &cs, NULL, 0, &err) == 0 && cs);
    k3_callspec_free(cs);
    json_decref(tools);
    /* more tools than a choice is enforced among */
    tools = json_array();
    for (int i = 0; i <= K3_CALL_MAX_TOOLS; i++)
        json_array_append_new(tools, json_pack("{s:s, s:{s:s++}}", "type", "function", "function", "name", "t",
                                               i % 2 ? "x" : "y", ""));
    CHECK(k3_callspec_compile(tools, K3_CALLS_REQUIRED, NULL, true, &cs, NULL, 0, &err) == K3_EXIT_USAGE && strstr(err.msg, "at most"));
    json_decref(tools);
}

/* get_weather's arguments by JSON Schema's rules for its schema, written
 * out by hand (not the module's validator). */
static bool weather_args_ok(const json_t *a) {
    if (!json_is_object(a) || !json_is_string(json_object_get(a, "city")) || !json_is_integer(json_object_get(a, "days")))
        return false;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)a, k, v) {
        if (!strcmp(k, "city") || !strcmp(k, "days")) continue;
        if (!strcmp(k, "unit")) {
            if (!json_is_string(v) || (strcmp(json_string_value(v), "c") && strcmp(json_string_value(v), "f")))
                return false;
        } else if (!strcmp(k, "hourly")) {
            if (!json_is_boolean(v)) return false;
        } else if (!strcmp(k, "fields")) {
            if (!json_is_array(v)) return false;
            for (size_t i = 0; i < json_array_size(v); i++)
                if (!json_is_string(json_array_get(v, i))) return false;
        } else if (!strcmp(k, "opt")) {
            if (!json_is_number(v) && !json_is_null(v)) return false;
        } else if (!strcmp(k, "tag")) {
            if (!(json_is_string(v) && !strcmp(json_string_value(v), "a&b")) &&
                !(json_is_integer(v) && json_integer_value(v) == 7))
                return false;
        } else {
            return false;
        }
    }
    return true;
}

/* Replies sampled under the mask from random rows (the markup ids raised
 * now and then so that values end): every finished one reads back as a
 * call of a declared tool with valid arguments, and rendering that call
 * gives ids the constraint accepts again. */
TEST(constrain_call_walks_read_back_valid) {
    call_fix f;
    CHECK(call_fix_open(&f));
    int vocab = tok_vocab_size(f.t), finished = 0, weather = 0;
    k3_chat_ids ids = k3_chat_markup(f.chat);
    float *row = xmalloc_array((size_t)vocab, sizeof *row), *pool = xmalloc_array(2 * (size_t)vocab, sizeof *pool);
    uint64_t seed = 7;
    for (size_t i = 0; i < 2 * (size_t)vocab; i++) pool[i] = (float)(k3_rng_next(&seed) >> 40);
    k3_callspec *named = NULL;
    k3_err cerr = {0};
    CHECK(k3_callspec_compile(f.tools, K3_CALLS_NAMED, "get_weather", true, &named, NULL, 0, &cerr) == 0);
    for (int walk = 0; walk < 16; walk++) {
        bool thinking = walk % 4 == 3;
        k3_constraint *c = k3_constraint_new_call(walk % 2 ? named : f.any, f.tb, f.chat, vocab, thinking);
        k3_chat_parser *p = k3_chat_parser_new(f.chat, thinking);
        k3_chat_delta d;
        k3_err err = {0};
        bool stop = false;
        for (int step = 0; step < 300 && !stop; step++) {
            memcpy(row, pool + rnd(&seed, (uint64_t)vocab), (size_t)vocab * sizeof *row);
            float hi = (float)(1ULL << 25);
            if (rnd(&seed, 4) == 0) row[ids.close] = hi;
            if (rnd(&seed, 3) == 0) row[ids.open] = hi;
            const float *m = k3_constraint_apply(c, row);
            CHECK(m);
            int32_t best = 0;
            for (int i = 1; i < vocab; i++)
                if (m[i] > m[best]) best = i;
            CHECK(m[best] > -INFINITY && k3_constraint_accept(c, best, &err) == 0);
            CHECK(k3_chat_parser_feed(p, best, &d, &err) == 0);
            stop = d.stop;
        }
        const char *fin;
        json_t *msg = k3_chat_parser_message(p, !stop, &fin);
        if (stop) {
            finished++;
            json_t *call = json_array_get(json_object_get(msg, "tool_calls"), 0);
            const char *name = json_string_value(json_object_get(json_object_get(call, "function"), "name"));
            json_t *args = json_loads(json_string_value(json_object_get(json_object_get(call, "function"), "arguments")),
                                      0, NULL);
            CHECKF(!strcmp(fin, "tool_calls") && json_array_size(json_object_get(msg, "tool_calls")) == 1 && args,
                   "walk %d: %s", walk, json_dumps(msg, 0));
            bool ok = false;
            if (name && !strcmp(name, "get_weather")) ok = weather_args_ok(args), weather++;
            else if (name && !strcmp(name, "say \"hi\" & go")) ok = json_is_string(json_object_get(args, "q"));
            else if (name && !strcmp(name, "noargs")) ok = json_object_size(args) == 0;
            CHECKF(ok && (walk % 2 == 0 || !strcmp(name, "get_weather")), "walk %d: %s", walk, json_dumps(msg, 0));
            /* the call rendered back is accepted again */
            json_t *again = json_pack("{s:s, s:s, s:[{s:s, s:s, s:{s:s, s:O}}]}", "role", "assistant", "content", "",
                                      "tool_calls", "id", "c", "type", "function", "function", "name", name,
                                      "arguments", args);
            if (thinking) json_object_set(again, "reasoning_content", json_object_get(msg, "reasoning_content"));
            char *text = json_dumps(again, 0);
            size_t n;
            int32_t *g = rendered_reply(&f, text, thinking, &n);
            k3_constraint *c2 = k3_constraint_new_call(f.any, f.tb, f.chat, vocab, thinking);
            bool ended;
            CHECKF(feed_reply(c2, g, n, vocab, &ended) == n && ended, "walk %d rendered back: %s", walk, text);
            k3_constraint_free(c2);
            free(g);
            free(text);
            json_decref(again);
            json_decref(args);
        }
        json_decref(msg);
        k3_chat_parser_free(p);
        k3_constraint_free(c);
    }
    CHECKF(finished >= 8 && weather >= 4, "%d of 16 walks finished, %d called get_weather", finished, weather);
    k3_callspec_free(named);
    free(pool);
    free(row);
    call_fix_close(&f);
}

/* ---- several calls, and strict tools under "auto" ---- */

#define CALL(id, name, args) \
    "{\"id\":\"" id "\",\"type\":\"function\",\"function\":{\"name\":\"" name "\",\"arguments\":" args "}}"
#define REPLY(content, calls) "{\"role\":\"assistant\",\"content\":\"" content "\",\"tool_calls\":[" calls "]}"

/* Tools for "auto": get_weather and say-hi strict, noargs not. */
static json_t *strict_tools(const call_fix *f) {
    json_t *t = json_deep_copy(f->tools);
    json_object_set_new(json_object_get(json_array_get(t, 0), "function"), "strict", json_true());
    return t;
}

/* The fixture's tools with none strict. */
static json_t *loose_tools(const call_fix *f) {
    json_t *t = json_deep_copy(f->tools);
    for (size_t i = 0; i < json_array_size(t); i++) json_object_del(json_object_get(json_array_get(t, i), "function"), "strict");
    return t;
}

/* The parser's reading of ids (a reply that ended or not). */
static json_t *read_back(const call_fix *f, const int32_t *g, size_t n, bool thinking, const char **fin) {
    k3_chat_parser *p = k3_chat_parser_new(f->chat, thinking);
    k3_chat_delta d;
    k3_err err = {0};
    for (size_t j = 0; j < n; j++)
        if (k3_chat_parser_feed(p, g[j], &d, &err)) abort();
    json_t *m = k3_chat_parser_message(p, false, fin);
    k3_chat_parser_free(p);
    return m;
}

/* The calls of message m and of the parser's reading back agree, in order
 * (arguments compared as values). */
static bool same_calls(const json_t *m, const json_t *back) {
    const json_t *a = json_object_get(m, "tool_calls"), *b = json_object_get(back, "tool_calls");
    if (json_array_size(a) != json_array_size(b)) return false;
    for (size_t i = 0; i < json_array_size(a); i++) {
        const json_t *fa = json_object_get(json_array_get(a, i), "function"),
                     *fb = json_object_get(json_array_get(b, i), "function");
        json_t *args = json_loads(json_string_value(json_object_get(fb, "arguments")), 0, NULL);
        bool ok = json_equal(json_object_get(fa, "name"), json_object_get(fb, "name")) &&
                  json_equal(args, json_object_get(fa, "arguments"));
        json_decref(args);
        if (!ok) return false;
    }
    return true;
}

/* Rendered assistant messages with several calls are accepted id for id
 * and end there under "required" with parallel calls, and under "auto"
 * with strict tools (also with content before the calls, a loose tool's
 * call whatever its arguments, and no call at all); the parser reads them
 * back as the same calls. Without parallel calls (and for a named
 * function) the second call is refused; under "auto" so are a strict
 * call's bad arguments and an undeclared tool. */
TEST(constrain_calls_several_and_strict_under_auto) {
    call_fix f;
    CHECK(call_fix_open(&f));
    int vocab = tok_vocab_size(f.t);
    json_t *stools = strict_tools(&f);
    k3_callspec *many = NULL, *named = NULL, *autop = NULL, *auto1 = NULL, *none = NULL;
    k3_err err = {0};
    CHECK(k3_callspec_compile(f.tools, K3_CALLS_REQUIRED, NULL, true, &many, NULL, 0, &err) == 0 && many);
    CHECK(k3_callspec_compile(f.tools, K3_CALLS_NAMED, "get_weather", true, &named, NULL, 0, &err) == 0 && named);
    CHECK(k3_callspec_compile(stools, K3_CALLS_AUTO, NULL, true, &autop, NULL, 0, &err) == 0 && autop);
    CHECK(k3_callspec_compile(stools, K3_CALLS_AUTO, NULL, false, &auto1, NULL, 0, &err) == 0 && auto1);
    /* no strict tool and parallel calls: nothing to enforce */
    json_t *ltools = loose_tools(&f);
    CHECK(k3_callspec_compile(ltools, K3_CALLS_AUTO, NULL, true, &none, NULL, 0, &err) == 0 && !none);
    json_decref(ltools);
    const char *W1 = CALL("a", "get_weather", "{\"city\":\"Paris\",\"days\":1}");
    const char *W2 = CALL("b", "get_weather", "{\"city\":\"Rome \\\"R\\\"\",\"days\":2,\"unit\":\"c\"}");
    char two[1024], three[1536], text2[1536], loose[1024], bad_args[1024], undeclared[1024];
    snprintf(two, sizeof two, REPLY("", "%s,%s"), W1, W2);
    snprintf(three, sizeof three, REPLY("", "%s,%s,%s"), W1,
             CALL("c", "say \\\"hi\\\" & go", "{\"q\":\"x\"}"), CALL("d", "noargs", "{}"));
    snprintf(text2, sizeof text2, REPLY("Let me look.", "%s,%s"), W2, W1);
    snprintf(loose, sizeof loose, REPLY("", "%s,%s"), CALL("a", "noargs", "{\"anything\":[1,\"x\"]}"), W1);
    snprintf(bad_args, sizeof bad_args, REPLY("ok", "%s"), CALL("a", "get_weather", "{\"city\":\"x\"}"));
    snprintf(undeclared, sizeof undeclared, REPLY("", "%s"), CALL("a", "nope", "{}"));
    static const char *const TEXT_ONLY = "{\"role\":\"assistant\",\"content\":\"Plain <|open|>call tool= text.\"}";
    const struct {
        const char *msg;
        const k3_callspec *cs;
        const char *label;
        bool ok;
    } C[] = {
        {two, many, "two calls, required", true},
        {three, many, "three calls of three tools, required", true},
        {two, f.any, "two calls, required without parallel calls", false},
        {two, named, "two calls, named", false},
        {two, autop, "two calls, auto", true},
        {three, autop, "three calls, auto", true},
        {text2, autop, "content then two calls, auto", true},
        {loose, autop, "a loose tool's call with any arguments, auto", true},
        {TEXT_ONLY, autop, "text only, auto", true},
        {TEXT_ONLY, auto1, "text only, auto without parallel calls", true},
        {text2, auto1, "content then two calls, auto without parallel calls", false},
        {bad_args, autop, "a strict call missing a required argument, auto", false},
        {undeclared, autop, "an undeclared tool, auto", false},
    };
    for (size_t i = 0; i < sizeof C / sizeof *C; i++)
        for (int thinking = 0; thinking < 2; thinking++) {
            size_t n;
            int32_t *g = rendered_reply(&f, C[i].msg, thinking, &n);
            k3_constraint *c = k3_constraint_new_call(C[i].cs, f.tb, f.chat, vocab, thinking);
            bool ended;
            size_t got = feed_reply(c, g, n, vocab, &ended);
            /* a free reply may go on after its end: only the ids are checked */
            bool accepted = got == n && (ended || C[i].cs->how == K3_CALLS_AUTO);
            CHECKF(accepted == C[i].ok, "%s (thinking %d): id %zu of %zu, ended %d", C[i].label, thinking, got, n, ended);
            if (accepted) {
                const char *fin;
                json_t *m = json_loads(C[i].msg, 0, NULL), *back = read_back(&f, g, n, thinking, &fin);
                CHECKF(same_calls(m, back), "%s read back as %s", C[i].label, json_dumps(back, 0));
                json_decref(back);
                json_decref(m);
            }
            k3_constraint_free(c);
            free(g);
        }
    k3_callspec_free(many);
    k3_callspec_free(named);
    k3_callspec_free(autop);
    k3_callspec_free(auto1);
    json_decref(stools);
    call_fix_close(&f);
}

/* Drives c through pieces: a markup id (text NULL) or a text's ids. */
typedef struct {
    int32_t id;
    const char *text;
} piece;

static bool drive(const call_fix *f, k3_constraint *c, const piece *pc, size_t n) {
    k3_err err = {0};
    for (size_t i = 0; i < n; i++) {
        int32_t one = pc[i].id, *v = &one;
        size_t k = 1;
        if (pc[i].text && tok_encode(f->t, pc[i].text, strlen(pc[i].text), false, &v, &k, &err)) return false;
        bool ok = true;
        for (size_t j = 0; j < k && ok; j++) ok = !k3_constraint_accept(c, v[j], &err);
        if (v != &one) free(v);
        if (!ok) return false;
    }
    return true;
}

/* Under "auto" with strict tools, the mask at each kind of state equals
 * feeding each id of the vocabulary on its own to a copy of the state. */
TEST(constrain_auto_strict_mask_equals_feeding_each_id) {
    call_fix f;
    CHECK(call_fix_open(&f));
    int vocab = tok_vocab_size(f.t);
    json_t *stools = strict_tools(&f);
    k3_callspec *autop = NULL, *auto1 = NULL, *counted = NULL;
    k3_err err = {0};
    CHECK(k3_callspec_compile(stools, K3_CALLS_AUTO, NULL, true, &autop, NULL, 0, &err) == 0);
    CHECK(k3_callspec_compile(stools, K3_CALLS_AUTO, NULL, false, &auto1, NULL, 0, &err) == 0);
    /* no strict tool, one call: only the count */
    json_t *ltools = loose_tools(&f);
    CHECK(k3_callspec_compile(ltools, K3_CALLS_AUTO, NULL, false, &counted, NULL, 0, &err) == 0 && counted);
    json_decref(ltools);
    k3_chat_ids m = k3_chat_markup(f.chat);
    const struct {
        const k3_callspec *cs;
        piece p[12];
        size_t n;
        const char *label;
    } S[] = {
        {autop, {{-1, "Hello"}}, 1, "free text"},
        {autop, {{m.open, NULL}}, 1, "an open header"},
        {autop, {{m.open, NULL}, {-1, "cal"}}, 2, "'cal'"},
        {autop, {{m.open, NULL}, {-1, "call"}}, 2, "'call'"},
        {autop, {{m.open, NULL}, {-1, "call tool"}}, 2, "'call tool'"},
        {autop, {{m.open, NULL}, {-1, "call tool=\""}}, 2, "choosing the tool"},
        {autop, {{m.open, NULL}, {-1, "call tool=\"get_weather\" index=\""}}, 2, "the index"},
        {autop, {{m.open, NULL}, {-1, "call tool=\"get_weather\" index=\"1\""}, {m.sep, NULL}, {m.open, NULL},
                 {-1, "argument key=\"city\" type=\"string\""}, {m.sep, NULL}, {-1, "Par"}}, 7, "a strict string argument"},
        {autop, {{m.open, NULL}, {-1, "call tool=\"noargs\""}}, 2, "a loose call's header"},
        {autop, {{m.open, NULL}, {-1, "argument"}}, 2, "another header"},
        {auto1, {{m.open, NULL}, {-1, "call tool=\"noargs\" index=\"1\""}, {m.sep, NULL}, {m.close, NULL}, {-1, "call"},
                 {m.sep, NULL}, {m.open, NULL}, {-1, "call"}}, 8, "'call' after the one call"},
        {counted, {{m.open, NULL}, {-1, "call tool=\"noargs\""}, {m.sep, NULL}, {m.open, NULL}}, 4,
         "an open header after the one call (no strict tool)"},
    };
    float *row = xcalloc((size_t)vocab, sizeof *row);
    for (size_t s = 0; s < sizeof S / sizeof *S; s++) {
        k3_constraint *c = k3_constraint_new_call(S[s].cs, f.tb, f.chat, vocab, s % 2);
        k3_constraint *cp = k3_constraint_new_call(S[s].cs, f.tb, f.chat, vocab, s % 2);
        CHECKF(drive(&f, c, S[s].p, S[s].n), "%s: driving refused", S[s].label);
        const float *mk = k3_constraint_apply(c, row);
        CHECKF(mk, "%s: nothing allowed", S[s].label);
        size_t allowed = 0, want = 0;
        for (int32_t id = 0; id < vocab && mk; id++) {
            k3_constraint_copy(cp, c);
            bool ok = !k3_constraint_accept(cp, id, &err);
            allowed += mk[id] > -INFINITY;
            want += ok;
            if ((mk[id] > -INFINITY) != ok) {
                size_t nb;
                const uint8_t *b = tok_token_bytes(f.t, id, &nb);
                CHECKF(0, "%s: id %d ('%.*s') mask %d, feeding it %d", S[s].label, id, b ? (int)nb : 0,
                       b ? (const char *)b : "", mk[id] > -INFINITY, ok);
                break;
            }
        }
        CHECKF(allowed == want && allowed > 0, "%s: %zu allowed, want %zu", S[s].label, allowed, want);
        k3_constraint_free(cp);
        k3_constraint_free(c);
    }
    free(row);
    k3_callspec_free(autop);
    k3_callspec_free(auto1);
    k3_callspec_free(counted);
    json_decref(stools);
    call_fix_close(&f);
}

/* A call of the fixture's tools is valid (the loose noargs: any arguments
 * when loose). */
static bool call_ok(const json_t *call, bool noargs_loose) {
    const json_t *fn = json_object_get(call, "function");
    const char *name = json_string_value(json_object_get(fn, "name"));
    json_t *args = json_loads(json_string_value(json_object_get(fn, "arguments")), 0, NULL);
    bool ok = false;
    if (!name || !args) ok = false;
    else if (!strcmp(name, "get_weather")) ok = weather_args_ok(args);
    else if (!strcmp(name, "say \"hi\" & go")) ok = json_is_string(json_object_get(args, "q")) && json_object_size(args) == 1;
    else if (!strcmp(name, "noargs")) ok = noargs_loose || json_object_size(args) == 0;
    json_decref(args);
    return ok;
}

/* Replies sampled under the mask from random rows, the markup raised now
 * and then (and, under "auto", the ids that spell `call tool="` after an
 * [open], and the end of the message): under "required" with parallel
 * calls every finished reply has one or more valid calls, some several;
 * under "auto" with strict tools every call there is valid (its name
 * declared, a strict tool's arguments valid), at most one without parallel
 * calls, and some replies call. */
TEST(constrain_calls_walks_several_and_auto) {
    call_fix f;
    CHECK(call_fix_open(&f));
    int vocab = tok_vocab_size(f.t);
    k3_chat_ids ids = k3_chat_markup(f.chat);
    json_t *stools = strict_tools(&f);
    k3_callspec *many = NULL, *autop = NULL, *auto1 = NULL;
    k3_err err = {0};
    CHECK(k3_callspec_compile(f.tools, K3_CALLS_REQUIRED, NULL, true, &many, NULL, 0, &err) == 0);
    CHECK(k3_callspec_compile(stools, K3_CALLS_AUTO, NULL, true, &autop, NULL, 0, &err) == 0);
    CHECK(k3_callspec_compile(stools, K3_CALLS_AUTO, NULL, false, &auto1, NULL, 0, &err) == 0);
    int32_t *path = NULL;
    size_t npath = 0;
    CHECK(tok_encode(f.t, "call tool=\"", 11, false, &path, &npath, &err) == 0 && npath > 0);
    float *row = xmalloc_array((size_t)vocab, sizeof *row), *pool = xmalloc_array(2 * (size_t)vocab, sizeof *pool);
    uint64_t seed = 11;
    for (size_t i = 0; i < 2 * (size_t)vocab; i++) pool[i] = (float)(k3_rng_next(&seed) >> 40);
    const k3_callspec *specs[] = {many, autop, auto1};
    for (int sp = 0; sp < 3; sp++) {
        const k3_callspec *cs = specs[sp];
        int finished = 0, several = 0, called = 0;
        for (int walk = 0; walk < 12; walk++) {
            bool thinking = walk % 3 == 2;
            k3_constraint *c = k3_constraint_new_call(cs, f.tb, f.chat, vocab, thinking);
            k3_chat_parser *p = k3_chat_parser_new(f.chat, thinking);
            k3_chat_delta d;
            bool stop = false;
            int on_path = -1; /* ids of `call tool="` written since an [open] */
            for (int step = 0; step < 400 && !stop; step++) {
                memcpy(row, pool + rnd(&seed, (uint64_t)vocab), (size_t)vocab * sizeof *row);
                float hi = (float)(1ULL << 25);
                if (rnd(&seed, 4) == 0) row[ids.close] = hi;
                if (rnd(&seed, 3) == 0) row[ids.open] = hi;
                if (cs->how == K3_CALLS_AUTO) {
                    if (on_path >= 0 && (size_t)on_path < npath && rnd(&seed, 5)) row[path[on_path]] = 2 * hi;
                    if (rnd(&seed, 30) == 0) row[ids.end_of_msg] = 4 * hi;
                }
                const float *m = k3_constraint_apply(c, row);
                CHECK(m);
                int32_t best = 0;
                for (int i = 1; i < vocab; i++)
                    if (m[i] > m[best]) best = i;
                CHECK(m[best] > -INFINITY && k3_constraint_accept(c, best, &err) == 0);
                CHECK(k3_chat_parser_feed(p, best, &d, &err) == 0);
                if (best == ids.open) on_path = 0;
                else if (on_path >= 0 && (size_t)on_path < npath && best == path[on_path]) on_path++;
                else on_path = -1;
                stop = d.stop;
            }
            const char *fin;
            json_t *msg = k3_chat_parser_message(p, !stop, &fin);
            const json_t *calls = json_object_get(msg, "tool_calls");
            size_t nc = json_array_size(calls);
            finished += stop;
            several += nc > 1;
            called += nc > 0;
            if (cs->how == K3_CALLS_REQUIRED && stop)
                CHECKF(nc >= 1 && !strcmp(fin, "tool_calls"), "walk %d: %s", walk, json_dumps(msg, 0));
            if (!cs->multi) CHECKF(nc <= 1, "walk %d: %zu calls without parallel calls", walk, nc);
            /* a call present validates, finished or not (the parser reads only closed calls) */
            for (size_t k = 0; k < nc; k++)
                CHECKF(call_ok(json_array_get(calls, k), cs->how == K3_CALLS_AUTO), "spec %d walk %d call %zu: %s", sp,
                       walk, k, json_dumps(msg, 0));
            json_decref(msg);
            k3_chat_parser_free(p);
            k3_constraint_free(c);
        }
        CHECKF(finished >= 4 && called >= 3 && (sp != 0 || several >= 2),
               "spec %d: %d of 12 finished, %d called, %d with several calls", sp, finished, called, several);
    }
    free(path);
    free(pool);
    free(row);
    k3_callspec_free(many);
    k3_callspec_free(autop);
    k3_callspec_free(auto1);
    json_decref(stools);
    call_fix_close(&f);
}
