/* safetensors.c: see safetensors.h.
 *
 * Opening runs in two phases. Phase 1 parses every shard's header on its own
 * (OpenMP, one shard per task, plus the optional model.safetensors.index.json
 * as one more task) into a per-shard table sorted by offset; nothing is shared
 * between tasks, so errors are kept per shard and the first one in shard order
 * is reported, whatever the thread count. Phase 2 is serial and linear: it
 * concatenates the tables, builds an open-addressing hash of the names (which
 * also finds duplicates across shards) and cross-checks the index file.
 *
 * The validation follows the safetensors format as the reference library
 * enforces it: tensors tile the data section exactly (no overlap, no gap, no
 * trailing bytes) and each span equals dtype size x product(shape). */
#include "formats/safetensors.h"

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

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this reader assumes a little-endian host"
#endif

/* The largest header we accept. Real K3 shards carry ~0.8 MB of header; the
 * cap only stops a corrupt length from asking for gigabytes. */
#define ST_MAX_HEADER (256u << 20)
/* Alignment and bounce-buffer size for O_DIRECT reads. 4096 satisfies every
 * logical block size Linux filesystems use. */
#define ST_DIRECT_ALIGN 4096u
#define ST_BOUNCE (8u << 20)

static const char *const dtype_names[ST_NDTYPES] = {
    "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"};
static const size_t dtype_sizes[ST_NDTYPES] = {8, 4, 2, 2, 8, 4, 2, 1, 1, 1};

const char *st_dtype_name(st_dtype d) {
    return (unsigned)d < ST_NDTYPES ? dtype_names[d] : "?";
}
size_t st_dtype_size(st_dtype d) { return (unsigned)d < ST_NDTYPES ? dtype_sizes[d] : 0; }

static int parse_dtype(const char *s) {
    for (int i = 0; i < ST_NDTYPES; i++)
        if (strcmp(s, dtype_names[i]) == 0) return i;
    return -1;
}

/* FNV-1a: names are short and this runs once per tensor at open time. */
static uint64_t hash_name(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

/* ---- phase 1: one header ---------------------------------------------- */

typedef struct {
    st_tensor *t;
    uint64_t *hash;
    size_t n;
    char *names;       /* arena holding every name of this shard */
    json_t *meta;      /* __metadata__ object or NULL */
} shard_parse;

static void shard_parse_free(shard_parse *p) {
    free(p->t);
    free(p->hash);
    free(p->names);
    if (p->meta) json_decref(p->meta);
    memset(p, 0, sizeof *p);
}

static int cmp_offset(const void *a, const void *b) {
    const st_tensor *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* A JSON integer that is >= 0, as uint64. */
static bool get_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v)) return false;
    json_int_t i = json_integer_value(v);
    if (i < 0) return false;
    *out = (uint64_t)i;
    return true;
}

/* Parses and validates the header text json[0..len) of file `fname` whose data
 * section holds data_len bytes starting at absolute offset data_start. */
static int parse_header(const char *json, size_t len, uint64_t data_start, uint64_t data_len,
                        const char *fname, int shard, shard_parse *out, k3_err *err) {
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return k3_fail(err, K3_EXIT_DATA, "%s: bad safetensors header: %s (at header byte %d)",
                       fname, je.text, je.position);
    if (!json_is_object(root)) {
        json_decref(root);
        return k3_fail(err, K3_EXIT_DATA, "%s: bad safetensors header: not a JSON object", fname);
    }
    size_t nkeys = json_object_size(root), namebytes = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) namebytes += strlen(key) + 1;
    out->t = xmalloc_array(nkeys ? nkeys : 1, sizeof *out->t);
    out->hash = xmalloc_array(nkeys ? nkeys : 1, sizeof *out->hash);
    out->names = xmalloc(namebytes ? namebytes : 1);
    char *arena = out->names;
    int rc = K3_OK;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) {
            const char *mk;
            json_t *mv;
            if (!json_is_object(val)) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: __metadata__ is not an object", fname);
                goto done;
            }
            json_object_foreach(val, mk, mv) if (!json_is_string(mv)) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: __metadata__ value '%s' is not a string",
                             fname, mk);
                goto done;
            }
            out->meta = json_incref(val);
            continue;
        }
        st_tensor *t = &out->t[out->n];
        memset(t, 0, sizeof *t);
        if (!json_is_object(val)) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': entry is not an object", fname, key);
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
                rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': unexpected key '%s'", fname, key, k2);
                goto done;
            }
        }
        if (!json_is_string(jd) || !json_is_array(js) || !json_is_array(jo)) {
            rc = k3_fail(err, K3_EXIT_DATA,
                         "%s: tensor '%s': needs string dtype, array shape and array data_offsets",
                         fname, key);
            goto done;
        }
        int d = parse_dtype(json_string_value(jd));
        if (d < 0) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': unknown dtype '%s'", fname, key,
                         json_string_value(jd));
            goto done;
        }
        t->dtype = (st_dtype)d;
        size_t rank = json_array_size(js);
        if (rank > ST_MAX_RANK) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': rank %zu exceeds %d", fname, key, rank,
                         ST_MAX_RANK);
            goto done;
        }
        t->rank = (int)rank;
        uint64_t numel = 1;
        bool ovf = false;
        for (size_t i = 0; i < rank; i++) {
            uint64_t dim;
            if (!get_u64(json_array_get(js, i), &dim)) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': shape[%zu] is not a non-negative integer",
                             fname, key, i);
                goto done;
            }
            t->shape[i] = (int64_t)dim;
            if (!k3_mul_ok(numel, dim, &numel)) ovf = true;
        }
        uint64_t nbytes = 0, b0, b1;
        if (ovf || numel > (uint64_t)INT64_MAX || !k3_mul_ok(numel, dtype_sizes[d], &nbytes)) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': shape overflows", fname, key);
            goto done;
        }
        if (json_array_size(jo) != 2 || !get_u64(json_array_get(jo, 0), &b0) ||
            !get_u64(json_array_get(jo, 1), &b1) || b1 < b0) {
            rc = k3_fail(err, K3_EXIT_DATA,
                         "%s: tensor '%s': data_offsets must be [begin, end] with 0 <= begin <= end",
                         fname, key);
            goto done;
        }
        if (b1 - b0 != nbytes) {
            rc = k3_fail(err, K3_EXIT_DATA,
                         "%s: tensor '%s': data_offsets span %llu bytes but %s x %llu elements needs %llu",
                         fname, key, (unsigned long long)(b1 - b0), dtype_names[d],
                         (unsigned long long)numel, (unsigned long long)nbytes);
            goto done;
        }
        if (b1 > data_len) {
            rc = k3_fail(err, K3_EXIT_DATA,
                         "%s: tensor '%s': data_offsets end %llu is past the data section (%llu bytes; truncated file?)",
                         fname, key, (unsigned long long)b1, (unsigned long long)data_len);
            goto done;
        }
        t->numel = (int64_t)numel;
        t->nbytes = nbytes;
        t->offset = data_start + b0;
        t->shard = shard;
        size_t kl = strlen(key) + 1;
        memcpy(arena, key, kl);
        t->name = arena;
        arena += kl;
        out->n++;
    }
    /* sort by offset, then demand the spans tile [0, data_len) exactly */
    qsort(out->t, out->n, sizeof *out->t, cmp_offset);
    uint64_t end = data_start;
    const char *prev = NULL;
    for (size_t i = 0; i < out->n; i++) {
        st_tensor *t = &out->t[i];
        if (t->nbytes == 0) continue; /* an empty tensor occupies nothing */
        if (t->offset < end) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: tensors '%s' and '%s' overlap", fname,
                         prev ? prev : "?", t->name);
            goto done;
        }
        if (t->offset > end) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: %llu unused bytes before tensor '%s' (gap in data section)",
                         fname, (unsigned long long)(t->offset - end), t->name);
            goto done;
        }
        end = t->offset + t->nbytes;
        prev = t->name;
    }
    if (end != data_start + data_len) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: %llu trailing bytes after the last tensor", fname,
                     (unsigned long long)(data_start + data_len - end));
        goto done;
    }
    for (size_t i = 0; i < out->n; i++) out->hash[i] = hash_name(out->t[i].name);
done:
    json_decref(root);
    if (rc) shard_parse_free(out);
    return rc;
}

/* Reads exactly len bytes at off; K3_EXIT_DATA on early end of file. */
static int pread_full(int fd, void *dst, size_t len, uint64_t off, const char *path, k3_err *err) {
    char *p = dst;
    while (len) {
        ssize_t r = pread(fd, p, len, (off_t)off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return k3_fail(err, K3_EXIT_RUNTIME, "%s: read error: %s", path, strerror(errno));
        }
        if (r == 0) return k3_fail(err, K3_EXIT_DATA, "%s: unexpected end of file", path);
        p += r;
        len -= (size_t)r;
        off += (uint64_t)r;
    }
    return K3_OK;
}

static int parse_file(const char *path, int shard, st_shard *sh, shard_parse *out, k3_err *err) {
    memset(out, 0, sizeof *out);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", path, strerror(errno));
    struct stat stt;
    int rc = K3_OK;
    char *buf = NULL;
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
    if ((rc = pread_full(fd, lenb, 8, 0, path, err))) goto out;
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
    buf = xmalloc((size_t)hlen);
    if ((rc = pread_full(fd, buf, (size_t)hlen, 8, path, err))) goto out;
    sh->file_size = fsize;
    sh->data_start = 8 + hlen;
    rc = parse_header(buf, (size_t)hlen, 8 + hlen, fsize - 8 - hlen, path, shard, out, err);
    if (rc == K3_OK) sh->ntensors = (int)out->n;
out:
    free(buf);
    close(fd);
    return rc;
}

int st_check_buffer(const void *file, size_t len, const char *name, size_t *ntensors, k3_err *err) {
    const unsigned char *b = file;
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
    int rc = parse_header((const char *)b + 8, (size_t)hlen, 8 + hlen, len - 8 - hlen, name, 0, &p, err);
    if (rc) return rc;
    if (ntensors) *ntensors = p.n;
    shard_parse_free(&p);
    return K3_OK;
}

/* ---- the index --------------------------------------------------------- */

typedef struct {
    char *names;
    json_t *meta;
    /* lazily opened; guarded by st_index.lock */
    int fd, fd_direct;     /* -1 until opened; fd_direct -2 when refused */
    const unsigned char *map;
} shard_priv;

struct st_index {
    int nshards;
    st_shard *shards;
    shard_priv *priv;
    size_t n;
    st_tensor *t;
    uint32_t *slots;       /* open addressing: tensor index + 1, 0 = empty */
    uint64_t *hashes;      /* per tensor */
    size_t mask;
    bool direct;           /* try O_DIRECT in st_pread */
    pthread_mutex_t lock;
};

size_t st_count(const st_index *ix) { return ix->n; }
const st_tensor *st_at(const st_index *ix, size_t i) { return i < ix->n ? &ix->t[i] : NULL; }
int st_nshards(const st_index *ix) { return ix->nshards; }
const st_shard *st_shard_at(const st_index *ix, int i) {
    return i >= 0 && i < ix->nshards ? &ix->shards[i] : NULL;
}

const st_tensor *st_find(const st_index *ix, const char *name) {
    uint64_t h = hash_name(name);
    for (size_t s = h & ix->mask;; s = (s + 1) & ix->mask) {
        uint32_t v = ix->slots[s];
        if (!v) return NULL;
        if (ix->hashes[v - 1] == h && strcmp(ix->t[v - 1].name, name) == 0) return &ix->t[v - 1];
    }
}

const char *st_metadata(const st_index *ix, int shard, const char *key) {
    if (shard < 0 || shard >= ix->nshards || !ix->priv[shard].meta) return NULL;
    return json_string_value(json_object_get(ix->priv[shard].meta, key));
}

void st_set_direct(st_index *ix, bool on) { ix->direct = on; }

void st_close(st_index *ix) {
    if (!ix) return;
    for (int i = 0; i < ix->nshards; i++) {
        shard_priv *p = &ix->priv[i];
        if (p->map) munmap((void *)p->map, ix->shards[i].file_size);
        if (p->fd >= 0) close(p->fd);
        if (p->fd_direct >= 0) close(p->fd_direct);
        free(p->names);
        if (p->meta) json_decref(p->meta);
        free(ix->shards[i].path);
    }
    pthread_mutex_destroy(&ix->lock);
    free(ix->priv);
    free(ix->shards);
    free(ix->t);
    free(ix->slots);
    free(ix->hashes);
    free(ix);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = xmalloc(n);
    snprintf(p, n, "%s%s%s", dir, ends_with(dir, "/") ? "" : "/", name);
    return p;
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
        char *p = path_join(dir, e->d_name);
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

/* Cross-checks model.safetensors.index.json (already parsed) against the
 * shards: every name it maps must be in the shard it names, the counts must
 * agree (so the two name sets are equal), and metadata.total_size, when
 * present, must equal the tensor bytes. */
static int check_index_json(st_index *ix, json_t *root, const char *ipath, k3_err *err) {
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm))
        return k3_fail(err, K3_EXIT_DATA, "%s: no weight_map object", ipath);
    const char *name;
    json_t *v;
    json_object_foreach(wm, name, v) {
        if (!json_is_string(v))
            return k3_fail(err, K3_EXIT_DATA, "%s: weight_map value for '%s' is not a string", ipath, name);
        const char *file = json_string_value(v);
        int s = -1;
        for (int i = 0; i < ix->nshards; i++)
            if (strcmp(base_name(ix->shards[i].path), file) == 0) { s = i; break; }
        if (s < 0)
            return k3_fail(err, K3_EXIT_DATA, "%s: names shard '%s' (for '%s'), which is not in the directory",
                           ipath, file, name);
        const st_tensor *t = st_find(ix, name);
        if (!t)
            return k3_fail(err, K3_EXIT_DATA, "%s: names tensor '%s', which no shard holds", ipath, name);
        if (t->shard != s)
            return k3_fail(err, K3_EXIT_DATA, "%s: maps '%s' to %s but it is in %s", ipath, name, file,
                           base_name(ix->shards[t->shard].path));
    }
    if (json_object_size(wm) != ix->n) {
        /* every index name was found, so some shard tensor is missing from it */
        for (size_t i = 0; i < ix->n; i++)
            if (!json_object_get(wm, ix->t[i].name))
                return k3_fail(err, K3_EXIT_DATA, "%s: does not list tensor '%s' (in %s)", ipath,
                               ix->t[i].name, base_name(ix->shards[ix->t[i].shard].path));
    }
    json_t *ts = json_object_get(json_object_get(root, "metadata"), "total_size");
    if (ts) {
        uint64_t total = 0, want;
        for (size_t i = 0; i < ix->n; i++) total += ix->t[i].nbytes;
        if (!get_u64(ts, &want))
            return k3_fail(err, K3_EXIT_DATA, "%s: metadata.total_size is not a non-negative integer", ipath);
        if (want != total)
            return k3_fail(err, K3_EXIT_DATA, "%s: metadata.total_size %llu but the shards hold %llu tensor bytes",
                           ipath, (unsigned long long)want, (unsigned long long)total);
    }
    return K3_OK;
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
        ipath = path_join(path, "model.safetensors.index.json");
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
    json_t *iroot = NULL;
    k3_err ierr = {0};
    int icode = K3_OK;
    json_object_seed(0); /* before any thread creates an object */
    int ntasks = nfiles + (ipath ? 1 : 0);
#pragma omp parallel for schedule(dynamic, 1)
    for (int task = 0; task < ntasks; task++) {
        if (ipath && task == 0) {
            /* the index file is the largest single parse: start it first */
            json_error_t je;
            iroot = json_load_file(ipath, 0, &je);
            if (!iroot)
                icode = k3_fail(&ierr, K3_EXIT_DATA, "%s: bad JSON: %s (line %d)", ipath, je.text, je.line);
            continue;
        }
        int s = task - (ipath ? 1 : 0);
        scode[s] = parse_file(ix->shards[s].path, s, &ix->shards[s], &sp[s], &serr[s]);
    }
    rc = K3_OK;
    for (int s = 0; s < nfiles && rc == K3_OK; s++)
        if (scode[s]) {
            if (err) *err = serr[s];
            rc = scode[s];
        }
    free(serr);
    free(scode);
    if (rc == K3_OK && icode) {
        if (err) *err = ierr;
        rc = icode;
    }
    if (rc) {
        for (int s = 0; s < nfiles; s++) shard_parse_free(&sp[s]);
        free(sp);
        if (iroot) json_decref(iroot);
        free(ipath);
        st_close(ix);
        return rc;
    }

    /* phase 2: concatenate in shard order, hash, find duplicates */
    size_t total = 0;
    for (int s = 0; s < nfiles; s++) total += sp[s].n;
    if (total >= UINT32_MAX / 2) {
        k3_fail(err, K3_EXIT_DATA, "%s: too many tensors (%zu)", path, total);
        rc = K3_EXIT_DATA;
    }
    ix->n = total;
    ix->t = xmalloc_array(total ? total : 1, sizeof *ix->t);
    ix->hashes = xmalloc_array(total ? total : 1, sizeof *ix->hashes);
    size_t cap = 16;
    while (cap < 2 * total) cap *= 2;
    ix->mask = cap - 1;
    ix->slots = xcalloc(cap, sizeof *ix->slots);
    size_t k = 0;
    for (int s = 0; s < nfiles; s++) {
        memcpy(ix->t + k, sp[s].t, sp[s].n * sizeof *ix->t);
        memcpy(ix->hashes + k, sp[s].hash, sp[s].n * sizeof *ix->hashes);
        k += sp[s].n;
        ix->priv[s].names = sp[s].names;
        ix->priv[s].meta = sp[s].meta;
        sp[s].names = NULL;
        sp[s].meta = NULL;
        shard_parse_free(&sp[s]);
    }
    free(sp);
    for (size_t i = 0; i < total && rc == K3_OK; i++) {
        uint64_t h = ix->hashes[i];
        size_t slot = h & ix->mask;
        for (;; slot = (slot + 1) & ix->mask) {
            uint32_t v = ix->slots[slot];
            if (!v) {
                ix->slots[slot] = (uint32_t)(i + 1);
                break;
            }
            const st_tensor *o = &ix->t[v - 1];
            if (ix->hashes[v - 1] == h && strcmp(o->name, ix->t[i].name) == 0) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s' is also in %s", ix->shards[ix->t[i].shard].path,
                             ix->t[i].name, ix->shards[o->shard].path);
                break;
            }
        }
    }
    if (rc == K3_OK && iroot) rc = check_index_json(ix, iroot, ipath, err);
    if (iroot) json_decref(iroot);
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
    }
    pthread_mutex_unlock(&ix->lock);
    return p->map + t->offset;
}

/* The O_DIRECT descriptor of shard s, or -1 when O_DIRECT is off or refused. */
static int direct_fd(st_index *ix, int s) {
    shard_priv *p = &ix->priv[s];
    if (!ix->direct) return -1;
    pthread_mutex_lock(&ix->lock);
    if (p->fd_direct == -1) {
        int fd = open(ix->shards[s].path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        p->fd_direct = fd >= 0 ? fd : -2; /* tmpfs and friends say EINVAL: stay buffered */
    }
    int fd = p->fd_direct;
    pthread_mutex_unlock(&ix->lock);
    return fd >= 0 ? fd : -1;
}

/* O_DIRECT read through an aligned bounce buffer. Returns 0, or -1 when the
 * filesystem refuses (EINVAL) so the caller falls back, or an error code. */
static int pread_direct(int fd, uint64_t off, unsigned char *dst, uint64_t len, const char *path,
                        k3_err *err) {
    const uint64_t A = ST_DIRECT_ALIGN;
    uint64_t start = off & ~(A - 1), stop = (off + len + A - 1) & ~(A - 1);
    size_t bsz = (size_t)(stop - start < ST_BOUNCE ? stop - start : ST_BOUNCE);
    void *bounce = NULL;
    if (posix_memalign(&bounce, A, bsz) != 0) return -1;
    int rc = 0;
    for (uint64_t pos = start; pos < off + len;) {
        size_t want = (size_t)(stop - pos < bsz ? stop - pos : bsz);
        ssize_t r = pread(fd, bounce, want, (off_t)pos);
        if (r < 0) {
            if (errno == EINTR) continue;
            rc = errno == EINVAL ? -1 : k3_fail(err, K3_EXIT_RUNTIME, "%s: read error: %s", path, strerror(errno));
            break;
        }
        uint64_t got_end = pos + (uint64_t)r;
        uint64_t lo = pos > off ? pos : off, hi = got_end < off + len ? got_end : off + len;
        if (hi > lo) memcpy(dst + (lo - off), (unsigned char *)bounce + (lo - pos), (size_t)(hi - lo));
        if ((size_t)r < want && got_end < off + len) {
            /* a short O_DIRECT read that is not at EOF: retry the rest aligned */
            if (r == 0) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: unexpected end of file", path);
                break;
            }
            pos = got_end & ~(A - 1);
            continue;
        }
        pos += want;
    }
    free(bounce);
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
    int dfd = direct_fd(ix, shard);
    if (dfd >= 0) {
        int r = pread_direct(dfd, off, dst, len, sh->path, err);
        if (r >= 0) return r;
        /* refused mid-way: remember and fall back to buffered reads */
        pthread_mutex_lock(&ix->lock);
        if (ix->priv[shard].fd_direct >= 0) close(ix->priv[shard].fd_direct);
        ix->priv[shard].fd_direct = -2;
        pthread_mutex_unlock(&ix->lock);
    }
    int rc = shard_fd(ix, shard, err);
    if (rc) return rc;
    return pread_full(ix->priv[shard].fd, dst, (size_t)len, off, sh->path, err);
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
