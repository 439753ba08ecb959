/* identity.c: a checkpoint directory's identity (identity.h). */
#include "formats/identity.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* The file's length and bytes; an absent optional file counts as "-". */
static int hash_file(uint64_t *h, const char *path, bool optional, k3_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (optional && errno == ENOENT) {
            *h = k3_fnv1a64(*h, "-", 1);
            return K3_OK;
        }
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: %s", path, strerror(errno));
    }
    fclose(f);
    char *d = NULL;
    size_t n = 0;
    int rc = k3_read_file(path, &d, &n, err);
    if (rc) return rc;
    *h = k3_fnv1a64(*h, &n, sizeof n);
    *h = k3_fnv1a64(*h, d, n);
    free(d);
    return K3_OK;
}

/* Shard i's name, 8-byte length and JSON header, and a sample of its data. */
static int hash_shard(uint64_t *h, st_index *ix, int i, k3_err *err) {
    enum { SAMPLE = 4096 };
    const st_shard *sh = st_shard_at(ix, i);
    const char *slash = strrchr(sh->path, '/');
    const char *name = slash ? slash + 1 : sh->path;
    *h = k3_fnv1a64(*h, name, strlen(name) + 1);
    uint64_t head = sh->data_start; /* 8 + header length, both hashed as stored */
    uint8_t *b = xmalloc(head > SAMPLE ? head : SAMPLE);
    int rc = st_pread(ix, i, 0, b, head, err);
    if (!rc) {
        *h = k3_fnv1a64(*h, b, (size_t)head);
        uint64_t k = sh->file_size - head < SAMPLE ? sh->file_size - head : SAMPLE;
        rc = st_pread(ix, i, head, b, k, err);
        if (!rc) *h = k3_fnv1a64(*h, b, (size_t)k);
    }
    if (!rc && sh->file_size >= SAMPLE) {
        rc = st_pread(ix, i, sh->file_size - SAMPLE, b, SAMPLE, err);
        if (!rc) *h = k3_fnv1a64(*h, b, SAMPLE);
    }
    free(b);
    return rc;
}

int k3_model_identity_of(const char *model_dir, st_index *ix, const char *tok_dir, uint64_t salt, uint64_t *out,
                           k3_err *err) {
    uint64_t h = k3_fnv1a64(K3_FNV_OFFSET, &salt, sizeof salt);
    char *p = k3_path_join(model_dir, "config.json");
    int rc = hash_file(&h, p, false, err);
    free(p);
    for (int i = 0; !rc && i < st_nshards(ix); i++) rc = hash_shard(&h, ix, i, err);
    const char *td = tok_dir ? tok_dir : model_dir;
    static const char *const tf[] = {"tiktoken.model", "tokenizer_config.json"};
    for (int i = 0; i < 2 && !rc; i++) {
        p = k3_path_join(td, tf[i]);
        rc = hash_file(&h, p, true, err);
        free(p);
    }
    if (rc) return rc;
    *out = h;
    return K3_OK;
}

int k3_model_identity(const char *model_dir, const char *tok_dir, uint64_t salt, uint64_t *out, k3_err *err) {
    st_index *ix = NULL;
    int rc = st_open(model_dir, &ix, err);
    if (!rc) rc = k3_model_identity_of(model_dir, ix, tok_dir, salt, out, err);
    st_close(ix);
    return rc;
}
