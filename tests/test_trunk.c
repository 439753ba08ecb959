/* Packed trunk: layout (4 KiB runs, 64-byte tensors), byte equality with the
 * source read independently, the CRC of each run, --verify catching a flipped
 * byte, and refusal of a trunk packed from another checkpoint. */
#include "harness.h"
#include "memory/trunk.h"

#include <stdlib.h>
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
    size_t packed = 0;
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
    free(bin);
    k3_trunk_free(t);
    st_close(ix);
    CHECKF(k3_trunk_verify(dir, model, &err) == 0, "%s", err.msg);
}

TEST(trunk_verify_catches_flipped_byte) {
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char dir[1024], bin[1100];
    snprintf(dir, sizeof dir, "%s/trunk", t_outdir());
    snprintf(bin, sizeof bin, "%s/trunk.bin", dir);
    k3_err err = {0};
    CHECKF(k3_trunk_pack(model, dir, &err) == 0, "%s", err.msg);
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

TEST(trunk_interrupted_pack_is_not_a_trunk) {
    const char *model = t_repo("tests/fixtures/gen/k3_like");
    char dir[1024], json[1100];
    snprintf(dir, sizeof dir, "%s/trunk", t_outdir());
    snprintf(json, sizeof json, "%s/trunk.json", dir);
    k3_err err = {0};
    CHECKF(k3_trunk_pack(model, dir, &err) == 0, "%s", err.msg);
    unlink(json); /* what a kill between the data and the index leaves */
    k3_trunk *t = NULL;
    CHECK(k3_trunk_open(dir, NULL, &t, &err) == K3_EXIT_USAGE);
    CHECKF(strstr(err.msg, "pack-trunk") != NULL, "%s", err.msg);
    /* a missing model directory is a usage error, nothing created */
    CHECK(k3_trunk_pack("tests/out/no-such-model", dir, &err) == K3_EXIT_USAGE);
}
