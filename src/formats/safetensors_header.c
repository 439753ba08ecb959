/* safetensors_header.c: phase 1 of opening a directory (safetensors.h): one
 * shard's header, read with the strict scanner for the common case and with
 * jansson as the general parser behind it (see parse_fast), validated as the
 * reference library does (tensors tile the data section exactly, each span
 * is dtype size x product(shape)), into the parsing thread's arenas. The
 * index over all shards is safetensors.c. */
#include "formats/st_internal.h"
#include "util/mapguard.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this reader assumes a little-endian host"
#endif

static const char *const dtype_names[ST_NDTYPES] = {
    "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"};
/* the same names as little-endian words, for the scanner */
#define DK(a, b, c, d) ((uint32_t)(a) | (uint32_t)(b) << 8 | (uint32_t)(c) << 16 | (uint32_t)(d) << 24)
static const uint32_t dtype_keys[ST_NDTYPES] = {
    DK('F', '6', '4', 0), DK('F', '3', '2', 0), DK('F', '1', '6', 0), DK('B', 'F', '1', '6'), DK('I', '6', '4', 0),
    DK('I', '3', '2', 0), DK('I', '1', '6', 0), DK('I', '8', 0, 0),     DK('U', '8', 0, 0),     DK('B', 'O', 'O', 'L')};
static const size_t dtype_sizes[ST_NDTYPES] = {8, 4, 2, 2, 8, 4, 2, 1, 1, 1};

const char *st_dtype_name(st_dtype d) {
    return (unsigned)d < ST_NDTYPES ? dtype_names[d] : "?";
}
size_t st_dtype_size(st_dtype d) { return (unsigned)d < ST_NDTYPES ? dtype_sizes[d] : 0; }

#define ST_HUGE ((size_t)2 << 20)
#define ST_ARENA_BLOCK ((size_t)256 << 20)

/* A zero-filled mapping of at least len bytes, or p == NULL. Huge pages only
 * for big blocks: each one touched is zeroed whole, which small tables must
 * not pay for. */
static st_block block_map(size_t len) {
    bool huge = len >= 4 * ST_HUGE;
    len = (len + (huge ? ST_HUGE : 4096) - 1) & ~((huge ? ST_HUGE : 4096) - 1);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return (st_block){NULL, 0, false};
#ifdef MADV_HUGEPAGE
    if (huge) madvise(p, len, MADV_HUGEPAGE); /* a hint: without it the tables are merely slower */
#endif
    return (st_block){p, len, true};
}

/* A zero-filled block of at least len bytes (malloc where mapping fails). */
st_block block_new(size_t len) {
    st_block b = block_map(len);
    return b.p ? b : (st_block){xcalloc(1, len), len, false};
}

void block_free(st_block *b) {
    if (b->mapped) munmap(b->p, b->len);
    else free(b->p);
    b->p = NULL;
}

static void arena_push(st_arena *a, st_block blk) {
    if (a->nb == a->capb) a->b = xrealloc_array(a->b, a->capb = a->capb ? 2 * a->capb : 4, sizeof *a->b);
    a->b[a->nb++] = blk;
}

/* need contiguous bytes at the top of the arena (not yet taken). */
static void *arena_room(st_arena *a, size_t need) {
    if (a->left >= need) return a->top;
    /* room for the shards still to come (a guess: sizes vary), so that one
     * open makes few blocks; reserving costs address space, not memory */
    size_t want = need;
    if (a->grain > 1) want = need < ST_ARENA_BLOCK / a->grain ? need * a->grain : ST_ARENA_BLOCK;
    /* where address space is scarce (strict overcommit), just what is needed */
    st_block blk = want > need ? block_map(want) : (st_block){NULL, 0, false};
    if (!blk.p) blk = block_new(need);
    arena_push(a, blk);
    a->top = blk.p;
    a->left = blk.len;
    return a->top;
}

static void arena_take(st_arena *a, size_t n) {
    n = (n + 63) & ~(size_t)63;
    if (n > a->left) n = a->left;
    a->top += n;
    a->left -= n;
    a->used += n;
}

/* Moves every block of from into to (which then frees them). */
static void arena_move(st_arena *to, st_arena *from) {
    for (size_t i = 0; i < from->nb; i++) arena_push(to, from->b[i]);
    to->used += from->used;
    free(from->b);
    from->b = NULL;
    from->nb = from->capb = from->left = from->used = 0;
    from->top = NULL;
}

static void arena_free(st_arena *a) {
    for (size_t i = 0; i < a->nb; i++) block_free(&a->b[i]);
    free(a->b);
    memset(a, 0, sizeof *a);
}


void shard_parse_free(shard_parse *p) {
    if (p->meta) json_decref(p->meta);
    memset(p, 0, sizeof *p);
}

/* The shortest tensor entry, "":{"dtype":"U8","shape":[],"data_offsets":[0,0]}
 * and its comma, is 50 bytes: no header of hlen bytes holds more than
 * hlen / 49 + 1 tensors, whichever parser reads it. */
static size_t max_tensors(size_t hlen) { return hlen / 49 + 1; }

/* Resets p for a fresh parse of a header of hlen bytes (keeps no tensors). */
static void shard_parse_init(shard_parse *p, parse_mem *m, size_t hlen) {
    shard_parse_free(p);
    p->cap = max_tensors(hlen);
    p->t = arena_room(&m->t, p->cap * sizeof *p->t);
    p->hash = arena_room(&m->h, p->cap * sizeof *p->hash);
    /* every name is a JSON string of the header, so the names fit in hlen */
    p->names = arena_room(&m->names, hlen + 1);
}

/* The parse succeeded: what it used of the arenas is now taken. */
static void shard_parse_keep(shard_parse *p, parse_mem *m) {
    arena_take(&m->t, p->n * sizeof *p->t);
    arena_take(&m->h, p->n * sizeof *p->hash);
    arena_take(&m->names, p->names_used);
}

void parse_mem_move(parse_mem *to, parse_mem *from) {
    arena_move(&to->t, &from->t);
    arena_move(&to->h, &from->h);
    arena_move(&to->names, &from->names);
}

void parse_mem_free(parse_mem *m) {
    arena_free(&m->t);
    arena_free(&m->h);
    arena_free(&m->names);
}

static int cmp_offset(const void *a, const void *b) {
    const st_tensor *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Validates one tensor entry and appends it. Both parsers end here, so a
 * header gets the same checks and messages whichever parser read it.
 * name is already in the arena; rank may exceed ST_MAX_RANK (then refused). */
static int add_tensor(shard_parse *out, const hdr_ctx *c, const char *name, size_t nlen, const char *dtype,
                      size_t dtlen, const uint64_t *shape, size_t rank, uint64_t b0, uint64_t b1,
                      k3_err *err) {
    int d = -1;
    if (dtlen >= 2 && dtlen <= 4) { /* every dtype name is 2..4 bytes: compare as one word */
        uint32_t key = 0;
        for (size_t i = 0; i < dtlen; i++) key |= (uint32_t)(unsigned char)dtype[i] << (8 * i);
        for (int i = 0; i < ST_NDTYPES && d < 0; i++)
            if (dtype_keys[i] == key) d = i;
    }
    if (d < 0)
        return k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': unknown dtype '%.*s'", c->fname, name,
                       (int)(dtlen > 64 ? 64 : dtlen), dtype);
    if (rank > ST_MAX_RANK)
        return k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': rank %zu exceeds %d", c->fname, name, rank,
                       ST_MAX_RANK);
    uint64_t numel = 1, nbytes = 0;
    bool ovf = false;
    for (size_t i = 0; i < rank; i++) {
        ovf |= __builtin_mul_overflow(numel, shape[i], &numel);
        ovf |= shape[i] > (uint64_t)INT64_MAX;
    }
    if (ovf || numel > (uint64_t)INT64_MAX || __builtin_mul_overflow(numel, (uint64_t)dtype_sizes[d], &nbytes))
        return k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': shape overflows", c->fname, name);
    if (b1 < b0)
        return k3_fail(err, K3_EXIT_DATA,
                       "%s: tensor '%s': data_offsets must be [begin, end] with 0 <= begin <= end", c->fname,
                       name);
    if (b1 - b0 != nbytes)
        return k3_fail(err, K3_EXIT_DATA,
                       "%s: tensor '%s': data_offsets span %llu bytes but %s x %llu elements needs %llu",
                       c->fname, name, (unsigned long long)(b1 - b0), dtype_names[d],
                       (unsigned long long)numel, (unsigned long long)nbytes);
    if (b1 > c->data_len)
        return k3_fail(err, K3_EXIT_DATA,
                       "%s: tensor '%s': data_offsets end %llu is past the data section (%llu bytes; truncated file?)",
                       c->fname, name, (unsigned long long)b1, (unsigned long long)c->data_len);
    if (out->n == out->cap) /* cannot happen (see max_tensors) */
        return k3_fail(err, K3_EXIT_DATA, "%s: more tensors than the header can hold", c->fname);
    out->hash[out->n] = hash_n(name, nlen);
    st_tensor *t = &out->t[out->n++];
    *t = (st_tensor){.name = name, .dtype = (st_dtype)d, .rank = (int)rank, .numel = (int64_t)numel,
                     .shard = c->shard, .offset = c->data_start + b0, .nbytes = nbytes};
    for (size_t i = 0; i < rank; i++) t->shape[i] = (int64_t)shape[i];
    return K3_OK;
}

static char *arena_put(shard_parse *out, const char *s, size_t n) {
    char *d = out->names + out->names_used;
    memcpy(d, s, n);
    d[n] = 0;
    out->names_used += n + 1;
    return d;
}

/* -- the fast path: a strict scanner for the shape every safetensors writer
 * emits (ASCII names without escapes, non-negative integers). It accepts a
 * subset of JSON and reads it exactly as jansson would; on anything outside
 * that subset it answers BAIL and the header is parsed again by jansson. The
 * fuzzer (fuzz/fuzz_safetensors.c) checks that both parsers agree. jansson
 * alone reads ~50 MB/s, too slow for the release's 75 MB of headers. */
/* One tensor entry as read from the header. */
typedef struct {
    const char *k, *dt;
    size_t kn, dtn, rank;
    uint64_t shape[ST_MAX_RANK], b0, b1;
} hdr_entry;

/* The entry exactly as writers emit it, without whitespace and with the
 * fields in the usual order:
 *   "name":{"dtype":"BF16","shape":[12288,7168],"data_offsets":[b,e]}
 * matched literally. The position after it, or NULL for anything else, which
 * the token scanner (same grammar, any spacing and order) then reads. */
static inline const char *compact_entry(const char *p, const char *e, hdr_entry *en) {
    if (p >= e || *p != '"') return NULL;
    const char *q = plain_str_end(p + 1, e);
    if (!q) return NULL;
    en->k = p + 1;
    en->kn = (size_t)(q - en->k);
    p = q + 1;
    if (!LIT_AT(p, e, ":{\"dtype\":\"")) return NULL;
    p += 11;
    if (!(q = plain_str_end(p, e))) return NULL;
    en->dt = p;
    en->dtn = (size_t)(q - p);
    p = q + 1;
    if (!LIT_AT(p, e, ",\"shape\":[")) return NULL;
    p += 10;
    size_t r = 0;
    if (p < e && *p == ']') p++;
    else
        for (;;) {
            uint64_t x;
            if (!(p = num_compact(p, e, &x))) return NULL;
            if (r < ST_MAX_RANK) en->shape[r] = x;
            r++;
            if (p < e && *p == ',') p++;
            else if (p < e && *p == ']') {
                p++;
                break;
            } else
                return NULL;
        }
    en->rank = r;
    if (!LIT_AT(p, e, ",\"data_offsets\":[")) return NULL;
    p += 17;
    if (!(p = num_compact(p, e, &en->b0)) || p >= e || *p != ',' || !(p = num_compact(p + 1, e, &en->b1)) ||
        !LIT_AT(p, e, "]}"))
        return NULL;
    return p + 2;
}

static int parse_fast(const char *json, size_t len, const hdr_ctx *c, shard_parse *out, k3_err *err) {
    scan s = {json, json + len};
    if (!sk_ch(&s, '{')) return BAIL;
    if (sk_ch(&s, '}')) goto end;
    do {
        hdr_entry en;
        sk_ws(&s);
        const char *np = compact_entry(s.p, s.e, &en);
        if (np && !key_is(en.k, en.kn, "__metadata__")) {
            s.p = np;
            goto add;
        }
        const char *k;
        size_t kn;
        if (!sk_str(&s, &k, &kn) || !sk_ch(&s, ':')) return BAIL;
        if (key_is(k, kn, "__metadata__")) {
            if (out->meta || !sk_ch(&s, '{')) return BAIL;
            out->meta = json_object();
            if (sk_ch(&s, '}')) continue;
            do {
                const char *mk, *mv;
                size_t mkn, mvn;
                if (!sk_str(&s, &mk, &mkn) || !sk_ch(&s, ':') || !sk_str(&s, &mv, &mvn)) return BAIL;
                char *ks = arena_put(out, mk, mkn);
                json_t *vs = json_stringn(mv, mvn);
                bool dup = json_object_get(out->meta, ks) != NULL;
                out->names_used -= mkn + 1; /* the key was only needed as a C string */
                if (dup || !vs) {
                    json_decref(vs);
                    return BAIL;
                }
                json_object_set_new(out->meta, ks, vs);
            } while (sk_ch(&s, ','));
            if (!sk_ch(&s, '}')) return BAIL;
            continue;
        }
        en.k = k;
        en.kn = kn;
        en.dt = NULL;
        en.dtn = en.rank = 0;
        size_t noff = 0;
        uint64_t offs[2];
        bool have_s = false, have_o = false;
        if (!sk_ch(&s, '{')) return BAIL;
        do {
            const char *f;
            size_t fn;
            if (!sk_str(&s, &f, &fn) || !sk_ch(&s, ':')) return BAIL;
            if (key_is(f, fn, "dtype")) {
                if (en.dt || !sk_str(&s, &en.dt, &en.dtn)) return BAIL;
            } else if (key_is(f, fn, "shape")) {
                if (have_s || !sk_uints(&s, en.shape, ST_MAX_RANK, &en.rank)) return BAIL;
                have_s = true;
            } else if (key_is(f, fn, "data_offsets")) {
                if (have_o || !sk_uints(&s, offs, 2, &noff) || noff != 2) return BAIL;
                have_o = true;
            } else {
                return BAIL;
            }
        } while (sk_ch(&s, ','));
        if (!sk_ch(&s, '}') || !en.dt || !have_s || !have_o) return BAIL;
        en.b0 = offs[0];
        en.b1 = offs[1];
    add:
        if (en.rank > ST_MAX_RANK) en.rank = ST_MAX_RANK + 1; /* refused by add_tensor */
        char *name = arena_put(out, en.k, en.kn);
        int rc = add_tensor(out, c, name, en.kn, en.dt, en.dtn, en.shape, en.rank, en.b0, en.b1, err);
        if (rc) return rc;
    } while (sk_ch(&s, ','));
    if (!sk_ch(&s, '}')) return BAIL;
end:
    sk_ws(&s);
    return s.p == s.e ? K3_OK : BAIL;
}

/* A JSON integer that is >= 0, as uint64. */
bool get_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v)) return false;
    json_int_t i = json_integer_value(v);
    if (i < 0) return false;
    *out = (uint64_t)i;
    return true;
}

/* -- the general path: jansson, for every header the scanner declines. */
static int parse_jansson(const char *json, size_t len, const hdr_ctx *c, shard_parse *out, k3_err *err) {
    const char *fname = c->fname;
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return k3_fail(err, K3_EXIT_DATA, "%s: bad safetensors header: %s (at header byte %d)", fname, je.text,
                       je.position);
    if (!json_is_object(root)) {
        json_decref(root);
        return k3_fail(err, K3_EXIT_DATA, "%s: bad safetensors header: not a JSON object", fname);
    }
    int rc = K3_OK;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) {
            const char *mk;
            json_t *mv;
            if (!json_is_object(val)) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: __metadata__ is not an object", fname);
                goto done;
            }
            json_object_foreach(val, mk, mv) if (!json_is_string(mv)) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: __metadata__ value '%s' is not a string", fname, mk);
                goto done;
            }
            out->meta = json_incref(val);
            continue;
        }
        size_t klen = strlen(key);
        char *name = arena_put(out, key, klen);
        if (!json_is_object(val)) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': entry is not an object", fname, name);
            goto done;
        }
        json_t *jd = NULL, *js = NULL, *jo = NULL;
        const char *k2;
        json_t *v2;
        json_object_foreach(val, k2, v2) {
            if (!strcmp(k2, "dtype")) jd = v2;
            else if (!strcmp(k2, "shape")) js = v2;
            else if (!strcmp(k2, "data_offsets")) jo = v2;
            else {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': unexpected key '%s'", fname, name, k2);
                goto done;
            }
        }
        if (!json_is_string(jd) || !json_is_array(js) || !json_is_array(jo)) {
            rc = k3_fail(err, K3_EXIT_DATA,
                         "%s: tensor '%s': needs string dtype, array shape and array data_offsets", fname, name);
            goto done;
        }
        size_t rank = json_array_size(js);
        uint64_t shape[ST_MAX_RANK], b0, b1;
        for (size_t i = 0; i < rank && i < ST_MAX_RANK; i++)
            if (!get_u64(json_array_get(js, i), &shape[i])) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': shape[%zu] is not a non-negative integer",
                             fname, name, i);
                goto done;
            }
        if (json_array_size(jo) != 2 || !get_u64(json_array_get(jo, 0), &b0) ||
            !get_u64(json_array_get(jo, 1), &b1)) {
            rc = k3_fail(err, K3_EXIT_DATA,
                         "%s: tensor '%s': data_offsets must be [begin, end] with 0 <= begin <= end", fname, name);
            goto done;
        }
        if ((rc = add_tensor(out, c, name, klen, json_string_value(jd), json_string_length(jd), shape,
                             rank, b0, b1, err)))
            goto done;
    }
done:
    json_decref(root);
    return rc;
}

/* After either parser: sort by offset, demand that the spans tile the data
 * section exactly, hash the names and refuse duplicates within the file. */
static int finish_shard(shard_parse *out, const hdr_ctx *c, k3_err *err) {
    const char *fname = c->fname;
    /* writers emit the header in offset order: sort only when it is not */
    bool sorted = true;
    for (size_t i = 1; i < out->n && sorted; i++) sorted = cmp_offset(&out->t[i - 1], &out->t[i]) <= 0;
    if (!sorted) {
        qsort(out->t, out->n, sizeof *out->t, cmp_offset);
        for (size_t i = 0; i < out->n; i++) out->hash[i] = hash_name(out->t[i].name);
    }
    uint64_t end = c->data_start;
    const char *prev = NULL;
    for (size_t i = 0; i < out->n; i++) {
        st_tensor *t = &out->t[i];
        if (t->nbytes == 0) continue; /* an empty tensor occupies nothing */
        if (t->offset < end)
            return k3_fail(err, K3_EXIT_DATA, "%s: tensors '%s' and '%s' overlap", fname, prev ? prev : "?",
                           t->name);
        if (t->offset > end)
            return k3_fail(err, K3_EXIT_DATA, "%s: %llu unused bytes before tensor '%s' (gap in data section)",
                           fname, (unsigned long long)(t->offset - end), t->name);
        end = t->offset + t->nbytes;
        prev = t->name;
    }
    if (end != c->data_start + c->data_len)
        return k3_fail(err, K3_EXIT_DATA, "%s: %llu trailing bytes after the last tensor", fname,
                       (unsigned long long)(c->data_start + c->data_len - end));
    size_t cap = 16;
    while (cap < 2 * out->n) cap *= 2;
    uint32_t *slots = xcalloc(cap, sizeof *slots);
    int rc = K3_OK;
    for (size_t i = 0; i < out->n && rc == K3_OK; i++) {
        uint64_t h = out->hash[i];
        for (size_t sl = h & (cap - 1);; sl = (sl + 1) & (cap - 1)) {
            if (!slots[sl]) {
                slots[sl] = (uint32_t)(i + 1);
                break;
            }
            size_t j = slots[sl] - 1;
            if (out->hash[j] == h && strcmp(out->t[j].name, out->t[i].name) == 0) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: bad safetensors header: duplicate tensor '%s'", fname,
                             out->t[i].name);
                break;
            }
        }
    }
    free(slots);
    return rc;
}

/* Parses and validates the header text json[0..len). use_jansson skips the
 * fast scanner; *fast (may be NULL) tells which parser produced the result. */
static int parse_header(const char *json, size_t len, const hdr_ctx *c, bool use_jansson, parse_mem *m,
                        shard_parse *out, bool *fast, k3_err *err) {
    memset(out, 0, sizeof *out);
    shard_parse_init(out, m, len);
    int rc = use_jansson ? BAIL : parse_fast(json, len, c, out, err);
    if (fast) *fast = rc != BAIL;
    if (rc == BAIL) {
        shard_parse_init(out, m, len);
        rc = parse_jansson(json, len, c, out, err);
    }
    if (rc == K3_OK) rc = finish_shard(out, c, err);
    if (rc) shard_parse_free(out);
    else shard_parse_keep(out, m);
    return rc;
}

bool force_jansson(void) {
    const char *e = getenv("K3_ST_JANSSON");
    return e && strcmp(e, "1") == 0;
}

/* Reads exactly len bytes at off; K3_EXIT_DATA on early end of file. */
/* buf/cap: the calling thread's reusable header buffer (fresh large
 * allocations would be page-faulted in for every shard). */
int parse_file(const char *path, int shard, st_shard *sh, parse_mem *m, shard_parse *out, char **bufp,
                      size_t *capp, k3_err *err) {
    memset(out, 0, sizeof *out);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", path, strerror(errno));
    struct stat stt;
    int rc = K3_OK;
    if (fstat(fd, &stt) != 0) {
        rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot stat: %s", path, strerror(errno));
        goto out;
    }
    uint64_t fsize = (uint64_t)stt.st_size;
    if (fsize < 8) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: file is %llu bytes, too short for the 8-byte header length",
                     path, (unsigned long long)fsize);
        goto out;
    }
    unsigned char lenb[8];
    if ((rc = k3_dio_pread(fd, lenb, 0, 8, path, err))) goto out;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lenb[i];
    if (hlen > fsize - 8) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: header length %llu runs past the end of the file (%llu bytes)",
                     path, (unsigned long long)hlen, (unsigned long long)fsize);
        goto out;
    }
    if (hlen < 2 || hlen > ST_MAX_HEADER) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: implausible header length %llu", path,
                     (unsigned long long)hlen);
        goto out;
    }
    sh->file_size = fsize;
    sh->data_start = 8 + hlen;
    hdr_ctx c = {path, shard, 8 + hlen, fsize - 8 - hlen};
    /* Shard headers are read, never mapped: a streaming run promises to map
     * no shard before it has checked its memory plan (tests/cli/test_stream.sh).
     * The buffer is reused across a thread's shards. */
    if (*capp < hlen) {
        free(*bufp);
        *bufp = xmalloc((size_t)hlen);
        *capp = (size_t)hlen;
    }
    char *buf = *bufp;
    if ((rc = k3_dio_pread(fd, buf, 8, hlen, path, err))) goto out;
    rc = parse_header(buf, (size_t)hlen, &c, force_jansson(), m, out, NULL, err);
    if (rc == K3_OK) sh->ntensors = (int)out->n;
out:
    close(fd);
    return rc;
}

int st_check_buffer(const void *file, size_t len, const char *name, bool use_jansson, st_buffer_info *info,
                    k3_err *err) {
    const unsigned char *b = file;
    if (info) memset(info, 0, sizeof *info);
    if (len < 8)
        return k3_fail(err, K3_EXIT_DATA, "%s: file is %zu bytes, too short for the 8-byte header length",
                       name, len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i];
    if (hlen > len - 8)
        return k3_fail(err, K3_EXIT_DATA, "%s: header length %llu runs past the end of the file (%zu bytes)",
                       name, (unsigned long long)hlen, len);
    if (hlen < 2 || hlen > ST_MAX_HEADER)
        return k3_fail(err, K3_EXIT_DATA, "%s: implausible header length %llu", name,
                       (unsigned long long)hlen);
    shard_parse p;
    hdr_ctx c = {name, 0, 8 + hlen, len - 8 - hlen};
    bool fast = false;
    parse_mem m = {0};
    int rc = parse_header((const char *)b + 8, (size_t)hlen, &c, use_jansson, &m, &p, &fast, err);
    if (info) info->fast = fast;
    if (rc) {
        parse_mem_free(&m);
        return rc;
    }
    if (info) {
        /* a digest of everything the index keeps, in offset order */
        uint64_t h = 0x9e3779b97f4a7c15ull;
        for (size_t i = 0; i < p.n; i++) {
            const st_tensor *t = &p.t[i];
            uint64_t v[4 + ST_MAX_RANK] = {p.hash[i], (uint64_t)t->dtype, (uint64_t)t->rank, t->offset};
            for (int r = 0; r < t->rank; r++) v[4 + r] = (uint64_t)t->shape[r];
            for (int r = 0; r < 4 + t->rank; r++) h = (h ^ v[r]) * 0x100000001b3ull;
        }
        info->ntensors = p.n;
        info->digest = h;
        const char *k;
        json_t *v;
        if (p.meta) json_object_foreach(p.meta, k, v) {
            h = (h ^ hash_name(k)) * 0x100000001b3ull;
            h = (h ^ hash_name(json_string_value(v))) * 0x100000001b3ull;
        }
        info->digest = h;
        info->nmeta = p.meta ? json_object_size(p.meta) : 0;
    }
    shard_parse_free(&p);
    parse_mem_free(&m);
    return K3_OK;
}

