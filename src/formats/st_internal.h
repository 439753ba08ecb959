/* st_internal.h (src/formats only): what the header parser
 * (safetensors_header.c) and the index (safetensors.c) share: the limits, the
 * name hash, the arenas the tables live in, one shard's parse, and the strict
 * JSON scanner both the header and the index file are read with. */
#ifndef K3_FORMATS_ST_INTERNAL_H
#define K3_FORMATS_ST_INTERNAL_H

#include "formats/safetensors.h"
#include "util/dio.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* The largest header we accept. Real K3 shards carry ~0.8 MB of header; the
 * cap only stops a corrupt length from asking for gigabytes. */
#define ST_MAX_HEADER (256u << 20)

/* Name hash, eight bytes at a time: it runs over ~35 MB of names (twice,
 * with the index file) when the release is opened. A multiply carries each
 * word's bits upwards, the rotate brings the high ones back down; a name of
 * 8 or more bytes ends with its last 8 bytes (overlapping the previous word),
 * a shorter one is read bytewise. */
static inline uint64_t hash_n(const char *s, size_t n) {
    const uint64_t K = 0xff51afd7ed558ccdull;
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (n * K), w = 0;
    if (n >= 8) {
        const char *last = s + n - 8;
        for (; s < last; s += 8) {
            memcpy(&w, s, 8);
            h = (h ^ w) * K;
            h = h << 31 | h >> 33;
        }
        memcpy(&w, last, 8);
    } else
        for (size_t i = 0; i < n; i++) w |= (uint64_t)(unsigned char)s[i] << (8 * i);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    h *= K;
    return h ^ (h >> 32);
}
static inline uint64_t hash_name(const char *s) { return hash_n(s, strlen(s)); }

/* ---- memory for the tables -------------------------------------------- */

/* The release's tables come to ~100 MB (tensor records, names, hashes, the
 * name table). From malloc they are faulted in 4 KiB at a time, which cost a
 * third of an open; anonymous mappings that ask for transparent huge pages
 * fault 2 MiB at a time. An arena hands out the top of its current block
 * (reserved, not committed: pages never touched cost nothing) and only
 * advances by what a shard really used, so what is touched stays packed. */typedef struct {
    void *p;
    size_t len;
    bool mapped;       /* mmap (else malloc) */
} st_block;

typedef struct {
    st_block *b;
    size_t nb, capb;
    char *top;         /* free room of the last block */
    size_t left;
    size_t grain;      /* reserve blocks for this many requests like the current one (0: 1) */
    size_t used;       /* bytes handed out and kept: what the tables touch (st_footprint) */
} st_arena;

/* One parsing thread's arenas: tensor records, name hashes, names. */
typedef struct {
    st_arena t, h, names;
} parse_mem;

typedef struct {
    st_tensor *t;      /* room in mem->t */
    uint64_t *hash;    /* name hashes, parallel to t */
    size_t n, cap;
    char *names;       /* room in mem->names holding every name of this shard */
    size_t names_used;
    json_t *meta;      /* __metadata__ object or NULL */
} shard_parse;

/* What the validator needs to know about the file. */
typedef struct {
    const char *fname;
    int shard;
    uint64_t data_start, data_len;
} hdr_ctx;

/* the strict scanner (its fallback is jansson) */
#define BAIL (-1)

typedef struct {
    const char *p, *e;
} scan;

static inline __attribute__((always_inline)) void sk_ws(scan *s) {
    /* the compact form has no whitespace: one compare in the usual case; the
     * mask has the bits of ' ', '\n', '\r' and '\t' */
    while (s->p < s->e && (unsigned char)*s->p <= ' ' && ((1ull << (unsigned char)*s->p) & 0x100002600ull)) s->p++;
}
static inline __attribute__((always_inline)) bool sk_ch(scan *s, char c) {
    sk_ws(s);
    if (s->p < s->e && *s->p == c) {
        s->p++;
        return true;
    }
    return false;
}
/* The closing quote of a plain string whose contents start at q, or NULL when
 * a byte before it is a backslash, a control character or outside printable
 * ASCII, or the text ends first. SSE2 (every x86-64 has it) looks at 16 bytes
 * per step; the bytewise loop is the definition and handles the tail. */
static inline const char *plain_str_end(const char *q, const char *e) {
#ifdef __SSE2__
    const __m128i quote = _mm_set1_epi8('"'), bsl = _mm_set1_epi8('\\'), sp = _mm_set1_epi8(0x20),
                  del = _mm_set1_epi8(0x7f);
    while (e - q >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(const void *)q);
        /* signed compare: bytes >= 0x80 are negative, so "< 0x20" flags them too */
        __m128i stop = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, bsl)),
                                    _mm_or_si128(_mm_cmplt_epi8(v, sp), _mm_cmpeq_epi8(v, del)));
        unsigned m = (unsigned)_mm_movemask_epi8(stop);
        if (m) {
            q += __builtin_ctz(m);
            return *q == '"' ? q : NULL;
        }
        q += 16;
    }
#endif
    for (; q < e; q++) {
        unsigned char ch = (unsigned char)*q;
        if (ch == '"') return q;
        if (ch < 0x20 || ch >= 0x7f || ch == '\\') return NULL;
    }
    return NULL;
}
/* A string of printable ASCII without escapes; *b, *n get its contents. */
static inline bool sk_str(scan *s, const char **b, size_t *n) {
    sk_ws(s);
    if (s->p >= s->e || *s->p != '"') return false;
    const char *q = plain_str_end(s->p + 1, s->e);
    if (!q) return false;
    *b = s->p + 1;
    *n = (size_t)(q - *b);
    s->p = q + 1;
    return true;
}
/* How many of the 8 bytes of w (in memory order) are ASCII digits before the
 * first one that is not. A byte is a digit iff its high nibble is 3 and
 * adding 6 keeps it so; a carry out of a byte only comes from a byte >= 0xfa,
 * itself a non-digit, and only disturbs the bytes after it. */
static inline unsigned digit_run8(uint64_t w) {
    const uint64_t hi = 0xF0F0F0F0F0F0F0F0ull, three = 0x3030303030303030ull;
    uint64_t nd = ((w & hi) ^ three) | (((w + 0x0606060606060606ull) & hi) ^ three);
    return nd ? (unsigned)__builtin_ctzll(nd) / 8 : 8;
}
/* The value of 8 ASCII digits in w (first digit in the lowest byte); bytes
 * that are 0 count as leading zeros. */
static inline uint64_t swar8(uint64_t w) {
    w = ((w & 0x0F0F0F0F0F0F0F0Full) * 2561) >> 8;
    w = ((w & 0x00FF00FF00FF00FFull) * 6553601) >> 16;
    return ((w & 0x0000FFFF0000FFFFull) * 42949672960001ull) >> 32;
}
static const uint64_t pow10_8[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000};
/* A non-negative JSON integer of at most 18 digits (fits int64 either way)
 * starting exactly at q: the position after it, or NULL. */
static inline const char *num_at(const char *q, const char *e, uint64_t *v) {
    const char *b = q;
    uint64_t x = 0;
    /* eight bytes at a time while eight remain; the bytewise loop finishes */
    while (e - q >= 8 && q - b <= 18) {
        uint64_t w;
        memcpy(&w, q, 8);
        unsigned L = digit_run8(w);
        if (L == 0) break;
        x = x * pow10_8[L] + swar8(w << (8 * (8 - L)));
        q += L;
        if (L < 8) break;
    }
    while (q < e && *q >= '0' && *q <= '9' && q - b < 19) x = x * 10 + (uint64_t)(*q++ - '0');
    size_t nd = (size_t)(q - b);
    if (nd == 0 || nd > 18 || (nd > 1 && *b == '0')) return NULL;
    if (q < e && (*q == '.' || *q == 'e' || *q == 'E' || (*q >= '0' && *q <= '9'))) return NULL;
    *v = x;
    return q;
}
/* num_at for the compact entry, where the caller then demands ',' or ']'
 * (so the character after the digits needs no check of its own): one or two
 * words of digits where 16 bytes remain, num_at otherwise. */
static __attribute__((noinline, unused)) const char *num_slow(const char *q, const char *e, uint64_t *v) {
    return num_at(q, e, v);
}
static inline __attribute__((always_inline)) const char *num_compact(const char *q, const char *e, uint64_t *v) {
    if (e - q < 16) return num_slow(q, e, v);
    uint64_t w, w2;
    memcpy(&w, q, 8);
    unsigned L = digit_run8(w);
    if (L == 0 || (L > 1 && (w & 0xff) == '0')) return NULL;
    if (L < 8) {
        *v = swar8(w << (8 * (8 - L)));
        return q + L;
    }
    memcpy(&w2, q + 8, 8);
    unsigned L2 = digit_run8(w2);
    if (L2 == 8) return num_slow(q, e, v); /* 16 digits or more: rare */
    *v = L2 ? swar8(w) * pow10_8[L2] + swar8(w2 << (8 * (8 - L2))) : swar8(w);
    return q + 8 + L2;
}
static inline bool sk_uint(scan *s, uint64_t *v) {
    sk_ws(s);
    const char *q = num_at(s->p, s->e, v);
    if (!q) return false;
    s->p = q;
    return true;
}
/* [u, u, ...] storing at most max values; *n gets the full count. */
static inline bool sk_uints(scan *s, uint64_t *v, size_t max, size_t *n) {
    *n = 0;
    if (!sk_ch(s, '[')) return false;
    if (sk_ch(s, ']')) return true;
    do {
        uint64_t x;
        if (!sk_uint(s, &x)) return false;
        if (*n < max) v[*n] = x;
        (*n)++;
    } while (sk_ch(s, ','));
    return sk_ch(s, ']');
}
#define key_is(k, n, lit) ((n) == sizeof(lit) - 1 && memcmp((k), (lit), sizeof(lit) - 1) == 0)
/* The literal lit at p (and inside the text). */
#define LIT_AT(p, e, lit) ((size_t)((e) - (p)) >= sizeof(lit) - 1 && memcmp((p), (lit), sizeof(lit) - 1) == 0)


/* Table memory (safetensors_header.c). */
st_block block_new(size_t len);
void block_free(st_block *b);
void parse_mem_move(parse_mem *to, parse_mem *from);
void parse_mem_free(parse_mem *m);
void shard_parse_free(shard_parse *p);
/* Phase 1 on one file: its header parsed and validated into out (in m). */
int parse_file(const char *path, int shard, st_shard *sh, parse_mem *m, shard_parse *out, char **bufp,
               size_t *capp, k3_err *err);
bool get_u64(const json_t *v, uint64_t *out);
bool force_jansson(void);

#endif
