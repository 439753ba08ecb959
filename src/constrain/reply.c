/* reply.c: one constrained chat reply (constrain.h): reasoning, the XTML
 * that opens the response channel, the JSON value, the XTML that closes it.
 *
 * The reply's shape is the template's assistant message (docs/chat.md):
 * with thinking on the generation prefix opened think, so the reply is
 *   reasoning [close]think[sep] [open]response[sep] JSON [close]response[sep] [end_of_msg]
 * and with thinking off it starts at the JSON. Reasoning is free text (base
 * ids only: no markup the parser would read as structure), ended by
 * [close]; what follows it up to the JSON is forced, as is the end after a
 * complete value. Forced text may be spelled by any ids whose bytes follow
 * it. */
#include "constrain/internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { ST_REASON, ST_FORCE, ST_JSON, ST_END };

typedef struct {
    int32_t id;        /* >= 0: this id */
    const char *text;  /* else these bytes */
} fitem;

struct k3_constraint {
    const k3_tokbytes *tb;
    const k3_tokenizer *tok;
    k3_chat_ids ids;
    int vocab, nbase;
    int stage;
    fitem open_seq[5], close_seq[4];
    const fitem *force;
    int nforce, fi, after;
    size_t fpos;
    k3_jstate js;
    uint8_t *allow;
    float *work;
};

k3_constraint *k3_constraint_new(const k3_jschema *schema, const k3_tokbytes *tb, const k3_chat *chat, int vocab,
                                 bool thinking) {
    k3_constraint *c = xcalloc(1, sizeof *c);
    c->tb = tb;
    c->tok = tb->tok;
    c->ids = k3_chat_markup(chat);
    c->vocab = vocab;
    c->nbase = tok_n_base(c->tok) < vocab ? tok_n_base(c->tok) : vocab;
    c->stage = thinking ? ST_REASON : ST_JSON;
    const fitem open_seq[5] = {{-1, "think"}, {c->ids.sep, NULL}, {c->ids.open, NULL}, {-1, "response"},
                               {c->ids.sep, NULL}};
    const fitem close_seq[4] = {{c->ids.close, NULL}, {-1, "response"}, {c->ids.sep, NULL},
                                {c->ids.end_of_msg, NULL}};
    memcpy(c->open_seq, open_seq, sizeof open_seq);
    memcpy(c->close_seq, close_seq, sizeof close_seq);
    k3_jstate_init(&c->js, schema);
    c->allow = xmalloc((size_t)vocab);
    c->work = xmalloc_array((size_t)vocab, sizeof *c->work);
    return c;
}

void k3_constraint_free(k3_constraint *c) {
    if (!c) return;
    free(c->allow);
    free(c->work);
    free(c);
}

static void force(k3_constraint *c, const fitem *seq, int n, int from, int after) {
    c->stage = ST_FORCE;
    c->force = seq;
    c->nforce = n;
    c->fi = from;
    c->fpos = 0;
    c->after = after;
}

static void force_next(k3_constraint *c) {
    c->fpos = 0;
    if (++c->fi == c->nforce) c->stage = c->after;
}

/* The bytes of a base id (NULL: none). */
static const uint8_t *bytes(const k3_constraint *c, int32_t id, size_t *n) {
    *n = 0;
    if (id < 0 || id >= c->nbase) return NULL;
    const uint8_t *p = tok_token_bytes(c->tok, id, n);
    return p && *n ? p : NULL;
}

static size_t allow_mask(k3_constraint *c) {
    uint8_t *a = c->allow;
    memset(a, 0, (size_t)c->vocab);
    size_t count = 0;
    switch (c->stage) {
    case ST_REASON:
        for (int32_t id = 0; id < c->nbase; id++) count += a[id] = 1;
        a[c->ids.close] = 1;
        return count + 1;
    case ST_FORCE: {
        const fitem *f = &c->force[c->fi];
        if (f->id >= 0) {
            a[f->id] = 1;
            return 1;
        }
        const char *rest = f->text + c->fpos;
        size_t nrest = strlen(rest);
        for (int32_t id = 0; id < c->nbase; id++) {
            size_t n;
            const uint8_t *p = bytes(c, id, &n);
            if (p && n <= nrest && !memcmp(p, rest, n)) count += a[id] = 1;
        }
        return count;
    }
    case ST_JSON:
        count = k3_jstate_mask(&c->js, c->tb, a);
        if (k3_jstate_done(&c->js)) {
            a[c->ids.close] = 1;
            count++;
        }
        return count;
    default: return 0;
    }
}

const float *k3_constraint_apply(k3_constraint *c, const float *row) {
    if (!allow_mask(c)) return NULL;
    for (int i = 0; i < c->vocab; i++) c->work[i] = c->allow[i] ? row[i] : -INFINITY;
    return c->work;
}

int k3_constraint_accept(k3_constraint *c, int32_t id, k3_err *err) {
    size_t n;
    const uint8_t *p = bytes(c, id, &n);
    switch (c->stage) {
    case ST_REASON:
        if (id == c->ids.close) force(c, c->open_seq, 5, 0, ST_JSON);
        else if (!p) break;
        return K3_OK;
    case ST_FORCE: {
        const fitem *f = &c->force[c->fi];
        if (f->id >= 0) {
            if (id != f->id) break;
            force_next(c);
            return K3_OK;
        }
        const char *rest = f->text + c->fpos;
        if (!p || n > strlen(rest) || memcmp(p, rest, n)) break;
        c->fpos += n;
        if (!rest[n]) force_next(c);
        return K3_OK;
    }
    case ST_JSON:
        if (id == c->ids.close && k3_jstate_done(&c->js)) {
            force(c, c->close_seq, 4, 1, ST_END);
            return K3_OK;
        }
        if (!p || !k3_jstate_feed(&c->js, p, n)) break;
        return K3_OK;
    default: break;
    }
    return k3_fail(err, K3_EXIT_RUNTIME, "structured output: id %d does not continue the reply", (int)id);
}
