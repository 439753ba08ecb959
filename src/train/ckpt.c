/* ckpt.c: training checkpoints as one safetensors file (atomic: temp file,
 * fsync, rename, directory fsync).
 *
 * Tensors, all F32, in the parameter table's order: every parameter under its
 * released name; every router bias (…gate.e_score_correction_bias); the
 * optimiser state as "optimizer.m1.<name>" (AdamW first moment, or the Muon
 * momentum) and "optimizer.m2.<name>" (AdamW second moment; absent for Muon
 * parameters, whose m2 is scratch). __metadata__ holds strings: format
 * "k3-train", version, step, total_steps, seed, data_position, optimizer_step,
 * best_val_loss, best_step, the model config (JSON text), the training
 * settings (JSON text), the data directory and payload_crc32c: the CRC-32C
 * (hex) of the whole data section, every weight, bias and optimiser moment,
 * checked by tckpt_open so that a flipped bit is never resumed or exported.
 * Version 1 checkpoints (older k3) carry no checksum: they are still read
 * (tckpt.unverified; the commands say so on stderr once the load succeeded):
 * the header, shape and finiteness checks still apply to them, so a damaged
 * one cannot crash the reader, though a flipped bit goes unnoticed. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats/safetensors.h"
#include "train/tinternal.h"

typedef struct {
    const char *name;
    const float *data;
    size_t n;
    int rank;
    int64_t shape[3];
} wt;

static bool muon_param(const topt *o, const tparam *p) {
    return o->c.muon && (p->group == TG_MUON || p->group == TG_MUON_HEADS);
}


int tckpt_save(const char *path, const tmodel *m, const topt *o, const tckpt_meta *meta, k3_err *err) {
    const int Ne = m->cfg.num_experts;
    size_t cap = (size_t)m->np * 3 + (size_t)m->n_moe + 1, n = 0;
    wt *ts = xcalloc(cap, sizeof(wt));
    char **names = xcalloc(cap, sizeof(char *));
    for (int i = 0; i < m->np; i++) {
        const tparam *p = &m->params[i];
        ts[n] = (wt){p->name, m->w + p->off, p->numel, p->rank, {p->shape[0], p->shape[1], p->shape[2]}};
        n++;
    }
    for (int q = 0; q < m->n_moe; q++) {
        names[n] = xmalloc(160);
        tm_bias_name(m->moe_layer[q], names[n], 160);
        ts[n] = (wt){names[n], m->bias + (size_t)q * Ne, (size_t)Ne, 1, {Ne, 0, 0}};
        n++;
    }
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < m->np; i++) {
            const tparam *p = &m->params[i];
            if (k == 1 && muon_param(o, p)) continue;
            size_t len = strlen(p->name) + 16;
            names[n] = xmalloc(len);
            snprintf(names[n], len, "optimizer.m%d.%s", k + 1, p->name);
            ts[n] = (wt){names[n], (k ? o->m2 : o->m1) + p->off, p->numel, p->rank,
                         {p->shape[0], p->shape[1], p->shape[2]}};
            n++;
        }
    /* metadata: strings, as safetensors requires */
    char num[6][32];
    const char *md[2 * 14];
    size_t nmd = 0;
#define MD(k, v) (md[2 * nmd] = (k), md[2 * nmd + 1] = (v), nmd++)
#define MDI(k, i, v) (snprintf(num[i], sizeof num[i], "%lld", (long long)(v)), MD(k, num[i]))
    uint32_t crc = 0;
    for (size_t i = 0; i < n; i++) crc = k3_crc32c(crc, ts[i].data, ts[i].n * 4);
    char crcs[16];
    snprintf(crcs, sizeof crcs, "%08x", crc);
    MD("format", "k3-train");
    MD("version", "2");
    MD("payload_crc32c", crcs);
    MDI("step", 0, meta->step);
    MDI("total_steps", 1, meta->total_steps);
    MDI("optimizer_step", 2, o->step);
    MDI("data_position", 3, meta->data_position);
    snprintf(num[4], sizeof num[4], "%llu", (unsigned long long)meta->seed);
    MD("seed", num[4]);
    char best[32];
    if (meta->best_step >= 0) {
        snprintf(best, sizeof best, "%.17g", meta->best_val_loss);
        MD("best_val_loss", best);
        MDI("best_step", 5, meta->best_step);
    }
    MD("config", meta->config_json ? meta->config_json : "{}");
    MD("train", meta->train_json ? meta->train_json : "{}");
    MD("data_dir", meta->data_dir ? meta->data_dir : "");
#undef MDI
#undef MD
    st_out_tensor *out = xcalloc(n ? n : 1, sizeof *out);
    for (size_t i = 0; i < n; i++) {
        out[i] = (st_out_tensor){.name = ts[i].name, .dtype = ST_F32, .rank = ts[i].rank, .data = ts[i].data,
                                 .nbytes = ts[i].n * 4};
        for (int r = 0; r < ts[i].rank; r++) out[i].shape[r] = ts[i].shape[r];
    }
    int rc = st_write(path, md, nmd, out, n, err);
    free(out);
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    free(ts);
    return rc;
}

static const char *md(st_index *ix, const char *key) { return st_metadata(ix, 0, key); }

/* CRC-32C of the file's data section (everything after the header). */
static int payload_crc(const char *path, uint32_t *out, k3_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", path, strerror(errno));
    unsigned char h8[8];
    uint64_t hlen = 0;
    int rc = K3_OK;
    if (fread(h8, 1, 8, f) != 8) rc = k3_fail(err, K3_EXIT_DATA, "%s: truncated header", path);
    for (int b = 0; b < 8; b++) hlen |= (uint64_t)h8[b] << (8 * b);
    if (!rc && (hlen > (uint64_t)INT64_MAX - 8 || fseeko(f, (off_t)(8 + hlen), SEEK_SET) != 0))
        rc = k3_fail(err, K3_EXIT_DATA, "%s: bad header length", path);
    const size_t B = 1 << 20;
    unsigned char *buf = xmalloc(B);
    uint32_t crc = 0;
    size_t got;
    while (!rc && (got = fread(buf, 1, B, f)) > 0) crc = k3_crc32c(crc, buf, got);
    if (!rc && ferror(f)) rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: read error: %s", path, strerror(errno));
    free(buf);
    fclose(f);
    *out = crc;
    return rc;
}

/* Metadata numbers: absent -> dflt; present -> a whole decimal in [lo, hi]. */
static bool meta_i64(st_index *ix, const char *key, int64_t lo, int64_t hi, int64_t dflt, int64_t *out) {
    const char *s = md(ix, key);
    if (!s) {
        *out = dflt;
        return true;
    }
    return k3_parse_i64(s, lo, hi, out);
}

static bool meta_u64(const char *s, uint64_t *out) {
    if (!s || *s < '0' || *s > '9') return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end) return false;
    *out = v;
    return true;
}

static bool meta_f64(const char *s, double *out) {
    if (!s) {
        *out = 0.0;
        return true;
    }
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end) return false;
    *out = v;
    return true;
}

int tckpt_open(const char *path, tckpt *ck, k3_err *err) {
    memset(ck, 0, sizeof *ck);
    int rc = st_open(path, &ck->ix, err);
    if (rc) return rc;
    const char *f = md(ck->ix, "format");
    if (!f || strcmp(f, "k3-train") != 0) {
        st_close(ck->ix);
        ck->ix = NULL;
        return k3_fail(err, K3_EXIT_DATA, "%s: not a k3 training checkpoint (no format k3-train)", path);
    }
    const char *keys[] = {"step", "total_steps", "seed", "config", "train", "optimizer_step"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!md(ck->ix, keys[i])) {
            st_close(ck->ix);
            ck->ix = NULL;
            return k3_fail(err, K3_EXIT_DATA, "%s: checkpoint metadata lacks %s", path, keys[i]);
        }
    ck->path = path;
    tckpt_meta *m = &ck->meta;
    /* every number is checked: a corrupt value is a data error, never a silent 0 */
    const char *bad = NULL;
    if (!meta_i64(ck->ix, "step", 0, INT64_MAX / 2, 0, &m->step)) bad = "step";
    else if (!meta_i64(ck->ix, "total_steps", 1, INT64_MAX / 2, 0, &m->total_steps)) bad = "total_steps";
    else if (!meta_u64(md(ck->ix, "seed"), &m->seed)) bad = "seed";
    else if (!meta_i64(ck->ix, "data_position", 0, INT64_MAX, 0, &m->data_position)) bad = "data_position";
    else if (!meta_i64(ck->ix, "best_step", -1, INT64_MAX / 2, -1, &m->best_step)) bad = "best_step";
    else if (!meta_f64(md(ck->ix, "best_val_loss"), &m->best_val_loss)) bad = "best_val_loss";
    else if (!meta_i64(ck->ix, "optimizer_step", 0, INT64_MAX / 2, 0, &ck->opt_step)) bad = "optimizer_step";
    if (bad) {
        st_close(ck->ix);
        ck->ix = NULL;
        return k3_fail(err, K3_EXIT_DATA, "%s: checkpoint metadata %s is not a valid number", path, bad);
    }
    int64_t version = 1;
    if (!meta_i64(ck->ix, "version", 1, 1000, 1, &version) || version > 2) {
        k3_fail(err, K3_EXIT_DATA, "%s: checkpoint version '%.20s' is not one this k3 reads (1 or 2)", path,
                md(ck->ix, "version"));
        st_close(ck->ix);
        ck->ix = NULL;
        return K3_EXIT_DATA;
    }
    const char *want = md(ck->ix, "payload_crc32c");
    if (!want && version >= 2) {
        st_close(ck->ix);
        ck->ix = NULL;
        return k3_fail(err, K3_EXIT_DATA, "%s: checkpoint metadata lacks payload_crc32c", path);
    }
    if (want) {
        uint32_t got = 0;
        if ((rc = payload_crc(path, &got, err))) {
            st_close(ck->ix);
            ck->ix = NULL;
            return rc;
        }
        char gots[16];
        snprintf(gots, sizeof gots, "%08x", got);
        if (strcmp(gots, want) != 0) {
            /* the message first: want lives in the index that st_close frees */
            k3_fail(err, K3_EXIT_DATA,
                    "%s: payload checksum mismatch (crc32c %s, metadata says %s): the weights or optimizer "
                    "state are corrupt", path, gots, want);
            st_close(ck->ix);
            ck->ix = NULL;
            return K3_EXIT_DATA;
        }
    } else {
        ck->unverified = true;
    }
    m->config_json = md(ck->ix, "config");
    m->train_json = md(ck->ix, "train");
    m->data_dir = md(ck->ix, "data_dir");
    return K3_OK;
}

void tckpt_close(tckpt *ck) {
    if (ck->ix) st_close(ck->ix);
    memset(ck, 0, sizeof *ck);
}

static int read_exact(tckpt *ck, const char *name, int rank, const int *shape, float *dst, k3_err *err) {
    const st_tensor *t = st_find(ck->ix, name);
    if (!t) return k3_fail(err, K3_EXIT_DATA, "%s: checkpoint lacks tensor %s", ck->path, name);
    bool ok = t->dtype == ST_F32 && t->rank == rank;
    for (int r = 0; ok && r < rank; r++) ok = t->shape[r] == shape[r];
    if (!ok) return k3_fail(err, K3_EXIT_DATA, "%s: tensor %s has the wrong dtype or shape", ck->path, name);
    return st_read(ck->ix, t, dst, err);
}

static bool finite_all(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

/* Every tensor is checked for finiteness on the way in, whether the caller
 * wants the optimiser state (resume) or not (export): both refuse the same
 * checkpoints. */
int tckpt_load(tckpt *ck, tmodel *m, topt *o, k3_err *err) {
    int rc;
    for (int i = 0; i < m->np; i++) {
        tparam *p = &m->params[i];
        if ((rc = read_exact(ck, p->name, p->rank, p->shape, m->w + p->off, err))) return rc;
        if (!finite_all(m->w + p->off, p->numel))
            return k3_fail(err, K3_EXIT_DATA, "%s: parameter %s is not finite", ck->path, p->name);
    }
    for (int q = 0; q < m->n_moe; q++) {
        char name[160];
        tm_bias_name(m->moe_layer[q], name, sizeof name);
        int sh = m->cfg.num_experts;
        if ((rc = read_exact(ck, name, 1, &sh, m->bias + (size_t)q * sh, err))) return rc;
        if (!finite_all(m->bias + (size_t)q * sh, (size_t)sh))
            return k3_fail(err, K3_EXIT_DATA, "%s: router bias %s is not finite", ck->path, name);
    }
    /* without an optimiser, the moments still exist in the checkpoint and are
     * checked one tensor at a time in a scratch buffer */
    float *scratch = NULL;
    rc = K3_OK;
    for (int k = 0; !rc && k < 2; k++)
        for (int i = 0; !rc && i < m->np; i++) {
            tparam *p = &m->params[i];
            char name[160];
            snprintf(name, sizeof name, "optimizer.m%d.%s", k + 1, p->name);
            float *dst;
            if (o) {
                dst = (k ? o->m2 : o->m1) + p->off;
                if (k == 1 && muon_param(o, p)) {
                    memset(dst, 0, p->numel * sizeof(float));
                    continue;
                }
            } else {
                if (!st_find(ck->ix, name)) continue; /* Muon parameters have no m2 */
                free(scratch);
                dst = scratch = xmalloc_array(p->numel ? p->numel : 1, sizeof(float));
            }
            if ((rc = read_exact(ck, name, p->rank, p->shape, dst, err))) break;
            if (!finite_all(dst, p->numel))
                rc = k3_fail(err, K3_EXIT_DATA, "%s: optimizer state %s is not finite", ck->path, name);
        }
    free(scratch);
    if (rc) return rc;
    if (o) o->step = ck->opt_step;
    return K3_OK;
}
