/* safetensors.c: see safetensors.h; phase 1 (one header) is safetensors_header.c.
 *
 * Opening runs in three phases. Phase 1 parses every shard's header on its
 * own (OpenMP, one shard per task) into a per-shard table sorted by offset,
 * in the parsing thread's arenas; nothing else is shared between tasks, so
 * errors are kept per shard and the first one in shard order is reported,
 * whatever the thread count. Phase 2 is linear: it links the tables into one
 * order and builds an open-addressing hash of the names (which also finds
 * duplicates across shards). Phase 3 cross-checks the optional
 * model.safetensors.index.json against that table (index_check_fast, with the
 * general index_load + check_index behind it).
 *
 * Headers are read by a strict scanner for the common case, with jansson as
 * the general parser behind it (see parse_fast).
 *
 * The validation follows the safetensors format as the reference library
 * enforces it: tensors tile the data section exactly (no overlap, no gap, no
 * trailing bytes) and each span equals dtype size x product(shape). */
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

/* ---- the index --------------------------------------------------------- */

typedef struct {
    st_tensor *t;          /* this shard's tensors, offset order (in ix->mem) */
    json_t *meta;
    /* lazily opened; guarded by st_index.lock */
    int fd;                /* buffered (st_data maps it); -1 until opened */
    int fd_direct;         /* st_pread's, O_DIRECT unless refused (util/dio.h); -1 until opened */
    const unsigned char *map;
} shard_priv;

/* One hash slot: the name pointer and hash bits live in the slot so a probe
 * touches one cache line plus the name itself. idx is tensor index + 1. */
typedef struct {
    const char *name;
    uint32_t idx, h32;
} st_slot;

struct st_index {
    int nshards;
    st_shard *shards;
    shard_priv *priv;
    size_t n;
    const st_tensor **tp;  /* every tensor, shard then offset order */
    st_slot *slots;        /* open addressing over the names */
    size_t mask;
    bool direct;           /* st_pread asks for O_DIRECT */
    pthread_mutex_t lock;
    size_t *first;         /* index of each shard's first tensor */
    parse_mem mem;         /* holds every tensor record, hash and name */
    st_block tp_blk, slots_blk;
    int refs;              /* st_open's reference plus each st_retain's */
};

size_t st_count(const st_index *ix) { return ix->n; }

/* An arena's kept bytes, plus, per block, the rest of the page its last
 * record was written into: the kernel faults a huge page (big blocks ask for
 * them, safetensors_header.c) whole. */
static uint64_t arena_footprint(const st_arena *a) {
    uint64_t b = a->used;
    for (size_t i = 0; i < a->nb; i++) b += a->b[i].len >= ((size_t)8 << 20) ? (uint64_t)2 << 20 : 4096;
    return b;
}

uint64_t st_footprint(const st_index *ix) {
    uint64_t b = sizeof *ix + arena_footprint(&ix->mem.t) + arena_footprint(&ix->mem.h) +
                 arena_footprint(&ix->mem.names) + ix->tp_blk.len + ix->slots_blk.len;
    b += (uint64_t)ix->nshards * (sizeof *ix->shards + sizeof *ix->priv + sizeof *ix->first);
    for (int i = 0; i < ix->nshards; i++) b += strlen(ix->shards[i].path) + 1;
    return b;
}
const st_tensor *st_at(const st_index *ix, size_t i) { return i < ix->n ? ix->tp[i] : NULL; }
int st_nshards(const st_index *ix) { return ix->nshards; }
const st_shard *st_shard_at(const st_index *ix, int i) {
    return i >= 0 && i < ix->nshards ? &ix->shards[i] : NULL;
}

/* Index of the tensor named s[0..n), or -1. */
static long find_h(const st_index *ix, const char *s, size_t n, uint64_t h) {
    for (size_t sl = h & ix->mask;; sl = (sl + 1) & ix->mask) {
        const st_slot *e = &ix->slots[sl];
        if (!e->idx) return -1;
        if (e->h32 == (uint32_t)(h >> 32) && strncmp(e->name, s, n) == 0 && e->name[n] == 0)
            return (long)e->idx - 1;
    }
}

static long find_n(const st_index *ix, const char *s, size_t n) { return find_h(ix, s, n, hash_n(s, n)); }

const st_tensor *st_find(const st_index *ix, const char *name) {
    long i = find_n(ix, name, strlen(name));
    return i < 0 ? NULL : ix->tp[i];
}

const char *st_metadata(const st_index *ix, int shard, const char *key) {
    if (shard < 0 || shard >= ix->nshards || !ix->priv[shard].meta) return NULL;
    return json_string_value(json_object_get(ix->priv[shard].meta, key));
}

void st_set_direct(st_index *ix, bool on) { ix->direct = on; }

st_index *st_retain(st_index *ix) {
    if (ix) __atomic_add_fetch(&ix->refs, 1, __ATOMIC_RELAXED);
    return ix;
}

void st_close(st_index *ix) {
    if (!ix || __atomic_sub_fetch(&ix->refs, 1, __ATOMIC_ACQ_REL) > 0) return;
    for (int i = 0; i < ix->nshards; i++) {
        shard_priv *p = &ix->priv[i];
        if (p->map) {
            k3_mapguard_remove(p->map);
            munmap((void *)p->map, ix->shards[i].file_size);
        }
        if (p->fd >= 0) close(p->fd);
        if (p->fd_direct >= 0) close(p->fd_direct);
        if (p->meta) json_decref(p->meta);
        free(ix->shards[i].path);
    }
    pthread_mutex_destroy(&ix->lock);
    free(ix->priv);
    free(ix->shards);
    free(ix->first);
    if (ix->tp_blk.p) block_free(&ix->tp_blk);
    if (ix->slots_blk.p) block_free(&ix->slots_blk);
    parse_mem_free(&ix->mem);
    free(ix);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* Lists the *.safetensors regular files of dir, sorted by name. */
static int list_shards(const char *dir, char ***out, int *n, k3_err *err) {
    DIR *d = opendir(dir);
    if (!d) return k3_fail(err, K3_EXIT_USAGE, "%s: cannot open directory: %s", dir, strerror(errno));
    int cap = 16, cnt = 0;
    char **v = xmalloc_array((size_t)cap, sizeof *v);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.' || !ends_with(e->d_name, ".safetensors")) continue;
        char *p = k3_path_join(dir, e->d_name);
        struct stat st;
        if (stat(p, &st) != 0 || !S_ISREG(st.st_mode)) {
            free(p);
            continue;
        }
        if (cnt == cap) v = xrealloc_array(v, (size_t)(cap *= 2), sizeof *v);
        v[cnt++] = p;
    }
    closedir(d);
    qsort(v, (size_t)cnt, sizeof *v, cmp_str);
    *out = v;
    *n = cnt;
    return K3_OK;
}

static const char *base_name(const char *p) {
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

/* model.safetensors.index.json, read into (name, file) pairs. The scanner
 * above reads the usual shape ({"metadata":{"total_size":N},"weight_map":{..}}
 * with plain ASCII names); anything else goes through jansson. */
typedef struct {
    const char *name, *file;
    size_t nlen, flen;
} wm_entry;

typedef struct {
    char *text;
    size_t maplen;       /* > 0: text is a read-only mapping of this length */
    json_t *root;        /* set when jansson parsed it (the strings live there) */
    wm_entry *e;         /* in blk, sized for the most entries the text can hold */
    st_block blk;
    size_t n, cap;
    bool has_total;
    uint64_t total;
} index_parse;

static void index_parse_free(index_parse *p) {
    if (p->maplen) munmap(p->text, p->maplen);
    else free(p->text);
    if (p->root) json_decref(p->root);
    if (p->blk.p) block_free(&p->blk);
    memset(p, 0, sizeof *p);
}

/* An entry is at least 6 bytes of text ("":"" and a comma), so a text of len
 * bytes holds at most len / 5 + 1 of them, whichever parser reads it. */
static void wm_init(index_parse *p, size_t len) {
    p->cap = len / 5 + 1;
    p->blk = block_new(p->cap * sizeof *p->e);
    p->e = p->blk.p;
}

static void wm_add(index_parse *p, const char *name, size_t nlen, const char *file, size_t flen) {
    if (p->n == p->cap) return; /* cannot happen (see wm_init); the count check then fails */
    p->e[p->n++] = (wm_entry){name, file, nlen, flen};
}

static int index_fast(index_parse *p, size_t len) {
    scan s = {p->text, p->text + len};
    bool seen_meta = false, seen_map = false;
    if (!sk_ch(&s, '{')) return BAIL;
    do {
        const char *k;
        size_t kn;
        if (!sk_str(&s, &k, &kn) || !sk_ch(&s, ':')) return BAIL;
        if (key_is(k, kn, "metadata") && !seen_meta) {
            seen_meta = true;
            if (!sk_ch(&s, '{')) return BAIL;
            if (sk_ch(&s, '}')) continue;
            const char *mk;
            size_t mkn;
            if (!sk_str(&s, &mk, &mkn) || !key_is(mk, mkn, "total_size") || !sk_ch(&s, ':') ||
                !sk_uint(&s, &p->total) || !sk_ch(&s, '}'))
                return BAIL;
            p->has_total = true;
        } else if (key_is(k, kn, "weight_map") && !seen_map) {
            seen_map = true;
            if (!sk_ch(&s, '{')) return BAIL;
            if (sk_ch(&s, '}')) continue;
            do {
                const char *n, *f;
                size_t nn, fn;
                if (!sk_str(&s, &n, &nn) || !sk_ch(&s, ':') || !sk_str(&s, &f, &fn)) return BAIL;
                wm_add(p, n, nn, f, fn);
            } while (sk_ch(&s, ','));
            if (!sk_ch(&s, '}')) return BAIL;
        } else {
            return BAIL;
        }
    } while (sk_ch(&s, ','));
    if (!sk_ch(&s, '}') || !seen_map) return BAIL;
    sk_ws(&s);
    return s.p == s.e ? K3_OK : BAIL;
}

static int index_load(const char *ipath, index_parse *p, k3_err *err) {
    memset(p, 0, sizeof *p);
    size_t len = 0;
    int fd = open(ipath, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", ipath, strerror(e));
    }
    len = (size_t)st.st_size;
    /* the weight map is tens of MB: read it in place (a populated read-only
     * mapping; both parsers take a length), copy only where mapping fails */
    void *map = len ? mmap(NULL, len, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0) : MAP_FAILED;
    int rc = K3_OK;
    if (map != MAP_FAILED) {
        p->text = map;
        p->maplen = len;
    } else {
        p->text = xmalloc(len + 1);
        rc = k3_dio_pread(fd, p->text, 0, len, ipath, err);
        if (rc == K3_OK) p->text[len] = 0;
    }
    close(fd);
    if (rc) return rc;
    wm_init(p, len);
    if (!force_jansson() && index_fast(p, len) == K3_OK) return K3_OK;
    p->n = 0;
    p->has_total = false;
    json_error_t je;
    p->root = json_loadb(p->text, len, JSON_REJECT_DUPLICATES, &je);
    if (!p->root)
        return k3_fail(err, K3_EXIT_DATA, "%s: bad JSON: %s (line %d)", ipath, je.text, je.line);
    json_t *wm = json_object_get(p->root, "weight_map");
    if (!json_is_object(wm)) return k3_fail(err, K3_EXIT_DATA, "%s: no weight_map object", ipath);
    const char *name;
    json_t *v;
    json_object_foreach(wm, name, v) {
        if (!json_is_string(v))
            return k3_fail(err, K3_EXIT_DATA, "%s: weight_map value for '%s' is not a string", ipath, name);
        wm_add(p, name, strlen(name), json_string_value(v), json_string_length(v));
    }
    json_t *ts = json_object_get(json_object_get(p->root, "metadata"), "total_size");
    if (ts) {
        if (!get_u64(ts, &p->total))
            return k3_fail(err, K3_EXIT_DATA, "%s: metadata.total_size is not a non-negative integer", ipath);
        p->has_total = true;
    }
    return K3_OK;
}



/* Shard base names by hash, for the file names of the weight map. */
typedef struct {
    int *slot;
    size_t mask;
} file_table;

static file_table file_table_new(const st_index *ix) {
    size_t cap = 16;
    while (cap < 4 * (size_t)ix->nshards) cap *= 2;
    file_table ft = {xmalloc_array(cap, sizeof(int)), cap - 1};
    for (size_t i = 0; i < cap; i++) ft.slot[i] = -1;
    for (int k = 0; k < ix->nshards; k++) {
        const char *b = base_name(ix->shards[k].path);
        size_t sl = hash_n(b, strlen(b)) & ft.mask;
        while (ft.slot[sl] >= 0) sl = (sl + 1) & ft.mask;
        ft.slot[sl] = k;
    }
    return ft;
}

static int file_shard(const st_index *ix, const file_table *ft, const char *f, size_t n) {
    for (size_t sl = hash_n(f, n) & ft->mask; ft->slot[sl] >= 0; sl = (sl + 1) & ft->mask) {
        const char *b = base_name(ix->shards[ft->slot[sl]].path);
        if (strncmp(b, f, n) == 0 && b[n] == 0) return ft->slot[sl];
    }
    return -1;
}

/* The shard of tensor t: tensors are in shard order, so a binary search of
 * the shards' first indices (a small table that stays in cache) answers
 * without touching the tensor's record. */
static int tensor_shard(const st_index *ix, long t) {
    int lo = 0, hi = ix->nshards - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (ix->first[mid] <= (size_t)t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Cross-checks the index file against the shards: every name it maps must be
 * in the shard it names, no name twice, and as many names as tensors (so the
 * two name sets are equal); metadata.total_size, when present, must equal
 * the tensor bytes.
 *
 * The lookups are independent, so they run in parallel and only say whether
 * all is well; when anything is not, a serial walk in file order finds the
 * first problem, so the message never depends on the thread count. */
static int check_index(st_index *ix, const index_parse *p, const char *ipath, k3_err *err) {
    st_block seen_blk = block_new(ix->n ? ix->n : 1);
    unsigned char *seen = seen_blk.p;
    file_table ft = file_table_new(ix);
    long nent = (long)p->n;
    int bad = p->n != ix->n;
    /* Lookups go in batches: hash a batch and prefetch its slots, then
     * prefetch the names those slots point to, then compare. The table is far
     * larger than the caches, so this hides most of the memory latency. */
    long nbatch = bad ? 0 : (nent + 15) / 16;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (long bi = 0; bi < nbatch; bi++) {
        long i0 = bi * 16, i1 = i0 + 16 < nent ? i0 + 16 : nent;
        uint64_t h[16];
        for (long i = i0; i < i1; i++) {
            h[i - i0] = hash_n(p->e[i].name, p->e[i].nlen);
            __builtin_prefetch(&ix->slots[h[i - i0] & ix->mask]);
        }
        for (long i = i0; i < i1; i++) __builtin_prefetch(ix->slots[h[i - i0] & ix->mask].name);
        int s = -1;
        for (long i = i0; i < i1; i++) {
            const wm_entry *e = &p->e[i];
            /* consecutive entries usually name the same shard */
            if (!(i > i0 && e->flen == p->e[i - 1].flen && memcmp(e->file, p->e[i - 1].file, e->flen) == 0))
                s = file_shard(ix, &ft, e->file, e->flen);
            long t = s < 0 ? -1 : find_h(ix, e->name, e->nlen, h[i - i0]);
            /* a tensor listed twice is seen twice (the byte may wrap later:
             * bad is set by then) */
            if (t < 0 || tensor_shard(ix, t) != s || __atomic_fetch_add(&seen[t], 1, __ATOMIC_RELAXED) != 0)
                bad = 1;
        }
    }
    int rc = K3_OK;
    if (bad) {
        /* something is wrong: find the first problem in file order */
        memset(seen, 0, ix->n);
        for (size_t i = 0; i < p->n && rc == K3_OK; i++) {
            const wm_entry *e = &p->e[i];
            int s = file_shard(ix, &ft, e->file, e->flen);
            long t = s < 0 ? -1 : find_n(ix, e->name, e->nlen);
            int nl = (int)(e->nlen > 200 ? 200 : e->nlen), fl = (int)(e->flen > 200 ? 200 : e->flen);
            if (s < 0)
                rc = k3_fail(err, K3_EXIT_DATA, "%s: names shard '%.*s' (for '%.*s'), which is not in the directory",
                             ipath, fl, e->file, nl, e->name);
            else if (t < 0)
                rc = k3_fail(err, K3_EXIT_DATA, "%s: names tensor '%.*s', which no shard holds", ipath, nl, e->name);
            else if (tensor_shard(ix, t) != s)
                rc = k3_fail(err, K3_EXIT_DATA, "%s: maps '%.*s' to %.*s but it is in %s", ipath, nl, e->name, fl,
                             e->file, base_name(ix->shards[tensor_shard(ix, t)].path));
            else if (seen[t]++)
                rc = k3_fail(err, K3_EXIT_DATA, "%s: lists tensor '%.*s' twice", ipath, nl, e->name);
        }
        for (size_t i = 0; i < ix->n && rc == K3_OK; i++)
            if (!seen[i])
                rc = k3_fail(err, K3_EXIT_DATA, "%s: does not list tensor '%s' (in %s)", ipath, ix->tp[i]->name,
                             base_name(ix->shards[ix->tp[i]->shard].path));
    }
    block_free(&seen_blk);
    free(ft.slot);
    if (rc == K3_OK && p->has_total) {
        /* the tensors of a shard tile its data section exactly (checked), so
         * their bytes are the section's length */
        uint64_t total = 0;
        for (int k = 0; k < ix->nshards; k++) total += ix->shards[k].file_size - ix->shards[k].data_start;
        if (p->total != total)
            rc = k3_fail(err, K3_EXIT_DATA, "%s: metadata.total_size %llu but the shards hold %llu tensor bytes",
                         ipath, (unsigned long long)p->total, (unsigned long long)total);
    }
    return rc;
}

/* Weight-map entries "name": "file" from s->p on, each looked up while its
 * text is still in cache, in batches (hash and prefetch the slots, prefetch
 * the names they point to, compare); seen[t] is set for every tensor found.
 * Stops after the last entry (no comma follows), or, when stop is given,
 * right after the comma that ends at stop. False on anything unusual or
 * wrong: an entry not in the shard it names, a wrong shard, text the strict
 * scanner does not take, stop not met exactly. */
#define WM_BATCH 32
static bool wm_run(const st_index *ix, const file_table *ft, unsigned char *seen, scan *s, const char *stop,
                   size_t *count) {
    wm_entry b[WM_BATCH];
    uint64_t h[WM_BATCH];
    int shard = -1;
    const char *prev_file = NULL, *shard_file = NULL;
    size_t prev_flen = 0, shard_flen = 0, nb = 0, n = 0;
    bool more = true, ok = true;
    while (ok && (more || nb)) {
        if (more) {
            wm_entry *e = &b[nb];
            if (!sk_str(s, &e->name, &e->nlen) || !sk_ch(s, ':')) {
                ok = false;
                break;
            }
            sk_ws(s);
            /* the same file as the entry before (quote included): a string
             * already read and checked */
            if (prev_file && (size_t)(s->e - s->p) > prev_flen + 1 && s->p[0] == '"' &&
                memcmp(s->p + 1, prev_file, prev_flen + 1) == 0) {
                e->file = s->p + 1;
                e->flen = prev_flen;
                s->p += prev_flen + 2;
            } else if (!sk_str(s, &e->file, &e->flen)) {
                ok = false;
                break;
            }
            prev_file = e->file;
            prev_flen = e->flen;
            h[nb] = hash_n(e->name, e->nlen);
            __builtin_prefetch(&ix->slots[h[nb] & ix->mask]);
            nb++;
            more = sk_ch(s, ',');
            if (more && stop && s->p >= stop) {
                if (s->p != stop) ok = false;
                more = false;
            }
            if (more && nb < WM_BATCH) continue;
        }
        for (size_t i = 0; i < nb; i++) __builtin_prefetch(ix->slots[h[i] & ix->mask].name);
        for (size_t i = 0; i < nb && ok; i++) {
            const wm_entry *e = &b[i];
            /* consecutive entries usually name the same shard */
            if (!(shard_file && e->flen == shard_flen && memcmp(e->file, shard_file, e->flen) == 0))
                shard = file_shard(ix, ft, e->file, e->flen);
            shard_file = e->file;
            shard_flen = e->flen;
            long t = shard < 0 ? -1 : find_h(ix, e->name, e->nlen, h[i]);
            /* in the shard named: its tensors are first[shard] .. first[shard + 1] - 1 */
            if (t < 0 || (size_t)t < ix->first[shard] || (size_t)t >= ix->first[shard + 1]) ok = false;
            else __atomic_store_n(&seen[t], 1, __ATOMIC_RELAXED); /* a tensor listed twice leaves another unseen */
        }
        n += nb;
        nb = 0;
    }
    if (stop && ok && s->p != stop) ok = false;
    *count = n;
    return ok;
}

/* The usual case: the weight map read by the strict scanner and checked as
 * it is read. A big weight map that is the last key is read in two halves
 * in parallel: the second half starts after the first '",' past the middle,
 * which is a boundary between entries only if the first half's reading ends
 * exactly there (a string can hold a comma, never a quote); otherwise the
 * whole map is read again in one piece. Answers K3_OK only when everything
 * checks (every entry in the shard it names, each tensor once, all listed,
 * total_size right); anything else, unusual text or a problem, answers BAIL
 * and the caller runs the general path (index_load, check_index), which also
 * words the message. */
static int index_check_fast(st_index *ix, const char *ipath) {
    if (force_jansson()) return BAIL;
    int fd = open(ipath, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0) {
        if (fd >= 0) close(fd);
        return BAIL;
    }
    size_t len = (size_t)st.st_size;
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return BAIL;
    st_block seen_blk = block_new(ix->n ? ix->n : 1);
    unsigned char *seen = seen_blk.p;
    file_table ft = file_table_new(ix);
    scan s = {map, (const char *)map + len};
    bool seen_meta = false, seen_map = false, has_total = false, ok = true;
    uint64_t total = 0;
    size_t count = 0;
    if (!sk_ch(&s, '{')) ok = false;
    else
        do {
            const char *k;
            size_t kn;
            if (!sk_str(&s, &k, &kn) || !sk_ch(&s, ':')) {
                ok = false;
            } else if (key_is(k, kn, "metadata") && !seen_meta) {
                seen_meta = true;
                if (!sk_ch(&s, '{')) ok = false;
                else if (sk_ch(&s, '}')) continue;
                else {
                    const char *mk;
                    size_t mkn;
                    ok = sk_str(&s, &mk, &mkn) && key_is(mk, mkn, "total_size") && sk_ch(&s, ':') &&
                         sk_uint(&s, &total) && sk_ch(&s, '}');
                    has_total = true;
                }
            } else if (key_is(k, kn, "weight_map") && !seen_map) {
                seen_map = true;
                if (!sk_ch(&s, '{')) ok = false;
                else if (sk_ch(&s, '}')) continue;
                else {
                    /* the split point: the first '",' after the middle of
                     * what is left (the map's own end is further on) */
                    const char *mid = s.p + (size_t)(s.e - s.p) / 2, *split = NULL;
                    if (s.e - s.p > 256) /* two threads pay off early; small maps test the split */
                        for (const char *q = mid; q + 1 < s.e && (q = memchr(q, '"', (size_t)(s.e - q - 1))); q++)
                            if (q[1] == ',') {
                                split = q + 2;
                                break;
                            }
                    bool done = false;
                    if (split) {
                        scan part[2] = {s, {split, s.e}};
                        size_t cnt[2] = {0, 0};
                        bool pok[2] = {false, false};
#pragma omp parallel for schedule(static, 1)
                        for (int i = 0; i < 2; i++)
                            pok[i] = wm_run(ix, &ft, seen, &part[i], i ? NULL : split, &cnt[i]);
                        if (pok[0] && pok[1]) {
                            s = part[1];
                            count = cnt[0] + cnt[1];
                            done = true;
                        } else {
                            /* not a boundary after all, or a problem: read it
                             * in one piece */
                            memset(seen, 0, ix->n);
                        }
                    }
                    if (ok && !done) ok = wm_run(ix, &ft, seen, &s, NULL, &count);
                    if (ok && !sk_ch(&s, '}')) ok = false;
                }
            } else {
                ok = false;
            }
        } while (ok && sk_ch(&s, ','));
    if (ok) {
        ok = sk_ch(&s, '}') && seen_map;
        sk_ws(&s);
        /* as many entries as tensors, each found: all listed, none twice */
        ok = ok && s.p == s.e && count == ix->n && (ix->n == 0 || !memchr(seen, 0, ix->n));
    }
    if (ok && has_total) {
        /* the tensors of a shard tile its data section exactly (checked), so
         * their bytes are the section's length */
        uint64_t sum = 0;
        for (int k = 0; k < ix->nshards; k++) sum += ix->shards[k].file_size - ix->shards[k].data_start;
        ok = sum == total;
    }
    block_free(&seen_blk);
    free(ft.slot);
    munmap(map, len);
    return ok ? K3_OK : BAIL;
}

int st_open(const char *path, st_index **out, k3_err *err) {
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0)
        return k3_fail(err, K3_EXIT_USAGE, "%s: %s", path, strerror(errno));
    char **files = NULL;
    int nfiles = 0, rc;
    char *ipath = NULL;
    if (S_ISDIR(st.st_mode)) {
        if ((rc = list_shards(path, &files, &nfiles, err))) return rc;
        if (nfiles == 0) {
            free(files);
            return k3_fail(err, K3_EXIT_USAGE, "%s: no *.safetensors shards in this directory", path);
        }
        ipath = k3_path_join(path, "model.safetensors.index.json");
        if (access(ipath, F_OK) != 0) {
            free(ipath);
            ipath = NULL;
        }
    } else {
        files = xmalloc(sizeof *files);
        files[0] = xstrdup(path);
        nfiles = 1;
    }

    st_index *ix = xcalloc(1, sizeof *ix);
    ix->refs = 1;
    pthread_mutex_init(&ix->lock, NULL);
    ix->nshards = nfiles;
    ix->shards = xcalloc((size_t)nfiles, sizeof *ix->shards);
    ix->priv = xcalloc((size_t)nfiles, sizeof *ix->priv);
    for (int i = 0; i < nfiles; i++) {
        ix->shards[i].path = files[i];
        ix->priv[i].fd = ix->priv[i].fd_direct = -1;
    }
    free(files);
    const char *env = getenv("K3_DIRECT_IO");
    ix->direct = !(env && strcmp(env, "0") == 0);

    /* phase 1: every header (and the index file) in parallel */
    shard_parse *sp = xcalloc((size_t)nfiles, sizeof *sp);
    k3_err *serr = xcalloc((size_t)nfiles, sizeof *serr);
    int *scode = xcalloc((size_t)nfiles, sizeof *scode);
    index_parse ip = {0};
    json_object_seed(0); /* before any thread creates an object */
#pragma omp parallel
    {
        char *buf = NULL;
        size_t cap = 0;
        size_t g = (size_t)nfiles;
        parse_mem mem = {.t.grain = g, .h.grain = g, .names.grain = g};
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < nfiles; s++) {
            scode[s] = parse_file(ix->shards[s].path, s, &ix->shards[s], &mem, &sp[s], &buf, &cap, &serr[s]);
        }
        free(buf);
#pragma omp critical(st_open_mem)
        parse_mem_move(&ix->mem, &mem);
    }
    rc = K3_OK;
    for (int s = 0; s < nfiles && rc == K3_OK; s++)
        if (scode[s]) {
            if (err) *err = serr[s];
            rc = scode[s];
        }
    free(serr);
    free(scode);
    if (rc) {
        for (int s = 0; s < nfiles; s++) shard_parse_free(&sp[s]);
        free(sp);
        index_parse_free(&ip);
        free(ipath);
        st_close(ix);
        return rc;
    }

    /* phase 2: concatenate in shard order, hash, find duplicates */
    size_t total = 0;
    for (int s = 0; s < nfiles; s++) total += sp[s].n;
    if (total >= UINT32_MAX / 2) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: too many tensors (%zu)", path, total);
        total = 0;
    }
    ix->n = total;
    ix->tp_blk = block_new((total ? total : 1) * sizeof *ix->tp);
    ix->tp = ix->tp_blk.p;
    size_t cap = 16;
    while (cap < 2 * total) cap *= 2;
    ix->mask = cap - 1;
    ix->slots_blk = block_new(cap * sizeof *ix->slots); /* zero-filled either way */
    ix->slots = ix->slots_blk.p;
    size_t k = 0;
    ix->first = xcalloc((size_t)nfiles + 1, sizeof *ix->first);
    for (int s = 0; s < nfiles; s++) ix->first[s + 1] = ix->first[s] + sp[s].n;
    for (int s = 0; s < nfiles && rc == K3_OK; s++) {
        for (size_t j = 0; j < sp[s].n && rc == K3_OK; j++) {
            size_t i = k + j;
            uint64_t h = sp[s].hash[j];
            if (j + 32 < sp[s].n) __builtin_prefetch(&ix->slots[sp[s].hash[j + 32] & ix->mask], 1);
            ix->tp[i] = &sp[s].t[j];
            const char *name = sp[s].t[j].name;
            for (size_t sl = h & ix->mask;; sl = (sl + 1) & ix->mask) {
                st_slot *e = &ix->slots[sl];
                if (!e->idx) {
                    *e = (st_slot){name, (uint32_t)(i + 1), (uint32_t)(h >> 32)};
                    break;
                }
                if (e->h32 == (uint32_t)(h >> 32) && strcmp(e->name, name) == 0) {
                    rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s' is also in %s", ix->shards[s].path, name,
                                 ix->shards[ix->tp[e->idx - 1]->shard].path);
                    break;
                }
            }
        }
        k += sp[s].n;
        /* the shard keeps its tensors, names and metadata; tp points in */
        ix->priv[s].t = sp[s].t;
        ix->priv[s].meta = sp[s].meta;
        sp[s].meta = NULL;
        shard_parse_free(&sp[s]);
    }
    for (int s = 0; s < nfiles; s++) shard_parse_free(&sp[s]);
    free(sp);
    /* phase 3: the index file. Its own errors (unreadable, bad JSON, no
     * weight_map) come before those of phase 2, as the shards' do. */
    if (ipath) {
        if (rc) {
            k3_err ierr = {0};
            int icode = index_load(ipath, &ip, &ierr);
            if (icode) {
                if (err) *err = ierr;
                rc = icode;
            }
        } else if (index_check_fast(ix, ipath) != K3_OK) {
            rc = index_load(ipath, &ip, err);
            if (rc == K3_OK) rc = check_index(ix, &ip, ipath, err);
        }
    }
    index_parse_free(&ip);
    free(ipath);
    if (rc) {
        st_close(ix);
        return rc;
    }
    *out = ix;
    return K3_OK;
}

/* ---- data access ------------------------------------------------------- */

static int shard_fd(st_index *ix, int s, k3_err *err) {
    shard_priv *p = &ix->priv[s];
    pthread_mutex_lock(&ix->lock);
    if (p->fd < 0) {
        p->fd = open(ix->shards[s].path, O_RDONLY | O_CLOEXEC);
        if (p->fd < 0) {
            int e = errno;
            pthread_mutex_unlock(&ix->lock);
            return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", ix->shards[s].path, strerror(e));
        }
    }
    pthread_mutex_unlock(&ix->lock);
    return K3_OK;
}

const void *st_data(st_index *ix, const st_tensor *t, k3_err *err) {
    int s = t->shard;
    shard_priv *p = &ix->priv[s];
    if (shard_fd(ix, s, err)) return NULL;
    pthread_mutex_lock(&ix->lock);
    if (!p->map) {
        struct stat st;
        /* a file that shrank since indexing would SIGBUS on access: refuse it */
        if (fstat(p->fd, &st) != 0 || (uint64_t)st.st_size != ix->shards[s].file_size) {
            pthread_mutex_unlock(&ix->lock);
            k3_fail(err, K3_EXIT_DATA, "%s: file changed size since it was indexed", ix->shards[s].path);
            return NULL;
        }
        void *m = mmap(NULL, ix->shards[s].file_size, PROT_READ, MAP_SHARED, p->fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            pthread_mutex_unlock(&ix->lock);
            k3_fail(err, K3_EXIT_RUNTIME, "%s: mmap failed: %s", ix->shards[s].path, strerror(e));
            return NULL;
        }
        p->map = m;
        k3_mapguard_add(m, ix->shards[s].file_size, ix->shards[s].path);
    }
    pthread_mutex_unlock(&ix->lock);
    return p->map + t->offset;
}

/* The descriptor st_pread reads shard s through: with O_DIRECT asked for
 * (util/dio.h: buffered where the filesystem refuses it, and from the first
 * refused read on) when the index reads direct, else the buffered one. */
static int read_fd(st_index *ix, int s, int *fd, k3_err *err) {
    if (!ix->direct) {
        int rc = shard_fd(ix, s, err);
        *fd = ix->priv[s].fd;
        return rc;
    }
    shard_priv *p = &ix->priv[s];
    int rc = K3_OK;
    pthread_mutex_lock(&ix->lock);
    if (p->fd_direct < 0) rc = k3_dio_open(ix->shards[s].path, true, &p->fd_direct, NULL, err);
    *fd = p->fd_direct;
    pthread_mutex_unlock(&ix->lock);
    return rc;
}

int st_pread(st_index *ix, int shard, uint64_t off, void *dst, uint64_t len, k3_err *err) {
    if (shard < 0 || shard >= ix->nshards)
        return k3_fail(err, K3_EXIT_RUNTIME, "st_pread: shard %d out of range", shard);
    const st_shard *sh = &ix->shards[shard];
    if (off > sh->file_size || len > sh->file_size - off)
        return k3_fail(err, K3_EXIT_DATA, "%s: read of %llu bytes at %llu is past the end of the file",
                       sh->path, (unsigned long long)len, (unsigned long long)off);
    if (len == 0) return K3_OK;
    int fd, rc = read_fd(ix, shard, &fd, err);
    return rc ? rc : k3_dio_pread(fd, dst, off, len, sh->path, err);
}

int st_read(st_index *ix, const st_tensor *t, void *dst, k3_err *err) {
    return st_pread(ix, t->shard, t->offset, dst, t->nbytes, err);
}

int st_read_f32(st_index *ix, const st_tensor *t, float *dst, k3_err *err) {
    size_t n = (size_t)t->numel;
    switch (t->dtype) {
    case ST_F32:
        return st_read(ix, t, dst, err);
    case ST_F16:
    case ST_BF16: {
        /* read the 16-bit values into the front half of dst, then widen from
         * the back so no value is overwritten before it is read */
        int rc = st_read(ix, t, dst, err);
        if (rc) return rc;
        const unsigned char *raw = (const unsigned char *)dst;
        for (size_t i = n; i-- > 0;) {
            uint16_t h;
            memcpy(&h, raw + 2 * i, 2);
            float f = t->dtype == ST_BF16 ? k3_bf16_to_f32(h) : k3_f16_to_f32(h);
            memcpy((unsigned char *)dst + 4 * i, &f, 4);
        }
        return K3_OK;
    }
    case ST_F64: {
        double *tmp = xmalloc_array(n ? n : 1, sizeof *tmp);
        int rc = st_read(ix, t, tmp, err);
        if (rc == K3_OK)
            for (size_t i = 0; i < n; i++) dst[i] = (float)tmp[i];
        free(tmp);
        return rc;
    }
    default:
        return k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s' is %s, not a float dtype",
                       ix->shards[t->shard].path, t->name, st_dtype_name(t->dtype));
    }
}

int st_write(const char *path, const char *const *md, size_t n_md, const st_out_tensor *ts, size_t n,
             k3_err *err) {
    json_t *hdr = json_object();
    if (n_md) {
        json_t *m = json_object();
        for (size_t i = 0; i < n_md; i++) json_object_set_new(m, md[2 * i], json_string(md[2 * i + 1]));
        json_object_set_new(hdr, "__metadata__", m);
    }
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t want = st_dtype_size(ts[i].dtype);
        for (int r = 0; r < ts[i].rank; r++) want *= (uint64_t)ts[i].shape[r];
        if (want != ts[i].nbytes) {
            json_decref(hdr);
            return k3_fail(err, K3_EXIT_RUNTIME, "%s: tensor %s: %llu bytes for its shape, %llu given", path,
                           ts[i].name, (unsigned long long)want, (unsigned long long)ts[i].nbytes);
        }
        json_t *e = json_object(), *sh = json_array(), *of = json_array();
        json_object_set_new(e, "dtype", json_string(st_dtype_name(ts[i].dtype)));
        for (int r = 0; r < ts[i].rank; r++) json_array_append_new(sh, json_integer(ts[i].shape[r]));
        json_object_set_new(e, "shape", sh);
        json_array_append_new(of, json_integer((json_int_t)off));
        off += ts[i].nbytes;
        json_array_append_new(of, json_integer((json_int_t)off));
        json_object_set_new(e, "data_offsets", of);
        json_object_set_new(hdr, ts[i].name, e);
    }
    char *text = json_dumps(hdr, JSON_COMPACT);
    json_decref(hdr);
    /* the header is padded so that the data section starts 8-byte aligned */
    size_t hl = strlen(text), pad = (8 - hl % 8) % 8;
    uint64_t hlen = hl + pad;
    char *h = xmalloc(hlen + 8);
    for (int b = 0; b < 8; b++) h[b] = (char)((hlen >> (8 * b)) & 0xff);
    memcpy(h + 8, text, hl);
    memset(h + 8 + hl, ' ', pad);
    free(text);
    k3_atomic_file af;
    int rc = k3_atomic_open(&af, path, err);
    if (!rc) rc = k3_atomic_write(&af, h, hlen + 8, err);
    for (size_t i = 0; !rc && i < n; i++) rc = k3_atomic_write(&af, ts[i].data, ts[i].nbytes, err);
    if (!rc) rc = k3_atomic_commit(&af, err);
    else if (af.f) k3_atomic_abort(&af);
    free(h);
    return rc;
}
