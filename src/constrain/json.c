/* json.c: the JSON pushdown machine over bytes (constrain.h), and the mask
 * it builds over a tokenizer's sorted token bytes.
 *
 * The top of the state is either a scalar being written (string, number,
 * literal: an enum/const value, a declared key, true/false/null) or the
 * innermost open container's phase. A number or a literal that could go on
 * ends at the first byte that does not continue it; that byte then goes to
 * the container. */
#include "constrain/internal.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

enum { K_OBJ = 1, K_ARR = 2 };
enum { O_START, O_KEY, O_COLON, O_VALUE, O_AFTER, O_NEXT, A_START, A_AFTER, A_NEXT };
enum { SK_NONE, SK_STR, SK_NUM, SK_LIT };
enum { S_BODY, S_ESC, S_HEX, S_LBS, S_LU };
enum { N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };
enum { L_ENUM, L_KEYS, L_WORDS };

#define MAX_INT_DIGITS 18
#define MAX_FRAC_DIGITS 16
#define MAX_EXP_DIGITS 2

static const jlit WORDS[] = {{"true", 4}, {"false", 5}, {"null", 4}};

static const jnode *node(const k3_jstate *st, uint16_t i) { return &st->s->nodes[i]; }

static uint64_t all_bits(size_t n) { return n >= 64 ? ~0ULL : (1ULL << n) - 1; }

static const jlit *lits(const k3_jstate *st, size_t *n) {
    const jnode *x = node(st, st->snode);
    switch (st->list) {
    case L_ENUM: *n = x->nlit; return x->lit;
    case L_KEYS: *n = x->nprops; return x->keys;
    default: *n = 3; return WORDS;
    }
}

void k3_jstate_init(k3_jstate *st, const k3_jschema *s) {
    memset(st, 0, sizeof *st);
    st->s = s;
    st->root = s->root;
}

void k3_jstate_copy(k3_jstate *dst, const k3_jstate *src) {
    memcpy(dst, src, offsetof(k3_jstate, f) + (size_t)src->depth * sizeof(k3_jframe));
}

static bool is_ws(uint8_t b) { return b == ' ' || b == '\n' || b == '\t' || b == '\r'; }

/* A value (scalar or container) just ended: its container goes on. */
static void value_end(k3_jstate *st) {
    st->sk = SK_NONE;
    if (st->depth == 0) {
        st->done = 1;
        return;
    }
    k3_jframe *f = &st->f[st->depth - 1];
    f->phase = f->kind == K_OBJ ? O_AFTER : A_AFTER;
}

/* A key ended as declared property j (or, j < 0, an additional one). */
static bool key_end(k3_jstate *st, int j) {
    k3_jframe *f = &st->f[st->depth - 1];
    const jnode *n = node(st, f->node);
    st->sk = SK_NONE;
    if (j >= 0) {
        if (f->used & (1ULL << j)) return false; /* a name twice */
        f->used |= 1ULL << j;
        f->vnode = n->pnode[j];
    } else {
        f->vnode = (uint16_t)n->addl;
    }
    f->phase = O_COLON;
    return true;
}

static bool lit_byte(k3_jstate *st, uint8_t b);

static void hash_cp(k3_jstate *st, uint32_t cp) {
    uint8_t u[4];
    int n;
    if (cp < 0x80) { u[0] = (uint8_t)cp; n = 1; }
    else if (cp < 0x800) { u[0] = (uint8_t)(0xC0 | cp >> 6); u[1] = (uint8_t)(0x80 | (cp & 63)); n = 2; }
    else if (cp < 0x10000) {
        u[0] = (uint8_t)(0xE0 | cp >> 12); u[1] = (uint8_t)(0x80 | ((cp >> 6) & 63)); u[2] = (uint8_t)(0x80 | (cp & 63)); n = 3;
    } else {
        u[0] = (uint8_t)(0xF0 | cp >> 18); u[1] = (uint8_t)(0x80 | ((cp >> 12) & 63));
        u[2] = (uint8_t)(0x80 | ((cp >> 6) & 63)); u[3] = (uint8_t)(0x80 | (cp & 63)); n = 4;
    }
    for (int i = 0; i < n; i++) st->hash = k3_jhash_byte(st->hash, u[i]);
}

static int hexval(uint8_t b) {
    if (b >= '0' && b <= '9') return b - '0';
    if (b >= 'a' && b <= 'f') return b - 'a' + 10;
    if (b >= 'A' && b <= 'F') return b - 'A' + 10;
    return -1;
}

/* A byte of a string: false rejects. */
static bool str_byte(k3_jstate *st, uint8_t b) {
    switch (st->sp) {
    case S_BODY:
        if (st->u8need) {
            if (b < st->u8lo || b > st->u8hi) return false;
            st->u8need--;
            st->u8lo = 0x80;
            st->u8hi = 0xBF;
            st->hash = k3_jhash_byte(st->hash, b);
            return true;
        }
        if (b == '"') {
            if (!st->key) {
                value_end(st);
                return true;
            }
            const jnode *n = node(st, st->f[st->depth - 1].node);
            for (size_t j = 0; j < n->nprops; j++)
                if (n->khash[j] == st->hash) return key_end(st, (int)j);
            return key_end(st, -1);
        }
        if (b == '\\') {
            st->sp = S_ESC;
            return true;
        }
        if (b < 0x20) return false;
        if (b >= 0x80) {
            st->u8lo = 0x80;
            st->u8hi = 0xBF;
            if (b >= 0xC2 && b <= 0xDF) st->u8need = 1;
            else if (b >= 0xE0 && b <= 0xEF) {
                st->u8need = 2;
                if (b == 0xE0) st->u8lo = 0xA0; /* no overlong forms */
                if (b == 0xED) st->u8hi = 0x9F; /* no surrogates */
            } else if (b >= 0xF0 && b <= 0xF4) {
                st->u8need = 3;
                if (b == 0xF0) st->u8lo = 0x90;
                if (b == 0xF4) st->u8hi = 0x8F; /* <= U+10FFFF */
            } else {
                return false;
            }
        }
        st->hash = k3_jhash_byte(st->hash, b);
        return true;
    case S_ESC: {
        const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
        const char *p = b ? strchr(from, b) : NULL;
        if (p) {
            st->hash = k3_jhash_byte(st->hash, (uint8_t)to[p - from]);
            st->sp = S_BODY;
            return true;
        }
        if (b != 'u') return false;
        st->sp = S_HEX;
        st->hexn = 0;
        st->hexv = 0;
        return true;
    }
    case S_HEX: {
        int d = hexval(b);
        if (d < 0) return false;
        st->hexv = (uint16_t)(st->hexv * 16 + d);
        st->hexn++;
        if (st->hi) { /* the low half of a pair: DC00..DFFF */
            if (st->hexn == 1 && d != 0xD) return false;
            if (st->hexn == 2 && d < 0xC) return false;
        } else if (st->hexn == 2 && st->hexv >= 0xDC && st->hexv <= 0xDF) {
            return false; /* a low half alone */
        }
        if (st->hexn < 4) return true;
        uint32_t v = st->hexv;
        if (st->hi) {
            hash_cp(st, 0x10000 + ((st->hi - 0xD800) << 10) + (v - 0xDC00));
            st->hi = 0;
            st->sp = S_BODY;
        } else if (v == 0) {
            return false; /* U+0000: many readers refuse it */
        } else if (v >= 0xD800 && v <= 0xDBFF) {
            st->hi = v;
            st->sp = S_LBS;
        } else {
            hash_cp(st, v);
            st->sp = S_BODY;
        }
        return true;
    }
    case S_LBS:
        if (b != '\\') return false;
        st->sp = S_LU;
        return true;
    default: /* S_LU */
        if (b != 'u') return false;
        st->sp = S_HEX;
        st->hexn = 0;
        st->hexv = 0;
        return true;
    }
}

static bool num_accepting(uint8_t sp) { return sp == N_ZERO || sp == N_INT || sp == N_FRAC || sp == N_EXP; }

/* A byte of a number: 1 taken, 0 rejected, 2 the number ended before it. */
static int num_byte(k3_jstate *st, uint8_t b) {
    bool digit = b >= '0' && b <= '9';
    bool real = node(st, st->snode)->types & T_NUM;
    switch (st->sp) {
    case N_MINUS:
        if (!digit) return 0;
        st->sp = b == '0' ? N_ZERO : N_INT;
        st->ndig = 1;
        return 1;
    case N_ZERO:
    case N_INT:
        if (digit) {
            if (st->sp == N_ZERO || st->ndig >= MAX_INT_DIGITS) return 0;
            st->ndig++;
            return 1;
        }
        if (real && b == '.') { st->sp = N_DOT; return 1; }
        if (real && (b == 'e' || b == 'E')) { st->sp = N_E; return 1; }
        return 2;
    case N_DOT:
        if (!digit) return 0;
        st->sp = N_FRAC;
        st->nfrac = 1;
        return 1;
    case N_FRAC:
        if (digit) {
            if (st->nfrac >= MAX_FRAC_DIGITS) return 0;
            st->nfrac++;
            return 1;
        }
        if (b == 'e' || b == 'E') { st->sp = N_E; return 1; }
        return 2;
    case N_E:
        if (b == '+' || b == '-') { st->sp = N_ESIGN; return 1; }
        /* fall through */
    case N_ESIGN:
        if (!digit) return 0;
        st->sp = N_EXP;
        st->nexp = 1;
        return 1;
    default: /* N_EXP */
        if (digit) {
            if (st->nexp >= MAX_EXP_DIGITS) return 0;
            st->nexp++;
            return 1;
        }
        return 2;
    }
}

/* The literal ended: a key names its property, a value ends. */
static bool lit_end(k3_jstate *st) {
    if (st->list != L_KEYS) {
        value_end(st);
        return true;
    }
    size_t n;
    const jlit *l = lits(st, &n);
    for (size_t j = 0; j < n; j++)
        if ((st->cand >> j & 1) && l[j].n == st->pos) return key_end(st, (int)j);
    return false;
}

/* A byte of a literal: 1 taken, 0 rejected, 2 it ended before the byte. */
static int lit_step(k3_jstate *st, uint8_t b) {
    size_t n;
    const jlit *l = lits(st, &n);
    uint64_t next = 0, complete = 0;
    for (uint64_t c = st->cand; c; c &= c - 1) {
        int j = __builtin_ctzll(c);
        if (l[j].n == st->pos) complete |= 1ULL << j;
        else if ((uint8_t)l[j].s[st->pos] == b) next |= 1ULL << j;
    }
    if (next) {
        st->cand = next;
        st->pos++;
        bool longer = false;
        for (uint64_t c = next; c && !longer; c &= c - 1) longer = l[__builtin_ctzll(c)].n > st->pos;
        if (!longer) return lit_end(st) ? 1 : 0;
        return 1;
    }
    if (complete) {
        st->cand = complete;
        return lit_end(st) ? 2 : 0;
    }
    return 0;
}

static bool lit_byte(k3_jstate *st, uint8_t b) { return lit_step(st, b) == 1; }

static void start_lit(k3_jstate *st, uint16_t nd, uint8_t list, uint64_t cand) {
    st->sk = SK_LIT;
    st->snode = nd;
    st->list = list;
    st->cand = cand;
    st->pos = 0;
}

static bool value_start(k3_jstate *st, uint16_t nd, uint8_t b) {
    const jnode *n = node(st, nd);
    uint8_t types = n->types & (st->depth == 0 && st->rtypes ? st->rtypes : T_ANY);
    if (n->nlit) {
        uint64_t cand = 0;
        for (size_t j = 0; j < n->nlit; j++)
            if (k3_jkind_bits(n->litv[j]) & types) cand |= 1ULL << j;
        if (!cand) return false;
        start_lit(st, nd, L_ENUM, cand);
        return lit_byte(st, b);
    }
    switch (b) {
    case '{':
    case '[':
        if (!(types & (b == '{' ? T_OBJ : T_ARR)) || st->depth >= K3_JSON_MAX_DEPTH) return false;
        st->f[st->depth++] = (k3_jframe){.node = nd, .kind = b == '{' ? K_OBJ : K_ARR,
                                         .phase = b == '{' ? O_START : A_START};
        return true;
    case '"':
        if (!(types & T_STR)) return false;
        st->sk = SK_STR;
        st->sp = S_BODY;
        st->key = 0;
        st->snode = nd;
        st->u8need = 0;
        st->hash = K3_JHASH_INIT;
        return true;
    case 't':
    case 'f':
    case 'n': {
        uint64_t c = (types & T_BOOL ? 3 : 0) | (types & T_NULL ? 4 : 0);
        if (!c) return false;
        start_lit(st, nd, L_WORDS, c);
        return lit_byte(st, b);
    }
    default:
        if (b != '-' && (b < '0' || b > '9')) return false;
        if (!(types & (T_NUM | T_INT))) return false;
        st->sk = SK_NUM;
        st->snode = nd;
        st->sp = N_MINUS;
        st->ndig = st->nfrac = st->nexp = 0;
        if (b == '-') return true;
        return num_byte(st, b) == 1;
    }
}

static bool key_possible(const k3_jstate *st, const k3_jframe *f) {
    const jnode *n = node(st, f->node);
    return n->addl >= 0 || (~f->used & all_bits(n->nprops)) != 0;
}

static bool key_start(k3_jstate *st, k3_jframe *f) {
    const jnode *n = node(st, f->node);
    if (!key_possible(st, f)) return false;
    f->phase = O_KEY;
    if (n->addl < 0) { /* declared names only, each once */
        start_lit(st, f->node, L_KEYS, all_bits(n->nprops) & ~f->used);
        return lit_byte(st, '"');
    }
    st->sk = SK_STR;
    st->sp = S_BODY;
    st->key = 1;
    st->u8need = 0;
    st->hash = K3_JHASH_INIT;
    return true;
}

static bool close_frame(k3_jstate *st) {
    st->depth--;
    value_end(st);
    return true;
}

/* A byte between scalars. */
static bool struct_byte(k3_jstate *st, uint8_t b) {
    if (is_ws(b)) {
        if (st->done || st->ws >= K3_JSON_MAX_WS) return false;
        st->ws++;
        return true;
    }
    st->ws = 0;
    if (st->depth == 0) return !st->done && value_start(st, st->root, b);
    k3_jframe *f = &st->f[st->depth - 1];
    const jnode *n = node(st, f->node);
    switch (f->phase) {
    case O_START:
        if (b == '}') return n->required == 0 && close_frame(st);
        /* fall through */
    case O_NEXT:
        return b == '"' && key_start(st, f);
    case O_COLON:
        if (b != ':') return false;
        f->phase = O_VALUE;
        return true;
    case O_VALUE: return value_start(st, f->vnode, b);
    case O_AFTER:
        if (b == ',' && key_possible(st, f)) {
            f->phase = O_NEXT;
            return true;
        }
        return b == '}' && (f->used & n->required) == n->required && close_frame(st);
    case A_START:
        if (b == ']') return close_frame(st);
        /* fall through */
    case A_NEXT: return value_start(st, (uint16_t)n->items, b);
    case A_AFTER:
        if (b == ',') {
            f->phase = A_NEXT;
            return true;
        }
        return b == ']' && close_frame(st);
    default: return false;
    }
}

static bool step_json(k3_jstate *st, uint8_t b) {
    switch (st->sk) {
    case SK_STR: return str_byte(st, b);
    case SK_NUM: {
        int r = num_byte(st, b);
        if (r != 2) return r == 1;
        value_end(st);
        return struct_byte(st, b);
    }
    case SK_LIT: {
        int r = lit_step(st, b);
        if (r != 2) return r == 1;
        return struct_byte(st, b);
    }
    default: return struct_byte(st, b);
    }
}

/* A byte: raw string text is written as its JSON form, escaped as
 * json_dumps escapes (so an enum value matches its compact text). */
static bool step(k3_jstate *st, uint8_t b) {
    if (!st->raw) return step_json(st, b);
    static const char SHORT[] = {['\b'] = 'b', ['\f'] = 'f', ['\n'] = 'n', ['\r'] = 'r', ['\t'] = 't',
                                 ['"'] = '"', ['\\'] = '\\'};
    if (b >= sizeof SHORT || !SHORT[b]) {
        if (b >= 0x20) return step_json(st, b);
        static const char HEX[] = "0123456789ABCDEF";
        const uint8_t u[6] = {'\\', 'u', '0', '0', (uint8_t)HEX[b >> 4], (uint8_t)HEX[b & 15]};
        for (int i = 0; i < 6; i++)
            if (!step_json(st, u[i])) return false;
        return true;
    }
    return step_json(st, '\\') && step_json(st, (uint8_t)SHORT[b]);
}

void k3_jstate_hold(k3_jstate *st, uint8_t types, bool raw) {
    st->rtypes = raw ? T_STR : types;
    if (raw) {
        step_json(st, '"');
        st->raw = 1;
    }
}

bool k3_jstate_raw_done(const k3_jstate *st) {
    if (!st->raw) return k3_jstate_done(st);
    k3_jstate c;
    k3_jstate_copy(&c, st);
    c.raw = 0;
    return step_json(&c, '"') && k3_jstate_done(&c);
}

bool k3_jstate_feed(k3_jstate *st, const uint8_t *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!step(st, b[i])) return false;
    return true;
}

bool k3_jstate_done(const k3_jstate *st) {
    if (st->done) return true;
    if (st->depth) return false;
    if (st->sk == SK_NUM) return num_accepting(st->sp);
    if (st->sk == SK_LIT) {
        size_t n;
        const jlit *l = lits(st, &n);
        for (uint64_t c = st->cand; c; c &= c - 1)
            if (l[__builtin_ctzll(c)].n == st->pos) return true;
    }
    return false;
}

/* ---- tokens ---- */


typedef struct {
    const uint8_t *p;
    size_t n;
    int32_t id;
} tok_ref;

static int cmp_tok(const void *a, const void *b) {
    const tok_ref *x = a, *y = b;
    int c = memcmp(x->p, y->p, x->n < y->n ? x->n : y->n);
    if (c) return c;
    if (x->n != y->n) return x->n < y->n ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

k3_tokbytes *k3_tokbytes_new(const k3_tokenizer *t) {
    k3_tokbytes *tb = xcalloc(1, sizeof *tb);
    tb->tok = t;
    tb->nbase = tok_n_base(t);
    size_t nb = (size_t)tb->nbase;
    tok_ref *refs = xmalloc_array(nb ? nb : 1, sizeof *refs);
    for (int32_t id = 0; id < tb->nbase; id++) {
        size_t n = 0;
        const uint8_t *p = tok_token_bytes(t, id, &n);
        if (p && n > 0 && n <= UINT16_MAX) refs[tb->n++] = (tok_ref){p, n, id};
    }
    qsort(refs, tb->n, sizeof *refs, cmp_tok);
    size_t n = tb->n ? tb->n : 1;
    tb->p = xmalloc_array(n, sizeof *tb->p);
    tb->len = xmalloc_array(n, sizeof *tb->len);
    tb->lcp = xmalloc_array(n, sizeof *tb->lcp);
    tb->plain = xmalloc_array(n, sizeof *tb->plain);
    tb->ord = xmalloc_array(n, sizeof *tb->ord);
    for (size_t k = 0; k < tb->n; k++) {
        size_t len = refs[k].n;
        tb->p[k] = refs[k].p;
        tb->ord[k] = refs[k].id;
        tb->len[k] = (uint16_t)len;
        if (len > tb->maxlen) tb->maxlen = len;
        size_t l = 0;
        if (k) {
            size_t m = tb->len[k - 1] < len ? tb->len[k - 1] : len;
            while (l < m && tb->p[k - 1][l] == tb->p[k][l]) l++;
        }
        tb->lcp[k] = (uint16_t)l;
        k3_jstate s = {.sk = SK_STR, .sp = S_BODY};
        bool ok = true;
        for (size_t i = 0; i < len && ok; i++) ok = tb->p[k][i] != '"' && tb->p[k][i] != '\\' && str_byte(&s, tb->p[k][i]);
        tb->plain[k] = ok && !s.u8need;
    }
    free(refs);
    return tb;
}

void k3_tokbytes_free(k3_tokbytes *tb) {
    if (!tb) return;
    free(tb->ord);
    free(tb->p);
    free(tb->len);
    free(tb->lcp);
    free(tb->plain);
    free(tb);
}

/* The ids whose bytes are exactly s[0..l): each found by bisection in the
 * sorted order (bytes, then length), so a forced or chosen text costs a few
 * lookups per prefix instead of a pass over the vocabulary. */
size_t k3_tokbytes_prefixes(const k3_tokbytes *tb, const uint8_t *s, size_t n, int32_t limit, uint8_t *allow) {
    size_t count = 0;
    for (size_t l = 1; l <= n && l <= tb->maxlen; l++) {
        size_t lo = 0, hi = tb->n;
        while (lo < hi) { /* first entry not below s[0..l) */
            size_t mid = lo + (hi - lo) / 2, m = tb->len[mid] < l ? tb->len[mid] : l;
            int c = memcmp(tb->p[mid], s, m);
            if (c < 0 || (c == 0 && tb->len[mid] < l)) lo = mid + 1;
            else hi = mid;
        }
        for (; lo < tb->n && tb->len[lo] == l && !memcmp(tb->p[lo], s, l); lo++)
            if (tb->ord[lo] < limit && !allow[tb->ord[lo]]) {
                allow[tb->ord[lo]] = 1;
                count++;
            }
    }
    return count;
}

/* Walks the ids in byte order keeping the states along the last path
 * tried: an id resumes from the bytes it shares with that path, and an id
 * that shares a rejected byte is rejected without a step. */
size_t k3_jstate_mask(const k3_jstate *st, const k3_tokbytes *tb, uint8_t *allow) {
    memset(allow, 0, (size_t)tb->nbase);
    bool fast = st->sk == SK_STR && st->sp == S_BODY && !st->u8need;
    k3_jstate *stk = xmalloc_array(tb->maxlen + 1, sizeof *stk);
    k3_jstate_copy(&stk[0], st);
    size_t have = 0, rej = SIZE_MAX, shared = 0, count = 0;
    for (size_t k = 0; k < tb->n; k++) {
        if (tb->lcp[k] < shared) shared = tb->lcp[k];
        if (fast && tb->plain[k]) {
            allow[tb->ord[k]] = 1;
            count++;
            continue;
        }
        if (rej != SIZE_MAX && shared > rej) continue;
        size_t d = shared < have ? shared : have, len = tb->len[k];
        const uint8_t *p = tb->p[k];
        shared = SIZE_MAX;
        for (; d < len; d++) {
            k3_jstate_copy(&stk[d + 1], &stk[d]);
            if (!step(&stk[d + 1], p[d])) break;
        }
        if (d < len) {
            rej = have = d;
            continue;
        }
        rej = SIZE_MAX;
        have = len;
        allow[tb->ord[k]] = 1;
        count++;
    }
    free(stk);
    return count;
}
