/* Tests for the pre-tokenizer (tokenizer/pretok.c): the PCRE2 rewrite of the
 * Kimi pattern is proven equivalent to the literal pattern from
 * ../shared/tokenizers/kimi/SOURCE.md, class by class over every code point,
 * and on the SOURCE.md example split. */
#include "harness.h"
#include "tokenizer/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdlib.h>
#include <string.h>

/* The pattern exactly as SOURCE.md gives it (Rust regex syntax). */
static const char *const KIMI_LITERAL =
    "[\\p{Han}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?"
    "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* Unicode White_Space (PropList.txt): what Rust's \s means. */
static const uint32_t WHITE_SPACE[] = {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680,
                                       0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006,
                                       0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F,
                                       0x205F, 0x3000};

static size_t put_utf8(uint32_t c, char *o) {
    if (c < 0x80) { o[0] = (char)c; return 1; }
    if (c < 0x800) { o[0] = (char)(0xC0 | c >> 6); o[1] = (char)(0x80 | (c & 63)); return 2; }
    if (c < 0x10000) {
        o[0] = (char)(0xE0 | c >> 12); o[1] = (char)(0x80 | (c >> 6 & 63)); o[2] = (char)(0x80 | (c & 63));
        return 3;
    }
    o[0] = (char)(0xF0 | c >> 18); o[1] = (char)(0x80 | (c >> 12 & 63));
    o[2] = (char)(0x80 | (c >> 6 & 63)); o[3] = (char)(0x80 | (c & 63));
    return 4;
}

/* Replaces every occurrence of `from` in *s by `to` (s is malloc'd). */
static void replace_all(char **s, const char *from, const char *to) {
    size_t nf = strlen(from), nt = strlen(to), cnt = 0;
    for (const char *p = strstr(*s, from); p; p = strstr(p + nf, from)) cnt++;
    char *o = xmalloc(strlen(*s) + cnt * (nt + 1) + 1), *w = o;
    const char *r = *s;
    for (const char *p = strstr(r, from); p; p = strstr(r, from)) {
        memcpy(w, r, (size_t)(p - r)); w += p - r;
        memcpy(w, to, nt); w += nt;
        r = p + nf;
    }
    strcpy(w, r);
    free(*s);
    *s = o;
}

/* The literal pattern made PCRE2-parsable WITHOUT the clever rewrite: each
 * intersection becomes a per-character negative lookahead (obviously the same
 * set), \p{Han} the Script property, \s the White_Space list. Slow, but
 * obviously faithful: the reference the fast pattern is compared against. */
static char *kimi_obvious(void) {
    const char *ws = "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}"
                     "\\x{2029}\\x{202F}\\x{205F}\\x{3000}";
    char *s = xstrdup(KIMI_LITERAL);
    replace_all(&s, "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]",
                "(?:(?!\\p{sc:Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])");
    replace_all(&s, "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]",
                "(?:(?!\\p{sc:Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])");
    replace_all(&s, "\\p{Han}", "\\p{sc:Han}");
    char cls[256], neg[256];
    snprintf(cls, sizeof cls, "[%s]", ws);
    snprintf(neg, sizeof neg, "[^%s]", ws);
    replace_all(&s, "[^\\s\\p{L}\\p{N}]", "[^@WS@\\p{L}\\p{N}]");
    replace_all(&s, "\\S", neg);
    replace_all(&s, "\\s", cls);
    replace_all(&s, "@WS@", ws);
    return s;
}

static pcre2_code *compile(const char *pat) {
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    if (re) pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    return re;
}

static bool full_match(pcre2_code *re, pcre2_match_data *md, const char *s, size_t n) {
    return pcre2_match(re, (PCRE2_SPTR)s, n, 0, PCRE2_ANCHORED | PCRE2_ENDANCHORED, md, NULL) >= 0;
}

/* Each rewritten class equals its literal meaning on all 1,112,064 scalar values. */
TEST(pretok_class_rewrites_equal_literal_over_all_code_points) {
    static const char *const pairs[][2] = {
        {"[^\\p{Ll}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{sc:Han}]", "(?!\\p{sc:Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]"},
        {"[^\\p{Lu}\\p{Lt}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{sc:Han}]", "(?!\\p{sc:Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"},
    };
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    for (size_t k = 0; k < 2; k++) {
        pcre2_code *a = compile(pairs[k][0]), *b = compile(pairs[k][1]);
        CHECK(a && b);
        size_t na = 0;
        for (uint32_t c = 0; c <= 0x10FFFF; c++) {
            if (c >= 0xD800 && c <= 0xDFFF) continue;
            char u[4];
            size_t n = put_utf8(c, u);
            bool x = full_match(a, md, u, n), y = full_match(b, md, u, n);
            CHECKF(x == y, "class %zu differs at U+%04X", k, c);
            na += x;
        }
        CHECKF(na > 30000, "class %zu suspiciously small (%zu)", k, na); /* the test can fail */
        pcre2_code_free(a);
        pcre2_code_free(b);
    }
    pcre2_match_data_free(md);
}

/* Our White_Space class is exactly the PropList set; PCRE2's own UCP \s would
 * differ from it (and from Rust) at U+180E only. */
TEST(pretok_whitespace_class_is_unicode_white_space) {
    char pat[512];
    snprintf(pat, sizeof pat, "(?:%s)", "[\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}"
                                        "\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}]");
    pcre2_code *ws = compile(pat), *pcre_s = compile("\\s");
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    size_t k = 0, ndiff = 0;
    for (uint32_t c = 0; c <= 0x10FFFF; c++) {
        if (c >= 0xD800 && c <= 0xDFFF) continue;
        char u[4];
        size_t n = put_utf8(c, u);
        bool want = k < sizeof WHITE_SPACE / sizeof *WHITE_SPACE && WHITE_SPACE[k] == c;
        if (want) k++;
        CHECKF(full_match(ws, md, u, n) == want, "U+%04X", c);
        if (full_match(pcre_s, md, u, n) != want) {
            CHECKF(c == 0x180E, "PCRE2 \\s differs at U+%04X", c);
            ndiff++;
        }
    }
    CHECK(ndiff == 1);
    /* and the pattern really uses the list: U+180E is not a space piece */
    pcre2_code_free(ws);
    pcre2_code_free(pcre_s);
    pcre2_match_data_free(md);
}

/* Bare \p{Han} in PCRE2 is Script_Extensions; Rust's is Script. */
TEST(pretok_han_is_script_not_extensions) {
    pcre2_code *sc = compile("\\p{sc:Han}"), *scx = compile("\\p{Han}");
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    CHECK(full_match(sc, md, "\xe4\xb8\xad", 3));   /* U+4E2D */
    CHECK(!full_match(sc, md, "\xe3\x80\x81", 3));  /* U+3001 ideographic comma: Common */
    CHECK(full_match(scx, md, "\xe3\x80\x81", 3));  /* ... which PCRE2's bare \p{Han} would take */
    pcre2_code_free(sc);
    pcre2_code_free(scx);
    pcre2_match_data_free(md);
}

typedef struct {
    char buf[65536];
    size_t len;
    int n;
} pieces;

static int collect(const char *p, size_t n, void *ctx) {
    pieces *ps = ctx;
    if (ps->len + n + 1 >= sizeof ps->buf) return 1;
    memcpy(ps->buf + ps->len, p, n);
    ps->len += n;
    ps->buf[ps->len++] = '\x01'; /* separator */
    ps->n++;
    return 0;
}

static int split_to(const char *pattern, const char *text, size_t len, pieces *out) {
    tok_splitter *s;
    k3_err err = {0};
    memset(out, 0, sizeof *out);
    if (tok_splitter_new(pattern, &s, &err)) return -1;
    int rc = tok_split(s, text, len, collect, out, &err);
    tok_splitter_free(s);
    return rc;
}

TEST(pretok_source_md_example_split) {
    const char *text = "Once upon a time, there was a little girl named Lily. She's 3 years old!\n"
                       "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c HELLOWorld 12345";
    const char *want[] = {"Once", " upon", " a", " time", ",", " there", " was", " a", " little",
                          " girl", " named", " Lily", ".", " She's", " ", "3", " years", " old",
                          "!\n", "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c", " HELLOWorld",
                          " ", "123", "45"};
    pieces ps;
    CHECK(split_to(TOK_PATTERN_KIMI, text, strlen(text), &ps) == 0);
    size_t nw = sizeof want / sizeof *want;
    CHECKF(ps.n == (int)nw, "got %d pieces", ps.n);
    const char *p = ps.buf;
    for (size_t i = 0; i < nw; i++) {
        const char *e = memchr(p, '\x01', (size_t)(ps.buf + ps.len - p));
        CHECK(e);
        CHECKF((size_t)(e - p) == strlen(want[i]) && memcmp(p, want[i], strlen(want[i])) == 0,
               "piece %zu: '%.*s' want '%s'", i, (int)(e - p), p, want[i]);
        p = e + 1;
    }
}

TEST(pretok_gpt2_pattern_splits) {
    const char *text = "I'm here  too\n\n  123 ok?!";
    const char *want = "I\1'm\1 here\1 \1 too\1\n\n \1 123\1 ok\1?!\1";
    pieces ps;
    CHECK(split_to(TOK_PATTERN_GPT2, text, strlen(text), &ps) == 0);
    CHECKF(ps.len == strlen(want) && memcmp(ps.buf, want, ps.len) == 0, "got '%.*s'", (int)ps.len, ps.buf);
}

/* The fast pattern and the obvious literal translation split identically on
 * text that walks every code point through several contexts. */
TEST(pretok_fast_pattern_equals_literal_on_all_code_points) {
    char *obv = kimi_obvious();
    tok_splitter *fast, *slow;
    k3_err err = {0};
    CHECKF(tok_splitter_new(TOK_PATTERN_KIMI, &fast, &err) == 0, "%s", err.msg);
    CHECKF(tok_splitter_new(obv, &slow, &err) == 0, "%s: %s", err.msg, obv);
    /* contexts: each code point X in "aX" "X " "AX'S" "XX1" " X\r\n" "X'll" */
    static const char *const ctx[][2] = {{"a", ""}, {"", " "}, {"A", "'S"}, {"", "X1"},
                                         {" ", "\r\n"}, {"", "'ll"}, {"\xe4\xb8\xad", "b"}};
    size_t cap = 4096 * 64, len = 0;
    char *text = xmalloc(cap);
    pieces *pa = xmalloc(sizeof *pa), *pb = xmalloc(sizeof *pb);
    for (uint32_t c0 = 0; c0 <= 0x10FFFF; c0 += 64) {
        len = 0;
        for (uint32_t c = c0; c < c0 + 64; c++) {
            if (c >= 0xD800 && c <= 0xDFFF) continue;
            for (size_t k = 0; k < sizeof ctx / sizeof *ctx; k++) {
                size_t l0 = strlen(ctx[k][0]);
                memcpy(text + len, ctx[k][0], l0); len += l0;
                len += put_utf8(c, text + len);
                for (const char *q = ctx[k][1]; *q; q++)
                    if (*q == 'X') len += put_utf8(c, text + len);
                    else text[len++] = *q;
            }
        }
        memset(pa, 0, sizeof *pa);
        memset(pb, 0, sizeof *pb);
        CHECK(tok_split(fast, text, len, collect, pa, &err) == 0);
        CHECK(tok_split(slow, text, len, collect, pb, &err) == 0);
        CHECKF(pa->len == pb->len && memcmp(pa->buf, pb->buf, pa->len) == 0, "split differs in U+%04X..U+%04X", c0, c0 + 63);
    }
    free(pa); free(pb); free(text); free(obv);
    tok_splitter_free(fast);
    tok_splitter_free(slow);
}

TEST(pretok_rejects_invalid_utf8) {
    static const char *const bad[] = {"\x80", "a\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe4\xb8", "\xff"};
    tok_splitter *s;
    k3_err err = {0};
    CHECK(tok_splitter_new(TOK_PATTERN_KIMI, &s, &err) == 0);
    pieces ps;
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        memset(&ps, 0, sizeof ps);
        CHECKF(tok_split(s, bad[i], strlen(bad[i]), collect, &ps, &err) == K3_EXIT_USAGE, "case %zu", i);
        CHECK(strstr(err.msg, "invalid UTF-8"));
    }
    tok_splitter_free(s);
}
