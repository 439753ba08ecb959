/* data.c: see data.h. */
#include "train/data.h"
#include "util/mapguard.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "token shards are little endian and read in place: a big-endian host needs byte swaps here"
#endif

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static uint32_t width_for(uint32_t vocab) { return vocab <= 65536u ? 2u : 4u; }

static void encode_header(const k3_shard_info *h, uint8_t out[K3_SHARD_HEADER_BYTES]) {
    memset(out, 0, K3_SHARD_HEADER_BYTES);
    memcpy(out, K3_SHARD_MAGIC, 8);
    put32(out + 8, h->version);
    put32(out + 12, h->vocab_size);
    put32(out + 16, h->token_bytes);
    put32(out + 20, h->eot_id);
    put64(out + 24, h->n_tokens);
    put64(out + 32, h->n_docs);
    put64(out + 40, h->tokenizer_hash);
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const uint8_t *s = p;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

int data_tokenizer_hash(const char *dir, uint64_t *hash, k3_err *err) {
    char path[4096];
    uint64_t h = 0xcbf29ce484222325ull;
    const char *names[2] = {"tiktoken.model", "tokenizer_config.json"};
    for (int i = 0; i < 2; i++) {
        if (snprintf(path, sizeof path, "%s/%s", dir, names[i]) >= (int)sizeof path)
            return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
        if (i == 1 && access(path, F_OK) != 0) break;
        char *data;
        size_t len;
        int rc = k3_read_file(path, &data, &len, err);
        if (rc) return rc;
        h = fnv1a(h, data, len);
        h = fnv1a(h, "\0", 1); /* keeps ("ab","c") apart from ("a","bc") */
        free(data);
    }
    *hash = h ? h : 1; /* 0 means "unknown" in a header */
    return 0;
}

/* ---- writing ------------------------------------------------------------- */
struct k3_shard_writer {
    k3_atomic_file af;
    k3_shard_info info;
    uint8_t *buf;
    size_t buf_cap;
};

int shard_writer_open(const char *path, uint32_t vocab_size, uint32_t eot_id,
                      uint64_t tokenizer_hash, k3_shard_writer **out, k3_err *err) {
    if (vocab_size == 0) return k3_fail(err, K3_EXIT_USAGE, "%s: vocabulary size 0", path);
    if (eot_id != K3_SHARD_NO_EOT && eot_id >= vocab_size)
        return k3_fail(err, K3_EXIT_USAGE, "%s: separator id %u outside vocabulary %u", path, eot_id, vocab_size);
    k3_shard_writer *w = xcalloc(1, sizeof *w);
    int rc = k3_atomic_open(&w->af, path, err);
    if (rc) {
        free(w);
        return rc;
    }
    w->info = (k3_shard_info){.version = K3_SHARD_VERSION, .vocab_size = vocab_size,
                              .token_bytes = width_for(vocab_size), .eot_id = eot_id,
                              .tokenizer_hash = tokenizer_hash};
    uint8_t hdr[K3_SHARD_HEADER_BYTES];
    encode_header(&w->info, hdr); /* placeholder counts, rewritten at commit */
    if ((rc = k3_atomic_write(&w->af, hdr, sizeof hdr, err))) {
        shard_writer_abort(w);
        return rc;
    }
    *out = w;
    return 0;
}

int shard_writer_append(k3_shard_writer *w, const int32_t *ids, size_t n, k3_err *err) {
    size_t tb = w->info.token_bytes;
    if (n * tb > w->buf_cap) {
        w->buf_cap = n * tb;
        w->buf = xrealloc(w->buf, w->buf_cap);
    }
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || (uint32_t)ids[i] >= w->info.vocab_size)
            return k3_fail(err, K3_EXIT_RUNTIME, "%s: token id %d outside vocabulary %u",
                           w->af.path, ids[i], w->info.vocab_size);
        if (tb == 2) {
            uint16_t v = (uint16_t)ids[i];
            memcpy(w->buf + 2 * i, &v, 2);
        } else {
            uint32_t v = (uint32_t)ids[i];
            memcpy(w->buf + 4 * i, &v, 4);
        }
    }
    int rc = k3_atomic_write(&w->af, w->buf, n * tb, err);
    if (!rc) w->info.n_tokens += n;
    return rc;
}

void shard_writer_add_docs(k3_shard_writer *w, uint64_t n_docs) { w->info.n_docs += n_docs; }

int shard_writer_commit(k3_shard_writer *w, k3_shard_info *info, k3_err *err) {
    uint8_t hdr[K3_SHARD_HEADER_BYTES];
    encode_header(&w->info, hdr);
    int rc = 0;
    if (fseek(w->af.f, 0, SEEK_SET) != 0)
        rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: seek failed: %s", w->af.tmp, strerror(errno));
    if (!rc) rc = k3_atomic_write(&w->af, hdr, sizeof hdr, err);
    if (rc) {
        shard_writer_abort(w);
        return rc;
    }
    if (info) *info = w->info;
    rc = k3_atomic_commit(&w->af, err);
    free(w->buf);
    free(w);
    return rc;
}

void shard_writer_abort(k3_shard_writer *w) {
    if (!w) return;
    k3_atomic_abort(&w->af);
    free(w->buf);
    free(w);
}

/* ---- reading ------------------------------------------------------------- */
int shard_open(const char *path, uint32_t expect_vocab, uint64_t expect_hash, k3_shard *s,
               k3_err *err) {
    memset(s, 0, sizeof *s);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot stat: %s", path, strerror(e));
    }
    uint64_t size = (uint64_t)st.st_size;
    if (size < K3_SHARD_HEADER_BYTES) {
        close(fd);
        return k3_fail(err, K3_EXIT_DATA, "%s: truncated shard: %llu bytes, smaller than the %u-byte header",
                       path, (unsigned long long)size, K3_SHARD_HEADER_BYTES);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot map: %s", path, strerror(e));
    const uint8_t *h = map;
    k3_shard_info in = {.version = get32(h + 8), .vocab_size = get32(h + 12),
                        .token_bytes = get32(h + 16), .eot_id = get32(h + 20),
                        .n_tokens = get64(h + 24), .n_docs = get64(h + 32),
                        .tokenizer_hash = get64(h + 40)};
    int rc = 0;
    uint64_t body;
    if (memcmp(h, K3_SHARD_MAGIC, 8) != 0)
        rc = k3_fail(err, K3_EXIT_DATA, "%s: not a k3 token shard (bad magic)", path);
    else if (in.version != K3_SHARD_VERSION)
        rc = k3_fail(err, K3_EXIT_DATA, "%s: shard version %u, this build reads version %u", path,
                     in.version, K3_SHARD_VERSION);
    else if (in.vocab_size == 0 || in.token_bytes != width_for(in.vocab_size))
        rc = k3_fail(err, K3_EXIT_DATA, "%s: bad header: %u-byte tokens for vocabulary %u", path,
                     in.token_bytes, in.vocab_size);
    else if (in.eot_id != K3_SHARD_NO_EOT && in.eot_id >= in.vocab_size)
        rc = k3_fail(err, K3_EXIT_DATA, "%s: bad header: separator id %u outside vocabulary %u",
                     path, in.eot_id, in.vocab_size);
    else if (!k3_mul_ok(in.n_tokens, in.token_bytes, &body) || body > UINT64_MAX - K3_SHARD_HEADER_BYTES)
        rc = k3_fail(err, K3_EXIT_DATA, "%s: bad header: token count %llu", path, (unsigned long long)in.n_tokens);
    else if (size < K3_SHARD_HEADER_BYTES + body)
        rc = k3_fail(err, K3_EXIT_DATA, "%s: truncated shard: %llu bytes, header says %llu tokens (%llu bytes)",
                     path, (unsigned long long)size, (unsigned long long)in.n_tokens,
                     (unsigned long long)(K3_SHARD_HEADER_BYTES + body));
    else if (size > K3_SHARD_HEADER_BYTES + body)
        rc = k3_fail(err, K3_EXIT_DATA, "%s: %llu bytes after the last token (header says %llu tokens)",
                     path, (unsigned long long)(size - K3_SHARD_HEADER_BYTES - body),
                     (unsigned long long)in.n_tokens);
    else if (expect_vocab && in.vocab_size != expect_vocab)
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: shard was made with a different vocabulary (%u ids, expected %u)",
                     path, in.vocab_size, expect_vocab);
    else if (expect_hash && in.tokenizer_hash && in.tokenizer_hash != expect_hash)
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: shard was made with a different tokenizer (hash %016llx, expected %016llx)",
                     path, (unsigned long long)in.tokenizer_hash, (unsigned long long)expect_hash);
    if (rc) {
        munmap(map, (size_t)size);
        return rc;
    }
    k3_mapguard_add(map, (size_t)size, path);
    s->info = in;
    s->map = map;
    s->map_len = (size_t)size;
    s->tokens = h + K3_SHARD_HEADER_BYTES;
    /* One pass over the ids: a corrupt id would index past the embedding. */
    for (uint64_t i = 0; i < in.n_tokens; i++) {
        int32_t t = shard_token(s, i);
        if (t < 0 || (uint32_t)t >= in.vocab_size) {
            rc = k3_fail(err, K3_EXIT_DATA, "%s: token %llu has id %u, outside vocabulary %u", path,
                         (unsigned long long)i, (uint32_t)t, in.vocab_size);
            shard_close(s);
            return rc;
        }
    }
    return 0;
}

int data_open_split(const char *dir, const char *split, uint32_t expect_vocab, k3_shard *s,
                    k3_err *err) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s.bin", dir, split) >= (int)sizeof path)
        return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    if (access(path, F_OK) != 0)
        return k3_fail(err, K3_EXIT_USAGE, "%s: no %s.bin (make it with k3 prepare)", dir, split);
    uint64_t h = 0;
    char tm[4096];
    if (snprintf(tm, sizeof tm, "%s/tiktoken.model", dir) >= (int)sizeof tm)
        return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    if (access(tm, F_OK) != 0)
        return k3_fail(err, K3_EXIT_USAGE, "%s: no tiktoken.model beside the shards", dir);
    int rc = data_tokenizer_hash(dir, &h, err);
    if (rc) return rc;
    return shard_open(path, expect_vocab, h, s, err);
}

void shard_close(k3_shard *s) {
    if (s->map) {
        k3_mapguard_remove(s->map);
        munmap(s->map, s->map_len);
    }
    memset(s, 0, sizeof *s);
}

void shard_read(const k3_shard *s, uint64_t start, size_t n, int32_t *out) {
    if (s->info.token_bytes == 2) {
        const uint16_t *t = (const uint16_t *)s->tokens + start;
        for (size_t i = 0; i < n; i++) out[i] = t[i];
    } else {
        const uint32_t *t = (const uint32_t *)s->tokens + start;
        for (size_t i = 0; i < n; i++) out[i] = (int32_t)t[i];
    }
}
