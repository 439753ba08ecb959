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
 * complete.
 *
 * Calls follow one another within the tools element; after each [close]call
 * the reply may open the next (several calls allowed) or close the tools.
 * Under "auto" the reply is free: only an [open] header is watched, byte by
 * byte, while it can still become a call header; on the way to `call
 * tool="` it is held to that text, and once that is complete the call is
 * masked as above (a strict tool's) or free again (a loose tool's). */
#include "constrain/internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ST_REASON, ST_FORCE, ST_JSON, ST_END, ST_CHOOSE, ST_ARGS, ST_NEXT, ST_FREE };
/* the header that opens a call, and how much of it names the element (the
 * parser reads the first word, up to a space, as the tag) */
static const char CALL_OPEN[] = "call tool=\"";
#define NCALL_OPEN (sizeof CALL_OPEN - 1)
#define NCALL_TAG 5
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
    int ncalls;              /* calls begun */
    char idx[24];            /* the index's digits and closing quote */
    /* free text ("auto"): the header being written; on the call path, its
     * first hlen bytes are CALL_OPEN's */
    uint8_t hdr;             /* HDR_* */
    size_t hlen;
    uint8_t *allow;
    float *work;
};
enum { HDR_NONE, HDR_PATH, HDR_OTHER };

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
    c->stage = cs->how == K3_CALLS_AUTO ? ST_FREE : ST_REASON;
    if (!thinking && c->stage == ST_REASON) open_call(c, false);
    return c;
}

void k3_constraint_copy(k3_constraint *dst, const k3_constraint *src) {
    uint8_t *allow = dst->allow;
    float *work = dst->work;
    *dst = *src;
    dst->allow = allow;
    dst->work = work;
    for (int i = 0; i < dst->nforce; i++)
        if (dst->seq[i].text == src->idx) dst->seq[i].text = dst->idx;
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

/* A call begins: its tool's name is chosen next. */
static void start_call(k3_constraint *c) {
    snprintf(c->idx, sizeof c->idx, "%d\"", ++c->ncalls);
    const char *t[K3_CALL_MAX_TOOLS];
    uint32_t len[K3_CALL_MAX_TOOLS];
    for (size_t i = 0; i < c->cs->n; i++) {
        t[i] = c->cs->t[i].head;
        len[i] = c->cs->t[i].nhead;
    }
    choose(c, CH_TOOL, t, len, NULL, c->cs->n);
}

/* After the reasoning (think: its close tag's name and [sep] are due, and
 * the empty response channel): up to the tool's name. */
static void open_call(k3_constraint *c, bool think) {
    const k3_chat_ids *m = &c->ids;
    const fitem seq[] = {{-1, "think"}, {m->sep, NULL}, {m->open, NULL}, {-1, "response"}, {m->sep, NULL},
                         {m->close, NULL}, {-1, "response"}, {m->sep, NULL}, {m->open, NULL}, {-1, "tools"},
                         {m->sep, NULL}, {m->open, NULL}, {-1, CALL_OPEN}, {-1, NULL}};
    force(c, ST_CHOOSE, think ? seq : seq + 5);
    start_call(c);
}

/* Free text: what the bytes p[0..n) of a header on the call path do. -1:
 * they make it a call header of another shape, or one more call than may
 * be; 0: it stays on the path (*left: it leaves it, for a header that is
 * not a call); 1: they complete CALL_OPEN. */
static int path_bytes(const k3_constraint *c, const uint8_t *p, size_t n, bool *left) {
    size_t h = c->hlen, m = 0;
    while (m < n && h + m < NCALL_OPEN && p[m] == (uint8_t)CALL_OPEN[h + m]) m++;
    *left = false;
    if (m < n) { /* it parts from the path at byte h + m (or runs past its end) */
        if (h + m >= NCALL_TAG) return -1;
        *left = true;
        return 0;
    }
    if (h + n >= NCALL_TAG && !c->cs->multi && c->ncalls) return -1;
    return h + n == NCALL_OPEN;
}

/* [sep] may end a header on the call path while its tag is not yet "call". */
static bool path_sep_ok(const k3_constraint *c) { return c->hlen < NCALL_TAG - 1; }

static bool all_required(const k3_constraint *c) { return (c->used & c->tool->required) == c->tool->required; }
static bool arg_left(const k3_constraint *c) {
    return c->tool->nargs && (~c->used & (c->tool->nargs >= 64 ? ~0ULL : (1ULL << c->tool->nargs) - 1));
}

/* The choice of text i is complete. */
static void chosen(k3_constraint *c, size_t i) {
    const fitem sep[] = {{c->ids.sep, NULL}, {-1, NULL}};
    switch (c->what) {
    case CH_TOOL: {
        c->tool = &c->cs->t[i];
        c->used = 0;
        if (c->tool->loose) { /* the rest of its header, and the call, are free */
            c->stage = ST_FREE;
            c->hdr = HDR_OTHER;
            break;
        }
        const fitem head[] = {{-1, c->idx}, {c->ids.sep, NULL}, {-1, NULL}};
        force(c, ST_ARGS, head);
        break;
    }
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
    case ST_NEXT:
        if (c->cs->multi) count += a[c->ids.open] = 1;
        return count + (a[c->ids.close] = 1);
    case ST_FREE: /* a header on the call path */
        for (int32_t id = 0; id < c->vocab; id++) {
            size_t n;
            const uint8_t *p = bytes(c, id, &n);
            bool left;
            a[id] = p ? path_bytes(c, p, n, &left) >= 0 : id != c->ids.sep || path_sep_ok(c);
            count += a[id];
        }
        return count;
    default: return 0;
    }
}

const float *k3_constraint_apply(k3_constraint *c, const float *row) {
    if (c->stage == ST_FREE && c->hdr != HDR_PATH) return row;
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
            const fitem seq[] = {{-1, "call"}, {c->ids.sep, NULL}, {-1, NULL}};
            force(c, c->cs->how == K3_CALLS_AUTO ? ST_FREE : ST_NEXT, seq);
            c->hdr = HDR_NONE;
            return K3_OK;
        }
        break;
    case ST_NEXT:
        if (id == c->ids.open && c->cs->multi) {
            const fitem seq[] = {{-1, CALL_OPEN}, {-1, NULL}};
            force(c, ST_CHOOSE, seq);
            start_call(c);
            return K3_OK;
        }
        if (id == c->ids.close) {
            const k3_chat_ids *m = &c->ids;
            const fitem seq[] = {{-1, "tools"}, {m->sep, NULL}, {m->close, NULL}, {-1, "message"},
                                 {m->sep, NULL}, {m->end_of_msg, NULL}, {-1, NULL}};
            force(c, ST_END, seq);
            return K3_OK;
        }
        break;
    case ST_FREE:
        /* as the parser reads headers: [open] or [close] begins one, [sep]
         * ends it, a base id's bytes are its text, other ids leave it */
        if (id == c->ids.open || id == c->ids.close) {
            c->hdr = id == c->ids.open ? HDR_PATH : HDR_OTHER;
            c->hlen = 0;
            return K3_OK;
        }
        if (c->hdr != HDR_PATH) {
            if (id == c->ids.sep) c->hdr = HDR_NONE;
            return K3_OK;
        }
        if (id == c->ids.sep) {
            if (!path_sep_ok(c)) break;
            c->hdr = HDR_NONE;
            return K3_OK;
        }
        if (p) {
            bool left;
            int r = path_bytes(c, p, n, &left);
            if (r < 0) break;
            c->hlen += n;
            if (left) {
                c->hdr = HDR_OTHER;
            } else if (r == 1) {
                c->hdr = HDR_OTHER; /* a loose call, or a call when no name is chosen, goes on free */
                if (c->cs->n) {
                    c->stage = ST_CHOOSE;
                    start_call(c);
                } else {
                    c->ncalls++;
                }
            }
        }
        return K3_OK;
    default: break;
    }
    return k3_fail(err, K3_EXIT_RUNTIME, "structured output: id %d does not continue the reply", (int)id);
}
