/* trunk.c: packing, verifying and opening a packed trunk (trunk.h). */
#include "memory/trunk.h"

#include <errno.h>
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
 * Cost: two small reads per trunk tensor (about 4,600 for the real K3). */
#define IDENT_SAMPLE 64
int k3_checkpoint_identity(st_index *ix, char out[17], k3_err *err) {
    uint64_t h = K3_FNV_OFFSET;
    for (int s = 0; s < st_nshards(ix); s++) {
        const st_shard *sh = st_shard_at(ix, s);
        const char *base = strrchr(sh->path, '/');
        base = base ? base + 1 : sh->path;
        h = k3_fnv1a64(h, base, strlen(base) + 1);
        h = k3_fnv1a64(h, &sh->file_size, sizeof sh->file_size);
        uint64_t hl = sh->data_start - 8;
        char *hdr = xmalloc(hl ? hl : 1);
        int rc = st_pread(ix, s, 8, hdr, hl, err);
        if (rc) { free(hdr); return rc; }
        h = k3_fnv1a64(h, hdr, hl);
        free(hdr);
    }
    size_t n = st_count(ix);
    uint8_t buf[2 * IDENT_SAMPLE];
    for (size_t i = 0; i < n; i++) {
        const st_tensor *t = st_at(ix, i);
        if (!k3_trunk_wants(t->name) || t->nbytes == 0) continue;
        uint64_t k = t->nbytes < IDENT_SAMPLE ? t->nbytes : IDENT_SAMPLE;
        int rc = st_pread(ix, t->shard, t->offset, buf, k, err);
        if (!rc) rc = st_pread(ix, t->shard, t->offset + t->nbytes - k, buf + k, k, err);
        if (rc) return rc;
        h = k3_fnv1a64(h, buf, 2 * k);
    }
    snprintf(out, 17, "%016llx", (unsigned long long)h);
    return K3_OK;
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static int cmp_tensor_src(const void *a, const void *b) {
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return x->offset < y->offset ? -1 : (x->offset > y->offset);
}

static char *join(const char *dir, const char *file) {
    size_t n = strlen(dir) + strlen(file) + 2;
    char *p = xmalloc(n);
    snprintf(p, n, "%s/%s", dir, file);
    return p;
}

static json_t *tensor_json(const k3_trunk_tensor *t) {
    json_t *shape = json_array();
    for (int i = 0; i < t->rank; i++) json_array_append_new(shape, json_integer(t->shape[i]));
    return json_pack("{s:s, s:s, s:o, s:I, s:I}", "name", t->name, "dtype", st_dtype_name(t->dtype), "shape",
                     shape, "offset", (json_int_t)t->offset, "bytes", (json_int_t)t->nbytes);
}

void k3_trunk_free(k3_trunk *t) {
    if (!t) return;
    for (int r = 0; r < t->nruns; r++) {
        for (int i = 0; i < t->runs[r].ntensors; i++) free(t->runs[r].tensors[i].name);
        free(t->runs[r].tensors);
    }
    free(t->runs);
    free(t->dir);
    free(t->bin_path);
    free(t);
}

int k3_trunk_pack(const char *model_dir, const char *trunk_dir, k3_err *err) {
    st_index *ix;
    int rc = st_open(model_dir, &ix, err);
    if (rc) return rc;
    if (mkdir(trunk_dir, 0755) != 0 && errno != EEXIST) {
        st_close(ix);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot create directory: %s", trunk_dir, strerror(errno));
    }
    k3_trunk *t = xcalloc(1, sizeof *t);
    t->dir = xstrdup(trunk_dir);
    t->bin_path = join(trunk_dir, "trunk.bin");
    /* A stale trunk.json next to a half-rewritten trunk.bin must never look
     * complete: drop the index first; it is written again last. */
    char *old_json = join(trunk_dir, "trunk.json");
    if (unlink(old_json) != 0 && errno != ENOENT) {
        rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot remove: %s", old_json, strerror(errno));
        free(old_json);
        goto out;
    }
    free(old_json);
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
    static const uint8_t zeros[K3_TRUNK_RUN_ALIGN];
    uint64_t pos = 0, done = 0;
    for (int r = 0; r < t->nruns && !rc; r++) {
        k3_trunk_run *run = &t->runs[r];
        if (run->offset > pos) rc = k3_atomic_write(&af, zeros, run->offset - pos, err);
        pos = run->offset;
        uint32_t crc = 0;
        for (int i = 0; i < run->ntensors && !rc; i++) {
            const st_tensor *s = members[r][i];
            uint64_t want = run->offset + run->tensors[i].offset;
            if (want > pos) {
                crc = k3_crc32c(crc, zeros, want - pos);
                rc = k3_atomic_write(&af, zeros, want - pos, err);
                pos = want;
            }
            for (uint64_t c = 0; c < s->nbytes && !rc; c += CHUNK) {
                uint64_t len = s->nbytes - c < CHUNK ? s->nbytes - c : CHUNK;
                rc = st_pread(ix, s->shard, s->offset + c, buf, len, err);
                if (!rc) rc = k3_atomic_write(&af, buf, len, err);
                crc = k3_crc32c(crc, buf, len);
                pos += len;
                done += len;
                k3_progress_update(&pr, done);
            }
        }
        run->crc = crc;
    }
    free(buf);
    if (rc) { k3_atomic_abort(&af); goto out_members; }
    k3_progress_finish(&pr);
    if ((rc = k3_atomic_commit(&af, err))) goto out_members;

    /* write trunk.json last: its presence marks a complete pack */
    json_t *root = json_object(), *runs = json_array();
    json_object_set_new(root, "format", json_string("k3-trunk"));
    json_object_set_new(root, "version", json_integer(1));
    json_object_set_new(root, "source_identity", json_string(t->identity));
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
    char *text = json_dumps(root, JSON_INDENT(1));
    json_decref(root);
    char *jpath = join(trunk_dir, "trunk.json");
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

static st_dtype dtype_from(const char *s) {
    for (int d = 0; d < ST_NDTYPES; d++)
        if (!strcmp(st_dtype_name((st_dtype)d), s)) return (st_dtype)d;
    return ST_NDTYPES;
}

int k3_trunk_open(const char *trunk_dir, st_index *ix, k3_trunk **out, k3_err *err) {
    char *jpath = join(trunk_dir, "trunk.json");
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
        strcmp(fmt, "k3-trunk") || version != 1 || strlen(ident) != 16 || !json_is_array(runs) || strchr(file, '/')) {
        rc = k3_fail(err, K3_EXIT_DATA, "%s: not a k3 trunk index (format k3-trunk version 1)", jpath);
        goto out;
    }
    memcpy(t->identity, ident, 17);
    t->bin_path = join(trunk_dir, file);
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
            const char *name, *dt;
            json_int_t to, tb;
            k3_trunk_tensor *tt = &run->tensors[i];
            if (json_unpack(jt, "{s:s, s:s, s:o, s:I, s:I}", "name", &name, "dtype", &dt, "shape", &shape, "offset",
                            &to, "bytes", &tb) ||
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

int k3_trunk_check_source(const k3_trunk *t, st_index *ix, k3_err *err) {
    char id[17];
    int rc = k3_checkpoint_identity(ix, id, err);
    if (rc) return rc;
    if (strcmp(id, t->identity))
        return k3_fail(err, K3_EXIT_DATA, "%s/trunk.json: packed from a different checkpoint (identity %s, model has %s)",
                       t->dir, t->identity, id);
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
