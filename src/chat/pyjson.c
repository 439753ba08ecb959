/* pyjson.c: CPython-compatible JSON serialization and the
 * UTF-8 helpers of the chat module.
 *
 * The release encoder writes tool schemas and argument values with Python's
 * json.dumps; the bytes must be the same, so this does not use jansson's
 * dumper (which prints reals with 17 digits and escapes differently). */
#include "chat/internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void chat_pyjson_string(k3_sbuf *b, const char *s, size_t n) {
    k3_sb_putc(b, '"');
    size_t run = 0; /* bytes copied as they are, flushed before each escape */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char u[8];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", c);
                esc = u;
            }
        }
        if (!esc) continue;
        k3_sb_put(b, s + run, i - run);
        k3_sb_puts(b, esc);
        run = i + 1;
    }
    k3_sb_put(b, s + run, n - run);
    k3_sb_putc(b, '"');
}

/* repr(float): the shortest digits that read back to x, fixed notation when
 * the decimal exponent is in [-4, 16), else d.ddde+XX. */
static void py_float(k3_sbuf *b, double x) {
    if (isnan(x)) { k3_sb_puts(b, "NaN"); return; }
    if (isinf(x)) { k3_sb_puts(b, x < 0 ? "-Infinity" : "Infinity"); return; }
    if (x == 0) { k3_sb_puts(b, signbit(x) ? "-0.0" : "0.0"); return; }
    char e[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, x);
        if (strtod(e, NULL) == x) break;
    }
    const char *s = e;
    if (*s == '-') { k3_sb_putc(b, '-'); s++; }
    char dig[24];
    int nd = 0;
    dig[nd++] = *s++;
    if (*s == '.')
        for (s++; *s != 'e' && nd < 20; s++) dig[nd++] = *s;
    int ex = atoi(s + 1);
    while (nd > 1 && dig[nd - 1] == '0') nd--;
    int decpt = ex + 1; /* value = 0.d1d2... * 10^decpt */
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            k3_sb_puts(b, "0.");
            for (int i = 0; i < -decpt; i++) k3_sb_putc(b, '0');
            k3_sb_put(b, dig, (size_t)nd);
        } else if (decpt >= nd) {
            k3_sb_put(b, dig, (size_t)nd);
            for (int i = nd; i < decpt; i++) k3_sb_putc(b, '0');
            k3_sb_puts(b, ".0");
        } else {
            k3_sb_put(b, dig, (size_t)decpt);
            k3_sb_putc(b, '.');
            k3_sb_put(b, dig + decpt, (size_t)(nd - decpt));
        }
    } else {
        k3_sb_putc(b, dig[0]);
        if (nd > 1) {
            k3_sb_putc(b, '.');
            k3_sb_put(b, dig + 1, (size_t)(nd - 1));
        }
        char t[16];
        snprintf(t, sizeof t, "e%c%02d", ex < 0 ? '-' : '+', ex < 0 ? -ex : ex);
        k3_sb_puts(b, t);
    }
}

static int cmp_key(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

void chat_pyjson(k3_sbuf *b, const json_t *v, bool compact, bool sort_keys) {
    const char *item_sep = compact ? "," : ", ", *key_sep = compact ? ":" : ": ";
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        size_t n = json_object_size(v), i = 0;
        const char **keys = xmalloc_array(n ? n : 1, sizeof *keys);
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)v, k, x) keys[i++] = k;
        if (sort_keys) qsort(keys, n, sizeof *keys, cmp_key);
        k3_sb_putc(b, '{');
        for (i = 0; i < n; i++) {
            if (i) k3_sb_puts(b, item_sep);
            chat_pyjson_string(b, keys[i], strlen(keys[i]));
            k3_sb_puts(b, key_sep);
            chat_pyjson(b, json_object_get(v, keys[i]), compact, sort_keys);
        }
        k3_sb_putc(b, '}');
        free(keys);
        break;
    }
    case JSON_ARRAY:
        k3_sb_putc(b, '[');
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) k3_sb_puts(b, item_sep);
            chat_pyjson(b, json_array_get(v, i), compact, sort_keys);
        }
        k3_sb_putc(b, ']');
        break;
    case JSON_STRING:
        chat_pyjson_string(b, json_string_value(v), json_string_length(v));
        break;
    case JSON_INTEGER: {
        char t[32];
        snprintf(t, sizeof t, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        k3_sb_puts(b, t);
        break;
    }
    case JSON_REAL: py_float(b, json_real_value(v)); break;
    case JSON_TRUE: k3_sb_puts(b, "true"); break;
    case JSON_FALSE: k3_sb_puts(b, "false"); break;
    case JSON_NULL: k3_sb_puts(b, "null"); break;
    }
}

/* Length of the valid character at in[0..n): >0 complete, 0 invalid, -1 a
 * valid but incomplete prefix. Same rules as tok_utf8_check (no overlongs,
 * surrogates or code points past U+10FFFF). */
static int utf8_char(const uint8_t *in, size_t n) {
    uint8_t c = in[0];
    if (c < 0x80) return 1;
    int len;
    uint8_t lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c == 0xe0) { len = 3; lo = 0xa0; }
    else if (c == 0xed) { len = 3; hi = 0x9f; }
    else if (c >= 0xe1 && c <= 0xef) len = 3;
    else if (c == 0xf0) { len = 4; lo = 0x90; }
    else if (c == 0xf4) { len = 4; hi = 0x8f; }
    else if (c >= 0xf1 && c <= 0xf3) len = 4;
    else return 0;
    for (int k = 1; k < len; k++) {
        if ((size_t)k >= n) return -1;
        uint8_t lo_k = k == 1 ? lo : 0x80, hi_k = k == 1 ? hi : 0xbf;
        if (in[k] < lo_k || in[k] > hi_k) return 0;
    }
    return len;
}

size_t chat_utf8_take(const uint8_t *in, size_t n, bool final, k3_sbuf *out) {
    static const char repl[] = "\xef\xbf\xbd";
    if (!n) return 0;
    size_t i = 0, run = 0;
    while (i < n) {
        int l = utf8_char(in + i, n - i);
        if (l > 0) { i += (size_t)l; continue; }
        k3_sb_put(out, in + run, i - run);
        if (l < 0 && !final) return i; /* hold the incomplete tail back */
        k3_sb_put(out, repl, 3);
        i = l < 0 ? n : i + 1;
        run = i;
    }
    k3_sb_put(out, in + run, n - run);
    return n;
}
