/* parser.c: the streaming output parser: generated ids to reasoning,
 * response and tool calls, by token id.
 *
 * Only the XTML ids delimit structure: [open] or [close] starts a tag header,
 * [sep] ends it; the header's bytes (between those ids) name the element and
 * its attributes. Every other id is text of the element on top of the stack:
 * think -> reasoning, response -> content (also text directly in the
 * message), argument -> that argument's value, json -> the fallback block,
 * tools/call -> dropped (whitespace between calls). The stack starts as
 * [message, think] or [message, response], the elements the generation
 * prefix opened, so text before [close]think[sep] is reasoning even when the
 * output is cut off. A close tag pops up to the nearest open element of that
 * name and is ignored when there is none. Other special ids are dropped. */
#include "chat/internal.h"

#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 32
#define MAX_HEADER 4096 /* a header longer than this is not markup: dropped */

typedef struct {
    k3_sbuf pend;  /* raw bytes of an incomplete character */
    k3_sbuf all;   /* the whole channel text so far (valid UTF-8) */
    k3_sbuf delta; /* new text of this feed */
} channel_t;

struct k3_chat_parser {
    const k3_chat *c;
    bool thinking, stopped;
    char stack[MAX_DEPTH][16];
    int depth, overflow; /* overflow: elements opened past MAX_DEPTH */
    bool in_header, header_close, header_long;
    k3_sbuf header;
    channel_t reasoning, content;
    /* the tool call being read */
    bool in_call, in_arg, in_json;
    k3_sbuf call_name, args, arg_key, arg_type, arg_val, json_block;
    int nargs;
    json_t *calls;     /* completed calls */
    json_t *new_call;  /* the call completed by the last feed (borrowed from calls) */
};

k3_chat_parser *k3_chat_parser_new(const k3_chat *c, bool thinking) {
    k3_chat_parser *p = xcalloc(1, sizeof *p);
    p->c = c;
    p->thinking = thinking;
    strcpy(p->stack[0], "message");
    strcpy(p->stack[1], thinking ? "think" : "response");
    p->depth = 2;
    p->calls = json_array();
    if (!p->calls) {
        fprintf(stderr, "k3: out of memory (json array)\n");
        exit(K3_EXIT_RUNTIME);
    }
    return p;
}

static void channel_free(channel_t *ch) {
    k3_sb_free(&ch->pend);
    k3_sb_free(&ch->all);
    k3_sb_free(&ch->delta);
}

void k3_chat_parser_free(k3_chat_parser *p) {
    if (!p) return;
    k3_sb_free(&p->header);
    channel_free(&p->reasoning);
    channel_free(&p->content);
    k3_sb_free(&p->call_name);
    k3_sb_free(&p->args);
    k3_sb_free(&p->arg_key);
    k3_sb_free(&p->arg_type);
    k3_sb_free(&p->arg_val);
    k3_sb_free(&p->json_block);
    json_decref(p->calls);
    free(p);
}

/* Appends bytes to a channel; whole characters move to its delta. */
static void channel_put(channel_t *ch, const void *s, size_t n, bool final) {
    if (!n && !ch->pend.n) return;
    k3_sb_put(&ch->pend, s, n);
    size_t before = ch->delta.n;
    size_t used = chat_utf8_take((const uint8_t *)ch->pend.p, ch->pend.n, final, &ch->delta);
    k3_sb_put(&ch->all, ch->delta.p + before, ch->delta.n - before);
    memmove(ch->pend.p, ch->pend.p + used, ch->pend.n - used);
    ch->pend.n -= used;
}

/* Valid UTF-8 copy of raw bytes (an invalid byte becomes U+FFFD). */
static void sane(k3_sbuf *out, const k3_sbuf *raw) {
    out->n = 0;
    k3_sb_put(out, "", 0);
    chat_utf8_take((const uint8_t *)raw->p, raw->n, true, out);
}

static json_t *jstr(const k3_sbuf *raw) {
    k3_sbuf s = {0};
    sane(&s, raw);
    json_t *v = json_stringn(s.p, s.n);
    k3_sb_free(&s);
    if (!v) {
        fprintf(stderr, "k3: out of memory (json string)\n");
        exit(K3_EXIT_RUNTIME);
    }
    return v;
}

static bool blank(const k3_sbuf *b) {
    for (size_t i = 0; i < b->n; i++)
        if (!strchr(" \t\r\n", b->p[i])) return false;
    return true;
}

static void end_arg(k3_chat_parser *p) {
    if (!p->in_arg) return;
    p->in_arg = false;
    k3_sbuf key = {0}, val = {0};
    sane(&key, &p->arg_key);
    sane(&val, &p->arg_val);
    k3_sb_puts(&p->args, p->nargs++ ? ", " : "{");
    chat_pyjson_string(&p->args, key.p, key.n);
    k3_sb_puts(&p->args, ": ");
    /* a typed value is JSON text; one that does not parse stays a string */
    json_t *v = NULL;
    if (!(p->arg_type.n == 6 && memcmp(p->arg_type.p, "string", 6) == 0) && !blank(&val))
        v = json_loadb(val.p, val.n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    if (v) {
        size_t a = 0, b = val.n;
        while (a < b && strchr(" \t\r\n", val.p[a])) a++;
        while (b > a && strchr(" \t\r\n", val.p[b - 1])) b--;
        k3_sb_put(&p->args, val.p + a, b - a);
        json_decref(v);
    } else {
        chat_pyjson_string(&p->args, val.p, val.n);
    }
    k3_sb_free(&key);
    k3_sb_free(&val);
}

static void end_call(k3_chat_parser *p) {
    if (!p->in_call) return;
    end_arg(p);
    p->in_call = p->in_json = false;
    k3_sbuf args = {0};
    if (p->nargs) {
        k3_sb_put(&args, p->args.p, p->args.n);
        k3_sb_putc(&args, '}');
    } else if (p->json_block.n) {
        sane(&args, &p->json_block);
    } else {
        k3_sb_puts(&args, "{}");
    }
    char id[32];
    snprintf(id, sizeof id, "call_%zu", json_array_size(p->calls) + 1);
    json_t *call = json_pack("{s:s, s:s, s:{s:o, s:s%}}", "id", id, "type", "function", "function", "name",
                             jstr(&p->call_name), "arguments", args.p, args.n);
    k3_sb_free(&args);
    if (!call || json_array_append_new(p->calls, call)) {
        fprintf(stderr, "k3: out of memory (tool call)\n");
        exit(K3_EXIT_RUNTIME);
    }
    p->new_call = call;
}

/* The value of attribute key in a header's attribute text, unescaped. */
static void get_attr(const k3_sbuf *h, size_t from, const char *key, k3_sbuf *out) {
    out->n = 0;
    k3_sb_put(out, "", 0);
    size_t kl = strlen(key);
    for (size_t i = from; i < h->n;) {
        while (i < h->n && h->p[i] == ' ') i++;
        size_t k0 = i;
        while (i < h->n && h->p[i] != '=' && h->p[i] != ' ') i++;
        size_t k1 = i;
        if (i + 1 >= h->n || h->p[i] != '=' || h->p[i + 1] != '"') {
            i++;
            continue;
        }
        i += 2;
        size_t v0 = i;
        while (i < h->n && h->p[i] != '"') i++;
        if (k1 - k0 == kl && memcmp(h->p + k0, key, kl) == 0) {
            for (size_t j = v0; j < i; j++) {
                if (h->p[j] == '&' && i - j >= 5 && memcmp(h->p + j, "&amp;", 5) == 0) {
                    k3_sb_putc(out, '&');
                    j += 4;
                } else if (h->p[j] == '&' && i - j >= 6 && memcmp(h->p + j, "&quot;", 6) == 0) {
                    k3_sb_putc(out, '"');
                    j += 5;
                } else {
                    k3_sb_putc(out, h->p[j]);
                }
            }
            return;
        }
        i++;
    }
}

static bool is(const char *tag, const char *name) { return strcmp(tag, name) == 0; }

static void on_open(k3_chat_parser *p, const char *tag, size_t attrs_at) {
    if (p->depth == MAX_DEPTH) {
        p->overflow++;
        return;
    }
    snprintf(p->stack[p->depth++], sizeof p->stack[0], "%s", tag);
    if (is(tag, "call")) {
        end_call(p); /* a call left open ends where the next begins */
        p->in_call = true;
        p->nargs = 0;
        p->args.n = p->json_block.n = 0;
        get_attr(&p->header, attrs_at, "tool", &p->call_name);
    } else if (is(tag, "argument") && p->in_call) {
        end_arg(p);
        p->in_arg = true;
        p->arg_val.n = 0;
        get_attr(&p->header, attrs_at, "key", &p->arg_key);
        get_attr(&p->header, attrs_at, "type", &p->arg_type);
    } else if (is(tag, "json") && p->in_call) {
        p->in_json = true;
    }
}

static void on_pop(k3_chat_parser *p, const char *tag) {
    if (is(tag, "think")) channel_put(&p->reasoning, "", 0, true);
    else if (is(tag, "response")) channel_put(&p->content, "", 0, true);
    else if (is(tag, "argument")) end_arg(p);
    else if (is(tag, "json")) p->in_json = false;
    else if (is(tag, "call")) end_call(p);
}

static void on_close(k3_chat_parser *p, const char *tag) {
    if (p->overflow) {
        p->overflow--;
        return;
    }
    int at = p->depth - 1;
    while (at >= 0 && !is(p->stack[at], tag)) at--;
    if (at < 0) return;
    while (p->depth > at) on_pop(p, p->stack[--p->depth]);
}

static void end_header(k3_chat_parser *p) {
    p->in_header = false;
    if (p->header_long) return;
    size_t n = 0;
    while (n < p->header.n && p->header.p[n] != ' ') n++;
    char tag[16];
    if (n == 0 || n >= sizeof tag) return; /* not an element this parser knows */
    memcpy(tag, p->header.p, n);
    tag[n] = 0;
    if (p->header_close) on_close(p, tag);
    else on_open(p, tag, n);
}

/* Where text goes now: the nearest element that has a channel. */
static void put_text(k3_chat_parser *p, const uint8_t *b, size_t n) {
    for (int i = p->depth - 1; i >= 0; i--) {
        const char *t = p->stack[i];
        if (is(t, "think")) return channel_put(&p->reasoning, b, n, false);
        if (is(t, "response") || is(t, "message")) return channel_put(&p->content, b, n, false);
        if (is(t, "argument")) {
            if (p->in_arg) k3_sb_put(&p->arg_val, b, n);
            return;
        }
        if (is(t, "json")) {
            if (p->in_json) k3_sb_put(&p->json_block, b, n);
            return;
        }
        if (is(t, "tools") || is(t, "call")) return;
    }
}

static void fill_delta(k3_chat_parser *p, k3_chat_delta *d) {
    d->reasoning = p->reasoning.delta.p ? p->reasoning.delta.p : "";
    d->reasoning_len = p->reasoning.delta.n;
    d->content = p->content.delta.p ? p->content.delta.p : "";
    d->content_len = p->content.delta.n;
    d->tool_call = p->new_call;
    d->stop = p->stopped;
}

int k3_chat_parser_feed(k3_chat_parser *p, int32_t id, k3_chat_delta *d, k3_err *err) {
    p->reasoning.delta.n = p->content.delta.n = 0;
    p->new_call = NULL;
    fill_delta(p, d);
    if (p->stopped) return K3_OK;
    const k3_tokenizer *tok = p->c->tok;
    if (id < 0 || id >= tok_vocab_size(tok))
        return k3_fail(err, K3_EXIT_USAGE, "generated id %d is outside the vocabulary", (int)id);
    const k3_chat_ids *m = &p->c->ids;
    if (k3_chat_is_stop(p->c, id)) {
        p->stopped = true;
    } else if (id == m->open || id == m->close) {
        p->in_header = true;
        p->header_close = id == m->close;
        p->header_long = false;
        p->header.n = 0;
    } else if (id == m->sep) {
        if (p->in_header) end_header(p);
    } else if (id < tok_n_base(tok)) {
        size_t n;
        const uint8_t *b = tok_token_bytes(tok, id, &n);
        if (!p->in_header) put_text(p, b, n);
        else if (p->header.n + n > MAX_HEADER) p->header_long = true;
        else k3_sb_put(&p->header, b, n);
    }
    fill_delta(p, d);
    return K3_OK;
}

void k3_chat_parser_flush(k3_chat_parser *p, k3_chat_delta *d) {
    p->reasoning.delta.n = p->content.delta.n = 0;
    p->new_call = NULL;
    channel_put(&p->reasoning, "", 0, true);
    channel_put(&p->content, "", 0, true);
    fill_delta(p, d);
}

json_t *k3_chat_parser_message(k3_chat_parser *p, bool cut_off, const char **finish_reason) {
    k3_chat_delta d;
    k3_chat_parser_flush(p, &d);
    size_t ncalls = json_array_size(p->calls);
    json_t *msg = json_pack("{s:s}", "role", "assistant");
    if (!msg) exit(K3_EXIT_RUNTIME);
    json_object_set_new(msg, "content",
                        p->content.all.n || !ncalls ? json_stringn(p->content.all.p ? p->content.all.p : "",
                                                                   p->content.all.n)
                                                    : json_null());
    if (p->thinking)
        json_object_set_new(msg, "reasoning_content",
                            json_stringn(p->reasoning.all.p ? p->reasoning.all.p : "", p->reasoning.all.n));
    if (ncalls) json_object_set_new(msg, "tool_calls", json_deep_copy(p->calls));
    if (finish_reason)
        *finish_reason = cut_off && !p->stopped ? "length" : ncalls ? "tool_calls" : "stop";
    return msg;
}
