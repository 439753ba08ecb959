/* trunk.c: packing, verifying and opening a packed trunk (trunk.h). */
#include "memory/trunk.h"

#include "memory/io.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CHUNK (64u << 20)

bool k3_trunk_wants(const char *name) {
    if (strstr(name, ".experts.")) return false;
    if (!strncmp(name, "vision_tower.", 13) || !strncmp(name, "mm_projector.", 13)) return false;
    return true;
}

int k3_trunk_layer_of(const char *name) {
    const char *p = strstr(name, "layers.");
    if (!p || (p != name && p[-1] != '.')) return -1;
    p += 7;
    if (*p < '0' || *p > '9') return -1;
    long v = strtol(p, (char **)&p, 10);
    if (*p != '.' || v > 1000000) return -1;
    return (int)v;
}

/* Identity of a checkpoint. Headers alone are not enough: two checkpoints of
 * the same architecture (another seed, a fine-tune) have identical headers and
 * sizes. So the hash also covers a sample of the data: the first and last
 * IDENT_SAMPLE bytes of every trunk tensor, which any retraining changes.
 *
 * The samples are tiny but many (two per trunk tensor: about 4,600 on the
 * released K3), so they are not read one by one: the ranges are merged into
 * reads (a gap of up to IDENT_GAP is read through, a read covers at most
 * IDENT_READ of the file), and the reads go out together through k3_io
 * (io_uring, IDENT_DEPTH in flight, O_DIRECT). The headers were just read by
 * st_open, so they are re-read buffered (from the page cache).
 *
 * Two hash functions ("schemes") over the same bytes, in the same order:
 * 1 = FNV-1a (the first trunks; one byte per multiply, ~0.2 s for the 76 MB of
 * the release's headers), 2 = hash64 below (four independent lanes of 8-byte
 * words, ~20x faster). New packs use 2; a trunk.json without
 * "identity_scheme" was packed with 1 and is checked with 1. */
#define IDENT_SAMPLE 64
#define IDENT_GAP (16u << 10)
#define IDENT_READ (1u << 20)
#define IDENT_BATCH (8u << 20)
#define IDENT_DEPTH 32

/* hash64: a streaming 64-bit hash of a byte sequence (the value depends only
 * on the bytes, not on how they are split into calls). Four lanes each take
 * every fourth 8-byte word: lane = rotl(lane ^ w * K2, 29) * K1, which keeps
 * four multiply chains in flight; the end folds the lanes, the length and the
 * tail and mixes the result. Not cryptographic: it tells checkpoints apart. */
#define HK1 0x9E3779B97F4A7C15ull
#define HK2 0xC2B2AE3D27D4EB4Full
typedef struct {
    uint64_t lane[4], n;
    uint8_t tail[32];
    int nt;
} hash64;

static void h64_init(hash64 *h) {
    memset(h, 0, sizeof *h);
    for (int i = 0; i < 4; i++) h->lane[i] = HK1 * (uint64_t)(i + 1);
}

static inline uint64_t h64_round(uint64_t a, uint64_t w) {
    a ^= w * HK2;
    a = (a << 29) | (a >> 35);
    return a * HK1;
}

static void h64_block(hash64 *h, const uint8_t *p) {
    uint64_t w[4];
    memcpy(w, p, 32);
    for (int i = 0; i < 4; i++) h->lane[i] = h64_round(h->lane[i], w[i]);
}

static void h64_add(hash64 *h, const void *data, size_t n) {
    const uint8_t *p = data;
    h->n += n;
    if (h->nt) {
        size_t k = 32 - (size_t)h->nt < n ? 32 - (size_t)h->nt : n;
        memcpy(h->tail + h->nt, p, k);
        h->nt += (int)k;
        p += k;
        n -= k;
        if (h->nt < 32) return;
        h64_block(h, h->tail);
        h->nt = 0;
    }
    for (; n >= 32; p += 32, n -= 32) h64_block(h, p);
    memcpy(h->tail, p, n);
    h->nt = (int)n;
}

static uint64_t h64_end(const hash64 *h) {
    uint64_t r = h->n * HK2;
    for (int i = 0; i < 4; i++) r = h64_round(r, h->lane[i]);
    uint8_t t[32] = {0};
    memcpy(t, h->tail, (size_t)h->nt);
    for (int i = 0; i < 4; i++) {
        uint64_t w;
        memcpy(&w, t + 8 * i, 8);
        r = h64_round(r, w);
    }
    r ^= r >> 31;
    r *= HK2;
    r ^= r >> 29;
    r *= HK1;
    return r ^ (r >> 32);
}

typedef struct {
    int scheme;
    uint64_t fnv;
    hash64 h;
} ident_hash;

static void ih_add(ident_hash *ih, const void *p, size_t n) {
    if (ih->scheme == 1) ih->fnv = k3_fnv1a64(ih->fnv, p, n);
    else h64_add(&ih->h, p, n);
}

typedef struct {
    int shard;
    uint64_t off, len;
} ident_range;

/* Reads every range (sorted by shard, then offset) and hands its bytes to
 * use(ctx, k, bytes) in range order. One buffer of IDENT_BATCH, reused. */
static int ident_read(st_index *ix, k3_io *io, int *fds, const ident_range *r, size_t n,
                      void (*use)(void *ctx, size_t k, const uint8_t *bytes), void *ctx, k3_identity_stats *stats,
                      k3_err *err) {
    size_t i = 0;
    k3_io_req *rq = xmalloc_array(n ? n : 1, sizeof *rq);
    size_t *first = xmalloc_array(n + 1, sizeof *first);
    uint64_t *at = xmalloc_array(n + 1, sizeof *at);
    uint8_t *buf = NULL;
    uint64_t cap = 0;
    int rc = K3_OK;
    while (i < n && !rc) {
        /* one batch: reads whose buffers add up to at most IDENT_BATCH */
        size_t nq = 0, i0 = i;
        uint64_t used = 0;
        while (i < n) {
            uint64_t start = r[i].off, end = r[i].off + r[i].len;
            size_t j = i + 1;
            while (j < n && r[j].shard == r[i].shard && r[j].off <= end + IDENT_GAP &&
                   r[j].off + r[j].len - start <= IDENT_READ) {
                if (r[j].off + r[j].len > end) end = r[j].off + r[j].len;
                j++;
            }
            uint64_t span = k3_dio_span(start, end - start);
            if (nq && used + span > IDENT_BATCH) break;
            if (fds[r[i].shard] < 0 &&
                (rc = k3_io_open(io, st_shard_at(ix, r[i].shard)->path, &fds[r[i].shard], NULL, err)))
                break;
            first[nq] = i;
            at[nq] = used;
            rq[nq++] = (k3_io_req){.fd = fds[r[i].shard], .offset = start, .len = end - start};
            used += span;
            i = j;
        }
        if (rc) break;
        first[nq] = i;
        if (used > cap) {
            free(buf);
            cap = used;
            buf = k3_dio_alloc(cap);
        }
        for (size_t q = 0; q < nq; q++) rq[q].buf = buf + at[q];
        rc = k3_io_read(io, rq, nq, err);
        if (rc) {
            char m[sizeof err->msg];
            snprintf(m, sizeof m, "%s", err->msg);
            k3_fail(err, rc, "%s: %s", st_shard_at(ix, r[i0].shard)->path, m);
        }
        for (size_t q = 0; q < nq && !rc; q++)
            for (size_t k = first[q]; k < first[q + 1]; k++)
                use(ctx, k, (const uint8_t *)rq[q].data + (r[k].off - rq[q].offset));
        if (stats) {
            stats->reads += nq;
            stats->bytes += used;
        }
    }
    free(buf);
    free(first);
    free(at);
    free(rq);
    return rc;
}

typedef struct {
    ident_hash *ih;
    st_index *ix;
    const ident_range *r;
    uint8_t **dst;           /* samples: where range k's bytes go */
} ident_use;

/* A header: the shard's name and size, then its bytes. */
static void use_header(void *vctx, size_t k, const uint8_t *bytes) {
    ident_use *u = vctx;
    const st_shard *sh = st_shard_at(u->ix, u->r[k].shard);
    const char *base = strrchr(sh->path, '/');
    base = base ? base + 1 : sh->path;
    ih_add(u->ih, base, strlen(base) + 1);
    ih_add(u->ih, &sh->file_size, sizeof sh->file_size);
    ih_add(u->ih, bytes, u->r[k].len);
}

static void use_sample(void *vctx, size_t k, const uint8_t *bytes) {
    ident_use *u = vctx;
    memcpy(u->dst[k], bytes, u->r[k].len);
}

int k3_checkpoint_identity_ex(st_index *ix, int scheme, char out[17], k3_identity_stats *stats, k3_err *err) {
    if (stats) memset(stats, 0, sizeof *stats);
    if (scheme != 1 && scheme != 2) return k3_fail(err, K3_EXIT_DATA, "identity scheme %d is not known", scheme);
    int ns = st_nshards(ix), rc = K3_OK;
    size_t n = st_count(ix);
    ident_hash ih = {.scheme = scheme, .fnv = K3_FNV_OFFSET};
    h64_init(&ih.h);
    int *fds = xmalloc_array((size_t)(ns ? ns : 1), sizeof *fds);
    int *hfds = xmalloc_array((size_t)(ns ? ns : 1), sizeof *hfds);
    for (int s = 0; s < ns; s++) fds[s] = hfds[s] = -1;
    k3_io *hio = k3_io_new(IDENT_DEPTH, false), *io = k3_io_new(IDENT_DEPTH, true);
    /* every shard's name, size and header, in shard order */
    ident_range *hr = xmalloc_array((size_t)(ns ? ns : 1), sizeof *hr);
    for (int s = 0; s < ns; s++) hr[s] = (ident_range){.shard = s, .off = 8, .len = st_shard_at(ix, s)->data_start - 8};
    ident_use u = {.ih = &ih, .ix = ix, .r = hr};
    rc = ident_read(ix, hio, hfds, hr, (size_t)ns, use_header, &u, stats, err);
    free(hr);
    /* the first and last bytes of every trunk tensor, in index order */
    ident_range *tr = xmalloc_array(2 * n + 1, sizeof *tr);
    uint8_t **dst = xmalloc_array(2 * n + 1, sizeof *dst);
    uint8_t *smp = xmalloc(2 * IDENT_SAMPLE * n + 1), *q = smp;
    size_t nr = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const st_tensor *t = st_at(ix, i);
        if (t->nbytes == 0 || !k3_trunk_wants(t->name)) continue;
        uint64_t k = t->nbytes < IDENT_SAMPLE ? t->nbytes : IDENT_SAMPLE;
        dst[nr] = q;
        tr[nr++] = (ident_range){.shard = t->shard, .off = t->offset, .len = k};
        dst[nr] = q + k;
        tr[nr++] = (ident_range){.shard = t->shard, .off = t->offset + t->nbytes - k, .len = k};
        q += 2 * k;
    }
    u = (ident_use){.ih = &ih, .ix = ix, .r = tr, .dst = dst};
    if (!rc) rc = ident_read(ix, io, fds, tr, nr, use_sample, &u, stats, err);
    if (!rc) {
        ih_add(&ih, smp, (size_t)(q - smp));
        uint64_t h = scheme == 1 ? ih.fnv : h64_end(&ih.h);
        snprintf(out, 17, "%016llx", (unsigned long long)h);
    }
    free(tr);
    free(dst);
    free(smp);
    k3_io_free(io);
    k3_io_free(hio);
    for (int s = 0; s < ns; s++) {
        if (fds[s] >= 0) close(fds[s]);
        if (hfds[s] >= 0) close(hfds[s]);
    }
    free(fds);
    free(hfds);
    return rc;
}

int k3_checkpoint_identity(st_index *ix, char out[17], k3_err *err) {
    return k3_checkpoint_identity_ex(ix, K3_IDENTITY_SCHEME, out, NULL, err);
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static int cmp_tensor_src(const void *a, const void *b) {
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return x->offset < y->offset ? -1 : (x->offset > y->offset);
}

static uint32_t table_crc(json_t *root);

int64_t k3_trunk_granule(const k3_trunk_tensor *t, uint64_t *bytes) {
    if (t->rank < 2 || t->shape[0] <= K3_TRUNK_CRC_ROWS || t->nbytes % (uint64_t)t->shape[0]) {
        *bytes = t->nbytes;
        return 1;
    }
    *bytes = t->nbytes / (uint64_t)t->shape[0] * K3_TRUNK_CRC_ROWS;
    return (t->shape[0] + K3_TRUNK_CRC_ROWS - 1) / K3_TRUNK_CRC_ROWS;
}

static json_t *tensor_json(const k3_trunk_tensor *t) {
    json_t *shape = json_array();
    for (int i = 0; i < t->rank; i++) json_array_append_new(shape, json_integer(t->shape[i]));
    char *hex = xmalloc_array((size_t)t->ngran * 8 + 1, 1);
    for (int64_t g = 0; g < t->ngran; g++) snprintf(hex + g * 8, 9, "%08x", t->gcrc[g]);
    hex[t->ngran * 8] = 0;
    /* (the checksums before the offset: an index stays greppable by its offsets) */
    json_t *j = json_pack("{s:s, s:s, s:o, s:s, s:I, s:I}", "name", t->name, "dtype", st_dtype_name(t->dtype),
                          "shape", shape, "rows_crc32c", hex, "offset", (json_int_t)t->offset, "bytes",
                          (json_int_t)t->nbytes);
    free(hex);
    return j;
}

void k3_trunk_free(k3_trunk *t) {
    if (!t) return;
    for (int r = 0; r < t->nruns; r++) {
        for (int i = 0; i < t->runs[r].ntensors; i++) {
            free(t->runs[r].tensors[i].name);
            free(t->runs[r].tensors[i].gcrc);
        }
        free(t->runs[r].tensors);
    }
    free(t->runs);
    free(t->dir);
    free(t->bin_path);
    free(t);
}

/* Where a shard's data and holes are (lseek SEEK_DATA / SEEK_HOLE), for the
 * packer to carry holes over. A filesystem without the two reports all data. */
typedef struct {
    int *fd;           /* per shard, opened on first use; -1 unopened */
    int n;
    int64_t data_end;  /* the data extent found last ends here (absolute) */
} hole_map;

static void holes_close(hole_map *h) {
    for (int i = 0; i < h->n; i++)
        if (h->fd[i] >= 0) close(h->fd[i]);
    free(h->fd);
}

/* Bytes of hole at [off, off + max) of shard s, 0 when off is in data (then
 * data_len gives the length of the data). Never fails: an unreadable map is
 * data, which the read that follows reports if need be. */
static uint64_t hole_len(hole_map *h, st_index *ix, int s, uint64_t off, uint64_t max) {
    h->data_end = -1;
    if (h->fd[s] < 0) h->fd[s] = open(st_shard_at(ix, s)->path, O_RDONLY | O_CLOEXEC);
    if (h->fd[s] < 0 || off > (uint64_t)INT64_MAX) return 0;
    off_t d = lseek(h->fd[s], (off_t)off, SEEK_DATA);
    if (d < 0) return errno == ENXIO ? max : 0; /* ENXIO: only a hole past off */
    if ((uint64_t)d > off) return (uint64_t)d - off < max ? (uint64_t)d - off : max;
    off_t e = lseek(h->fd[s], (off_t)off, SEEK_HOLE);
    h->data_end = e > d ? (int64_t)e : -1;
    return 0;
}

static uint64_t data_len(const hole_map *h, uint64_t off, uint64_t max) {
    uint64_t len = h->data_end > 0 && (uint64_t)h->data_end > off ? (uint64_t)h->data_end - off : max;
    if (len > max) len = max;
    return len < CHUNK ? len : CHUNK;
}

int k3_trunk_pack(const char *model_dir, const char *trunk_dir, k3_err *err) {
    st_index *ix;
    int rc = st_open(model_dir, &ix, err);
    if (rc) return rc;
    if ((rc = k3_mkdir_p(trunk_dir, err))) {
        st_close(ix);
        return rc;
    }
    k3_trunk *t = xcalloc(1, sizeof *t);
    t->identity_scheme = K3_IDENTITY_SCHEME;
    t->dir = xstrdup(trunk_dir);
    t->bin_path = k3_path_join(trunk_dir, "trunk.bin");
    if ((rc = k3_checkpoint_identity(ix, t->identity, err))) goto out;

    /* group trunk tensors by layer: run 0 = model level, run L+1 = layer L */
    int max_layer = -1;
    size_t n = st_count(ix);
    for (size_t i = 0; i < n; i++) {
        const st_tensor *s = st_at(ix, i);
        if (k3_trunk_wants(s->name)) {
            int L = k3_trunk_layer_of(s->name);
            if (L > max_layer) max_layer = L;
        }
    }
    t->nruns = max_layer + 2;
    t->runs = xcalloc((size_t)t->nruns, sizeof *t->runs);
    const st_tensor ***members = xcalloc((size_t)t->nruns, sizeof *members);
    int *cap = xcalloc((size_t)t->nruns, sizeof *cap);
    for (size_t i = 0; i < n; i++) {
        const st_tensor *s = st_at(ix, i);
        if (!k3_trunk_wants(s->name)) continue;
        int r = k3_trunk_layer_of(s->name) + 1;
        k3_trunk_run *run = &t->runs[r];
        if (run->ntensors == cap[r]) {
            cap[r] = cap[r] ? 2 * cap[r] : 32;
            members[r] = xrealloc_array(members[r], (size_t)cap[r], sizeof *members[r]);
        }
        members[r][run->ntensors++] = s;
    }
    /* layout */
    uint64_t off = 0, total = 0;
    for (int r = 0; r < t->nruns; r++) {
        k3_trunk_run *run = &t->runs[r];
        run->layer = r - 1;
        qsort(members[r], (size_t)run->ntensors, sizeof *members[r], cmp_tensor_src);
        run->tensors = xcalloc((size_t)(run->ntensors ? run->ntensors : 1), sizeof *run->tensors);
        off = align_up(off, K3_TRUNK_RUN_ALIGN);
        run->offset = off;
        uint64_t in = 0;
        for (int i = 0; i < run->ntensors; i++) {
            const st_tensor *s = members[r][i];
            k3_trunk_tensor *tt = &run->tensors[i];
            tt->name = xstrdup(s->name);
            tt->dtype = s->dtype;
            tt->rank = s->rank;
            memcpy(tt->shape, s->shape, sizeof tt->shape);
            in = align_up(in, K3_TRUNK_TENSOR_ALIGN);
            tt->offset = in;
            tt->nbytes = s->nbytes;
            uint64_t gb;
            tt->ngran = k3_trunk_granule(tt, &gb);
            tt->gcrc = xcalloc((size_t)tt->ngran, sizeof *tt->gcrc);
            in += s->nbytes;
        }
        run->bytes = in;
        off += in;
        total += in;
    }
    t->file_size = off;

    /* write trunk.bin */
    k3_atomic_file af;
    if ((rc = k3_atomic_open(&af, t->bin_path, err))) goto out_members;
    k3_progress pr;
    k3_progress_start(&pr, "pack-trunk", total, true);
    uint8_t *buf = xmalloc(CHUNK);
    hole_map holes = {xmalloc_array((size_t)st_nshards(ix), sizeof(int)), st_nshards(ix), -1};
    for (int i = 0; i < holes.n; i++) holes.fd[i] = -1;
    uint64_t pos = 0, done = 0;
    for (int r = 0; r < t->nruns && !rc; r++) {
        k3_trunk_run *run = &t->runs[r];
        /* padding is zeros: left as holes, so that a sparse source stays sparse */
        if (run->offset > pos) rc = k3_atomic_skip(&af, run->offset - pos, err);
        pos = run->offset;
        uint32_t crc = 0;
        for (int i = 0; i < run->ntensors && !rc; i++) {
            const st_tensor *s = members[r][i];
            uint64_t want = run->offset + run->tensors[i].offset;
            if (want > pos) {
                crc = k3_crc32c_zeros(crc, want - pos);
                rc = k3_atomic_skip(&af, want - pos, err);
                pos = want;
            }
            k3_trunk_tensor *tt = &run->tensors[i];
            uint64_t gb;
            k3_trunk_granule(tt, &gb);
            for (uint64_t c = 0; c < s->nbytes && !rc;) {
                /* a hole in the source stays a hole: the sparse replica's
                 * 109 GB of trunk is then packed from its headers alone */
                uint64_t hole = hole_len(&holes, ix, s->shard, s->offset + c, s->nbytes - c);
                uint64_t len = hole ? hole : data_len(&holes, s->offset + c, s->nbytes - c);
                if (hole) {
                    rc = k3_atomic_skip(&af, len, err);
                    crc = k3_crc32c_zeros(crc, len);
                } else {
                    rc = st_pread(ix, s->shard, s->offset + c, buf, len, err);
                    if (!rc) rc = k3_atomic_write(&af, buf, len, err);
                    crc = k3_crc32c(crc, buf, len);
                }
                /* the same bytes into their granules' checksums */
                for (uint64_t d = 0; d < len && gb;) {
                    uint64_t at = c + d, g = at / gb, n = (g + 1) * gb - at < len - d ? (g + 1) * gb - at : len - d;
                    tt->gcrc[g] = hole ? k3_crc32c_zeros(tt->gcrc[g], n) : k3_crc32c(tt->gcrc[g], buf + d, n);
                    d += n;
                }
                c += len;
                pos += len;
                done += len;
                k3_progress_update(&pr, done);
            }
        }
        run->crc = crc;
    }
    free(buf);
    holes_close(&holes);
    if (rc) { k3_atomic_abort(&af); goto out_members; }
    k3_progress_finish(&pr);
    /* trunk.bin is written beside the old one, so a failed pack leaves the
     * previous pack whole. Only now, before the new data replaces the old,
     * the old index goes: a stale trunk.json must never describe a new
     * trunk.bin; the new index is written last. */
    char *old_json = k3_path_join(trunk_dir, "trunk.json");
    if (unlink(old_json) != 0 && errno != ENOENT) {
        rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot remove: %s", old_json, strerror(errno));
        free(old_json);
        k3_atomic_abort(&af);
        goto out_members;
    }
    free(old_json);
    if ((rc = k3_atomic_commit(&af, err))) goto out_members;

    /* write trunk.json last: its presence marks a complete pack */
    json_t *root = json_object(), *runs = json_array();
    json_object_set_new(root, "format", json_string("k3-trunk"));
    json_object_set_new(root, "version", json_integer(K3_TRUNK_VERSION));
    json_object_set_new(root, "source_identity", json_string(t->identity));
    json_object_set_new(root, "identity_scheme", json_integer(K3_IDENTITY_SCHEME));
    json_object_set_new(root, "file", json_string("trunk.bin"));
    json_object_set_new(root, "file_size", json_integer((json_int_t)t->file_size));
    for (int r = 0; r < t->nruns; r++) {
        k3_trunk_run *run = &t->runs[r];
        json_t *ts = json_array();
        for (int i = 0; i < run->ntensors; i++) json_array_append_new(ts, tensor_json(&run->tensors[i]));
        char crc[9];
        snprintf(crc, sizeof crc, "%08x", run->crc);
        json_array_append_new(runs, json_pack("{s:i, s:I, s:I, s:s, s:o}", "layer", run->layer, "offset",
                                              (json_int_t)run->offset, "bytes", (json_int_t)run->bytes, "crc32c",
                                              crc, "tensors", ts));
    }
    json_object_set_new(root, "runs", runs);
    char tcrc[9];
    snprintf(tcrc, sizeof tcrc, "%08x", table_crc(root));
    json_object_set_new(root, "table_crc32c", json_string(tcrc));
    char *text = json_dumps(root, JSON_INDENT(1));
    json_decref(root);
    char *jpath = k3_path_join(trunk_dir, "trunk.json");
    rc = k3_write_file_atomic(jpath, text, strlen(text), err);
    free(jpath);
    free(text);
out_members:
    for (int r = 0; r < t->nruns; r++) free(members[r]);
    free(members);
    free(cap);
out:
    k3_trunk_free(t);
    st_close(ix);
    return rc;
}

/* CRC-32C of the index without its own checksum, in one canonical form
 * (compact, keys sorted): an edited offset, dtype, shape or name fails it. */
static uint32_t table_crc(json_t *root) {
    json_t *copy = json_deep_copy(root);
    json_object_del(copy, "table_crc32c");
    char *text = json_dumps(copy, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(copy);
    uint32_t crc = text ? k3_crc32c(0, text, strlen(text)) : 0;
    free(text);
    return crc;
}

static st_dtype dtype_from(const char *s) {
    for (int d = 0; d < ST_NDTYPES; d++)
        if (!strcmp(st_dtype_name((st_dtype)d), s)) return (st_dtype)d;
    return ST_NDTYPES;
}

int k3_trunk_open(const char *trunk_dir, st_index *ix, k3_trunk **out, k3_err *err) {
    char *jpath = k3_path_join(trunk_dir, "trunk.json");
    json_error_t je;
    json_t *root = json_load_file(jpath, 0, &je);
    if (!root) {
        struct stat st;
        int missing = stat(jpath, &st) != 0;
        int rc = missing ? k3_fail(err, K3_EXIT_USAGE, "%s: no packed trunk here (run 'k3 pack-trunk' first)", jpath)
                         : k3_fail(err, K3_EXIT_DATA, "%s: line %d: %s", jpath, je.line, je.text);
        free(jpath);
        return rc;
    }
    int rc = K3_OK;
    k3_trunk *t = xcalloc(1, sizeof *t);
    t->dir = xstrdup(trunk_dir);
    const char *fmt = NULL, *ident = NULL, *file = NULL;
    json_int_t version = 0, fsize = 0;
    json_t *runs = NULL;
    if (json_unpack_ex(root, &je, 0, "{s:s, s:I, s:s, s:s, s:I, s:o}", "format", &fmt, "version", &version,
                       "source_identity", &ident, "file", &file, "file_size", &fsize, "runs", &runs) ||
        strcmp(fmt, "k3-trunk") || strlen(ident) != 16 || !json_is_array(runs) || strchr(file, '/')) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: not a k3 trunk index (format k3-trunk)", jpath);
        goto out;
    }
    if (version != K3_TRUNK_VERSION) {
        rc = k3_fail(err, K3_EXIT_DATA,
                     version < K3_TRUNK_VERSION
                         ? "%s: k3-trunk version %lld, packed by an older k3 (version %d checksums every %d rows of a "
                           "matrix, so a rank can read its rows alone): pack it again (k3 pack-trunk MODEL_DIR TRUNK_DIR)"
                         : "%s: k3-trunk version %lld is newer than this k3 reads (%d, %d rows a checksum)",
                     jpath, (long long)version, K3_TRUNK_VERSION, K3_TRUNK_CRC_ROWS);
        goto out;
    }
    {
        const char *want = json_string_value(json_object_get(root, "table_crc32c"));
        char got[9];
        snprintf(got, sizeof got, "%08x", table_crc(root));
        if (!want) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: packed by an older k3 without an index checksum: pack again", jpath);
            goto out;
        }
        if (strcmp(want, got) != 0) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: index checksum mismatch (table_crc32c %s, computed %s): the index was "
                         "edited or damaged; pack again", jpath, want, got);
            goto out;
        }
    }
    memcpy(t->identity, ident, 17);
    /* absent: packed before scheme 2 existed */
    json_t *js = json_object_get(root, "identity_scheme");
    t->identity_scheme = js ? (int)json_integer_value(js) : 1;
    if (t->identity_scheme != 1 && t->identity_scheme != 2) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: identity_scheme %d is not known (packed by a newer k3?)", jpath,
                     t->identity_scheme);
        goto out;
    }
    t->bin_path = k3_path_join(trunk_dir, file);
    t->file_size = (uint64_t)fsize;
    struct stat st;
    if (stat(t->bin_path, &st) != 0 || (uint64_t)st.st_size != t->file_size) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: missing or wrong size (index says %llu bytes)", t->bin_path,
                     (unsigned long long)t->file_size);
        goto out;
    }
    t->nruns = (int)json_array_size(runs);
    t->runs = xcalloc((size_t)(t->nruns ? t->nruns : 1), sizeof *t->runs);
    for (int r = 0; r < t->nruns && !rc; r++) {
        json_t *jr = json_array_get(runs, (size_t)r), *ts = NULL;
        k3_trunk_run *run = &t->runs[r];
        json_int_t layer, o, b;
        const char *crc;
        if (json_unpack(jr, "{s:I, s:I, s:I, s:s, s:o}", "layer", &layer, "offset", &o, "bytes", &b, "crc32c", &crc,
                        "tensors", &ts) ||
            o < 0 || b < 0 || (uint64_t)o + (uint64_t)b > t->file_size || !json_is_array(ts)) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: run %d is malformed or out of the file's bounds", jpath, r);
            break;
        }
        run->layer = (int)layer;
        run->offset = (uint64_t)o;
        run->bytes = (uint64_t)b;
        run->crc = (uint32_t)strtoul(crc, NULL, 16);
        run->ntensors = (int)json_array_size(ts);
        run->tensors = xcalloc((size_t)(run->ntensors ? run->ntensors : 1), sizeof *run->tensors);
        for (int i = 0; i < run->ntensors; i++) {
            json_t *jt = json_array_get(ts, (size_t)i), *shape = NULL;
            const char *name, *dt, *hex;
            json_int_t to, tb;
            k3_trunk_tensor *tt = &run->tensors[i];
            if (json_unpack(jt, "{s:s, s:s, s:o, s:s, s:I, s:I}", "name", &name, "dtype", &dt, "shape", &shape,
                            "rows_crc32c", &hex, "offset", &to, "bytes", &tb) ||
                dtype_from(dt) == ST_NDTYPES || !json_is_array(shape) || json_array_size(shape) > ST_MAX_RANK ||
                to < 0 || tb < 0 || (uint64_t)to + (uint64_t)tb > run->bytes) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: run %d tensor %d is malformed", jpath, r, i);
                break;
            }
            tt->name = xstrdup(name);
            tt->dtype = dtype_from(dt);
            tt->rank = (int)json_array_size(shape);
            for (int d = 0; d < tt->rank; d++) tt->shape[d] = json_integer_value(json_array_get(shape, (size_t)d));
            tt->offset = (uint64_t)to;
            tt->nbytes = (uint64_t)tb;
            uint64_t gb;
            tt->ngran = k3_trunk_granule(tt, &gb);
            if (strlen(hex) != (size_t)tt->ngran * 8 || strspn(hex, "0123456789abcdef") != strlen(hex)) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: run %d tensor %s: rows_crc32c holds %zu hex digits, not %lld",
                             jpath, r, tt->name, strlen(hex), (long long)tt->ngran * 8);
                break;
            }
            tt->gcrc = xmalloc_array((size_t)tt->ngran, sizeof *tt->gcrc);
            for (int64_t g = 0; g < tt->ngran; g++) {
                char h[9];
                memcpy(h, hex + g * 8, 8);
                h[8] = 0;
                tt->gcrc[g] = (uint32_t)strtoul(h, NULL, 16);
            }
        }
    }
    if (!rc && ix) rc = k3_trunk_check_source(t, ix, err);
out:
    json_decref(root);
    free(jpath);
    if (rc) k3_trunk_free(t);
    else *out = t;
    return rc;
}

static int cmp_ptr(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)*(const void *const *)a, y = (uintptr_t)*(const void *const *)b;
    return x < y ? -1 : x > y;
}

int k3_trunk_check_source(const k3_trunk *t, st_index *ix, k3_err *err) {
    char id[17];
    int irc = k3_checkpoint_identity_ex(ix, t->identity_scheme, id, NULL, err);
    if (irc) return irc;
    if (strcmp(id, t->identity))
        return k3_fail(err, K3_EXIT_DATA, "%s/trunk.json: packed from a different checkpoint (identity %s, model has %s)",
                       t->dir, t->identity, id);
    /* the table against the checkpoint: every tensor where the pack would put
     * it, as the source declares it, without overlaps, and none missing */
    size_t want = 0, have = 0, total = 0;
    for (size_t i = 0; i < st_count(ix); i++) want += k3_trunk_wants(st_at(ix, i)->name);
    for (int r = 0; r < t->nruns; r++) total += (size_t)t->runs[r].ntensors;
    const st_tensor **seen = xcalloc(total ? total : 1, sizeof *seen);
    int rc = K3_OK;
    for (int r = 0; r < t->nruns && !rc; r++) {
        const k3_trunk_run *run = &t->runs[r];
        if (r > 0 && run->offset < t->runs[r - 1].offset + t->runs[r - 1].bytes) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s/trunk.json: run %d overlaps the run before it", t->dir, r);
            break;
        }
        uint64_t end = 0;
        for (int i = 0; i < run->ntensors; i++) {
            const k3_trunk_tensor *tt = &run->tensors[i];
            const st_tensor *s = st_find(ix, tt->name);
            bool ok = s && k3_trunk_wants(tt->name) && k3_trunk_layer_of(tt->name) == run->layer &&
                      s->dtype == tt->dtype && s->rank == tt->rank && s->nbytes == tt->nbytes;
            for (int d = 0; ok && d < s->rank; d++) ok = s->shape[d] == tt->shape[d];
            if (!ok) {
                rc = k3_fail(err, K3_EXIT_DATA,
                             "%s/trunk.json: tensor '%s' (run %d) does not match the checkpoint's name, dtype, shape or layer",
                             t->dir, tt->name, r);
                break;
            }
            if (tt->offset < end || tt->offset % K3_TRUNK_TENSOR_ALIGN) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s/trunk.json: tensor '%s' overlaps another or is misaligned",
                             t->dir, tt->name);
                break;
            }
            end = tt->offset + tt->nbytes;
            seen[have++] = s;
        }
    }
    if (!rc) {
        qsort(seen, have, sizeof *seen, cmp_ptr);
        for (size_t i = 1; i < have && !rc; i++)
            if (seen[i] == seen[i - 1])
                rc = k3_fail(err, K3_EXIT_DATA, "%s/trunk.json: tensor '%s' is indexed twice", t->dir, seen[i]->name);
    }
    free(seen);
    if (rc) return rc;
    if (want != have)
        return k3_fail(err, K3_EXIT_DATA, "%s/trunk.json: indexes %zu trunk tensors, the checkpoint has %zu", t->dir,
                       have, want);
    return K3_OK;
}

const k3_trunk_run *k3_trunk_run_for(const k3_trunk *t, int layer) {
    for (int r = 0; r < t->nruns; r++)
        if (t->runs[r].layer == layer) return &t->runs[r];
    return NULL;
}

int k3_trunk_verify(const char *trunk_dir, const char *model_dir, k3_err *err) {
    st_index *ix;
    int rc = st_open(model_dir, &ix, err);
    if (rc) return rc;
    k3_trunk *t;
    if ((rc = k3_trunk_open(trunk_dir, ix, &t, err))) { st_close(ix); return rc; }
    /* every trunk tensor of the source must be in the pack (the loop below
     * checks the other direction) */
    size_t want = 0, have = 0;
    for (size_t i = 0; i < st_count(ix); i++) want += k3_trunk_wants(st_at(ix, i)->name);
    for (int r = 0; r < t->nruns; r++) have += (size_t)t->runs[r].ntensors;
    if (want != have) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: holds %zu trunk tensors, the source has %zu", t->bin_path, have, want);
        goto out;
    }
    FILE *f = fopen(t->bin_path, "rb");
    if (!f) {
        rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", t->bin_path, strerror(errno));
        goto out;
    }
    uint8_t *a = xmalloc(CHUNK), *b = xmalloc(CHUNK);
    uint64_t total = 0, done = 0;
    for (int r = 0; r < t->nruns; r++) total += t->runs[r].bytes;
    k3_progress pr;
    k3_progress_start(&pr, "verify", total, true);
    for (int r = 0; r < t->nruns && !rc; r++) {
        const k3_trunk_run *run = &t->runs[r];
        uint32_t crc = 0;
        uint64_t pos = 0;
        for (int i = 0; i < run->ntensors && !rc; i++) {
            const k3_trunk_tensor *tt = &run->tensors[i];
            const st_tensor *s = st_find(ix, tt->name);
            if (!s || s->nbytes != tt->nbytes || s->dtype != tt->dtype) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor %s is not in the source as packed", t->bin_path, tt->name);
                break;
            }
            /* padding before the tensor counts in the CRC */
            while (pos < tt->offset && !rc) {
                uint64_t len = tt->offset - pos < CHUNK ? tt->offset - pos : CHUNK;
                if (fseeko(f, (off_t)(run->offset + pos), SEEK_SET) || fread(a, 1, len, f) != len)
                    rc = k3_fail(err, K3_EXIT_DATA, "%s: truncated", t->bin_path);
                crc = k3_crc32c(crc, a, len);
                pos += len;
            }
            uint64_t gb;
            k3_trunk_granule(tt, &gb);
            uint32_t gcrc = 0;
            for (uint64_t c = 0; c < tt->nbytes && !rc; c += CHUNK) {
                uint64_t len = tt->nbytes - c < CHUNK ? tt->nbytes - c : CHUNK;
                if (fseeko(f, (off_t)(run->offset + tt->offset + c), SEEK_SET) || fread(a, 1, len, f) != len) {
                    rc = k3_fail(err, K3_EXIT_DATA, "%s: truncated", t->bin_path);
                    break;
                }
                if ((rc = st_pread(ix, s->shard, s->offset + c, b, len, err))) break;
                if (memcmp(a, b, len)) {
                    rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor %s differs from the source checkpoint", t->bin_path,
                                 tt->name);
                    break;
                }
                crc = k3_crc32c(crc, a, len);
                /* each granule's checksum, as a reader of some rows checks it */
                for (uint64_t d = 0; d < len && !rc;) {
                    uint64_t at = c + d, g = at / gb, n = (g + 1) * gb - at < len - d ? (g + 1) * gb - at : len - d;
                    gcrc = k3_crc32c(gcrc, a + d, n);
                    d += n;
                    if (at + n == (g + 1) * gb || at + n == tt->nbytes) {
                        if (gcrc != tt->gcrc[g])
                            rc = k3_fail(err, K3_EXIT_DATA, "%s: tensor %s: rows %lld.. fail their checksum",
                                         t->bin_path, tt->name, (long long)g * K3_TRUNK_CRC_ROWS);
                        gcrc = 0;
                    }
                }
                pos += len;
                done += len;
                k3_progress_update(&pr, done);
            }
        }
        if (!rc && crc != run->crc)
            rc = k3_fail(err, K3_EXIT_DATA, "%s: run for layer %d fails its checksum", t->bin_path, run->layer);
    }
    if (!rc) k3_progress_finish(&pr);
    free(a);
    free(b);
    fclose(f);
out:
    k3_trunk_free(t);
    st_close(ix);
    return rc;
}
