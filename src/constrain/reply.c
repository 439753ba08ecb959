/* reply.c: one constrained chat reply (constrain.h): reasoning, the XTML
 * that opens the response channel, the JSON value, the XTML that closes it;
 * or, for a tool call, the XTML of the call with its arguments.
 *
 * The reply's shape is the template's assistant message (docs/chat.md):
 * with thinking on the generation prefix opened think, so the reply is
 *   reasoning [close]think[sep] [open]response[sep] JSON [close]response[sep] [end_of_msg]
 * and with thinking off it starts at the JSON. Reasoning is free text (base
 * ids only: no markup the parser would read as structure), ended by
 * [close]; what follows it up to the JSON is forced, as is the end after a
 * complete value. Forced text may be spelled by any ids whose bytes follow
 * it. A call's names are a choice among texts (the tools', the unused
 * parameters', the parameter's type names): an id is allowed when its bytes
 * follow one of the texts still possible; no text is a prefix of another
 * (each ends at its closing quote), so the choice is made when one is
 * complete. */
#include "constrain/internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { ST_REASON, ST_FORCE, ST_JSON, ST_END, ST_CHOOSE, ST_ARGS };
enum { CH_TOOL, CH_KEY, CH_TYPE };
#define MAX_SEQ 16

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
    fitem seq[MAX_SEQ]; /* the forced items */
    int nforce, fi, after;
    size_t fpos;
    k3_jstate js;
    /* a tool call */
    const k3_callspec *cs;
    const k3_calltool *tool; /* the one chosen */
    uint64_t used;           /* its arguments written */
    int arg;                 /* the argument being written */
    int what;                /* CH_*: what the choice chooses */
    const char *ctext[K3_CALL_MAX_TOOLS > 64 ? K3_CALL_MAX_TOOLS : 64];
    uint32_t clen[K3_CALL_MAX_TOOLS > 64 ? K3_CALL_MAX_TOOLS : 64];
    uint8_t alive[K3_CALL_MAX_TOOLS > 64 ? K3_CALL_MAX_TOOLS : 64];
    size_t ncand, cpos;
    uint8_t *allow;
    float *work;
};

static void open_call(k3_constraint *c, bool think);

static k3_constraint *alloc(const k3_tokbytes *tb, const k3_chat *chat, int vocab) {
    k3_constraint *c = xcalloc(1, sizeof *c);
    c->tb = tb;
    c->tok = tb->tok;
    c->ids = k3_chat_markup(chat);
    c->vocab = vocab;
    c->nbase = tok_n_base(c->tok) < vocab ? tok_n_base(c->tok) : vocab;
    c->allow = xmalloc((size_t)vocab);
    c->work = xmalloc_array((size_t)vocab, sizeof *c->work);
    return c;
}

k3_constraint *k3_constraint_new(const k3_jschema *schema, const k3_tokbytes *tb, const k3_chat *chat, int vocab,
                                 bool thinking) {
    k3_constraint *c = alloc(tb, chat, vocab);
    c->stage = thinking ? ST_REASON : ST_JSON;
    k3_jstate_init(&c->js, schema);
    return c;
}

k3_constraint *k3_constraint_new_call(const k3_callspec *cs, const k3_tokbytes *tb, const k3_chat *chat, int vocab,
                                      bool thinking) {
    k3_constraint *c = alloc(tb, chat, vocab);
    c->cs = cs;
    c->stage = ST_REASON;
    if (!thinking) open_call(c, false);
    return c;
}

void k3_constraint_free(k3_constraint *c) {
    if (!c) return;
    free(c->allow);
    free(c->work);
    free(c);
}

/* Forces items (ids >= 0, else texts; a NULL text ends the list), then
 * stage after. */
static void force(k3_constraint *c, int after, const fitem *items) {
    int n = 0;
    while (items[n].id >= 0 || items[n].text) n++;
    memcpy(c->seq, items, (size_t)n * sizeof *items);
    c->stage = ST_FORCE;
    c->nforce = n;
    c->fi = 0;
    c->fpos = 0;
    c->after = after;
}

static void force_next(k3_constraint *c) {
    c->fpos = 0;
    if (++c->fi == c->nforce) c->stage = c->after;
}

/* A choice among the texts t[0..n) where alive. */
static void choose(k3_constraint *c, int what, const char *const *t, const uint32_t *len, const uint8_t *alive,
                   size_t n) {
    c->what = what;
    c->ncand = n;
    c->cpos = 0;
    for (size_t i = 0; i < n; i++) {
        c->ctext[i] = t[i];
        c->clen[i] = len[i];
        c->alive[i] = alive ? alive[i] : 1;
    }
}

/* After the reasoning (think: its close tag's name and [sep] are due, and
 * the empty response channel): up to the tool's name. */
static void open_call(k3_constraint *c, bool think) {
    const k3_chat_ids *m = &c->ids;
    const fitem seq[] = {{-1, "think"}, {m->sep, NULL}, {m->open, NULL}, {-1, "response"}, {m->sep, NULL},
                         {m->close, NULL}, {-1, "response"}, {m->sep, NULL}, {m->open, NULL}, {-1, "tools"},
                         {m->sep, NULL}, {m->open, NULL}, {-1, "call tool=\""}, {-1, NULL}};
    force(c, ST_CHOOSE, think ? seq : seq + 5);
    const char *t[K3_CALL_MAX_TOOLS];
    uint32_t len[K3_CALL_MAX_TOOLS];
    for (size_t i = 0; i < c->cs->n; i++) {
        t[i] = c->cs->t[i].head;
        len[i] = c->cs->t[i].nhead;
    }
    choose(c, CH_TOOL, t, len, NULL, c->cs->n);
}

static bool all_required(const k3_constraint *c) { return (c->used & c->tool->required) == c->tool->required; }
static bool arg_left(const k3_constraint *c) {
    return c->tool->nargs && (~c->used & (c->tool->nargs >= 64 ? ~0ULL : (1ULL << c->tool->nargs) - 1));
}

/* The choice of text i is complete. */
static void chosen(k3_constraint *c, size_t i) {
    const fitem sep[] = {{c->ids.sep, NULL}, {-1, NULL}};
    switch (c->what) {
    case CH_TOOL:
        c->tool = &c->cs->t[i];
        c->used = 0;
        force(c, ST_ARGS, sep);
        break;
    case CH_KEY: {
        c->arg = (int)i;
        c->used |= 1ULL << i;
        const char *t[K3_NCALL_TYPES];
        uint32_t len[K3_NCALL_TYPES];
        uint8_t alive[K3_NCALL_TYPES];
        for (int ty = 0; ty < K3_NCALL_TYPES; ty++) {
            t[ty] = k3_call_types[ty].attr;
            len[ty] = (uint32_t)strlen(t[ty]);
            alive[ty] = c->tool->ntypes[i] >> ty & 1;
        }
        choose(c, CH_TYPE, t, len, alive, K3_NCALL_TYPES);
        break;
    }
    default: { /* CH_TYPE */
        const k3_jschema *p = c->tool->params;
        k3_jstate_init(&c->js, p);
        c->js.root = p->nodes[p->root].pnode[c->arg];
        k3_jstate_hold(&c->js, k3_call_types[i].bits, k3_call_types[i].bits == T_STR);
        force(c, ST_JSON, sep);
    }
    }
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
        const fitem *f = &c->seq[c->fi];
        if (f->id >= 0) {
            a[f->id] = 1;
            return 1;
        }
        const char *rest = f->text + c->fpos;
        return k3_tokbytes_prefixes(c->tb, (const uint8_t *)rest, strlen(rest), c->nbase, a);
    }
    case ST_JSON:
        count = k3_jstate_mask(&c->js, c->tb, a);
        if (k3_jstate_raw_done(&c->js)) {
            a[c->ids.close] = 1;
            count++;
        }
        return count;
    case ST_CHOOSE:
        for (size_t i = 0; i < c->ncand; i++)
            if (c->alive[i])
                count += k3_tokbytes_prefixes(c->tb, (const uint8_t *)c->ctext[i] + c->cpos, c->clen[i] - c->cpos,
                                              c->nbase, a);
        return count;
    case ST_ARGS:
        if (arg_left(c)) count += a[c->ids.open] = 1;
        if (all_required(c)) count += a[c->ids.close] = 1;
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
        if (id == c->ids.close) {
            if (c->cs) {
                open_call(c, true);
            } else {
                const fitem seq[] = {{-1, "think"}, {c->ids.sep, NULL}, {c->ids.open, NULL}, {-1, "response"},
                                     {c->ids.sep, NULL}, {-1, NULL}};
                force(c, ST_JSON, seq);
            }
        } else if (!p) {
            break;
        }
        return K3_OK;
    case ST_FORCE: {
        const fitem *f = &c->seq[c->fi];
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
        if (id == c->ids.close && k3_jstate_raw_done(&c->js)) {
            const fitem end[] = {{-1, "response"}, {c->ids.sep, NULL}, {c->ids.end_of_msg, NULL}, {-1, NULL}};
            const fitem arg[] = {{-1, "argument"}, {c->ids.sep, NULL}, {-1, NULL}};
            force(c, c->cs ? ST_ARGS : ST_END, c->cs ? arg : end);
            return K3_OK;
        }
        if (!p || !k3_jstate_feed(&c->js, p, n)) break;
        return K3_OK;
    case ST_CHOOSE: {
        if (!p) break;
        size_t done = SIZE_MAX, left = 0;
        for (size_t i = 0; i < c->ncand; i++) {
            if (!c->alive[i]) continue;
            c->alive[i] = n <= c->clen[i] - c->cpos && !memcmp(p, c->ctext[i] + c->cpos, n);
            left += c->alive[i];
            if (c->alive[i] && c->clen[i] == c->cpos + n) done = i;
        }
        if (!left) break;
        c->cpos += n;
        if (done != SIZE_MAX) chosen(c, done);
        return K3_OK;
    }
    case ST_ARGS:
        if (id == c->ids.open && arg_left(c)) {
            const fitem seq[] = {{-1, "argument key=\""}, {-1, NULL}};
            force(c, ST_CHOOSE, seq);
            uint8_t alive[64];
            for (size_t i = 0; i < c->tool->nargs; i++) alive[i] = !(c->used >> i & 1);
            choose(c, CH_KEY, (const char *const *)c->tool->khead, c->tool->nkhead, alive, c->tool->nargs);
            return K3_OK;
        }
        if (id == c->ids.close && all_required(c)) {
            const k3_chat_ids *m = &c->ids;
            const fitem seq[] = {{-1, "call"},    {m->sep, NULL},  {m->close, NULL},      {-1, "tools"},
                                 {m->sep, NULL},  {m->close, NULL}, {-1, "message"},     {m->sep, NULL},
                                 {m->end_of_msg, NULL}, {-1, NULL}};
            force(c, ST_END, seq);
            return K3_OK;
        }
        break;
    default: break;
    }
    return k3_fail(err, K3_EXIT_RUNTIME, "structured output: id %d does not continue the reply", (int)id);
}
