/* template.c: the K3 chat template: an OpenAI-shaped request to prompt ids,
 * segment by segment as the release encoder (encoding_k3.py) builds them.
 *
 * Two passes: validate() checks every field the template reads and names the
 * first bad one; render() then walks the request trusting the shapes. Tool
 * results are first put into the order of the calls they answer (by
 * tool_call_id), as the release encoder does before rendering. */
#include "chat/internal.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define IMAGE_PLACEHOLDER "<|kimi_image_placeholder|>"

/* ---- markup id resolution --------------------------------------------- */

static const char *const k3_names[4] = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"};
/* The same ids as the Kimi tokenizer_config names them (../shared/fixtures/xtml/
 * SOURCE.md); the config leaves [sep] unnamed, so it has the reserved name. */
static const char *const kimi_names[4] = {"<|im_user|>", "<|im_assistant|>",
                                          "<|reserved_token_163589|>", "<|im_end|>"};

static bool resolve(const k3_tokenizer *tok, const char *const names[4], int32_t out[4]) {
    for (int i = 0; i < 4; i++)
        if ((out[i] = tok_special_id(tok, names[i])) < 0) return false;
    return true;
}

int k3_chat_new(const k3_tokenizer *tok, k3_chat **out, k3_err *err) {
    int32_t v[4];
    if (!resolve(tok, k3_names, v) && !resolve(tok, kimi_names, v))
        return k3_fail(err, K3_EXIT_USAGE,
                       "tokenizer has no XTML ids (<|open|> <|close|> <|sep|> <|end_of_msg|>): "
                       "not a chat model");
    k3_chat *c = xcalloc(1, sizeof *c);
    c->tok = tok;
    c->ids = (k3_chat_ids){v[0], v[1], v[2], v[3], tok_special_id(tok, "[EOS]")};
    *out = c;
    return K3_OK;
}

void k3_chat_free(k3_chat *c) { free(c); }
k3_chat_ids k3_chat_markup(const k3_chat *c) { return c->ids; }
bool k3_chat_is_stop(const k3_chat *c, int32_t id) {
    return id == c->ids.end_of_msg || (c->ids.eos >= 0 && id == c->ids.eos);
}

/* ---- validation -------------------------------------------------------- */

static const char *const top_fields[] = {"messages", "tools", "tool_choice", "response_format",
                                         "thinking", "thinking_effort", "add_generation_prompt",
                                         "image_prompts"};

int k3_chat_check_fields(const json_t *req, k3_err *err) {
    if (!json_is_object(req)) return k3_fail(err, K3_EXIT_USAGE, "request: want a JSON object");
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)req, k, v) {
        size_t i = 0, n = sizeof top_fields / sizeof *top_fields;
        while (i < n && strcmp(k, top_fields[i])) i++;
        if (i == n) return k3_fail(err, K3_EXIT_USAGE, "request.%s: unknown field", k);
    }
    return K3_OK;
}

typedef struct {
    char s[256];
} path_t;

static __attribute__((format(printf, 2, 3))) const char *P(path_t *p, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->s, sizeof p->s, fmt, ap);
    va_end(ap);
    return p->s;
}

/* v is absent, null or a string */
static int opt_string(const json_t *obj, const char *key, const char *where, k3_err *err) {
    const json_t *v = json_object_get(obj, key);
    if (v && !json_is_null(v) && !json_is_string(v))
        return k3_fail(err, K3_EXIT_USAGE, "%s.%s: want a string", where, key);
    return K3_OK;
}

static int check_content(const json_t *m, const char *where, k3_err *err) {
    const json_t *c = json_object_get(m, "content");
    if (!c || json_is_null(c) || json_is_string(c)) return K3_OK;
    if (!json_is_array(c))
        return k3_fail(err, K3_EXIT_USAGE, "%s.content: want a string, an array of parts or null",
                       where);
    for (size_t j = 0; j < json_array_size(c); j++) {
        const json_t *part = json_array_get(c, j), *type = json_object_get(part, "type");
        if (!json_is_object(part))
            return k3_fail(err, K3_EXIT_USAGE, "%s.content[%zu]: want an object", where, j);
        if (!json_is_string(type))
            return k3_fail(err, K3_EXIT_USAGE, "%s.content[%zu].type: want a string", where, j);
        const char *t = json_string_value(type);
        if (strcmp(t, "image") == 0 || strcmp(t, "image_url") == 0) continue;
        if (!json_is_string(json_object_get(part, "text")))
            return k3_fail(err, K3_EXIT_USAGE, "%s.content[%zu].text: want a string", where, j);
    }
    return K3_OK;
}

/* ---- tool-call arguments ------------------------------------------------
 *
 * A JSON-string `arguments` is read as the release encoder reads it: one
 * object level deep, keeping each non-string value's own JSON text (`1e2`
 * stays `1e2`, `[1,2]` keeps its spacing) and decoding string values. Any
 * string that is not such an object (malformed, another JSON type, blank) is
 * kept whole for the JSON fallback block; only "" means no arguments. The
 * value grammar is Python's json scanner: NaN, Infinity and -Infinity are
 * numbers, raw control characters in strings are errors. */

typedef struct {
    const char *s;
    size_t n, i;
} scan_t;

static void scan_ws(scan_t *c) {
    while (c->i < c->n && strchr(" \t\n\r", c->s[c->i]) && c->s[c->i]) c->i++;
}
static bool scan_lit(scan_t *c, const char *lit) {
    size_t l = strlen(lit);
    if (c->n - c->i < l || memcmp(c->s + c->i, lit, l)) return false;
    c->i += l;
    return true;
}
static int hexval(char h) {
    return h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
}
static bool scan_hex4(scan_t *c, uint32_t *v) {
    if (c->n - c->i < 4) return false;
    *v = 0;
    for (int k = 0; k < 4; k++) {
        int h = hexval(c->s[c->i + (size_t)k]);
        if (h < 0) return false;
        *v = *v << 4 | (uint32_t)h;
    }
    c->i += 4;
    return true;
}
static void put_cp(k3_sbuf *o, uint32_t cp) {
    char b[4];
    size_t n;
    if (cp < 0x80) { b[0] = (char)cp; n = 1; }
    else if (cp < 0x800) { b[0] = (char)(0xc0 | cp >> 6); b[1] = (char)(0x80 | (cp & 63)); n = 2; }
    else if (cp < 0x10000) {
        b[0] = (char)(0xe0 | cp >> 12); b[1] = (char)(0x80 | (cp >> 6 & 63)); b[2] = (char)(0x80 | (cp & 63));
        n = 3;
    } else {
        b[0] = (char)(0xf0 | cp >> 18); b[1] = (char)(0x80 | (cp >> 12 & 63));
        b[2] = (char)(0x80 | (cp >> 6 & 63)); b[3] = (char)(0x80 | (cp & 63));
        n = 4;
    }
    k3_sb_put(o, b, n);
}
/* A string at c->i (which is '"'); decoded into out when out is set. A lone
 * surrogate escape is refused (it has no UTF-8 form to tokenize). */
static bool scan_string(scan_t *c, k3_sbuf *out) {
    c->i++;
    while (c->i < c->n) {
        unsigned char ch = (unsigned char)c->s[c->i++];
        if (ch == '"') return true;
        if (ch < 0x20) return false;
        if (ch != '\\') {
            if (out) k3_sb_putc(out, (char)ch);
            continue;
        }
        if (c->i >= c->n) return false;
        char e = c->s[c->i++];
        const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
        const char *hit = e ? strchr(from, e) : NULL;
        if (hit) {
            if (out) k3_sb_putc(out, to[hit - from]);
            continue;
        }
        uint32_t cp, lo;
        if (e != 'u' || !scan_hex4(c, &cp)) return false;
        if (cp >= 0xd800 && cp < 0xdc00) {
            if (c->n - c->i < 6 || c->s[c->i] != '\\' || c->s[c->i + 1] != 'u') return false;
            c->i += 2;
            if (!scan_hex4(c, &lo) || lo < 0xdc00 || lo > 0xdfff) return false;
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        } else if (cp >= 0xdc00 && cp < 0xe000) {
            return false;
        }
        if (out) put_cp(out, cp);
    }
    return false;
}
static bool is_digit(scan_t *c) { return c->i < c->n && c->s[c->i] >= '0' && c->s[c->i] <= '9'; }
/* -?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)? or -Infinity */
static bool scan_number(scan_t *c) {
    if (c->i < c->n && c->s[c->i] == '-') {
        c->i++;
        if (scan_lit(c, "Infinity")) return true;
    }
    if (!is_digit(c)) return false;
    if (c->s[c->i++] != '0')
        while (is_digit(c)) c->i++;
    if (c->i + 1 < c->n && c->s[c->i] == '.' && c->s[c->i + 1] >= '0' && c->s[c->i + 1] <= '9') {
        c->i++;
        while (is_digit(c)) c->i++;
    }
    if (c->i < c->n && (c->s[c->i] == 'e' || c->s[c->i] == 'E')) {
        size_t back = c->i++;
        if (c->i < c->n && (c->s[c->i] == '+' || c->s[c->i] == '-')) c->i++;
        if (!is_digit(c)) c->i = back;
        while (is_digit(c)) c->i++;
    }
    return true;
}
/* One value at c->i; *type is its XTML type. */
static bool scan_value(scan_t *c, int depth, const char **type, k3_sbuf *str) {
    if (c->i >= c->n || depth > 1000) return false;
    char ch = c->s[c->i];
    if (ch == '"') {
        *type = "string";
        return scan_string(c, str);
    }
    if (ch == '{' || ch == '[') {
        char end = ch == '{' ? '}' : ']';
        const char *t;
        *type = ch == '{' ? "object" : "array";
        c->i++;
        scan_ws(c);
        if (c->i < c->n && c->s[c->i] == end) {
            c->i++;
            return true;
        }
        for (;;) {
            if (ch == '{') {
                if (c->i >= c->n || c->s[c->i] != '"' || !scan_string(c, NULL)) return false;
                scan_ws(c);
                if (c->i >= c->n || c->s[c->i++] != ':') return false;
                scan_ws(c);
            }
            if (!scan_value(c, depth + 1, &t, NULL)) return false;
            scan_ws(c);
            if (c->i >= c->n) return false;
            char sep = c->s[c->i++];
            if (sep == end) return true;
            if (sep != ',') return false;
            scan_ws(c);
        }
    }
    if (scan_lit(c, "true") || scan_lit(c, "false")) {
        *type = "boolean";
        return true;
    }
    if (scan_lit(c, "null")) {
        *type = "null";
        return true;
    }
    *type = "number";
    return scan_lit(c, "NaN") || scan_lit(c, "Infinity") || scan_number(c);
}

typedef struct {
    k3_sbuf key, text; /* text: the decoded string, or the value's JSON text */
    const char *type;
} arg_t;
typedef struct {
    arg_t *v;
    size_t n;
} args_t;

static void args_free(args_t *a) {
    for (size_t i = 0; i < a->n; i++) {
        k3_sb_free(&a->v[i].key);
        k3_sb_free(&a->v[i].text);
    }
    free(a->v);
    a->v = NULL;
    a->n = 0;
}

/* {"key": value, ...} one level deep; what follows the closing brace is
 * not read. */
static bool parse_args_object(const char *s, size_t n, args_t *out) {
    scan_t c = {s, n, 0};
    scan_ws(&c);
    if (c.i >= n || s[c.i++] != '{') return false;
    scan_ws(&c);
    if (c.i >= n) return false;
    if (s[c.i] == '}') return true;
    for (;;) {
        scan_ws(&c);
        arg_t a = {.type = NULL};
        const char *kt;
        k3_sb_put(&a.key, "", 0);
        k3_sb_put(&a.text, "", 0);
        out->v = xrealloc_array(out->v, out->n + 1, sizeof *out->v);
        out->v[out->n++] = a;
        arg_t *cur = &out->v[out->n - 1];
        if (c.i >= n || s[c.i] != '"' || !scan_value(&c, 0, &kt, &cur->key)) return false;
        scan_ws(&c);
        if (c.i >= n || s[c.i++] != ':') return false;
        scan_ws(&c);
        size_t v0 = c.i;
        if (!scan_value(&c, 0, &cur->type, &cur->text)) return false;
        if (strcmp(cur->type, "string")) k3_sb_put(&cur->text, s + v0, c.i - v0);
        scan_ws(&c);
        char t = c.i < n ? s[c.i++] : 0;
        scan_ws(&c);
        if (t == '}') return true;
        if (t != ',') return false;
    }
}

enum { ARGS_NONE, ARGS_OBJECT, ARGS_LIST, ARGS_RAW };

/* Arguments as the release normalizes them: absent, null or "" -> none; an
 * object as it is (values written by json.dumps); a string as above. */
static int normalize_args(const json_t *a, const char *where, args_t *list, int *kind, k3_err *err) {
    *kind = ARGS_NONE;
    list->v = NULL;
    list->n = 0;
    if (!a || json_is_null(a)) return K3_OK;
    if (json_is_object(a)) {
        *kind = ARGS_OBJECT;
        return K3_OK;
    }
    if (!json_is_string(a))
        return k3_fail(err, K3_EXIT_USAGE, "%s.arguments: want a JSON string or an object", where);
    if (!json_string_length(a)) return K3_OK;
    if (parse_args_object(json_string_value(a), json_string_length(a), list)) {
        *kind = ARGS_LIST;
    } else {
        args_free(list);
        *kind = ARGS_RAW;
    }
    return K3_OK;
}

static int check_tool_calls(const json_t *m, const char *where, k3_err *err) {
    const json_t *tc = json_object_get(m, "tool_calls");
    if (!tc || json_is_null(tc)) return K3_OK;
    if (!json_is_array(tc)) return k3_fail(err, K3_EXIT_USAGE, "%s.tool_calls: want an array", where);
    path_t p;
    for (size_t j = 0; j < json_array_size(tc); j++) {
        const json_t *call = json_array_get(tc, j);
        if (!json_is_object(call))
            return k3_fail(err, K3_EXIT_USAGE, "%s.tool_calls[%zu]: want an object", where, j);
        if (opt_string(call, "id", P(&p, "%s.tool_calls[%zu]", where, j), err)) return err->code;
        const json_t *fn = json_object_get(call, "function");
        if (fn) {
            if (!json_is_object(fn))
                return k3_fail(err, K3_EXIT_USAGE, "%s.tool_calls[%zu].function: want an object",
                               where, j);
            P(&p, "%s.tool_calls[%zu].function", where, j);
        } else {
            fn = call;
            P(&p, "%s.tool_calls[%zu]", where, j);
        }
        if (!json_is_string(json_object_get(fn, "name")))
            return k3_fail(err, K3_EXIT_USAGE, "%s.name: want a string", p.s);
        args_t args;
        int kind;
        if (normalize_args(json_object_get(fn, "arguments"), p.s, &args, &kind, err)) return err->code;
        args_free(&args);
    }
    return K3_OK;
}

static const char *const roles[] = {"system", "user", "assistant", "tool"};

static int validate(const json_t *req, bool *thinking, bool *gen_prompt, k3_err *err) {
    if (!json_is_object(req)) return k3_fail(err, K3_EXIT_USAGE, "request: want a JSON object");
    const json_t *msgs = json_object_get(req, "messages");
    if (!msgs) return k3_fail(err, K3_EXIT_USAGE, "messages: missing");
    if (!json_is_array(msgs)) return k3_fail(err, K3_EXIT_USAGE, "messages: want an array");
    path_t p;
    for (size_t i = 0; i < json_array_size(msgs); i++) {
        const json_t *m = json_array_get(msgs, i);
        P(&p, "messages[%zu]", i);
        if (!json_is_object(m)) return k3_fail(err, K3_EXIT_USAGE, "%s: want an object", p.s);
        const json_t *role = json_object_get(m, "role");
        size_t r = 0;
        if (json_is_string(role))
            while (r < 4 && strcmp(json_string_value(role), roles[r])) r++;
        if (!json_is_string(role) || r == 4)
            return k3_fail(err, K3_EXIT_USAGE,
                           "%s.role: want one of system, user, assistant, tool", p.s);
        if (check_content(m, p.s, err) || opt_string(m, "name", p.s, err)) return err->code;
        if (r == 0) {
            const json_t *t = json_object_get(m, "tools");
            if (t && !json_is_null(t) && !json_is_array(t))
                return k3_fail(err, K3_EXIT_USAGE, "%s.tools: want an array", p.s);
        } else if (r == 2) {
            if (opt_string(m, "reasoning_content", p.s, err) || opt_string(m, "reasoning", p.s, err) ||
                check_tool_calls(m, p.s, err))
                return err->code;
        } else if (r == 3) {
            if (opt_string(m, "tool_call_id", p.s, err) || opt_string(m, "id", p.s, err) ||
                opt_string(m, "tool", p.s, err))
                return err->code;
        }
    }
    const json_t *v;
    if ((v = json_object_get(req, "tools")) && !json_is_null(v) && !json_is_array(v))
        return k3_fail(err, K3_EXIT_USAGE, "tools: want an array");
    if ((v = json_object_get(req, "tool_choice")) && !json_is_null(v) && !json_is_string(v) &&
        !json_is_object(v))
        return k3_fail(err, K3_EXIT_USAGE, "tool_choice: want a string or an object");
    if ((v = json_object_get(req, "response_format")) && !json_is_null(v) && !json_is_string(v) &&
        !json_is_object(v))
        return k3_fail(err, K3_EXIT_USAGE, "response_format: want an object");
    *thinking = *gen_prompt = true;
    if ((v = json_object_get(req, "thinking"))) {
        if (!json_is_boolean(v)) return k3_fail(err, K3_EXIT_USAGE, "thinking: want true or false");
        *thinking = json_is_true(v);
    }
    if ((v = json_object_get(req, "add_generation_prompt"))) {
        if (!json_is_boolean(v))
            return k3_fail(err, K3_EXIT_USAGE, "add_generation_prompt: want true or false");
        *gen_prompt = json_is_true(v);
    }
    if ((v = json_object_get(req, "thinking_effort")) && !json_is_null(v)) {
        if (!json_is_string(v)) return k3_fail(err, K3_EXIT_USAGE, "thinking_effort: want a string");
        const char *e = json_string_value(v);
        /* the release accepts only these three, although its own instruction
         * text also lists `medium` */
        if (*thinking && strcmp(e, "low") && strcmp(e, "high") && strcmp(e, "max"))
            return k3_fail(err, K3_EXIT_USAGE, "thinking_effort: want one of low, high, max (got '%s')",
                           e);
    }
    if ((v = json_object_get(req, "image_prompts")) && !json_is_null(v)) {
        if (!json_is_array(v)) return k3_fail(err, K3_EXIT_USAGE, "image_prompts: want an array");
        for (size_t i = 0; i < json_array_size(v); i++)
            if (!json_is_string(json_array_get(v, i)))
                return k3_fail(err, K3_EXIT_USAGE, "image_prompts[%zu]: want a string", i);
    }
    return K3_OK;
}

/* ---- tool results in call order --------------------------------------- */

typedef struct {
    const json_t *m;
    size_t at;        /* its index in messages (for error messages) */
    const char *tool; /* the matched call's function name, or NULL */
} view_t;

static const json_t *call_fn(const json_t *call) {
    const json_t *fn = json_object_get(call, "function");
    return fn ? fn : call;
}

/* Each run of consecutive tool messages that all match, by tool_call_id (or
 * id), a call of the latest assistant message is sorted by call position
 * (stable) and named after the matched call; a run with any unmatched
 * message stays as it came. */
static view_t *order_tool_results(const json_t *msgs, size_t *nv) {
    size_t n = json_array_size(msgs);
    view_t *out = xmalloc_array(n ? n : 1, sizeof *out);
    size_t *pos = xmalloc_array(n ? n : 1, sizeof *pos);
    const json_t *calls = NULL; /* the latest assistant's tool_calls */
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        const json_t *m = json_array_get(msgs, i);
        const char *role = json_string_value(json_object_get(m, "role"));
        if (strcmp(role, "tool")) {
            if (strcmp(role, "assistant") == 0) calls = json_object_get(m, "tool_calls");
            out[o++] = (view_t){m, i, NULL};
            i++;
            continue;
        }
        size_t start = o;
        bool unresolved = false;
        for (; i < n && strcmp(json_string_value(json_object_get(json_array_get(msgs, i), "role")),
                               "tool") == 0;
             i++) {
            const json_t *t = json_array_get(msgs, i);
            const json_t *id = json_object_get(t, "tool_call_id");
            if (!id) id = json_object_get(t, "id");
            size_t found = 0;
            const char *name = NULL;
            if (json_is_string(id) && json_is_array(calls))
                for (size_t j = 0; j < json_array_size(calls); j++) {
                    const json_t *cid = json_object_get(json_array_get(calls, j), "id");
                    if (json_is_string(cid) && json_string_length(cid) == json_string_length(id) &&
                        memcmp(json_string_value(cid), json_string_value(id), json_string_length(id)) ==
                            0) {
                        found = j + 1; /* the first call with this id */
                        name = json_string_value(
                            json_object_get(call_fn(json_array_get(calls, j)), "name"));
                        break;
                    }
                }
            if (!found) unresolved = true;
            pos[o] = found;
            out[o++] = (view_t){t, i, name};
        }
        if (unresolved) {
            for (size_t k = start; k < o; k++) out[k].tool = NULL;
            continue;
        }
        /* insertion sort by call position: stable, and runs are short */
        for (size_t k = start + 1; k < o; k++) {
            view_t v = out[k];
            size_t pv = pos[k], j = k;
            while (j > start && pos[j - 1] > pv) {
                out[j] = out[j - 1];
                pos[j] = pos[j - 1];
                j--;
            }
            out[j] = v;
            pos[j] = pv;
        }
    }
    free(pos);
    *nv = o;
    return out;
}

/* ---- rendering ---------------------------------------------------------- */

typedef struct {
    const k3_chat *c;
    int32_t *ids;
    size_t n, cap;
    const json_t *prompts; /* image_prompts or NULL */
    size_t next_prompt;
    size_t *ends;          /* NULL: not wanted; else where each message ended */
    size_t nends, cends;
    k3_err *err;
} enc_t;

static void push_ids(enc_t *e, const int32_t *v, size_t n) {
    if (e->n + n > e->cap) {
        size_t cap = e->cap ? e->cap : 256;
        while (cap < e->n + n) cap *= 2;
        e->ids = xrealloc_array(e->ids, cap, sizeof *e->ids);
        e->cap = cap;
    }
    memcpy(e->ids + e->n, v, n * sizeof *v);
    e->n += n;
}

static int mark(enc_t *e, int32_t id) {
    push_ids(e, &id, 1);
    return K3_OK;
}

/* One segment; an empty one gives nothing. */
static int segment(enc_t *e, const char *s, size_t n, bool allow_special) {
    if (!n) return K3_OK;
    int32_t *v;
    size_t k;
    if (tok_encode(e->c->tok, s, n, allow_special, &v, &k, e->err)) return e->err->code;
    push_ids(e, v, k);
    free(v);
    return K3_OK;
}
static int text(enc_t *e, const char *s) { return segment(e, s, strlen(s), false); }

/* The next image prompt (markup); without image_prompts the placeholder. */
static int image(enc_t *e) {
    if (!e->prompts) return segment(e, IMAGE_PLACEHOLDER, strlen(IMAGE_PLACEHOLDER), true);
    if (e->next_prompt >= json_array_size(e->prompts))
        return k3_fail(e->err, K3_EXIT_USAGE, "image_prompts: more images than image prompts (%zu)",
                       json_array_size(e->prompts));
    const json_t *s = json_array_get(e->prompts, e->next_prompt++);
    return segment(e, json_string_value(s), json_string_length(s), true);
}

/* Message text: with image_prompts, each placeholder in it is an image. */
static int user_text(enc_t *e, const char *s, size_t n) {
    if (!e->prompts) return segment(e, s, n, false);
    const size_t pl = strlen(IMAGE_PLACEHOLDER);
    for (;;) {
        const char *hit = n >= pl ? memmem(s, n, IMAGE_PLACEHOLDER, pl) : NULL;
        if (!hit) return segment(e, s, n, false);
        if (segment(e, s, (size_t)(hit - s), false) || image(e)) return e->err->code;
        n -= (size_t)(hit - s) + pl;
        s = hit + pl;
    }
}
static int user_json_text(enc_t *e, const json_t *s) {
    return user_text(e, json_string_value(s), json_string_length(s));
}

static int attr(enc_t *e, const char *key, const char *val, size_t n) {
    k3_sbuf k = {0}, v = {0};
    k3_sb_putc(&k, ' ');
    k3_sb_puts(&k, key);
    for (size_t i = 0; i < n; i++) {
        if (val[i] == '&') k3_sb_puts(&v, "&amp;");
        else if (val[i] == '"') k3_sb_puts(&v, "&quot;");
        else k3_sb_putc(&v, val[i]);
    }
    int rc = segment(e, k.p, k.n, false) || text(e, "=\"") || segment(e, v.p, v.n, false) ||
             text(e, "\"");
    k3_sb_free(&k);
    k3_sb_free(&v);
    return rc ? e->err->code : K3_OK;
}
static int attr_s(enc_t *e, const char *key, const char *val) { return attr(e, key, val, strlen(val)); }
static int attr_j(enc_t *e, const char *key, const json_t *s) {
    return attr(e, key, json_string_value(s), json_string_length(s));
}

static int open_tag(enc_t *e, const char *tag) { return mark(e, e->c->ids.open) || text(e, tag); }
static int sep(enc_t *e) { return mark(e, e->c->ids.sep); }
static int open_simple(enc_t *e, const char *tag) { return open_tag(e, tag) || sep(e); }
static int close_tag(enc_t *e, const char *tag) {
    return mark(e, e->c->ids.close) || text(e, tag) || sep(e);
}
static int end_message(enc_t *e) {
    if (close_tag(e, "message") || mark(e, e->c->ids.end_of_msg)) return e->err->code;
    if (e->ends) {
        if (e->nends == e->cends) {
            e->cends *= 2;
            e->ends = xrealloc_array(e->ends, e->cends, sizeof *e->ends);
        }
        e->ends[e->nends++] = e->n;
    }
    return K3_OK;
}

/* A message role="system" type=TYPE carrying the encoder's own text. */
static int internal_system(enc_t *e, const char *type, const char *body) {
    if (open_tag(e, "message") || attr_s(e, "role", "system") || attr_s(e, "type", type) || sep(e) ||
        text(e, body) || end_message(e))
        return e->err->code;
    return K3_OK;
}

static int tool_declare(enc_t *e, const json_t *tools, bool dynamic) {
    k3_sbuf b = {0};
    k3_sb_puts(&b, dynamic ? "## New Tools Available\n"
                          "The system dynamically extends the toolset via lazy-loading.\n"
                          "You have access to all existing and extended tools.\n"
                          "Here are the specs for the extended tools.\n\n```json\n"
                        : "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n");
    chat_pyjson(&b, tools, true, true);
    k3_sb_puts(&b, "\n```");
    int rc = open_tag(e, "message") || attr_s(e, "role", "system") || attr_s(e, "type", "tool-declare") ||
             sep(e) || segment(e, b.p, b.n, false) || end_message(e);
    k3_sb_free(&b);
    return rc ? e->err->code : K3_OK;
}

static int content(enc_t *e, const json_t *c) {
    if (!c || json_is_null(c)) return K3_OK;
    if (json_is_string(c)) return user_json_text(e, c);
    for (size_t j = 0; j < json_array_size(c); j++) {
        const json_t *part = json_array_get(c, j);
        const char *t = json_string_value(json_object_get(part, "type"));
        int rc = strcmp(t, "image") == 0 || strcmp(t, "image_url") == 0
                     ? image(e)
                     : user_json_text(e, json_object_get(part, "text"));
        if (rc) return rc;
    }
    return K3_OK;
}

/* <message role=ROLE [name=NAME]> */
static int open_message(enc_t *e, const char *role, const json_t *m) {
    const json_t *name = json_object_get(m, "name");
    if (open_tag(e, "message") || attr_s(e, "role", role)) return e->err->code;
    if (json_is_string(name) && json_string_length(name) && attr_j(e, "name", name)) return e->err->code;
    return sep(e);
}

static const char *xtml_type(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_TRUE:
    case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    case JSON_INTEGER:
    case JSON_REAL: return "number";
    case JSON_STRING: return "string";
    case JSON_OBJECT: return "object";
    default: return "array";
    }
}

static int tool_call(enc_t *e, const json_t *call, size_t index, const char *where) {
    const json_t *fn = call_fn(call);
    char idx[32];
    snprintf(idx, sizeof idx, "%zu", index);
    if (open_tag(e, "call") || attr_j(e, "tool", json_object_get(fn, "name")) || attr_s(e, "index", idx) ||
        sep(e))
        return e->err->code;
    const json_t *a = json_object_get(fn, "arguments");
    args_t args;
    int kind;
    if (normalize_args(a, where, &args, &kind, e->err)) return e->err->code;
    int rc = K3_OK;
    if (kind == ARGS_RAW) {
        rc = open_tag(e, "json") || attr_s(e, "type", "object") || sep(e) || user_json_text(e, a) ||
             close_tag(e, "json");
    } else if (kind == ARGS_LIST) {
        for (size_t i = 0; i < args.n && !rc; i++) {
            const arg_t *g = &args.v[i];
            rc = open_tag(e, "argument") || attr(e, "key", g->key.p, g->key.n) || attr_s(e, "type", g->type) ||
                 sep(e) || user_text(e, g->text.p, g->text.n) || close_tag(e, "argument");
        }
    } else if (kind == ARGS_OBJECT) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)a, k, v) {
            k3_sbuf b = {0};
            if (json_is_string(v)) k3_sb_put(&b, json_string_value(v), json_string_length(v));
            else chat_pyjson(&b, v, false, false);
            rc = open_tag(e, "argument") || attr_s(e, "key", k) || attr_s(e, "type", xtml_type(v)) ||
                 sep(e) || user_text(e, b.p, b.n) || close_tag(e, "argument");
            k3_sb_free(&b);
            if (rc) break;
        }
    }
    args_free(&args);
    if (rc) return e->err->code;
    return close_tag(e, "call");
}

static int assistant(enc_t *e, const json_t *m, bool thinking, const char *where) {
    if (open_message(e, "assistant", m)) return e->err->code;
    if (thinking) {
        /* reasoning_content, else reasoning (an empty string falls
         * through); only empty reasoning is left out, whitespace is kept */
        const json_t *r = json_object_get(m, "reasoning_content");
        if (!json_is_string(r) || !json_string_length(r)) r = json_object_get(m, "reasoning");
        if (open_simple(e, "think")) return e->err->code;
        if (json_is_string(r) && user_json_text(e, r)) return e->err->code;
        if (close_tag(e, "think")) return e->err->code;
    }
    if (open_simple(e, "response") || content(e, json_object_get(m, "content")) ||
        close_tag(e, "response"))
        return e->err->code;
    const json_t *calls = json_object_get(m, "tool_calls");
    if (json_array_size(calls)) {
        if (open_simple(e, "tools")) return e->err->code;
        path_t p;
        for (size_t j = 0; j < json_array_size(calls); j++) {
            const json_t *call = json_array_get(calls, j);
            P(&p, "%s.tool_calls[%zu]%s", where, j, json_object_get(call, "function") ? ".function" : "");
            if (tool_call(e, call, j + 1, p.s)) return e->err->code;
        }
        if (close_tag(e, "tools")) return e->err->code;
    }
    return end_message(e);
}

static const char *const effort_text =
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort=%s`.";

static int response_format(enc_t *e, const json_t *rf) {
    const json_t *type = json_is_object(rf) ? json_object_get(rf, "type") : rf;
    const char *t = json_is_string(type) ? json_string_value(type) : "";
    static const char *const raw_json =
        "Your response must be raw JSON data without markdown code blocks (```json) or any "
        "additional formatting.";
    if (strcmp(t, "json_object") == 0) {
        k3_sbuf b = {0};
        k3_sb_puts(&b, "The system is invoked with `response_format=json_object`.\n");
        k3_sb_puts(&b, raw_json);
        int rc = internal_system(e, "response-format", b.p);
        k3_sb_free(&b);
        return rc;
    }
    if (strcmp(t, "json_schema")) return K3_OK;
    /* the schema: json_schema.schema, else json_schema.json_schema, else
     * json_schema itself; none is `null` */
    const json_t *js = json_is_object(rf) ? json_object_get(rf, "json_schema") : NULL, *schema = js;
    if (json_is_object(js)) {
        if (json_object_get(js, "schema")) schema = json_object_get(js, "schema");
        else if (json_object_get(js, "json_schema")) schema = json_object_get(js, "json_schema");
    }
    k3_sbuf b = {0};
    k3_sb_puts(&b, "The system is invoked with `response_format=json_schema`.\n");
    k3_sb_puts(&b, raw_json);
    k3_sb_puts(&b, "\nThe JSON data must match the following schema:\n```json\n");
    if (schema) chat_pyjson(&b, schema, true, true);
    else k3_sb_puts(&b, "null");
    k3_sb_puts(&b, "\n```");
    int rc = internal_system(e, "response-format", b.p);
    k3_sb_free(&b);
    return rc;
}

static int render(enc_t *e, const json_t *req, bool thinking, bool gen_prompt) {
    const json_t *tools = json_object_get(req, "tools");
    if (json_array_size(tools) && tool_declare(e, tools, false)) return e->err->code;
    const json_t *effort = json_object_get(req, "thinking_effort");
    if (thinking && json_is_string(effort)) {
        char body[512];
        snprintf(body, sizeof body, effort_text, json_string_value(effort));
        if (internal_system(e, "thinking-effort", body)) return e->err->code;
    }
    size_t nv;
    view_t *views = order_tool_results(json_object_get(req, "messages"), &nv);
    const json_t *calls = NULL; /* the latest assistant's tool_calls */
    size_t tool_index = 0;
    int rc = K3_OK;
    path_t p;
    for (size_t i = 0; i < nv && !rc; i++) {
        const json_t *m = views[i].m;
        const char *role = json_string_value(json_object_get(m, "role"));
        if (strcmp(role, "assistant") == 0) {
            calls = json_object_get(m, "tool_calls");
            tool_index = 0;
            rc = assistant(e, m, thinking, P(&p, "messages[%zu]", views[i].at));
        } else if (strcmp(role, "tool") == 0) {
            tool_index++;
            /* the matched call's name, else the message's own tool (or
             * name), else the call at the same position */
            const char *name = views[i].tool;
            size_t name_len = name ? strlen(name) : 0;
            if (!name) {
                const json_t *own = json_object_get(m, "tool");
                if (!own) own = json_object_get(m, "name");
                if (json_is_string(own)) {
                    name = json_string_value(own);
                    name_len = json_string_length(own);
                } else if (json_is_array(calls) && tool_index <= json_array_size(calls)) {
                    const json_t *nm = json_object_get(call_fn(json_array_get(calls, tool_index - 1)), "name");
                    name = json_string_value(nm);
                    name_len = json_string_length(nm);
                }
            }
            if (!name) {
                rc = k3_fail(e->err, K3_EXIT_USAGE,
                             "messages[%zu]: a tool message needs a tool_call_id that matches a call, "
                             "a name, or a call at its position in the last assistant message",
                             views[i].at);
                break;
            }
            char idx[32];
            snprintf(idx, sizeof idx, "%zu", tool_index);
            rc = open_tag(e, "message") || attr_s(e, "role", "tool") || attr(e, "tool", name, name_len) ||
                 attr_s(e, "index", idx) || sep(e) || content(e, json_object_get(m, "content")) ||
                 end_message(e);
        } else if (strcmp(role, "system") == 0 && json_array_size(json_object_get(m, "tools"))) {
            rc = tool_declare(e, json_object_get(m, "tools"), true);
        } else {
            rc = open_message(e, role, m) || content(e, json_object_get(m, "content")) || end_message(e);
        }
    }
    free(views);
    if (rc) return e->err->code;
    const json_t *tc = json_object_get(req, "tool_choice");
    if (json_is_string(tc) && strcmp(json_string_value(tc), "required") == 0 &&
        internal_system(e, "tool-choice",
                        "The system is invoked with `tool_choice=required`.\n"
                        "You MUST call tools in the next message."))
        return e->err->code;
    if (json_is_string(tc) && strcmp(json_string_value(tc), "none") == 0 &&
        internal_system(e, "tool-choice",
                        "The system is invoked with `tool_choice=none`.\n"
                        "You MUST NOT call any tools in the next message."))
        return e->err->code;
    const json_t *rf = json_object_get(req, "response_format");
    if (rf && !json_is_null(rf) && response_format(e, rf)) return e->err->code;
    if (gen_prompt && (open_message(e, "assistant", NULL) || open_simple(e, thinking ? "think" : "response")))
        return e->err->code;
    if (e->prompts && e->next_prompt != json_array_size(e->prompts))
        return k3_fail(e->err, K3_EXIT_USAGE, "image_prompts: %zu given, %zu images in the messages",
                       json_array_size(e->prompts), e->next_prompt);
    return K3_OK;
}

int k3_chat_encode_marked(const k3_chat *c, const json_t *request, int32_t **ids, size_t *n, size_t **ends,
                          size_t *nends, k3_err *err) {
    bool thinking = true, gen_prompt = true;
    if (validate(request, &thinking, &gen_prompt, err)) return err->code;
    const json_t *prompts = json_object_get(request, "image_prompts");
    enc_t e = {.c = c, .prompts = json_is_array(prompts) ? prompts : NULL, .err = err};
    if (ends) {
        e.cends = 16;
        e.ends = xmalloc_array(e.cends, sizeof *e.ends);
    }
    if (render(&e, request, thinking, gen_prompt)) {
        free(e.ids);
        free(e.ends);
        return err->code;
    }
    *ids = e.ids ? e.ids : xmalloc(sizeof **ids);
    *n = e.n;
    if (ends) {
        *ends = e.ends;
        *nends = e.nends;
    }
    return K3_OK;
}

int k3_chat_encode(const k3_chat *c, const json_t *request, int32_t **ids, size_t *n, k3_err *err) {
    return k3_chat_encode_marked(c, request, ids, n, NULL, NULL, err);
}
