/* Tests for token shards (train/data.h): write/read round trips at both
 * widths, the exact header bytes, and the errors for damaged or mismatched
 * shards. */
#include "harness.h"
#include "train/data.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int write_shard(const char *path, uint32_t vocab, const int32_t *ids, size_t n,
                       uint64_t hash, k3_err *err) {
    k3_shard_writer *w;
    int rc = shard_writer_open(path, vocab, 0, hash, &w, err);
    if (rc) return rc;
    /* in two appends, to cover the buffer reuse */
    if ((rc = shard_writer_append(w, ids, n / 2, err)) ||
        (rc = shard_writer_append(w, ids + n / 2, n - n / 2, err))) {
        shard_writer_abort(w);
        return rc;
    }
    shard_writer_add_docs(w, 3);
    return shard_writer_commit(w, NULL, err);
}

TEST(shard_roundtrip_uint16_and_uint32) {
    uint32_t vocabs[2] = {65536, 65537};
    for (int v = 0; v < 2; v++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/s%d.bin", t_outdir(), v);
        int32_t ids[1000];
        for (int i = 0; i < 1000; i++) ids[i] = (int32_t)(((uint32_t)i * 2654435761u) % vocabs[v]);
        ids[7] = (int32_t)vocabs[v] - 1;
        k3_err err = {0};
        CHECKF(write_shard(path, vocabs[v], ids, 1000, 42, &err) == 0, "%s", err.msg);
        k3_shard s;
        CHECKF(shard_open(path, vocabs[v], 42, &s, &err) == 0, "%s", err.msg);
        CHECK(s.info.token_bytes == (v == 0 ? 2u : 4u));
        CHECK(s.info.n_tokens == 1000 && s.info.n_docs == 3 && s.info.eot_id == 0);
        CHECK(s.map_len == 64 + 1000 * (size_t)s.info.token_bytes);
        int32_t back[1000];
        shard_read(&s, 0, 1000, back);
        CHECK(memcmp(back, ids, sizeof ids) == 0);
        CHECK(shard_token(&s, 7) == (int32_t)vocabs[v] - 1);
        shard_close(&s);
    }
}

/* The header layout documented in data.h, checked byte by byte. */
TEST(shard_header_bytes_are_as_documented) {
    char path[1024];
    snprintf(path, sizeof path, "%s/h.bin", t_outdir());
    int32_t ids[3] = {1, 258, 7};
    k3_err err = {0};
    k3_shard_writer *w;
    CHECK(shard_writer_open(path, 300, 299, 0x1122334455667788ull, &w, &err) == 0);
    CHECK(shard_writer_append(w, ids, 3, &err) == 0);
    shard_writer_add_docs(w, 1);
    CHECK(shard_writer_commit(w, NULL, &err) == 0);
    char *d;
    size_t n;
    CHECK(k3_read_file(path, &d, &n, &err) == 0);
    const uint8_t want[70] = {'K', '3', 'T', 'O', 'K', 'E', 'N', 'S', 1, 0, 0, 0, 0x2c, 1, 0, 0,
                              2, 0, 0, 0, 0x2b, 1, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0,
                              1, 0, 0, 0, 0, 0, 0, 0, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,
                              0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                              1, 0, 2, 1, 7, 0};
    CHECKF(n == 70, "size %zu", n);
    CHECK(memcmp(d, want, 70) == 0);
    free(d);
}

static void corrupt_copy(const char *src, const char *dst, long truncate_to, long poke_at,
                         uint8_t poke, const char *append) {
    char *d;
    size_t n;
    k3_err err = {0};
    if (k3_read_file(src, &d, &n, &err)) return;
    if (truncate_to >= 0) n = (size_t)truncate_to;
    if (poke_at >= 0) d[poke_at] = (char)poke;
    FILE *f = fopen(dst, "wb");
    fwrite(d, 1, n, f);
    if (append) fputs(append, f);
    fclose(f);
    free(d);
}

TEST(shard_errors_are_clear) {
    char good[1024], bad[1024];
    snprintf(good, sizeof good, "%s/g.bin", t_outdir());
    snprintf(bad, sizeof bad, "%s/b.bin", t_outdir());
    int32_t ids[100];
    for (int i = 0; i < 100; i++) ids[i] = i;
    k3_err err = {0};
    CHECK(write_shard(good, 1000, ids, 100, 5, &err) == 0);
    k3_shard s;

    corrupt_copy(good, bad, 64 + 150, -1, 0, NULL); /* cut in the middle of the tokens */
    CHECK(shard_open(bad, 0, 0, &s, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "truncated shard") && strstr(err.msg, bad), "%s", err.msg);
    corrupt_copy(good, bad, 10, -1, 0, NULL); /* cut inside the header */
    CHECK(shard_open(bad, 0, 0, &s, &err) == K3_EXIT_DATA && strstr(err.msg, "truncated"));
    corrupt_copy(good, bad, -1, -1, 0, "x"); /* trailing garbage */
    CHECK(shard_open(bad, 0, 0, &s, &err) == K3_EXIT_DATA && strstr(err.msg, "after the last token"));
    corrupt_copy(good, bad, -1, 0, 'X', NULL);
    CHECK(shard_open(bad, 0, 0, &s, &err) == K3_EXIT_DATA && strstr(err.msg, "bad magic"));
    corrupt_copy(good, bad, -1, 8, 9, NULL);
    CHECK(shard_open(bad, 0, 0, &s, &err) == K3_EXIT_DATA && strstr(err.msg, "version 9"));
    corrupt_copy(good, bad, -1, 16, 4, NULL); /* 4-byte width for a 1000-id vocabulary */
    CHECK(shard_open(bad, 0, 0, &s, &err) == K3_EXIT_DATA && strstr(err.msg, "bad header"));
    corrupt_copy(good, bad, -1, 64 + 2 * 50 + 1, 0x7f, NULL); /* token 50 := 0x7f32 */
    CHECK(shard_open(bad, 0, 0, &s, &err) == K3_EXIT_DATA && strstr(err.msg, "token 50"));

    CHECK(shard_open(good, 2000, 0, &s, &err) == K3_EXIT_USAGE);
    CHECKF(strstr(err.msg, "different vocabulary (1000 ids, expected 2000)"), "%s", err.msg);
    CHECK(shard_open(good, 1000, 6, &s, &err) == K3_EXIT_USAGE && strstr(err.msg, "different tokenizer"));
    CHECK(shard_open(good, 1000, 5, &s, &err) == 0);
    shard_close(&s);
    snprintf(bad, sizeof bad, "%s/missing.bin", t_outdir());
    CHECK(shard_open(bad, 0, 0, &s, &err) == K3_EXIT_RUNTIME && strstr(err.msg, "missing.bin"));
}

TEST(shard_writer_is_atomic) {
    char path[1024];
    snprintf(path, sizeof path, "%s/a.bin", t_outdir());
    unlink(path);
    k3_err err = {0};
    k3_shard_writer *w;
    CHECK(shard_writer_open(path, 100, K3_SHARD_NO_EOT, 0, &w, &err) == 0);
    int32_t ids[2] = {5, 100}; /* 100 is outside the vocabulary */
    CHECK(shard_writer_append(w, ids, 1, &err) == 0);
    CHECK(access(path, F_OK) != 0); /* nothing at the final path before commit */
    CHECK(shard_writer_append(w, ids, 2, &err) == K3_EXIT_RUNTIME);
    shard_writer_abort(w);
    CHECK(access(path, F_OK) != 0);
    CHECK(shard_writer_open(path, 0, K3_SHARD_NO_EOT, 0, &w, &err) == K3_EXIT_USAGE);
}

/* A prepared directory: shard + tokenizer files; the hash ties them. */
TEST(data_dir_split_checks_tokenizer) {
    const char *d = t_outdir();
    char path[1024];
    k3_err err = {0};
    k3_shard s;
    const char *names[3] = {"train.bin", "tiktoken.model", "tokenizer_config.json"};
    for (int i = 0; i < 3; i++) { /* scratch directories persist between runs */
        snprintf(path, sizeof path, "%s/%s", d, names[i]);
        unlink(path);
    }
    CHECK(data_open_split(d, "train", 0, &s, &err) == K3_EXIT_USAGE);
    CHECKF(strstr(err.msg, "no train.bin (make it with k3 prepare)"), "%s", err.msg);
    snprintf(path, sizeof path, "%s/tiktoken.model", d);
    CHECK(k3_write_file_atomic(path, "YQ== 0\n", 7, &err) == 0);
    uint64_t h1, h2;
    CHECK(data_tokenizer_hash(d, &h1, &err) == 0);
    int32_t ids[4] = {1, 2, 3, 0};
    snprintf(path, sizeof path, "%s/train.bin", d);
    CHECK(write_shard(path, 300, ids, 4, h1, &err) == 0);
    CHECKF(data_open_split(d, "train", 300, &s, &err) == 0, "%s", err.msg);
    CHECK(s.info.n_tokens == 4);
    shard_close(&s);
    /* a different tokenizer config changes the hash: the shard is refused */
    snprintf(path, sizeof path, "%s/tokenizer_config.json", d);
    CHECK(k3_write_file_atomic(path, "{}", 2, &err) == 0);
    CHECK(data_tokenizer_hash(d, &h2, &err) == 0 && h2 != h1);
    CHECK(data_open_split(d, "train", 300, &s, &err) == K3_EXIT_USAGE);
    CHECKF(strstr(err.msg, "different tokenizer"), "%s", err.msg);
    CHECK(data_open_split(d, "val", 0, &s, &err) == K3_EXIT_USAGE && strstr(err.msg, "no val.bin"));
}
