/* Packed trunk: layout (4 KiB runs, 64-byte tensors), byte equality with the
 * source read independently, the CRC of each run, --verify catching a flipped
 * byte, and refusal of a trunk packed from another checkpoint. */
#include "harness.h"
#include "memory/trunk.h"

#include <stdlib.h>
#include <jansson.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int copy_file(const char *from, const char *to) {
    char *d;
    size_t n;
    k3_err err = {0};
    if (k3_read_file(from, &d, &n, &err)) return 1;
    int rc = k3_write_file_atomic(to, d, n, &err);
    free(d);
    return rc;
}

/* Copies the fixture directory (config, index, shards) into dst. */
static int copy_model(const char *src, const char *dst) {
    if (strlen(src) > 1000 || strlen(dst) > 1000) return 1;
    mkdir(dst, 0755);
    static const char *names[] = {"config.json", "model.safetensors.index.json"};
    char a[4096], b[4096];
    for (int i = 0; i < 2; i++) {
        snprintf(a, sizeof a, "%s/%s", src, names[i]);
        snprintf(b, sizeof b, "%s/%s", dst, names[i]);
        if (copy_file(a, b)) return 1;
    }
    for (int s = 1; s <= 10; s++) {
        snprintf(a, sizeof a, "%s/model-%05d-of-000010.safetensors", src, s);
        snprintf(b, sizeof b, "%s/model-%05d-of-000010.safetensors", dst, s);
        if (copy_file(a, b)) return 1;
    }
    return 0;
}

static char *slurp(const char *path, size_t *n) {
    char *d = NULL;
    k3_err err = {0};
    if (k3_read_file(path, &d, n, &err)) return NULL;
    return d;
}

/* Packs model into this test's trunk/ (dir) and names one of its files
 * (file = dir/name). */
static int pack_trunk_here(const char *model, char *dir, size_t dn, char *file, size_t fn, const char *name,
                        k3_err *err) {
    snprintf(dir, dn, "%s/trunk", t_outdir());
    snprintf(file, fn, "%s/%s", dir, name);
    return k3_trunk_pack(model, dir, err);
}

TEST(trunk_pack_layout_bytes_and_crc) {
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/trunk", t_outdir());
    k3_err err = {0};
    CHECKF(k3_trunk_pack(model, dir, &err) == 0, "%s", err.msg);
    st_index *ix;
    CHECKF(st_open(model, &ix, &err) == 0, "%s", err.msg);
    k3_trunk *t;
    CHECKF(k3_trunk_open(dir, ix, &t, &err) == 0, "%s", err.msg);
    size_t blen;
    char *bin = slurp(t->bin_path, &blen);
    CHECK(bin != NULL && blen == t->file_size);
    /* runs: the model-level run plus one per layer, each on 4 KiB */
    CHECK(k3_trunk_run_for(t, K3_TRUNK_MODEL_RUN) != NULL);
    for (int L = 0; L < t->nruns - 1; L++) CHECKF(k3_trunk_run_for(t, L) != NULL, "layer %d", L);
    size_t packed = 0, multi = 0;
    for (int r = 0; r < t->nruns; r++) {
        const k3_trunk_run *run = &t->runs[r];
        CHECKF(run->offset % 4096 == 0, "run %d at %llu", r, (unsigned long long)run->offset);
        CHECK(run->offset + run->bytes <= blen);
        CHECKF(k3_crc32c(0, bin + run->offset, run->bytes) == run->crc, "run %d crc", r);
        for (int i = 0; i < run->ntensors; i++) {
            const k3_trunk_tensor *tt = &run->tensors[i];
            CHECKF(tt->offset % 64 == 0, "%s at %llu", tt->name, (unsigned long long)tt->offset);
            CHECKF(!strstr(tt->name, ".experts."), "%s packed", tt->name);
            CHECKF(k3_trunk_layer_of(tt->name) == run->layer, "%s in run for layer %d", tt->name, run->layer);
            const st_tensor *s = st_find(ix, tt->name);
            CHECKF(s && s->nbytes == tt->nbytes, "%s", tt->name);
            char *src = malloc(s->nbytes ? s->nbytes : 1);
            CHECK(st_read(ix, s, src, &err) == 0);
            bool same = memcmp(src, bin + run->offset + tt->offset, s->nbytes) == 0;
            /* a checksum per 16 rows of a matrix's first dimension (one for a
             * vector or a matrix of 16 rows or fewer), over the source's bytes */
            int64_t rows = tt->rank >= 2 ? tt->shape[0] : 1;
            uint64_t gb = rows > 16 ? s->nbytes / (uint64_t)rows * 16 : s->nbytes;
            int64_t ng = rows > 16 ? (rows + 15) / 16 : 1;
            CHECKF(tt->ngran == ng, "%s: %lld granules, want %lld", tt->name, (long long)tt->ngran, (long long)ng);
            for (int64_t g = 0; g < ng && tt->ngran == ng; g++) {
                uint64_t o = (uint64_t)g * gb, len = s->nbytes - o < gb ? s->nbytes - o : gb;
                CHECKF(k3_crc32c(0, src + o, len) == tt->gcrc[g], "%s granule %lld", tt->name, (long long)g);
            }
            multi += ng > 1;
            free(src);
            CHECKF(same, "%s differs from the source", tt->name);
            packed++;
        }
    }
    /* every non-expert tensor is packed */
    size_t want = 0;
    for (size_t i = 0; i < st_count(ix); i++)
        if (!strstr(st_at(ix, i)->name, ".experts.")) want++;
    CHECKF(packed == want, "%zu packed of %zu", packed, want);
    CHECKF(multi > 10, "%zu matrices of several granules", multi);
    free(bin);
    k3_trunk_free(t);
    st_close(ix);
    CHECKF(k3_trunk_verify(dir, model, &err) == 0, "%s", err.msg);
}

TEST(trunk_verify_catches_flipped_byte) {
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char dir[1024], bin[1100];
    k3_err err = {0};
    CHECKF(pack_trunk_here(model, dir, sizeof dir, bin, sizeof bin, "trunk.bin", &err) == 0, "%s", err.msg);
    FILE *f = fopen(bin, "r+b");
    CHECK(f != NULL);
    fseek(f, 4096 + 100, SEEK_SET);
    int c = fgetc(f);
    fseek(f, 4096 + 100, SEEK_SET);
    fputc(c ^ 0x10, f);
    fclose(f);
    CHECK(k3_trunk_verify(dir, model, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "trunk.bin") != NULL, "%s", err.msg);
    /* packing again over the damaged trunk restores it */
    CHECKF(k3_trunk_pack(model, dir, &err) == 0, "%s", err.msg);
    CHECKF(k3_trunk_verify(dir, model, &err) == 0, "%s", err.msg);
}

static uint64_t allocated_bytes(const char *path) {
    struct stat st;
    return stat(path, &st) ? 0 : (uint64_t)st.st_blocks * 512u;
}

/* A source whose data is mostly holes (as in the sparse replica of the
 * release) packs into a trunk that is mostly holes, with the same bytes. */
TEST(trunk_pack_keeps_source_holes) {
    char model[1024], dense[1100], sparse[1100];
    snprintf(model, sizeof model, "%s/model", t_outdir());
    snprintf(dense, sizeof dense, "%s/dense", t_outdir());
    snprintf(sparse, sizeof sparse, "%s/sparse", t_outdir());
    CHECK(copy_model(t_repo("tests/fixtures/gen/k3_like"), model) == 0);
    k3_err err = {0};
    CHECKF(k3_trunk_pack(model, dense, &err) == 0, "%s", err.msg);
    /* every shard's data, 4 KiB-aligned, made a hole (it then reads as zeros) */
    st_index *ix;
    CHECKF(st_open(model, &ix, &err) == 0, "%s", err.msg);
    for (int s = 0; s < st_nshards(ix); s++) {
        const st_shard *sh = st_shard_at(ix, s);
        uint64_t a = (sh->data_start + 4095) / 4096 * 4096, b = sh->file_size / 4096 * 4096;
        if (b <= a) continue;
        int fd = open(sh->path, O_RDWR);
        CHECK(fd >= 0);
        if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)a, (off_t)(b - a)) != 0) {
            close(fd);
            st_close(ix);
            char why[160];
            snprintf(why, sizeof why, "this filesystem cannot punch holes: %s", strerror(errno));
            t_skip(why);
            return;
        }
        close(fd);
    }
    st_close(ix);
    CHECKF(st_open(model, &ix, &err) == 0, "%s", err.msg);
    CHECKF(k3_trunk_pack(model, sparse, &err) == 0, "%s", err.msg);
    k3_trunk *t;
    CHECKF(k3_trunk_open(sparse, ix, &t, &err) == 0, "%s", err.msg);
    size_t blen;
    char *bin = slurp(t->bin_path, &blen);
    CHECK(bin != NULL && blen == t->file_size);
    /* the bytes read back are the source's, and each run's CRC is theirs */
    size_t zero_tensors = 0;
    for (int r = 0; r < t->nruns && bin; r++) {
        const k3_trunk_run *run = &t->runs[r];
        CHECKF(k3_crc32c(0, bin + run->offset, run->bytes) == run->crc, "run %d crc", r);
        for (int i = 0; i < run->ntensors; i++) {
            const k3_trunk_tensor *tt = &run->tensors[i];
            const st_tensor *s = st_find(ix, tt->name);
            CHECK(s != NULL);
            char *src = xmalloc(s->nbytes ? s->nbytes : 1);
            CHECK(st_read(ix, s, src, &err) == 0);
            CHECKF(memcmp(src, bin + run->offset + tt->offset, s->nbytes) == 0, "%s", tt->name);
            bool zero = true;
            for (uint64_t k = 0; k < s->nbytes && zero; k++) zero = src[k] == 0;
            zero_tensors += zero;
            free(src);
        }
    }
    CHECK(zero_tensors > 0); /* the holes really reached the packed tensors */
    CHECKF(k3_trunk_verify(sparse, model, &err) == 0, "%s", err.msg);
    char dbin[1200];
    snprintf(dbin, sizeof dbin, "%s/trunk.bin", dense);
    uint64_t on_disk = allocated_bytes(t->bin_path), dense_disk = allocated_bytes(dbin);
    CHECKF(dense_disk >= t->file_size && on_disk * 4 < t->file_size, "sparse pack holds %llu bytes on disk of %llu (dense %llu)",
           (unsigned long long)on_disk, (unsigned long long)t->file_size, (unsigned long long)dense_disk);
    free(bin);
    k3_trunk_free(t);
    st_close(ix);
}

TEST(trunk_from_other_checkpoint_refused) {
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char dir[1024], copy[1024];
    snprintf(dir, sizeof dir, "%s/trunk", t_outdir());
    snprintf(copy, sizeof copy, "%s/model", t_outdir());
    k3_err err = {0};
    CHECKF(k3_trunk_pack(model, dir, &err) == 0, "%s", err.msg);
    /* another architecture */
    st_index *other;
    CHECK(st_open(t_repo("tests/fixtures/gen/s2_two_dense"), &other, &err) == 0);
    k3_trunk *t = NULL;
    CHECK(k3_trunk_open(dir, other, &t, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "different checkpoint") != NULL, "%s", err.msg);
    st_close(other);
    /* the same headers with other weights (a retrained checkpoint): change the
     * first byte of one trunk tensor in a copy */
    CHECK(copy_model(model, copy) == 0);
    st_index *ix;
    CHECK(st_open(copy, &ix, &err) == 0);
    const st_tensor *s = st_find(ix, "language_model.model.layers.1.input_layernorm.weight");
    CHECK(s != NULL);
    char path[1100];
    snprintf(path, sizeof path, "%s", st_shard_at(ix, s->shard)->path);
    uint64_t off = s->offset;
    st_close(ix);
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    fseek(f, (long)off, SEEK_SET);
    int c = fgetc(f);
    fseek(f, (long)off, SEEK_SET);
    fputc(c ^ 1, f);
    fclose(f);
    CHECK(st_open(copy, &ix, &err) == 0);
    CHECK(k3_trunk_open(dir, ix, &t, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "different checkpoint") != NULL, "%s", err.msg);
    st_close(ix);
}

/* The identity as it was first defined, one read per sample: the batched
 * reads must give the same value (trunks packed before stay valid). */
static int identity_one_by_one(st_index *ix, char out[17], size_t *samples) {
    k3_err err = {0};
    uint64_t h = K3_FNV_OFFSET;
    for (int s = 0; s < st_nshards(ix); s++) {
        const st_shard *sh = st_shard_at(ix, s);
        const char *base = strrchr(sh->path, '/');
        base = base ? base + 1 : sh->path;
        h = k3_fnv1a64(h, base, strlen(base) + 1);
        h = k3_fnv1a64(h, &sh->file_size, sizeof sh->file_size);
        char *hdr = xmalloc(sh->data_start - 8);
        if (st_pread(ix, s, 8, hdr, sh->data_start - 8, &err)) return 1;
        h = k3_fnv1a64(h, hdr, sh->data_start - 8);
        free(hdr);
    }
    *samples = 0;
    for (size_t i = 0; i < st_count(ix); i++) {
        const st_tensor *t = st_at(ix, i);
        if (!k3_trunk_wants(t->name) || t->nbytes == 0) continue;
        uint8_t buf[128];
        uint64_t k = t->nbytes < 64 ? t->nbytes : 64;
        if (st_pread(ix, t->shard, t->offset, buf, k, &err) ||
            st_pread(ix, t->shard, t->offset + t->nbytes - k, buf + k, k, &err))
            return 1;
        h = k3_fnv1a64(h, buf, 2 * k);
        *samples += 2;
    }
    snprintf(out, 17, "%016llx", (unsigned long long)h);
    return 0;
}

TEST(trunk_identity_batched_reads_same_value) {
    static const char *models[] = {"tests/fixtures/gen/k3_like", "tests/fixtures/gen/s2_two_dense",
                                   "peer/tiny-checkpoint"};
    for (int m = 0; m < 3; m++) {
        const char *dir = m < 2 ? t_repo(models[m]) : t_fixture(models[m]);
        st_index *ix;
        k3_err err = {0};
        CHECKF(st_open(dir, &ix, &err) == 0, "%s", err.msg);
        char want[17], got[17];
        size_t samples = 0;
        CHECK(identity_one_by_one(ix, want, &samples) == 0);
        k3_identity_stats st;
        CHECKF(k3_checkpoint_identity_ex(ix, 1, got, &st, &err) == 0, "%s", err.msg);
        CHECKF(!strcmp(got, want), "%s: %s vs %s one by one", models[m], got, want);
        /* scheme 2 hashes the same bytes with another function */
        char v2[17];
        CHECKF(k3_checkpoint_identity_ex(ix, 2, v2, NULL, &err) == 0, "%s", err.msg);
        CHECKF(strcmp(v2, want) != 0, "%s: scheme 2 gave the FNV value", models[m]);
        /* the samples were merged into far fewer reads (headers included) */
        CHECKF(st.reads > 0 && st.reads * 4 <= samples + (size_t)st_nshards(ix) * 4, "%s: %llu reads for %zu samples",
               models[m], (unsigned long long)st.reads, samples);
        st_close(ix);
    }
    /* a flipped byte at the end of a matrix changes it too */
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char copy[1024];
    snprintf(copy, sizeof copy, "%s/model", t_outdir());
    CHECK(copy_model(model, copy) == 0);
    st_index *ix;
    k3_err err = {0};
    CHECK(st_open(copy, &ix, &err) == 0);
    char before[17], after[17];
    CHECK(k3_checkpoint_identity(ix, before, &err) == 0);
    const st_tensor *s = st_find(ix, "language_model.model.layers.2.self_attn.o_proj.weight");
    CHECK(s != NULL);
    char path[1100];
    snprintf(path, sizeof path, "%s", st_shard_at(ix, s->shard)->path);
    uint64_t off = s->offset + s->nbytes - 1;
    st_close(ix);
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    fseek(f, (long)off, SEEK_SET);
    int c = fgetc(f);
    fseek(f, (long)off, SEEK_SET);
    fputc(c ^ 0x10, f);
    fclose(f);
    CHECK(st_open(copy, &ix, &err) == 0);
    CHECK(k3_checkpoint_identity(ix, after, &err) == 0);
    CHECKF(strcmp(before, after) != 0, "identity unchanged by a flipped last byte: %s", after);
    st_close(ix);
}

/* A trunk.json written before identity schemes existed (no "identity_scheme",
 * an FNV-1a identity) is still accepted for its checkpoint, and refused for
 * another. */
/* Writes an edited index with a valid table checksum (the canonical form:
 * compact, sorted keys, without the checksum itself); takes root. */
static int write_signed_index(const char *json, json_t *root) {
    json_object_del(root, "table_crc32c");
    char *canon = json_dumps(root, JSON_COMPACT | JSON_SORT_KEYS);
    char crc[9];
    snprintf(crc, sizeof crc, "%08x", k3_crc32c(0, canon, strlen(canon)));
    free(canon);
    json_object_set_new(root, "table_crc32c", json_string(crc));
    char *text = json_dumps(root, JSON_INDENT(1));
    json_decref(root);
    k3_err err = {0};
    int rc = k3_write_file_atomic(json, text, strlen(text), &err);
    free(text);
    return rc;
}

/* An index of format version 1 (no per-rows checksums) is refused with a
 * line saying to pack again, even with a valid table checksum. */
TEST(trunk_version_1_refused) {
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char dir[1024], json[1100];
    k3_err err = {0};
    CHECKF(pack_trunk_here(model, dir, sizeof dir, json, sizeof json, "trunk.json", &err) == 0, "%s", err.msg);
    json_t *root = json_load_file(json, 0, NULL);
    CHECK(root != NULL);
    CHECK(json_integer_value(json_object_get(root, "version")) == 2);
    json_object_set_new(root, "version", json_integer(1));
    CHECK(write_signed_index(json, root) == 0);
    k3_trunk *t = NULL;
    CHECK(k3_trunk_open(dir, NULL, &t, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "version 1") && strstr(err.msg, "pack it again"), "%s", err.msg);
}

TEST(trunk_old_identity_scheme_accepted) {
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char dir[1024], json[1100];
    k3_err err = {0};
    CHECKF(pack_trunk_here(model, dir, sizeof dir, json, sizeof json, "trunk.json", &err) == 0, "%s", err.msg);
    st_index *ix;
    CHECK(st_open(model, &ix, &err) == 0);
    char v1[17], v2[17];
    CHECK(k3_checkpoint_identity_ex(ix, 1, v1, NULL, &err) == 0);
    CHECK(k3_checkpoint_identity_ex(ix, 2, v2, NULL, &err) == 0);
    char *text;
    size_t n;
    CHECK(k3_read_file(json, &text, &n, &err) == 0);
    char *at = strstr(text, v2), *sch = strstr(text, "\"identity_scheme\"");
    CHECK(at != NULL && sch != NULL);
    memcpy(at, v1, 16);
    memcpy(sch, "\"identity_schemX\"", 17); /* an unknown key: as if absent */
    json_t *root = json_loads(text, 0, NULL);
    free(text);
    CHECK(root != NULL && write_signed_index(json, root) == 0);
    k3_trunk *t = NULL;
    CHECKF(k3_trunk_open(dir, ix, &t, &err) == 0, "%s", err.msg);
    CHECK(t->identity_scheme == 1);
    k3_trunk_free(t);
    st_close(ix);
    CHECK(st_open(t_repo("tests/fixtures/gen/s2_two_dense"), &ix, &err) == 0);
    CHECK(k3_trunk_open(dir, ix, &t, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "different checkpoint") != NULL, "%s", err.msg);
    st_close(ix);
}

/* An index without its checksum (packed before it existed, or stripped) is
 * refused: an edited offset there would otherwise be read as wrong weights. */
TEST(trunk_index_without_checksum_refused) {
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char dir[1024], json[1100];
    k3_err err = {0};
    CHECKF(pack_trunk_here(model, dir, sizeof dir, json, sizeof json, "trunk.json", &err) == 0, "%s", err.msg);
    char *text;
    size_t n;
    CHECK(k3_read_file(json, &text, &n, &err) == 0);
    char *at = strstr(text, "\"table_crc32c\"");
    CHECK(at != NULL);
    memcpy(at, "\"table_crc32X\"", 14);
    CHECK(k3_write_file_atomic(json, text, n, &err) == 0);
    free(text);
    k3_trunk *t = NULL;
    CHECK(k3_trunk_open(dir, NULL, &t, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "checksum") != NULL, "%s", err.msg);
}

TEST(trunk_interrupted_pack_is_not_a_trunk) {
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char dir[1024], json[1100];
    k3_err err = {0};
    CHECKF(pack_trunk_here(model, dir, sizeof dir, json, sizeof json, "trunk.json", &err) == 0, "%s", err.msg);
    unlink(json); /* what a kill between the data and the index leaves */
    k3_trunk *t = NULL;
    CHECK(k3_trunk_open(dir, NULL, &t, &err) == K3_EXIT_USAGE);
    CHECKF(strstr(err.msg, "pack-trunk") != NULL, "%s", err.msg);
    /* a missing model directory is a usage error, nothing created */
    CHECK(k3_trunk_pack("tests/out/no-such-model", dir, &err) == K3_EXIT_USAGE);
}
