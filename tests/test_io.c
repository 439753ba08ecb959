/* Batched aligned reads: every backend returns the exact bytes of unaligned
 * ranges, and reading past the end of a file is an error, not garbage. */
#include "harness.h"
#include "memory/io.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint8_t pattern(uint64_t i) { return (uint8_t)((i * 2654435761u) >> 13); }

static const char *make_file(size_t n) {
    static char path[1024];
    snprintf(path, sizeof path, "%s/data.bin", t_outdir());
    uint8_t *d = malloc(n);
    for (size_t i = 0; i < n; i++) d[i] = pattern(i);
    k3_err err = {0};
    if (k3_write_file_atomic(path, d, n, &err)) path[0] = 0;
    free(d);
    return path;
}

static int check_backend(int depth, bool direct) {
    const size_t N = 3u << 20;
    const char *path = make_file(N);
    if (!path[0]) return 1;
    k3_io *io = k3_io_new(depth, direct);
    k3_err err = {0};
    int fd;
    if (k3_io_open(io, path, &fd, NULL, &err)) return 2;
    enum { R = 40 };
    k3_io_req reqs[R];
    uint64_t seed = 12345;
    for (int i = 0; i < R; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t off = (seed >> 20) % (N - 70000);
        uint64_t len = 1 + (seed >> 40) % 65536;
        reqs[i] = (k3_io_req){.fd = fd, .offset = off, .len = len};
        reqs[i].buf = k3_io_alloc(k3_io_span(off, len));
    }
    int bad = k3_io_read(io, reqs, R, &err) ? 3 : 0;
    if (bad) fprintf(stderr, "  %s\n", err.msg);
    for (int i = 0; i < R && !bad; i++)
        for (uint64_t j = 0; j < reqs[i].len; j++)
            if (((const uint8_t *)reqs[i].data)[j] != pattern(reqs[i].offset + j)) { bad = 4; break; }
    /* past the end of the file */
    k3_io_req past = {.fd = fd, .offset = N - 10, .len = 100};
    past.buf = k3_io_alloc(k3_io_span(past.offset, past.len));
    if (!bad && k3_io_read(io, &past, 1, &err) != K3_EXIT_DATA) bad = 5;
    free(past.buf);
    for (int i = 0; i < R; i++) free(reqs[i].buf);
    close(fd);
    k3_io_free(io);
    return bad;
}

TEST(io_pread_buffered_exact) { int r = check_backend(1, false); CHECKF(r == 0, "code %d", r); }
TEST(io_pread_direct_exact) { int r = check_backend(1, true); CHECKF(r == 0, "code %d", r); }
TEST(io_batched_direct_exact) { int r = check_backend(16, true); CHECKF(r == 0, "code %d", r); }
TEST(io_batched_buffered_exact) { int r = check_backend(16, false); CHECKF(r == 0, "code %d", r); }

TEST(io_direct_refused_falls_back) {
    /* a buffer that is not block aligned makes O_DIRECT refuse the read; the
     * reader must still return the right bytes */
    const char *path = make_file(1u << 20);
    k3_io *io = k3_io_new(1, true);
    k3_err err = {0};
    int fd;
    CHECK(k3_io_open(io, path, &fd, NULL, &err) == 0);
    char *raw = k3_io_alloc(3 * 4096);
    k3_io_req q = {.fd = fd, .offset = 5000, .len = 3000, .buf = raw + 64};
    CHECK(k3_io_read(io, &q, 1, &err) == 0);
    for (uint64_t j = 0; j < q.len; j++) CHECK(((const uint8_t *)q.data)[j] == pattern(q.offset + j));
    free(raw);
    close(fd);
    k3_io_free(io);
}

TEST(io_span_is_aligned_superset) {
    CHECK(k3_io_span(0, 1) == 4096);
    CHECK(k3_io_span(4095, 2) == 8192);
    CHECK(k3_io_span(4096, 4096) == 4096);
}

/* Asynchronous use: requests submitted up to the depth and completed one at a
 * time (in any order) bring the same exact bytes; past the end is an error
 * naming that request. */
static int check_async(int depth, bool direct) {
    const size_t N = 3u << 20;
    const char *path = make_file(N);
    if (!path[0]) return 1;
    k3_io *io = k3_io_new(depth, direct);
    k3_err err = {0};
    int fd;
    if (k3_io_open(io, path, &fd, NULL, &err)) return 2;
    enum { R = 37 };
    k3_io_req reqs[R];
    uint64_t seed = 777;
    for (int i = 0; i < R; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t off = (seed >> 20) % (N - 300000), len = 1 + (seed >> 40) % 300000;
        reqs[i] = (k3_io_req){.fd = fd, .offset = off, .len = len};
        reqs[i].buf = k3_io_alloc(k3_io_span(off, len));
    }
    int bad = 0, next = 0, got = 0;
    bool seen[R] = {0};
    while (got < R && !bad) {
        while (next < R && k3_io_inflight(io) < depth)
            if (k3_io_submit(io, &reqs[next++], &err)) bad = 3;
        k3_io_req *d;
        if (!bad && k3_io_complete(io, &d, &err)) bad = 4;
        if (bad) break;
        int i = (int)(d - reqs);
        if (i < 0 || i >= R || seen[i]) { bad = 5; break; }
        seen[i] = true;
        got++;
        for (uint64_t j = 0; j < d->len; j++)
            if (((const uint8_t *)d->data)[j] != pattern(d->offset + j)) { bad = 6; break; }
    }
    if (!bad && k3_io_inflight(io) != 0) bad = 7;
    k3_io_req past = {.fd = fd, .offset = N - 10, .len = 100};
    past.buf = k3_io_alloc(k3_io_span(past.offset, past.len));
    k3_io_req *d = NULL;
    if (!bad) {
        int rc = k3_io_submit(io, &past, &err);
        if (!rc) rc = k3_io_complete(io, &d, &err);
        else d = &past;
        if (rc != K3_EXIT_DATA || d != &past) bad = 8;
    }
    free(past.buf);
    for (int i = 0; i < R; i++) free(reqs[i].buf);
    close(fd);
    k3_io_free(io);
    return bad;
}

TEST(io_async_ring_direct_exact) { int r = check_async(8, true); CHECKF(r == 0, "code %d", r); }
TEST(io_async_ring_buffered_exact) { int r = check_async(4, false); CHECKF(r == 0, "code %d", r); }
TEST(io_async_pread_exact) { int r = check_async(1, true); CHECKF(r == 0, "code %d", r); }

/* k3_io_submit_batch with buffers inside a registered arena (read_fixed) and
 * outside it: exact bytes, each request once; registration is refused with
 * K3_IO_REGISTER=0 and without a ring, and the bytes are the same. */
static int check_batch(int depth, bool direct, bool reg, bool *registered) {
    const size_t N = 3u << 20;
    const char *path = make_file(N);
    if (!path[0]) return 1;
    k3_io *io = k3_io_new(depth, direct);
    k3_err err = {0};
    int fd;
    if (k3_io_open(io, path, &fd, NULL, &err)) return 2;
    enum { R = 29, MAXLEN = 100000, SLOT = MAXLEN + 2 * 4096 };
    uint64_t arena_len = (uint64_t)R * ((SLOT + 4095) / 4096 * 4096);
    uint8_t *arena = k3_io_alloc(arena_len);
    if (!reg) setenv("K3_IO_REGISTER", "0", 1);
    void *b = arena;
    *registered = k3_io_register(io, &b, &arena_len, 1);
    unsetenv("K3_IO_REGISTER");
    k3_io_req reqs[R];
    k3_io_req *qs[R];
    uint64_t seed = 4242;
    for (int i = 0; i < R; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t off = (seed >> 20) % (N - MAXLEN), len = 1 + (seed >> 40) % MAXLEN;
        reqs[i] = (k3_io_req){.fd = fd, .offset = off, .len = len};
        /* every third request outside the arena */
        reqs[i].buf = i % 3 == 2 ? k3_io_alloc(k3_io_span(off, len))
                                  : arena + (uint64_t)i * ((SLOT + 4095) / 4096 * 4096);
        qs[i] = &reqs[i];
    }
    int bad = 0, next = 0, got = 0;
    bool seen[R] = {0};
    while (got < R && !bad) {
        int room = depth - k3_io_inflight(io), n = R - next < room ? R - next : room;
        if (n > 0 && k3_io_submit_batch(io, qs + next, n, &err)) bad = 3;
        next += n > 0 ? n : 0;
        k3_io_req *d;
        if (!bad && k3_io_complete(io, &d, &err)) bad = 4;
        if (bad) break;
        int i = (int)(d - reqs);
        if (i < 0 || i >= R || seen[i]) { bad = 5; break; }
        seen[i] = true;
        got++;
        for (uint64_t j = 0; j < d->len; j++)
            if (((const uint8_t *)d->data)[j] != pattern(d->offset + j)) { bad = 6; break; }
    }
    if (!bad && k3_io_inflight(io) != 0) bad = 7;
    /* more than the free depth is refused, nothing sent */
    if (!bad && k3_io_submit_batch(io, qs, depth + 1, &err) == 0) bad = 8;
    if (!bad && k3_io_inflight(io) != 0) bad = 9;
    close(fd);
    k3_io_free(io);
    for (int i = 0; i < R; i++)
        if (i % 3 == 2) free(reqs[i].buf);
    free(arena);
    return bad;
}

TEST(io_batch_registered_exact) {
    bool r = false;
    int rc = check_batch(8, true, true, &r);
    CHECKF(rc == 0, "registered: code %d", rc);
    /* (an unprivileged user may be refused by RLIMIT_MEMLOCK: same bytes, plain reads) */
    if (geteuid() == 0) CHECK(r);
    rc = check_batch(8, true, false, &r);
    CHECKF(rc == 0 && !r, "K3_IO_REGISTER=0: code %d registered %d", rc, r);
    rc = check_batch(8, false, true, &r);
    CHECKF(rc == 0, "buffered: code %d", rc);
    rc = check_batch(1, true, true, &r);
    CHECKF(rc == 0 && !r, "pread backend: code %d registered %d", rc, r);
}
