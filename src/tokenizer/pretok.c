/* pretok.c: regex pre-tokenization (the split before BPE) with PCRE2.
 *
 * The reference tokenizer (tiktoken) runs its pattern with Rust's fancy-regex
 * / regex crates. Three places where PCRE2 reads the same text differently
 * are rewritten here so the pieces come out identical:
 *
 *  1. Class intersection `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]` does
 *     not exist in PCRE2 10.42. General categories partition every code point,
 *     so "in Lu|Lt|Lm|Lo|M and not Han" is exactly "not in any OTHER category
 *     and not Han": [^\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{sc:Han}] (\p{C}
 *     includes Cn, unassigned). One negated class, so JIT keeps it fast.
 *  2. Rust's bare \p{Han} is the Script property; PCRE2's bare \p{Han} is
 *     Script_Extensions (it would take CJK punctuation like U+3001 as Han).
 *     We write \p{sc:Han}.
 *  3. Rust's \s is the Unicode White_Space property; PCRE2's UCP \s also takes
 *     U+180E (Mongolian vowel separator, no longer White_Space since Unicode
 *     6.3). We spell White_Space out as an explicit list.
 *
 * And one difference of data, not syntax: PCRE2 10.42 has Unicode 14 tables,
 * tiktoken's regex crate Unicode 16. The characters added since are listed in
 * unicode_delta.h (read off tiktoken itself) and added to each class.
 *
 * tests/test_pretok.c proves each rewrite against the literal forms over
 * every code point, and the whole pattern against tiktoken's behaviour on
 * every code point. */
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode_delta.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdlib.h>
#include <string.h>

/* Unicode White_Space (PropList.txt), as used by Rust's \s. */
#define WS "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}" \
           "\\x{202F}\\x{205F}\\x{3000}"
#define HAN "\\p{sc:Han}"
/* [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]] */
#define UPPERISH "(?:[^\\p{Ll}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}" HAN "]|[" NEW_UPPERISH "])"
/* [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]] */
#define LOWERISH "(?:[^\\p{Lu}\\p{Lt}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}" HAN "]|[" NEW_LOWERISH "])"
/* \p{L}\p{N} inside a class */
#define LN "\\p{L}\\p{N}" NEW_LN
#define CONTRACTION "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"

const char *const TOK_PATTERN_KIMI =
    "[" HAN NEW_HAN "]+"
    "|[^\\r\\n" LN "]?" UPPERISH "*" LOWERISH "+" CONTRACTION
    "|[^\\r\\n" LN "]?" UPPERISH "+" LOWERISH "*" CONTRACTION
    "|[\\p{N}" NEW_N "]{1,3}"
    "| ?[^" WS LN "]+[\\r\\n]*"
    "|[" WS "]*[\\r\\n]+"
    "|[" WS "]+(?![^" WS "])"
    "|[" WS "]+";

const char *const TOK_PATTERN_GPT2 =
    "'(?:[sdmt]|ll|ve|re)"
    "| ?[\\p{L}" NEW_L "]+"
    "| ?[\\p{N}" NEW_N "]+"
    "| ?[^" WS LN "]+"
    "|[" WS "]+(?![^" WS "])"
    "|[" WS "]+";

struct tok_splitter {
    pcre2_code *re;
    bool jit;
};

int tok_splitter_new(const char *pattern, tok_splitter **out, k3_err *err) {
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return k3_fail(err, K3_EXIT_USAGE, "pre-tokenizer pattern: %s at offset %zu", (char *)msg,
                       (size_t)eo);
    }
    tok_splitter *s = xcalloc(1, sizeof *s);
    s->re = re;
    /* JIT is an accelerator only: when unavailable the interpreter gives the
     * same matches. */
    s->jit = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0;
    *out = s;
    return K3_OK;
}

void tok_splitter_free(tok_splitter *s) {
    if (!s) return;
    pcre2_code_free(s->re);
    free(s);
}

/* Strict UTF-8 (no overlongs, no surrogates, nothing past U+10FFFF). Returns
 * the offset of the first bad byte, or len when all of it is valid. */
size_t tok_utf8_check(const uint8_t *p, size_t len) {
    size_t i = 0;
    while (i < len) {
        uint8_t c = p[i];
        if (c < 0x80) { i++; continue; }
        size_t n;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) n = 1;
        else if (c == 0xE0) { n = 2; lo = 0xA0; }
        else if (c >= 0xE1 && c <= 0xEC) n = 2;
        else if (c == 0xED) { n = 2; hi = 0x9F; }
        else if (c >= 0xEE && c <= 0xEF) n = 2;
        else if (c == 0xF0) { n = 3; lo = 0x90; }
        else if (c >= 0xF1 && c <= 0xF3) n = 3;
        else if (c == 0xF4) { n = 3; hi = 0x8F; }
        else return i;
        if (len - i <= n) return i;
        if (p[i + 1] < lo || p[i + 1] > hi) return i;
        for (size_t k = 2; k <= n; k++)
            if ((p[i + k] & 0xC0) != 0x80) return i;
        i += n + 1;
    }
    return len;
}

int tok_split(const tok_splitter *s, const char *text, size_t len,
              int (*cb)(const char *piece, size_t n, void *ctx), void *ctx, k3_err *err) {
    size_t bad = tok_utf8_check((const uint8_t *)text, len);
    if (bad != len) return k3_fail(err, K3_EXIT_USAGE, "input text: invalid UTF-8 at byte %zu", bad);
    if (len == 0) return K3_OK;
    /* Match data per call: this is what makes concurrent calls on one
     * splitter safe (the compiled pattern itself is read-only). */
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md) return k3_fail(err, K3_EXIT_RUNTIME, "pre-tokenizer: out of memory");
    pcre2_match_context *mc = NULL;
    pcre2_jit_stack *js = NULL;
    size_t js_max = 0;       /* the private JIT stack's limit (0: the default 32 KiB one) */
    uint32_t opts = PCRE2_NO_UTF_CHECK;
    int rc = K3_OK;
    size_t pos = 0;
    while (pos < len) {
        int m = pcre2_match(s->re, (PCRE2_SPTR)text, len, pos, opts, md, mc);
        if (m == PCRE2_ERROR_JIT_STACKLIMIT) {
            /* A long piece (a run of millions of letters) outgrew the JIT
             * stack, which grows with the piece: retry with a private one,
             * 64 MiB then doubling to 1 GiB (address space, used only as
             * deep as the match goes); past that the interpreter, which
             * keeps its backtracking on the heap. Same pattern, same pieces. */
            pcre2_jit_stack_free(js);
            js = NULL;
            js_max = js_max ? js_max * 2 : (size_t)64 << 20;
            if (!mc && !(mc = pcre2_match_context_create(NULL))) {
                rc = k3_fail(err, K3_EXIT_RUNTIME, "pre-tokenizer: out of memory");
                break;
            }
            if (js_max > ((size_t)1 << 30)) opts |= PCRE2_NO_JIT;
            else if ((js = pcre2_jit_stack_create(64 * 1024, js_max, NULL))) pcre2_jit_stack_assign(mc, NULL, js);
            else opts |= PCRE2_NO_JIT; /* no room for the stack: the interpreter */
            continue;
        }
        if (m < 0) {
            if (m == PCRE2_ERROR_NOMATCH) {
                rc = k3_fail(err, K3_EXIT_USAGE, "input text: pre-tokenizer pattern matches nothing at byte %zu", pos);
            } else {
                PCRE2_UCHAR msg[256];
                pcre2_get_error_message(m, msg, sizeof msg);
                rc = k3_fail(err, K3_EXIT_RUNTIME, "input text: pre-tokenizer failed at byte %zu: %s", pos, (char *)msg);
            }
            break;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        /* Both patterns match every character, so pieces are contiguous; a
         * gap or an empty match would mean a pattern that drops text. */
        if (ov[0] != pos || ov[1] <= ov[0]) {
            rc = k3_fail(err, K3_EXIT_USAGE, "input text: pre-tokenizer pattern leaves text unmatched at byte %zu", pos);
            break;
        }
        if (cb(text + ov[0], ov[1] - ov[0], ctx)) break;
        pos = ov[1];
    }
    pcre2_match_data_free(md);
    pcre2_match_context_free(mc);
    pcre2_jit_stack_free(js);
    return rc;
}
