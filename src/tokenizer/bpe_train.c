/* bpe_train.c: see bpe_train.h.
 *
 * Training state. Every distinct pre-token ("word") is an array of token ids
 * with a count. Every adjacent pair that occurs anywhere has a record: its
 * total count (sum over words of occurrences x word count), the list of words
 * that held it when it was counted up (entries may be stale; they are checked
 * when used), and its place in a max-heap ordered by (count, left bytes,
 * right bytes). A merge visits only the words on the merged pair's list,
 * rewrites them, and changes the counts of just the pairs that touched a
 * merged position. */
#include "tokenizer/bpe_train.h"

#include <jansson.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ---- hashing ------------------------------------------------------------- */
static uint64_t mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = mix64(h ^ v);
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, p, n);
    return mix64(h ^ v ^ 0x5bd1e995ull);
}

/* ---- pre-token counts ---------------------------------------------------- */
typedef struct {
    uint64_t hash, count; /* count 0 = empty slot */
    size_t off;           /* bytes in the arena */
    uint32_t len;
} cnt_entry;

struct bpe_counts {
    cnt_entry *tab;
    size_t cap, n; /* cap a power of two */
    uint8_t *arena;
    size_t arena_len, arena_cap;
    uint64_t total;
};

bpe_counts *bpe_counts_new(void) {
    bpe_counts *c = xcalloc(1, sizeof *c);
    c->cap = 1024;
    c->tab = xcalloc(c->cap, sizeof *c->tab);
    return c;
}

void bpe_counts_free(bpe_counts *c) {
    if (!c) return;
    free(c->tab);
    free(c->arena);
    free(c);
}

static void counts_grow(bpe_counts *c) {
    size_t ncap = c->cap * 2;
    cnt_entry *nt = xcalloc(ncap, sizeof *nt);
    for (size_t i = 0; i < c->cap; i++) {
        if (!c->tab[i].count) continue;
        size_t j = c->tab[i].hash & (ncap - 1);
        while (nt[j].count) j = (j + 1) & (ncap - 1);
        nt[j] = c->tab[i];
    }
    free(c->tab);
    c->tab = nt;
    c->cap = ncap;
}

static void counts_add_hashed(bpe_counts *c, const uint8_t *s, size_t n, uint64_t h,
                              uint64_t count) {
    if (!count) return;
    if (n > UINT32_MAX) { /* bpe_count_docs refuses such documents up front */
        fprintf(stderr, "k3: BPE: a %zu-byte pre-token is longer than 4 GiB\n", n);
        exit(K3_EXIT_RUNTIME);
    }
    if ((c->n + 1) * 4 > c->cap * 3) counts_grow(c);
    size_t j = h & (c->cap - 1);
    for (;;) {
        cnt_entry *e = &c->tab[j];
        if (!e->count) break;
        if (e->hash == h && e->len == n && memcmp(c->arena + e->off, s, n) == 0) {
            e->count += count;
            c->total += count;
            return;
        }
        j = (j + 1) & (c->cap - 1);
    }
    if (c->arena_len + n > c->arena_cap) {
        size_t nc = c->arena_cap ? c->arena_cap * 2 : 65536;
        while (nc < c->arena_len + n) nc *= 2;
        c->arena = xrealloc(c->arena, nc);
        c->arena_cap = nc;
    }
    memcpy(c->arena + c->arena_len, s, n);
    c->tab[j] = (cnt_entry){.hash = h, .count = count, .off = c->arena_len, .len = (uint32_t)n};
    c->arena_len += n;
    c->n++;
    c->total += count;
}

void bpe_counts_add(bpe_counts *c, const uint8_t *bytes, size_t n, uint64_t count) {
    counts_add_hashed(c, bytes, n, hash_bytes(bytes, n), count);
}

void bpe_counts_merge(bpe_counts *dst, const bpe_counts *src) {
    for (size_t i = 0; i < src->cap; i++) {
        const cnt_entry *e = &src->tab[i];
        if (e->count) counts_add_hashed(dst, src->arena + e->off, e->len, e->hash, e->count);
    }
}

size_t bpe_counts_unique(const bpe_counts *c) { return c->n; }
uint64_t bpe_counts_total(const bpe_counts *c) { return c->total; }

uint64_t bpe_counts_get(const bpe_counts *c, const uint8_t *bytes, size_t n) {
    uint64_t h = hash_bytes(bytes, n);
    for (size_t j = h & (c->cap - 1);; j = (j + 1) & (c->cap - 1)) {
        const cnt_entry *e = &c->tab[j];
        if (!e->count) return 0;
        if (e->hash == h && e->len == n && memcmp(c->arena + e->off, bytes, n) == 0)
            return e->count;
    }
}

static int count_piece(const char *piece, size_t n, void *ctx) {
    bpe_counts_add(ctx, (const uint8_t *)piece, n, 1);
    return 0;
}

/* Earliest special occurrence in [p, p+n): its offset and length (the longest
 * special wins where several start at the same place). Returns false if none. */
static bool find_special(const char *p, size_t n, const char *const *specials,
                         const size_t *slen, int n_specials, size_t *at, size_t *len) {
    bool found = false;
    for (int s = 0; s < n_specials; s++) {
        if (!slen[s]) continue;
        const char *q = memmem(p, n, specials[s], slen[s]);
        if (!q) continue;
        size_t o = (size_t)(q - p);
        if (!found || o < *at || (o == *at && slen[s] > *len)) {
            *at = o;
            *len = slen[s];
            found = true;
        }
    }
    return found;
}

static int count_doc(bpe_counts *c, const tok_splitter *sp, const char *p, size_t n,
                     const char *const *specials, const size_t *slen, int n_specials,
                     k3_err *err) {
    if (n > UINT32_MAX)
        return k3_fail(err, K3_EXIT_USAGE, "a %zu-byte document is longer than 4 GiB", n);
    while (n) {
        size_t at = n, len = 0;
        if (!find_special(p, n, specials, slen, n_specials, &at, &len)) at = n;
        if (at) {
            int rc = tok_split(sp, p, at, count_piece, c, err);
            if (rc) return rc;
        }
        if (at == n) break;
        p += at + len;
        n -= at + len;
    }
    return 0;
}

int bpe_count_docs(bpe_counts *c, const tok_splitter *sp, const char *const *docs,
                   const size_t *lens, size_t n_docs, const char *const *specials,
                   int n_specials, k3_progress *progress, k3_err *err) {
    size_t *slen = xcalloc(n_specials > 0 ? (size_t)n_specials : 1, sizeof *slen);
    for (int s = 0; s < n_specials; s++) slen[s] = strlen(specials[s]);
    int nt = omp_get_max_threads();
    bpe_counts **local = xcalloc((size_t)nt, sizeof *local);
    size_t fail_doc = SIZE_MAX;
    k3_err first = {0};
    uint64_t done = progress ? progress->done : 0;
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num();
        bpe_counts *lc = local[t] = bpe_counts_new();
        k3_err e = {0};
#pragma omp for schedule(dynamic, 64)
        for (size_t d = 0; d < n_docs; d++) {
            size_t fd;
#pragma omp atomic read
            fd = fail_doc;
            if (d > fd) continue;
            if (count_doc(lc, sp, docs[d], lens[d], specials, slen, n_specials, &e)) {
#pragma omp critical(bpe_count_err)
                if (d < fail_doc) {
#pragma omp atomic write
                    fail_doc = d;
                    first = e;
                }
            }
            if (progress) {
                uint64_t now;
#pragma omp atomic capture
                now = done += lens[d];
                if (t == 0) k3_progress_update(progress, now);
            }
        }
    }
    /* Summing in thread order keeps the arena order stable for a given thread
     * count; the counts themselves never depend on it. */
    for (int t = 0; t < nt; t++) {
        if (local[t]) bpe_counts_merge(c, local[t]);
        bpe_counts_free(local[t]);
    }
    free(local);
    free(slen);
    if (progress) k3_progress_update(progress, done);
    if (fail_doc != SIZE_MAX) {
        if (err) *err = first;
        return first.code ? first.code : K3_EXIT_USAGE;
    }
    return 0;
}

int bpe_count_text(bpe_counts *c, const tok_splitter *sp, const char *text, size_t len,
                   const char *const *specials, int n_specials, k3_progress *progress,
                   k3_err *err) {
    size_t *slen = xcalloc(n_specials > 0 ? (size_t)n_specials : 1, sizeof *slen);
    for (int s = 0; s < n_specials; s++) slen[s] = strlen(specials[s]);
    size_t cap = 1024, n = 0;
    const char **docs = xmalloc_array(cap, sizeof *docs);
    size_t *lens = xmalloc_array(cap, sizeof *lens);
    const char *p = text;
    size_t left = len;
    while (left) {
        size_t at = left, sl = 0;
        if (!find_special(p, left, specials, slen, n_specials, &at, &sl)) at = left;
        if (at) {
            if (n == cap) {
                cap *= 2;
                docs = xrealloc_array(docs, cap, sizeof *docs);
                lens = xrealloc_array(lens, cap, sizeof *lens);
            }
            docs[n] = p;
            lens[n++] = at;
        }
        if (at == left) break;
        p += at + sl;
        left -= at + sl;
    }
    /* the pieces hold no specials any more */
    int rc = bpe_count_docs(c, sp, docs, lens, n, NULL, 0, progress, err);
    free(docs);
    free(lens);
    free(slen);
    return rc;
}

/* ---- a map from a pair of ids (one uint64 key) to an int32 ----------------- */
typedef struct {
    uint64_t *keys; /* UINT64_MAX = empty */
    int32_t *vals;
    size_t cap, n;
} pairmap;

static uint64_t pkey(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

static void pm_init(pairmap *m, size_t cap) {
    m->cap = cap;
    m->n = 0;
    m->keys = xmalloc_array(cap, sizeof *m->keys);
    m->vals = xmalloc_array(cap, sizeof *m->vals);
    memset(m->keys, 0xff, cap * sizeof *m->keys);
}

static void pm_free(pairmap *m) {
    free(m->keys);
    free(m->vals);
}

/* Slot of key: holds the key, or the empty slot where it would go. */
static size_t pm_slot(const pairmap *m, uint64_t k) {
    size_t j = mix64(k) & (m->cap - 1);
    while (m->keys[j] != UINT64_MAX && m->keys[j] != k) j = (j + 1) & (m->cap - 1);
    return j;
}

static int32_t pm_get(const pairmap *m, uint64_t k) {
    size_t j = pm_slot(m, k);
    return m->keys[j] == k ? m->vals[j] : -1;
}

static void pm_put(pairmap *m, uint64_t k, int32_t v) {
    if ((m->n + 1) * 2 > m->cap) {
        pairmap nm;
        pm_init(&nm, m->cap * 2);
        for (size_t i = 0; i < m->cap; i++)
            if (m->keys[i] != UINT64_MAX) {
                size_t j = pm_slot(&nm, m->keys[i]);
                nm.keys[j] = m->keys[i];
                nm.vals[j] = m->vals[i];
            }
        nm.n = m->n;
        pm_free(m);
        *m = nm;
    }
    size_t j = pm_slot(m, k);
    if (m->keys[j] == UINT64_MAX) m->n++;
    m->keys[j] = k;
    m->vals[j] = v;
}

/* ---- trainer ------------------------------------------------------------- */
typedef struct {
    int32_t a, b;
    int64_t count;
    int32_t heap_pos; /* -1 when not in the heap */
    uint32_t *words, nw, cw;
} pair_rec;

typedef struct {
    /* tokens */
    uint8_t **tb;
    uint32_t *tl;
    int n_tok, cap_tok;
    bpe_counts *tok_index; /* token bytes -> id + 1 (unique_tokens only) */
    /* words */
    size_t n_words;
    int32_t *sym;
    size_t *woff;
    uint32_t *wlen;
    uint64_t *wcount;
    uint32_t *stamp;
    /* pairs */
    pair_rec *pairs;
    size_t n_pairs, cap_pairs;
    pairmap pmap;
    int32_t *heap;
    size_t heap_n;
} trainer;

static int cmp_tok(const trainer *T, int32_t x, int32_t y) {
    if (x == y) return 0;
    uint32_t lx = T->tl[x], ly = T->tl[y];
    int c = memcmp(T->tb[x], T->tb[y], lx < ly ? lx : ly);
    if (c) return c;
    return lx < ly ? -1 : (lx > ly ? 1 : 0);
}

/* true if pair p ranks above pair q: more frequent, or equally frequent and
 * (left bytes, right bytes) greater. */
static bool pair_above(const trainer *T, const pair_rec *p, const pair_rec *q) {
    if (p->count != q->count) return p->count > q->count;
    int c = cmp_tok(T, p->a, q->a);
    if (c) return c > 0;
    c = cmp_tok(T, p->b, q->b);
    if (c) return c > 0;
    /* same bytes, different ids: only possible without unique_tokens; any
     * fixed order keeps training deterministic */
    if (p->a != q->a) return p->a > q->a;
    return p->b > q->b;
}

static void heap_set(trainer *T, size_t pos, int32_t pi) {
    T->heap[pos] = pi;
    T->pairs[pi].heap_pos = (int32_t)pos;
}

static void heap_up(trainer *T, size_t pos) {
    int32_t pi = T->heap[pos];
    while (pos > 0) {
        size_t up = (pos - 1) / 2;
        if (!pair_above(T, &T->pairs[pi], &T->pairs[T->heap[up]])) break;
        heap_set(T, pos, T->heap[up]);
        pos = up;
    }
    heap_set(T, pos, pi);
}

static void heap_down(trainer *T, size_t pos) {
    int32_t pi = T->heap[pos];
    for (;;) {
        size_t l = 2 * pos + 1, best = pos;
        int32_t bi = pi;
        if (l < T->heap_n && pair_above(T, &T->pairs[T->heap[l]], &T->pairs[bi])) best = l, bi = T->heap[l];
        if (l + 1 < T->heap_n && pair_above(T, &T->pairs[T->heap[l + 1]], &T->pairs[bi]))
            best = l + 1, bi = T->heap[l + 1];
        if (best == pos) break;
        heap_set(T, pos, bi);
        pos = best;
    }
    heap_set(T, pos, pi);
}

/* Restores the heap after pairs[pi].count changed. */
static void heap_fix(trainer *T, int32_t pi) {
    pair_rec *p = &T->pairs[pi];
    if (p->count <= 0) {
        if (p->heap_pos < 0) return;
        size_t pos = (size_t)p->heap_pos;
        p->heap_pos = -1;
        T->heap_n--;
        if (pos == T->heap_n) return;
        int32_t moved = T->heap[T->heap_n];
        heap_set(T, pos, moved);
        heap_up(T, pos);
        heap_down(T, (size_t)T->pairs[moved].heap_pos);
        return;
    }
    if (p->heap_pos < 0) {
        T->heap[T->heap_n] = pi;
        p->heap_pos = (int32_t)T->heap_n++;
        heap_up(T, (size_t)p->heap_pos);
        return;
    }
    heap_up(T, (size_t)p->heap_pos);
    heap_down(T, (size_t)p->heap_pos);
}

static void pair_add(trainer *T, int32_t a, int32_t b, int64_t delta, uint32_t w) {
    uint64_t k = pkey(a, b);
    int32_t pi = pm_get(&T->pmap, k);
    if (pi < 0) {
        if (T->n_pairs == T->cap_pairs) {
            T->cap_pairs *= 2;
            T->pairs = xrealloc_array(T->pairs, T->cap_pairs, sizeof *T->pairs);
            T->heap = xrealloc_array(T->heap, T->cap_pairs, sizeof *T->heap);
        }
        pi = (int32_t)T->n_pairs++;
        T->pairs[pi] = (pair_rec){.a = a, .b = b, .heap_pos = -1};
        pm_put(&T->pmap, k, pi);
    }
    pair_rec *p = &T->pairs[pi];
    p->count += delta;
    if (delta > 0 && (p->nw == 0 || p->words[p->nw - 1] != w)) {
        if (p->nw == p->cw) {
            p->cw = p->cw ? p->cw * 2 : 4;
            p->words = xrealloc_array(p->words, p->cw, sizeof *p->words);
        }
        p->words[p->nw++] = w;
    }
    heap_fix(T, pi);
}

static int32_t add_token(trainer *T, const uint8_t *s, uint32_t n) {
    if (T->n_tok == T->cap_tok) {
        T->cap_tok *= 2;
        T->tb = xrealloc_array(T->tb, (size_t)T->cap_tok, sizeof *T->tb);
        T->tl = xrealloc_array(T->tl, (size_t)T->cap_tok, sizeof *T->tl);
    }
    int32_t id = T->n_tok++;
    T->tb[id] = xmalloc(n);
    memcpy(T->tb[id], s, n);
    T->tl[id] = n;
    if (T->tok_index) bpe_counts_add(T->tok_index, s, n, (uint64_t)id + 1);
    return id;
}

typedef struct {
    const uint8_t *s;
    uint32_t n;
    uint64_t count;
} word_src;

static int cmp_word_src(const void *x, const void *y) {
    const word_src *a = x, *b = y;
    int c = memcmp(a->s, b->s, a->n < b->n ? a->n : b->n);
    if (c) return c;
    return a->n < b->n ? -1 : (a->n > b->n ? 1 : 0);
}

/* Builds the pair -> merge lookup that bpe_apply_merges uses. */
struct bpe_pair_index {
    pairmap first; /* pair -> first merge with it */
    int32_t *next; /* [n_merges] next merge with the same pair, -1 */
};

static void build_index(bpe_model *m) {
    struct bpe_pair_index *ix = xcalloc(1, sizeof *ix);
    size_t cap = 64;
    while (cap < (size_t)m->n_merges * 2 + 2) cap *= 2;
    pm_init(&ix->first, cap);
    ix->next = xmalloc_array((size_t)m->n_merges + 1, sizeof *ix->next);
    int32_t *last = xmalloc_array((size_t)m->n_merges + 1, sizeof *last);
    for (int i = 0; i < m->n_merges; i++) {
        ix->next[i] = -1;
        uint64_t k = pkey(m->merges[i].left, m->merges[i].right);
        int32_t f = pm_get(&ix->first, k);
        if (f < 0) {
            pm_put(&ix->first, k, i);
            last[i] = i;
        } else {
            ix->next[last[f]] = i;
            last[f] = i;
        }
    }
    free(last);
    m->index = ix;
}

int bpe_train(const bpe_counts *c, const bpe_train_opts *opts, bpe_model *out, k3_err *err) {
    memset(out, 0, sizeof *out);
    if (opts->target_tokens < 256)
        return k3_fail(err, K3_EXIT_USAGE, "BPE: %d tokens requested, at least 256 needed",
                       opts->target_tokens);
    if (c->n >= UINT32_MAX)
        return k3_fail(err, K3_EXIT_USAGE, "BPE: too many distinct pre-tokens (%zu)", c->n);
    trainer T;
    memset(&T, 0, sizeof T);
    T.cap_tok = 512;
    T.tb = xmalloc_array((size_t)T.cap_tok, sizeof *T.tb);
    T.tl = xmalloc_array((size_t)T.cap_tok, sizeof *T.tl);
    if (opts->unique_tokens) T.tok_index = bpe_counts_new();
    for (int b = 0; b < 256; b++) {
        uint8_t byte = (uint8_t)b;
        add_token(&T, &byte, 1);
    }

    /* Words in byte order, so that the state (and any tie not settled by
     * bytes) never depends on hash-table or thread order. */
    word_src *ws = xmalloc_array(c->n ? c->n : 1, sizeof *ws);
    size_t nw = 0, total_syms = 0;
    for (size_t i = 0; i < c->cap; i++)
        if (c->tab[i].count) {
            ws[nw++] = (word_src){c->arena + c->tab[i].off, c->tab[i].len, c->tab[i].count};
            total_syms += c->tab[i].len;
        }
    qsort(ws, nw, sizeof *ws, cmp_word_src);
    T.n_words = nw;
    T.sym = xmalloc_array(total_syms ? total_syms : 1, sizeof *T.sym);
    T.woff = xmalloc_array(nw ? nw : 1, sizeof *T.woff);
    T.wlen = xmalloc_array(nw ? nw : 1, sizeof *T.wlen);
    T.wcount = xmalloc_array(nw ? nw : 1, sizeof *T.wcount);
    T.stamp = xcalloc(nw ? nw : 1, sizeof *T.stamp);
    size_t off = 0, max_len = 1;
    for (size_t w = 0; w < nw; w++) {
        T.woff[w] = off;
        T.wlen[w] = ws[w].n;
        T.wcount[w] = ws[w].count;
        for (uint32_t i = 0; i < ws[w].n; i++) T.sym[off + i] = ws[w].s[i];
        off += ws[w].n;
        if (ws[w].n > max_len) max_len = ws[w].n;
    }
    free(ws);

    T.cap_pairs = 4096;
    T.pairs = xmalloc_array(T.cap_pairs, sizeof *T.pairs);
    T.heap = xmalloc_array(T.cap_pairs, sizeof *T.heap);
    pm_init(&T.pmap, 8192);
    for (size_t w = 0; w < nw; w++) {
        const int32_t *s = T.sym + T.woff[w];
        for (uint32_t i = 0; i + 1 < T.wlen[w]; i++)
            pair_add(&T, s[i], s[i + 1], (int64_t)T.wcount[w], (uint32_t)w);
    }

    size_t cap_m = 256;
    bpe_merge *merges = xmalloc_array(cap_m, sizeof *merges);
    int n_merges = 0;
    int32_t *old = xmalloc_array(max_len, sizeof *old);
    uint8_t *omark = xmalloc(max_len), *nmark = xmalloc(max_len), *npair = xmalloc(max_len);
    uint8_t *cat = NULL;
    size_t cat_cap = 0;
    k3_progress prog;
    if (opts->progress) k3_progress_start(&prog, "BPE merges", (uint64_t)(opts->target_tokens - 256), false);

    int rc = 0;
    while (T.n_tok < opts->target_tokens && T.heap_n > 0) {
        int32_t top = T.heap[0];
        int32_t a = T.pairs[top].a, b = T.pairs[top].b;
        uint32_t la = T.tl[a], lb = T.tl[b];
        if ((uint64_t)la + lb > UINT32_MAX) { rc = k3_fail(err, K3_EXIT_RUNTIME, "BPE: token too long"); break; }
        if (la + lb > cat_cap) {
            cat_cap = (size_t)(la + lb) * 2;
            cat = xrealloc(cat, cat_cap);
        }
        memcpy(cat, T.tb[a], la);
        memcpy(cat + la, T.tb[b], lb);
        int32_t x = -1;
        if (T.tok_index) {
            uint64_t v = bpe_counts_get(T.tok_index, cat, la + lb);
            if (v) x = (int32_t)(v - 1);
        }
        if (x < 0) x = add_token(&T, cat, la + lb);
        if ((size_t)n_merges == cap_m) {
            cap_m *= 2;
            merges = xrealloc_array(merges, cap_m, sizeof *merges);
        }
        merges[n_merges++] = (bpe_merge){a, b, x};
        uint32_t stamp = (uint32_t)n_merges;

        /* The list cannot grow while we walk it: every pair this merge adds
         * contains x, and x's bytes are longer than a's or b's. */
        uint32_t *list = T.pairs[top].words, n_list = T.pairs[top].nw;
        for (uint32_t li = 0; li < n_list; li++) {
            uint32_t w = list[li];
            if (T.stamp[w] == stamp) continue;
            T.stamp[w] = stamp;
            int32_t *s = T.sym + T.woff[w];
            uint32_t n = T.wlen[w];
            bool any = false;
            for (uint32_t i = 0; i + 1 < n; i++)
                if (s[i] == a && s[i + 1] == b) { any = true; break; }
            if (!any) continue; /* stale entry */
            memcpy(old, s, n * sizeof *s);
            memset(omark, 0, n);
            uint32_t k = 0;
            for (uint32_t i = 0; i < n;) {
                if (i + 1 < n && old[i] == a && old[i + 1] == b) {
                    if (i > 0) omark[i - 1] = 1;
                    omark[i] = 1;
                    if (i + 2 < n) omark[i + 1] = 1;
                    nmark[k] = 1;
                    s[k++] = x;
                    i += 2;
                } else {
                    nmark[k] = 0;
                    s[k++] = old[i++];
                }
            }
            T.wlen[w] = k;
            int64_t cnt = (int64_t)T.wcount[w];
            /* old pairs that touched a merged position go, the pairs around
             * each new token come; all other pairs are unchanged */
            for (uint32_t j = 0; j + 1 < n; j++)
                if (omark[j]) pair_add(&T, old[j], old[j + 1], -cnt, w);
            memset(npair, 0, k);
            for (uint32_t p = 0; p < k; p++)
                if (nmark[p]) {
                    if (p > 0) npair[p - 1] = 1;
                    if (p + 1 < k) npair[p] = 1;
                }
            for (uint32_t q = 0; q + 1 < k; q++)
                if (npair[q]) pair_add(&T, s[q], s[q + 1], cnt, w);
        }
        pair_rec *tp = &T.pairs[top];
        if (tp->count != 0) {
            rc = k3_fail(err, K3_EXIT_RUNTIME, "BPE: internal error: pair count %lld after merge",
                         (long long)tp->count);
            break;
        }
        free(tp->words);
        tp->words = NULL;
        tp->nw = tp->cw = 0;
        if (opts->progress) k3_progress_update(&prog, (uint64_t)(T.n_tok - 256));
    }
    if (opts->progress) k3_progress_finish(&prog);

    free(old);
    free(omark);
    free(nmark);
    free(npair);
    free(cat);
    for (size_t i = 0; i < T.n_pairs; i++) free(T.pairs[i].words);
    free(T.pairs);
    free(T.heap);
    pm_free(&T.pmap);
    free(T.sym);
    free(T.woff);
    free(T.wlen);
    free(T.wcount);
    free(T.stamp);
    bpe_counts_free(T.tok_index);

    out->n_tokens = T.n_tok;
    out->bytes = T.tb;
    out->lens = T.tl;
    out->n_merges = n_merges;
    out->merges = merges;
    build_index(out);
    if (rc) bpe_model_free(out);
    return rc;
}

void bpe_model_free(bpe_model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_tokens; i++) free(m->bytes[i]);
    free(m->bytes);
    free(m->lens);
    free(m->merges);
    if (m->index) {
        pm_free(&m->index->first);
        free(m->index->next);
        free(m->index);
    }
    memset(m, 0, sizeof *m);
}

void bpe_apply_merges(const bpe_model *m, const uint8_t *bytes, size_t len, int32_t **ids,
                      size_t *n, size_t *cap) {
    if (*n + len > *cap) {
        *cap = (*n + len) * 2 + 16;
        *ids = xrealloc_array(*ids, *cap, sizeof **ids);
    }
    int32_t *s = *ids + *n;
    size_t k = len;
    for (size_t i = 0; i < len; i++) s[i] = bytes[i];
    const struct bpe_pair_index *ix = m->index;
    int32_t cur = 0; /* merges before cur are done */
    for (;;) {
        /* the next merge in creation order that applies here */
        int32_t best = -1;
        for (size_t i = 0; i + 1 < k; i++) {
            int32_t j = pm_get(&ix->first, pkey(s[i], s[i + 1]));
            while (j >= 0 && j < cur) j = ix->next[j];
            if (j >= 0 && (best < 0 || j < best)) best = j;
        }
        if (best < 0) break;
        const bpe_merge *mg = &m->merges[best];
        size_t o = 0;
        for (size_t i = 0; i < k;) {
            if (i + 1 < k && s[i] == mg->left && s[i + 1] == mg->right) {
                s[o++] = mg->result;
                i += 2;
            } else {
                s[o++] = s[i++];
            }
        }
        k = o;
        cur = best + 1;
    }
    *n += k;
}

/* ---- output -------------------------------------------------------------- */
static size_t base64(const uint8_t *s, size_t n, char *out) {
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16;
        if (i + 1 < n) v |= (uint32_t)s[i + 1] << 8;
        if (i + 2 < n) v |= s[i + 2];
        out[o++] = tab[(v >> 18) & 63];
        out[o++] = tab[(v >> 12) & 63];
        out[o++] = i + 1 < n ? tab[(v >> 6) & 63] : '=';
        out[o++] = i + 2 < n ? tab[v & 63] : '=';
    }
    return o;
}

int bpe_write_tiktoken(const bpe_model *m, const char *dir, const char *const *specials,
                       int n_specials, int n_reserved, const char *eos,
                       const char *pattern_name, k3_err *err) {
    if (n_specials > n_reserved)
        return k3_fail(err, K3_EXIT_USAGE, "%d specials do not fit in %d reserved ids", n_specials, n_reserved);
    /* tiktoken maps bytes to a rank, so equal bytes under two ids cannot be
     * written */
    bpe_counts *seen = bpe_counts_new();
    for (int i = 0; i < m->n_tokens; i++) {
        if (bpe_counts_get(seen, m->bytes[i], m->lens[i])) {
            bpe_counts_free(seen);
            return k3_fail(err, K3_EXIT_RUNTIME, "%s: BPE vocabulary has two tokens with the same bytes (id %d)", dir, i);
        }
        bpe_counts_add(seen, m->bytes[i], m->lens[i], 1);
    }
    bpe_counts_free(seen);
    bool eos_ok = false;
    for (int s = 0; s < n_specials; s++) eos_ok |= eos && strcmp(specials[s], eos) == 0;
    if (eos && !eos_ok) return k3_fail(err, K3_EXIT_USAGE, "eos token '%s' is not a special", eos);

    size_t cap = 0;
    for (int i = 0; i < m->n_tokens; i++) cap += (m->lens[i] + 2) / 3 * 4 + 16;
    char *buf = xmalloc(cap + 1), path[4096];
    size_t o = 0;
    for (int i = 0; i < m->n_tokens; i++) {
        o += base64(m->bytes[i], m->lens[i], buf + o);
        int w = snprintf(buf + o, cap + 1 - o, " %d\n", i);
        if (w < 0 || (size_t)w >= cap + 1 - o) { free(buf); return k3_fail(err, K3_EXIT_RUNTIME, "tiktoken.model: buffer"); }
        o += (size_t)w;
    }
    int rc;
    if (snprintf(path, sizeof path, "%s/tiktoken.model", dir) >= (int)sizeof path) {
        free(buf);
        return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    }
    rc = k3_write_file_atomic(path, buf, o, err);
    free(buf);
    if (rc) return rc;

    json_t *root = json_object(), *added = json_object();
    for (int s = 0; s < n_specials; s++) {
        char id[32];
        snprintf(id, sizeof id, "%d", m->n_tokens + s);
        json_t *e = json_object();
        json_object_set_new(e, "content", json_string(specials[s]));
        json_object_set_new(e, "lstrip", json_false());
        json_object_set_new(e, "normalized", json_false());
        json_object_set_new(e, "rstrip", json_false());
        json_object_set_new(e, "single_word", json_false());
        json_object_set_new(e, "special", json_true());
        json_object_set_new(added, id, e);
    }
    json_object_set_new(root, "added_tokens_decoder", added);
    if (eos) {
        json_object_set_new(root, "bos_token", json_string(eos));
        json_object_set_new(root, "eos_token", json_string(eos));
    }
    json_object_set_new(root, "num_reserved_special_tokens", json_integer(n_reserved));
    if (pattern_name) json_object_set_new(root, "pretokenizer", json_string(pattern_name));
    json_object_set_new(root, "tokenizer_class", json_string("TikTokenTokenizer"));
    char *js = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!js) return k3_fail(err, K3_EXIT_RUNTIME, "tokenizer_config.json: cannot serialise");
    size_t jl = strlen(js);
    char *js2 = xmalloc(jl + 2);
    memcpy(js2, js, jl);
    js2[jl] = '\n';
    free(js);
    if (snprintf(path, sizeof path, "%s/tokenizer_config.json", dir) >= (int)sizeof path) {
        free(js2);
        return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    }
    rc = k3_write_file_atomic(path, js2, jl + 1, err);
    free(js2);
    return rc;
}

typedef struct {
    const bpe_model *m;
    int32_t **ids;
    size_t *n, *cap;
} replay_ctx;

static int replay_piece(const char *piece, size_t len, void *ctx) {
    replay_ctx *r = ctx;
    bpe_apply_merges(r->m, (const uint8_t *)piece, len, r->ids, r->n, r->cap);
    return 0;
}

int bpe_encode_reference(const bpe_model *m, const tok_splitter *sp, const char *text, size_t len,
                         const char *special, int32_t special_id, int32_t **ids, size_t *n, size_t *cap,
                         k3_err *err) {
    replay_ctx r = {m, ids, n, cap};
    size_t sl = strlen(special);
    const char *p = text, *end = text + len;
    while (p < end) {
        const char *q = sl ? memmem(p, (size_t)(end - p), special, sl) : NULL;
        size_t seg = q ? (size_t)(q - p) : (size_t)(end - p);
        int rc = tok_split(sp, p, seg, replay_piece, &r, err);
        if (rc) return rc;
        if (!q) break;
        if (*n == *cap) *ids = xrealloc_array(*ids, *cap = *cap * 2 + 16, sizeof **ids);
        (*ids)[(*n)++] = special_id;
        p = q + sl;
    }
    return 0;
}
