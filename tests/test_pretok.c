/* Tests for the pre-tokenizer (tokenizer/pretok.c): the PCRE2 rewrite of the
 * Kimi pattern is proven equivalent to the literal pattern from
 * tests/fixtures/tokenizer/kimi/SOURCE.md, class by class over every code point,
 * and on the SOURCE.md example split. */
#include "harness.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode_delta.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdlib.h>
#include <string.h>

/* Under the sanitizers (many times slower) the per-code-point sweeps take
 * every SWEEP_STRIDE-th code point: there they look for memory errors; the
 * release run is the exhaustive proof. */
#ifdef __SANITIZE_ADDRESS__
#define SWEEP_STRIDE 97
#else
#define SWEEP_STRIDE 1
#endif

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
 * set), \p{Han} the Script property, \s the White_Space list, and each
 * class gains the Unicode 15-16 additions of unicode_delta.h. Slow, but
 * obviously faithful: the reference the fast pattern is compared against. */
static char *kimi_obvious(void) {
    const char *ws = "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}"
                     "\\x{2029}\\x{202F}\\x{205F}\\x{3000}";
    char *s = xstrdup(KIMI_LITERAL);
    replace_all(&s, "[^\\s\\p{L}\\p{N}]", "[^@WS@\\p{L}\\p{N}]");
    replace_all(&s, "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]",
                "(?:(?![\\p{sc:Han}@HAN@])[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}@UPPER@])");
    replace_all(&s, "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]",
                "(?:(?![\\p{sc:Han}@HAN@])[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}@LOWER@])");
    replace_all(&s, "[\\p{Han}]", "[\\p{sc:Han}@HAN@]");
    replace_all(&s, "\\p{L}\\p{N}]", "\\p{L}\\p{N}@LN@]");
    replace_all(&s, "\\p{N}{1,3}", "[\\p{N}@N@]{1,3}");
    /* the Unicode 15-16 additions, after the rewriting above */
    replace_all(&s, "@HAN@", NEW_HAN);
    replace_all(&s, "@UPPER@", NEW_UPPERISH);
    replace_all(&s, "@LOWER@", NEW_LOWERISH);
    replace_all(&s, "@LN@", NEW_LN);
    replace_all(&s, "@N@", NEW_N);
    char cls[256], neg[256];
    snprintf(cls, sizeof cls, "[%s]", ws);
    snprintf(neg, sizeof neg, "[^%s]", ws);
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
        for (uint32_t c = 0; c <= 0x10FFFF; c += SWEEP_STRIDE) {
            if (c >= 0xD800 && c <= 0xDFFF) continue;
            char u[4];
            size_t n = put_utf8(c, u);
            bool x = full_match(a, md, u, n), y = full_match(b, md, u, n);
            CHECKF(x == y, "class %zu differs at U+%04X", k, c);
            na += x;
        }
        CHECKF(na * SWEEP_STRIDE > 30000, "class %zu suspiciously small (%zu)", k, na); /* the test can fail */
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
    size_t ndiff = 0;
    for (uint32_t c = 0; c <= 0x10FFFF; c++) {
        if (c >= 0xD800 && c <= 0xDFFF) continue;
        if (c > 0x3000 && c % SWEEP_STRIDE) continue;
        char u[4];
        size_t n = put_utf8(c, u);
        bool want = false;
        for (size_t k = 0; k < sizeof WHITE_SPACE / sizeof *WHITE_SPACE; k++) want |= WHITE_SPACE[k] == c;
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
 * text that walks every code point of planes 0-3 and 14 (and a sample of the
 * uniform rest) through several contexts. */
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
    for (uint32_t c0 = 0; c0 <= 0x10FFFF; c0 += 64 * SWEEP_STRIDE) {
        /* planes 4-13 (unassigned) and 15-16 (private use) are uniform: a
         * sample of them; everything else in full */
        if (c0 >= 0x40000 && (c0 < 0xE0000 || c0 >= 0xF0000) && (c0 / 64) % 61) continue;
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
        CHECKF(tok_split(slow, text, len, collect, pb, &err) == 0, "%s", err.msg);
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

/* One piece or several: does the Kimi pattern take all of s as its first match? */
static bool one_piece(pcre2_code *re, pcre2_match_data *md, const char *s, size_t n) {
    if (pcre2_match(re, (PCRE2_SPTR)s, n, 0, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, md, NULL) < 0) return false;
    return pcre2_get_ovector_pointer(md)[1] == n;
}

/* tests/fixtures/tokenizer/classes.txt records, for every code point X, which
 * of eight probe strings tiktoken's own regex keeps as one piece (see
 * tools/tiktoken-check/classes.js). Our pattern must agree everywhere (every
 * code point of planes 0-3 and 14, a sample of the uniform rest): this
 * covers the category, script and White_Space tables of both regex engines,
 * whatever Unicode version each was built with. */
TEST(pretok_kimi_classes_match_tiktoken_on_every_code_point) {
    char *data;
    size_t len;
    k3_err err = {0};
    CHECKF(k3_read_file(t_repo("tests/fixtures/tokenizer/classes.txt"), &data, &len, &err) == 0, "%s", err.msg);
    pcre2_code *re = compile(TOK_PATTERN_KIMI);
    CHECK(re);
    static const char *const pre[8] = {"\xe4\xb8\xad", "a", "", "..", "1", "  ", "a'", ""};
    static const char *const post[8] = {"", "", "A", "", "", "", "", "Ab"};
    /* runs: starts[i] .. starts[i+1]-1 have masks[i] */
    size_t nruns = 0, cap = 8192;
    uint32_t *starts = xmalloc_array(cap, sizeof *starts), *masks = xmalloc_array(cap, sizeof *masks);
    for (char *p = data; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (*p == '#' || *p == '\n') continue;
        unsigned st, m;
        CHECK(sscanf(p, "%x %x", &st, &m) == 2);
        CHECK(nruns == 0 || st > starts[nruns - 1]);
        if (nruns == cap) {
            starts = xrealloc_array(starts, cap *= 2, sizeof *starts);
            masks = xrealloc_array(masks, cap, sizeof *masks);
        }
        starts[nruns] = st;
        masks[nruns++] = m;
    }
    CHECK(nruns > 100 && starts[0] == 0);
    size_t nbad = 0;
    bool list = getenv("K3_CLASS_DIFF") != NULL;
#pragma omp parallel reduction(+ : nbad)
    {
        pcre2_match_data *tmd = pcre2_match_data_create(1, NULL);
        size_t run = 0;
#pragma omp for schedule(static)
        for (uint32_t c = 0; c <= 0x10FFFF; c += SWEEP_STRIDE) {
            if (c >= 0xD800 && c <= 0xDFFF) continue;
            /* planes 4-13 (unassigned) and 15-16 (private use): one run in
             * classes.txt, sampled; planes 0-3 and 14 in full */
            if (c >= 0x40000 && (c < 0xE0000 || c >= 0xF0000) && c % 61) continue;
            while (run > 0 && starts[run] > c) run--;
            while (run + 1 < nruns && starts[run + 1] <= c) run++;
            uint32_t want = masks[run], got = 0;
            for (int i = 0; i < 8; i++) {
                char s[16];
                size_t n = strlen(pre[i]);
                memcpy(s, pre[i], n);
                n += put_utf8(c, s + n);
                memcpy(s + n, post[i], strlen(post[i]));
                n += strlen(post[i]);
                if (one_piece(re, tmd, s, n)) got |= 1u << i;
            }
            if (got != want) {
                if (list) fprintf(stderr, "  U+%04X ours %02x tiktoken %02x\n", c, got, want);
                nbad++;
            }
        }
        pcre2_match_data_free(tmd);
    }
    free(data);
    free(starts);
    free(masks);
    pcre2_code_free(re);
    CHECKF(nbad == 0, "%zu code points classified differently from tiktoken (K3_CLASS_DIFF=1 lists them)", nbad);
}
