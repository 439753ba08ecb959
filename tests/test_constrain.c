/* Tests for structured output (constrain/).
 *
 * The JSON machine is checked against jansson's parser on thousands of
 * generated texts (valid ones, and the same mutated: a byte dropped,
 * inserted, replaced, the text cut), every prefix of a valid text must be
 * accepted, and schema cases are written out by hand from JSON Schema's
 * rules. The mask is checked against feeding each of the Kimi tokenizer's
 * 163,840 ids on its own. */
#include "constrain/constrain.h"
#include "harness.h"

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
        size_t count = k3_jstate_mask(&st, tb, allow), want_count = 0;
        for (int32_t id = 0; id < nb; id++) {
            size_t n;
            const uint8_t *p = tok_token_bytes(t, id, &n);
            k3_jstate c = st;
            bool want = p && n && k3_jstate_feed(&c, p, n);
            want_count += want;
            CHECKF(allow[id] == want, "after '%s': id %d ('%.*s') mask %d, feeding it %d", PREFIXES[i], id, (int)n,
                   (const char *)p, allow[id], want);
        }
        CHECKF(count == want_count && count > 0, "after '%s': %zu allowed, want %zu", PREFIXES[i], count, want_count);
    }
    free(allow);
    k3_jschema_free(sc);
    k3_tokbytes_free(tb);
    tok_free(t);
}
