/* tokenizer.c: the Kimi tiktoken-style tokenizer: loading, byte-level BPE,
 * specials, decoding. The split before BPE lives in pretok.c.
 *
 * Every choice that could make our ids differ from tiktoken's follows what
 * tiktoken's Rust core does: a piece that is itself a token is emitted whole
 * (without merging); otherwise the adjacent pair with the lowest rank is
 * merged first, the leftmost one on ties; with specials allowed, the text
 * between two specials is split on its own (so a lookahead at its end sees
 * the end of the text). */
#include "tokenizer/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Ids reserved for specials after the base ranks: 256 in the Kimi tokenizer
 * class; a tokenizer_config.json may say otherwise with
 * "num_reserved_special_tokens" (k3 prepare writes 1 for small vocabularies). */
#define DEFAULT_RESERVED 256
#define MAX_RESERVED 65536

struct k3_tokenizer {
    int n_base, n_vocab, n_reserved;
    uint8_t *blob;   /* bytes of every id (base tokens, then special names) */
    uint32_t *off;   /* id i is blob[off[i] .. off[i+1]) */
    /* open addressing: base token bytes -> id. Each slot keeps 32 bits of
     * the hash so a probe touches the token bytes only on a likely hit. */
    struct slot { uint32_t tag; int32_t id; } *ht; /* id -1: empty */
    uint32_t ht_mask;
    int32_t byte_id[256];
    int32_t *pair_id; /* [65536]: id of each 2-byte token or -1 (the hot BPE lookup) */
    size_t max_len;  /* longest token (base or special), in bytes */
    int eos, bos;
    bool special_first[256]; /* first bytes of special names */
    bool special_newline;     /* some special name holds a '\n' (no safe cuts) */
    tok_splitter *split;
};

/* ---- hashing of byte strings ------------------------------------------ */

static inline uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    h = (h ^ w) * 0x94D049BB133111EBull;
    return h ^ (h >> 29);
}

/* Base-token id of p[0..n), or -1. */
static inline int32_t lookup(const k3_tokenizer *t, const uint8_t *p, size_t n) {
    if (n == 1) return t->byte_id[p[0]];
    if (n == 2) return t->pair_id[p[0] << 8 | p[1]];
    uint64_t h = hash_bytes(p, n);
    uint32_t i = (uint32_t)h & t->ht_mask, tag = (uint32_t)(h >> 32);
    for (;;) {
        struct slot s = t->ht[i];
        if (s.id < 0) return -1;
        if (s.tag == tag) {
            uint32_t o = t->off[s.id];
            if (t->off[s.id + 1] - o == n && memcmp(t->blob + o, p, n) == 0) return s.id;
        }
        i = (i + 1) & t->ht_mask;
    }
}

/* Inserts id; returns the id already holding the same bytes, or -1. */
static int32_t insert(k3_tokenizer *t, int32_t id) {
    const uint8_t *p = t->blob + t->off[id];
    size_t n = t->off[id + 1] - t->off[id];
    uint64_t h = hash_bytes(p, n);
    uint32_t i = (uint32_t)h & t->ht_mask, tag = (uint32_t)(h >> 32);
    for (;;) {
        struct slot s = t->ht[i];
        if (s.id < 0) {
            t->ht[i] = (struct slot){tag, id};
            return -1;
        }
        if (s.tag == tag && t->off[s.id + 1] - t->off[s.id] == n && memcmp(t->blob + t->off[s.id], p, n) == 0)
            return s.id;
        i = (i + 1) & t->ht_mask;
    }
}

/* ---- loading ------------------------------------------------------------ */

static int b64_value(int c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Strict standard base64 with padding; appends to out. Returns decoded length or -1. */
static long b64_decode(const char *s, size_t n, uint8_t *out) {
    if (n == 0 || n % 4) return -1;
    size_t w = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            char c = s[i + k];
            if (c == '=' && i + 4 == n && k >= 2) { v[k] = 0; pad++; continue; }
            if (pad) return -1; /* data after '=' */
            v[k] = b64_value((unsigned char)c);
            if (v[k] < 0) return -1;
        }
        uint32_t x = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        /* non-canonical encodings (stray low bits before the padding) are refused */
        if ((pad == 1 && (x & 0xFF)) || (pad == 2 && (x & 0xFFFF))) return -1;
        out[w++] = (uint8_t)(x >> 16);
        if (pad < 2) out[w++] = (uint8_t)(x >> 8);
        if (pad < 1) out[w++] = (uint8_t)x;
    }
    return (long)w;
}

static int load_ranks(k3_tokenizer *t, const char *path, k3_err *err) {
    char *data;
    size_t len;
    int rc = k3_read_file(path, &data, &len, err);
    if (rc) return rc; /* a missing file is K3_EXIT_USAGE, a read error K3_EXIT_RUNTIME */
    size_t lines = 0;
    for (size_t i = 0; i < len; i++) lines += data[i] == '\n';
    if (len && data[len - 1] != '\n') lines++;
    if (len >= UINT32_MAX) {
        free(data);
        return k3_fail(err, K3_EXIT_USAGE, "%s: file too large", path);
    }
    if (lines == 0) {
        free(data);
        return k3_fail(err, K3_EXIT_USAGE, "%s: empty vocabulary", path);
    }
    if (lines > (size_t)INT32_MAX - t->n_reserved - 1) {
        free(data);
        return k3_fail(err, K3_EXIT_USAGE, "%s: too many lines", path);
    }
    /* base64 never decodes to more bytes than it has characters */
    t->blob = xmalloc(len + 1);
    t->off = xmalloc_array(lines + t->n_reserved + 1, sizeof *t->off);
    size_t w = 0, n = 0;
    const char *p = data, *end = data + len;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl) nl = end;
        size_t lineno = n + 1;
        const char *sp = memchr(p, ' ', (size_t)(nl - p));
        if (!sp) {
            rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: expected 'BASE64 RANK'", path, lineno);
            break;
        }
        long b = b64_decode(p, (size_t)(sp - p), t->blob + w);
        if (b <= 0) {
            rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: bad base64 token", path, lineno);
            break;
        }
        uint64_t rank = 0;
        const char *q = sp + 1;
        if (q == nl) {
            rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: missing rank", path, lineno);
            break;
        }
        for (; q < nl; q++) {
            if (*q < '0' || *q > '9' || rank > INT32_MAX) break;
            rank = rank * 10 + (uint64_t)(*q - '0');
        }
        if (q != nl) {
            rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: bad rank", path, lineno);
            break;
        }
        /* Ranks are the ids: they must be 0, 1, 2, ... in file order. */
        if (rank != n) {
            rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: rank %llu out of order (expected %zu)", path,
                         lineno, (unsigned long long)rank, n);
            break;
        }
        t->off[n++] = (uint32_t)w;
        w += (size_t)b;
        p = nl + 1;
    }
    free(data);
    if (rc) return rc;
    t->off[n] = (uint32_t)w;
    t->n_base = (int)n;
    size_t cap = 1024;
    while (cap < 2 * n) cap *= 2;
    t->ht = xmalloc_array(cap, sizeof *t->ht);
    memset(t->ht, 0xFF, cap * sizeof *t->ht);
    t->ht_mask = (uint32_t)(cap - 1);
    for (int i = 0; i < 256; i++) t->byte_id[i] = -1;
    t->pair_id = xmalloc_array(65536, sizeof *t->pair_id);
    memset(t->pair_id, 0xFF, 65536 * sizeof *t->pair_id);
    for (size_t i = 0; i < n; i++) {
        int32_t dup = insert(t, (int32_t)i);
        if (dup >= 0)
            return k3_fail(err, K3_EXIT_USAGE, "%s:%zu: token duplicates the one of rank %d", path,
                           i + 1, dup);
        size_t l = t->off[i + 1] - t->off[i];
        const uint8_t *b = t->blob + t->off[i];
        if (l == 1) t->byte_id[b[0]] = (int32_t)i;
        if (l == 2) t->pair_id[b[0] << 8 | b[1]] = (int32_t)i;
        if (l > t->max_len) t->max_len = l;
    }
    /* Byte-level BPE can spell any text only if every byte is a token. */
    for (int i = 0; i < 256; i++)
        if (t->byte_id[i] < 0)
            return k3_fail(err, K3_EXIT_USAGE, "%s: no token for the single byte 0x%02x", path, i);
    return K3_OK;
}

/* A token name in the config: a string or an AddedToken object {"content": ...}. */
static const char *token_name(json_t *v) {
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v)) {
        json_t *c = json_object_get(v, "content");
        if (json_is_string(c)) return json_string_value(c);
    }
    return NULL;
}

static int load_specials(k3_tokenizer *t, const char *path, k3_err *err) {
    char **names = xcalloc((size_t)t->n_reserved, sizeof *names);
    struct stat st;
    json_t *root = NULL;
    int rc = K3_OK;
    t->eos = t->bos = -1;
    if (stat(path, &st) == 0) {
        json_error_t je;
        /* model_max_length is 1e30 in the released file: too big for an integer */
        root = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je);
        if (!root) {
            free(names);
            return k3_fail(err, K3_EXIT_USAGE, "%s:%d: %s", path, je.line, je.text);
        }
        if (!json_is_object(root)) rc = k3_fail(err, K3_EXIT_USAGE, "%s: not a JSON object", path);
        json_t *dec = json_object_get(root, "added_tokens_decoder");
        if (dec && !json_is_object(dec)) rc = k3_fail(err, K3_EXIT_USAGE, "%s: added_tokens_decoder is not an object", path);
        const char *key;
        json_t *val;
        json_object_foreach(dec, key, val) {
            if (rc) break;
            char *e;
            errno = 0;
            long id = strtol(key, &e, 10);
            if (!*key || *e || errno || id < t->n_base || id >= (long)t->n_base + t->n_reserved) {
                rc = k3_fail(err, K3_EXIT_USAGE, "%s: added_tokens_decoder id '%s' is not in the reserved range %d..%d",
                             path, key, t->n_base, t->n_base + t->n_reserved - 1);
                break;
            }
            const char *name = token_name(val);
            if (!name || !*name) {
                rc = k3_fail(err, K3_EXIT_USAGE, "%s: added_tokens_decoder '%s' has no content", path, key);
                break;
            }
            names[id - t->n_base] = xstrdup(name);
        }
    } else if (errno != ENOENT) {
        free(names);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: %s", path, strerror(errno));
    }
    /* Lay the special names out after the base tokens. */
    size_t extra = 0;
    char auto_name[64];
    for (int i = 0; i < t->n_reserved && !rc; i++) {
        if (!names[i]) {
            int k = snprintf(auto_name, sizeof auto_name, "<|reserved_token_%d|>", t->n_base + i);
            if (k < 0 || (size_t)k >= sizeof auto_name) {
                rc = k3_fail(err, K3_EXIT_RUNTIME, "reserved token name too long");
                break;
            }
            names[i] = xstrdup(auto_name);
        }
        extra += strlen(names[i]);
    }
    if (!rc) {
        size_t base_end = t->off[t->n_base];
        t->blob = xrealloc(t->blob, base_end + extra + 1);
        size_t w = base_end;
        if (base_end + extra >= UINT32_MAX) rc = k3_fail(err, K3_EXIT_USAGE, "%s: vocabulary too large", path);
        for (int i = 0; i < t->n_reserved && !rc; i++) {
            size_t l = strlen(names[i]);
            memcpy(t->blob + w, names[i], l);
            t->off[t->n_base + i] = (uint32_t)w;
            w += l;
            t->special_first[(uint8_t)names[i][0]] = true;
            if (strchr(names[i], '\n')) t->special_newline = true;
            if (l > t->max_len) t->max_len = l;
        }
        if (!rc) {
            t->off[t->n_base + t->n_reserved] = (uint32_t)w;
            t->n_vocab = t->n_base + t->n_reserved;
        }
    }
    for (int i = 0; i < t->n_reserved && !rc; i++)
        for (int j = 0; j < i; j++)
            if (strcmp(names[i], names[j]) == 0) {
                rc = k3_fail(err, K3_EXIT_USAGE, "%s: special token '%s' named twice (ids %d and %d)",
                             path, names[i], t->n_base + j, t->n_base + i);
                break;
            }
    for (int i = 0; i < t->n_reserved; i++) free(names[i]);
    free(names);
    if (!rc && root) {
        static const char *const keys[2] = {"eos_token", "bos_token"};
        int *dst[2] = {&t->eos, &t->bos};
        for (int k = 0; k < 2 && !rc; k++) {
            json_t *v = json_object_get(root, keys[k]);
            if (!v || json_is_null(v)) continue;
            const char *name = token_name(v);
            int id = name ? tok_special_id(t, name) : -1;
            if (id < 0) rc = k3_fail(err, K3_EXIT_USAGE, "%s: %s is not a special token", path, keys[k]);
            *dst[k] = id;
        }
    }
    json_decref(root);
    return rc;
}

/* The two options of tokenizer_config.json that shape loading itself: how many
 * ids are reserved for specials, and which pre-tokenization pattern the
 * vocabulary was trained with ("kimi", the default, or "gpt2"). */
static int load_options(const char *dir, int *n_reserved, const char **pattern, k3_err *err) {
    char path[4096];
    *n_reserved = DEFAULT_RESERVED;
    *pattern = TOK_PATTERN_KIMI;
    int k = snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (k < 0 || (size_t)k >= sizeof path) return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    struct stat st;
    if (stat(path, &st) != 0) return K3_OK;
    json_error_t je;
    json_t *root = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je);
    if (!root) return k3_fail(err, K3_EXIT_USAGE, "%s:%d: %s", path, je.line, je.text);
    if (!json_is_object(root)) {
        /* an array or a scalar would silently drop every special token */
        json_decref(root);
        return k3_fail(err, K3_EXIT_USAGE, "%s: not a JSON object", path);
    }
    int rc = K3_OK;
    json_t *v = json_object_get(root, "num_reserved_special_tokens");
    if (v) {
        double d = json_is_number(v) ? json_number_value(v) : -1;
        if (!(d >= 1 && d <= MAX_RESERVED) || d != (double)(int)d)
            rc = k3_fail(err, K3_EXIT_USAGE, "%s: num_reserved_special_tokens must be an integer in 1..%d", path,
                         MAX_RESERVED);
        else *n_reserved = (int)d;
    }
    v = json_object_get(root, "pretokenizer");
    if (!rc && v) {
        const char *name = json_is_string(v) ? json_string_value(v) : "";
        if (!strcmp(name, "kimi")) *pattern = TOK_PATTERN_KIMI;
        else if (!strcmp(name, "gpt2")) *pattern = TOK_PATTERN_GPT2;
        else rc = k3_fail(err, K3_EXIT_USAGE, "%s: pretokenizer must be \"kimi\" or \"gpt2\"", path);
    }
    json_decref(root);
    return rc;
}

int tok_load(const char *dir, k3_tokenizer **out, k3_err *err) {
    char path[4096];
    k3_tokenizer *t = xcalloc(1, sizeof *t);
    const char *pattern = TOK_PATTERN_KIMI;
    int rc = load_options(dir, &t->n_reserved, &pattern, err);
    int k = snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    if (!rc && (k < 0 || (size_t)k >= sizeof path)) rc = k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    if (!rc) rc = load_ranks(t, path, err);
    if (!rc) {
        k = snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
        if (k < 0 || (size_t)k >= sizeof path) rc = k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    }
    if (!rc) rc = load_specials(t, path, err);
    if (!rc) rc = tok_splitter_new(pattern, &t->split, err);
    if (rc) {
        tok_free(t);
        return rc;
    }
    *out = t;
    return K3_OK;
}

void tok_free(k3_tokenizer *t) {
    if (!t) return;
    free(t->blob);
    free(t->off);
    free(t->ht);
    free(t->pair_id);
    tok_splitter_free(t->split);
    free(t);
}

int tok_vocab_size(const k3_tokenizer *t) { return t->n_vocab; }
int tok_n_base(const k3_tokenizer *t) { return t->n_base; }
int tok_eos_id(const k3_tokenizer *t) { return t->eos; }
int tok_bos_id(const k3_tokenizer *t) { return t->bos; }
size_t tok_max_token_bytes(const k3_tokenizer *t) { return t->max_len; }

int tok_special_id(const k3_tokenizer *t, const char *name) {
    size_t l = strlen(name);
    for (int i = t->n_base; i < t->n_vocab; i++)
        if (t->off[i + 1] - t->off[i] == l && memcmp(t->blob + t->off[i], name, l) == 0) return i;
    return -1;
}

/* ---- encoding ------------------------------------------------------------ */

typedef struct {
    int32_t *v;
    size_t n, cap;
} idvec;

static inline void push(idvec *o, int32_t id) {
    if (o->n == o->cap) o->v = xrealloc_array(o->v, o->cap = o->cap ? 2 * o->cap : 256, sizeof *o->v);
    o->v[o->n++] = id;
}

#define NO_RANK INT32_MAX

/* tiktoken's merge loop, as is: parts[i] is a start offset with the rank of
 * the pair starting there; each round merges the leftmost lowest pair.
 * Quadratic, but pieces are short; long ones go to bpe_long. */
static void bpe_short(const k3_tokenizer *t, const uint8_t *p, size_t n, idvec *o) {
    uint32_t start[129];
    int32_t rank[129];
    size_t m = n + 1;
    for (size_t i = 0; i <= n; i++) start[i] = (uint32_t)i;
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t r = lookup(t, p + i, 2);
        rank[i] = r < 0 ? NO_RANK : r;
    }
    rank[n - 1] = rank[n] = NO_RANK;
    for (;;) {
        int32_t best = NO_RANK;
        size_t bi = 0;
        for (size_t i = 0; i + 1 < m; i++)
            if (rank[i] < best) { best = rank[i]; bi = i; }
        if (best == NO_RANK) break;
        /* merge parts bi and bi+1, then re-rank the pairs that changed */
        memmove(start + bi + 1, start + bi + 2, (m - bi - 2) * sizeof *start);
        memmove(rank + bi + 1, rank + bi + 2, (m - bi - 2) * sizeof *rank);
        m--;
        for (size_t j = bi ? bi - 1 : 0; j <= bi; j++) {
            if (j + 2 < m) {
                int32_t r = lookup(t, p + start[j], start[j + 2] - start[j]);
                rank[j] = r < 0 ? NO_RANK : r;
            } else {
                rank[j] = NO_RANK;
            }
        }
    }
    for (size_t i = 0; i + 1 < m; i++) push(o, lookup(t, p + start[i], start[i + 1] - start[i]));
}

/* The same merge order in O(n log n) for long pieces: a doubly linked list of
 * parts and a binary heap of candidate pairs keyed by (rank, start offset).
 * Start offsets order parts left to right, so the heap minimum is exactly the
 * leftmost lowest-ranked pair bpe_short would pick. Stale heap entries (a
 * pair whose left part changed) are skipped by a version check. */
typedef struct {
    int32_t rank;
    uint32_t pos, ver;
} cand;

static inline bool cand_less(cand a, cand b) {
    return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

static void heap_push(cand *h, size_t *n, cand c) {
    size_t i = (*n)++;
    while (i && cand_less(c, h[(i - 1) / 2])) { h[i] = h[(i - 1) / 2]; i = (i - 1) / 2; }
    h[i] = c;
}

static cand heap_pop(cand *h, size_t *n) {
    cand top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && cand_less(h[c + 1], h[c])) c++;
        if (!cand_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

static void bpe_long(const k3_tokenizer *t, const uint8_t *p, size_t n, idvec *o) {
    /* part i starts at byte i (parts are identified by their start offset) */
    uint32_t *next = xmalloc_array(n + 1, sizeof *next), *prev = xmalloc_array(n + 1, sizeof *prev);
    uint32_t *ver = xcalloc(n + 1, sizeof *ver);
    cand *h = xmalloc_array(3 * n, sizeof *h); /* at most n-1 initial + 2 per merge - 1 per pop */
    size_t hn = 0;
    for (size_t i = 0; i <= n; i++) { next[i] = (uint32_t)i + 1; prev[i] = (uint32_t)i - 1; }
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t r = lookup(t, p + i, 2);
        if (r >= 0) heap_push(h, &hn, (cand){r, (uint32_t)i, 0});
    }
    while (hn) {
        cand c = heap_pop(h, &hn);
        uint32_t a = c.pos;
        if (c.ver != ver[a]) continue; /* stale */
        uint32_t b = next[a];          /* merge a and b: a absorbs b */
        next[a] = next[b];
        if (next[b] <= n) prev[next[b]] = a;
        ver[a]++;
        ver[b] = UINT32_MAX; /* b is gone: any entry for it is stale */
        if (next[a] < n) {   /* pair (a, next[a]) */
            uint32_t e = next[next[a]];
            int32_t r = lookup(t, p + a, e - a);
            if (r >= 0) heap_push(h, &hn, (cand){r, a, ver[a]});
        }
        if (a > 0) { /* pair (prev[a], a): its right end moved */
            uint32_t l = prev[a];
            ver[l]++;
            int32_t r = lookup(t, p + l, next[a] - l);
            if (r >= 0) heap_push(h, &hn, (cand){r, l, ver[l]});
        }
    }
    for (uint32_t i = 0; i < n; i = next[i]) push(o, lookup(t, p + i, next[i] - i));
    free(next); free(prev); free(ver); free(h);
}

static void encode_piece(const k3_tokenizer *t, const uint8_t *p, size_t n, idvec *o) {
    int32_t whole = lookup(t, p, n);
    if (whole >= 0) { push(o, whole); return; }
    if (n <= 128) bpe_short(t, p, n, o);
    else bpe_long(t, p, n, o);
}

typedef struct {
    const k3_tokenizer *t;
    idvec *o;
} enc_ctx;

static int on_piece(const char *piece, size_t n, void *ctx) {
    enc_ctx *e = ctx;
    encode_piece(e->t, (const uint8_t *)piece, n, e->o);
    return 0;
}

/* Leftmost special name in text[from..len): its id and offset, or -1. */
static int32_t find_special(const k3_tokenizer *t, const char *text, size_t len, size_t from, size_t *at) {
    for (size_t i = from; i < len; i++) {
        if (!t->special_first[(uint8_t)text[i]]) continue;
        int32_t best = -1;
        size_t best_len = 0;
        for (int id = t->n_base; id < t->n_vocab; id++) {
            size_t l = t->off[id + 1] - t->off[id];
            /* longest name wins where two start at the same place */
            if (l > best_len && l <= len - i && memcmp(text + i, t->blob + t->off[id], l) == 0) {
                best = id;
                best_len = l;
            }
        }
        if (best >= 0) { *at = i; return best; }
    }
    return -1;
}

/* Encodes valid UTF-8 text[0..len) into o. */
static int encode_range(const k3_tokenizer *t, const char *text, size_t len, bool allow_special,
                        idvec *o, k3_err *err) {
    enc_ctx e = {t, o};
    size_t pos = 0;
    int rc = K3_OK;
    while (pos <= len && !rc) {
        size_t at = len;
        int32_t sp = allow_special ? find_special(t, text, len, pos, &at) : -1;
        rc = tok_split(t->split, text + pos, at - pos, on_piece, &e, err);
        if (sp < 0) break;
        push(o, sp);
        pos = at + (t->off[sp + 1] - t->off[sp]);
    }
    return rc;
}

/* Where the Kimi pattern always ends a piece: after a '\n' that is followed
 * by a character that is not White_Space (here: a printable ASCII byte, which
 * is enough to find one often). No alternative of the pattern continues past
 * a '\n' into a non-space (the ones that take '\n' end in [\r\n]* or are
 * all whitespace), and a whitespace run holding a '\n' is taken whole by
 * \s*[\r\n]+ before (?!\S) is ever consulted, so the pieces on each side do
 * not depend on the other. No special name holds a '\n' (checked at load),
 * so none spans the cut either. */
size_t tok_safe_cut(const k3_tokenizer *t, const char *text, size_t len, size_t at) {
    if (t->special_newline) return len;
    for (size_t i = at ? at : 1; i < len; i++)
        if (text[i - 1] == '\n' && text[i] > ' ' && text[i] < 0x7F) return i;
    return len;
}

#define PAR_MIN (1u << 20)  /* inputs at least this long are encoded in parallel */
#define PAR_CHUNK (1u << 18)

int tok_encode(const k3_tokenizer *t, const char *text, size_t len, bool allow_special,
               int32_t **ids, size_t *n, k3_err *err) {
    size_t bad = tok_utf8_check((const uint8_t *)text, len);
    if (bad != len) return k3_fail(err, K3_EXIT_USAGE, "input text: invalid UTF-8 at byte %zu", bad);
    /* Long texts: independent chunks at safe cuts, encoded in parallel and
     * joined in order; the ids are the same as in one pass. */
    size_t nch = 0, cap = 0, *cut = NULL;
    if (len >= PAR_MIN && !omp_in_parallel() && omp_get_max_threads() > 1) {
        for (size_t p = 0; p < len;) {
            size_t q = tok_safe_cut(t, text, len, p + PAR_CHUNK);
            if (nch + 2 > cap) cut = xrealloc_array(cut, cap = cap ? 2 * cap : 64, sizeof *cut);
            if (!nch) cut[nch++] = 0;
            cut[nch++] = q;
            p = q;
        }
        nch--;
    }
    if (nch < 2) {
        free(cut);
        idvec o = {0};
        int rc = encode_range(t, text, len, allow_special, &o, err);
        if (rc) {
            free(o.v);
            return rc;
        }
        *ids = o.v ? o.v : xmalloc(sizeof(int32_t));
        *n = o.n;
        return K3_OK;
    }
    idvec *parts = xcalloc(nch, sizeof *parts);
    k3_err *errs = xcalloc(nch, sizeof *errs);
    int *rcs = xcalloc(nch, sizeof *rcs);
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t k = 0; k < nch; k++)
        rcs[k] = encode_range(t, text + cut[k], cut[k + 1] - cut[k], allow_special, &parts[k], &errs[k]);
    int rc = K3_OK;
    size_t total = 0;
    for (size_t k = 0; k < nch; k++) {
        if (rcs[k] && !rc) {
            rc = rcs[k];
            if (err) *err = errs[k];
        }
        total += parts[k].n;
    }
    int32_t *out = rc ? NULL : xmalloc_array(total ? total : 1, sizeof *out);
    size_t w = 0;
    for (size_t k = 0; k < nch; k++) {
        if (out) memcpy(out + w, parts[k].v, parts[k].n * sizeof *out);
        w += parts[k].n;
        free(parts[k].v);
    }
    free(parts);
    free(errs);
    free(rcs);
    free(cut);
    if (rc) return rc;
    *ids = out;
    *n = total;
    return K3_OK;
}

/* ---- decoding ------------------------------------------------------------ */

const uint8_t *tok_token_bytes(const k3_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    *len = t->off[id + 1] - t->off[id];
    return t->blob + t->off[id];
}

int tok_decode(const k3_tokenizer *t, const int32_t *ids, size_t n, uint8_t **out, size_t *len,
               k3_err *err) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return k3_fail(err, K3_EXIT_USAGE, "id %d is outside the vocabulary (0..%d)", ids[i], t->n_vocab - 1);
        total += t->off[ids[i] + 1] - t->off[ids[i]];
    }
    uint8_t *b = xmalloc(total + 1);
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        size_t l = t->off[ids[i] + 1] - t->off[ids[i]];
        memcpy(b + w, t->blob + t->off[ids[i]], l);
        w += l;
    }
    *out = b;
    *len = w;
    return K3_OK;
}

/* ---- incremental decoding ---------------------------------------------- */

void tok_stream_init(tok_stream *s, const k3_tokenizer *t) {
    s->tok = t;
    s->npending = 0;
}

/* Length a UTF-8 sequence starting with lead byte c will have; 0 if c can
 * never start one. */
static int utf8_seq_len(uint8_t c) {
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c >= 0xE0 && c <= 0xEF) return 3;
    if (c >= 0xF0 && c <= 0xF4) return 4;
    return 0;
}

static void out_put(uint8_t *out, size_t cap, size_t *w, const uint8_t *p, size_t n) {
    if (*w + n > cap) {
        /* The caller sized out below tok_max_token_bytes() + 4: a programming
         * error that would otherwise drop text silently. */
        fprintf(stderr, "k3: internal error: tok_stream buffer too small (%zu bytes)\n", cap);
        abort();
    }
    memcpy(out + *w, p, n);
    *w += n;
}

/* May byte b stand at position k (1..3) of a sequence led by lead? (The
 * second byte has tighter bounds after E0, ED, F0 and F4: no overlongs, no
 * surrogates, nothing past U+10FFFF.) */
static bool utf8_cont_ok(uint8_t lead, int k, uint8_t b) {
    uint8_t lo = 0x80, hi = 0xBF;
    if (k == 1) {
        if (lead == 0xE0) lo = 0xA0;
        if (lead == 0xED) hi = 0x9F;
        if (lead == 0xF0) lo = 0x90;
        if (lead == 0xF4) hi = 0x8F;
    }
    return b >= lo && b <= hi;
}

/* Emits every decided byte of pending: whole characters, and bytes that can
 * never be part of one. Keeps a valid but incomplete tail (at most 3 bytes). */
static void stream_drain(tok_stream *s, uint8_t *out, size_t cap, size_t *w) {
    int i = 0;
    while (i < s->npending) {
        const uint8_t *p = s->pending + i;
        int need = utf8_seq_len(p[0]), have = s->npending - i, k = 1;
        if (need == 0) { /* never a lead byte */
            out_put(out, cap, w, p, 1);
            i++;
            continue;
        }
        while (k < need && k < have && utf8_cont_ok(p[0], k, p[k])) k++;
        if (k < need && k < have) { /* broken sequence: the lead goes out alone */
            out_put(out, cap, w, p, 1);
            i++;
            continue;
        }
        if (k < need) break; /* incomplete so far: wait for the next token */
        out_put(out, cap, w, p, (size_t)need);
        i += need;
    }
    memmove(s->pending, s->pending + i, (size_t)(s->npending - i));
    s->npending -= i;
}

size_t tok_stream_feed(tok_stream *s, int32_t id, uint8_t *out, size_t cap) {
    size_t len, w = 0;
    const uint8_t *b = tok_token_bytes(s->tok, id, &len);
    if (!b) return 0;
    for (size_t i = 0; i < len; i++) {
        s->pending[s->npending++] = b[i];
        if (s->npending == 4 || i + 1 == len) stream_drain(s, out, cap, &w);
    }
    return w;
}

size_t tok_stream_flush(tok_stream *s, uint8_t *out, size_t cap) {
    size_t w = 0;
    out_put(out, cap, &w, s->pending, (size_t)s->npending);
    s->npending = 0;
    return w;
}
