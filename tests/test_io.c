/* Batched aligned reads: every backend returns the exact bytes of unaligned
 * ranges, and reading past the end of a file is an error, not garbage; the
 * same for util/dio.h, the reader under them (at the end). */
#include "harness.h"
#include "memory/io.h"
#include "util/dio.h"

#include <fcntl.h>
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
        reqs[i].buf = k3_dio_alloc(k3_dio_span(off, len));
    }
    int bad = k3_io_read(io, reqs, R, &err) ? 3 : 0;
    if (bad) fprintf(stderr, "  %s\n", err.msg);
    for (int i = 0; i < R && !bad; i++)
        for (uint64_t j = 0; j < reqs[i].len; j++)
            if (((const uint8_t *)reqs[i].data)[j] != pattern(reqs[i].offset + j)) { bad = 4; break; }
    /* past the end of the file */
    k3_io_req past = {.fd = fd, .offset = N - 10, .len = 100};
    past.buf = k3_dio_alloc(k3_dio_span(past.offset, past.len));
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
    char *raw = k3_dio_alloc(3 * 4096);
    k3_io_req q = {.fd = fd, .offset = 5000, .len = 3000, .buf = raw + 64};
    CHECK(k3_io_read(io, &q, 1, &err) == 0);
    for (uint64_t j = 0; j < q.len; j++) CHECK(((const uint8_t *)q.data)[j] == pattern(q.offset + j));
    free(raw);
    close(fd);
    k3_io_free(io);
}

TEST(io_span_is_aligned_superset) {
    CHECK(k3_dio_span(0, 1) == 4096);
    CHECK(k3_dio_span(4095, 2) == 8192);
    CHECK(k3_dio_span(4096, 4096) == 4096);
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
        reqs[i].buf = k3_dio_alloc(k3_dio_span(off, len));
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
    past.buf = k3_dio_alloc(k3_dio_span(past.offset, past.len));
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
    uint8_t *arena = k3_dio_alloc(arena_len);
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
        reqs[i].buf = i % 3 == 2 ? k3_dio_alloc(k3_dio_span(off, len))
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

/* ---- the one positional reader underneath (util/dio.h, which the shards'
 * index reads through too): any range read through an O_DIRECT descriptor,
 * a buffered one, or one whose O_DIRECT read was refused, gives the file's
 * exact bytes; a refusal leaves the descriptor buffered; a range past the
 * end of the file is a data error naming the file and the offset. */

static bool fd_is_direct(int fd) { return (fcntl(fd, F_GETFL) & O_DIRECT) != 0; }

/* Reads `count` pseudo-random ranges (some larger than the bounce buffer)
 * with k3_dio_pread into unaligned memory; 0 or the first bad range + 1. */
static int check_ranges(int fd, const char *path, size_t n, int count, uint64_t seed) {
    uint8_t *buf = malloc((10u << 20) + 3);
    int bad = 0;
    for (int i = 0; i < count && !bad; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t len = i % 5 == 4 ? (9u << 20) + (seed >> 50) : 1 + (seed >> 40) % 70000;
        if (len > n / 2) len = n / 2;
        uint64_t off = (seed >> 17) % (n - len);
        uint8_t *dst = buf + 1 + i % 3; /* never aligned the way O_DIRECT wants */
        k3_err err = {0};
        if (k3_dio_pread(fd, dst, off, len, path, &err)) {
            fprintf(stderr, "  %s\n", err.msg);
            bad = i + 1;
        }
        for (uint64_t j = 0; j < len && !bad; j++)
            if (dst[j] != pattern(off + j)) bad = i + 1;
    }
    free(buf);
    return bad;
}

TEST(dio_pread_exact_direct_and_buffered) {
    const size_t N = 24u << 20;
    const char *path = make_file(N);
    CHECK(path[0]);
    for (int direct = 0; direct < 2; direct++) {
        int fd;
        bool d;
        k3_err err = {0};
        CHECKF(k3_dio_open(path, direct, &fd, &d, &err) == 0, "%s", err.msg);
        CHECK(d == fd_is_direct(fd) && (direct || !d));
        int bad = check_ranges(fd, path, N, 25, 99 + (uint64_t)direct);
        CHECKF(!bad, "direct %d: range %d", direct, bad - 1);
        /* nothing was refused: an O_DIRECT descriptor stays O_DIRECT */
        CHECK(fd_is_direct(fd) == d);
        close(fd);
    }
}

TEST(dio_refused_read_falls_back_buffered) {
    const size_t N = 1u << 20;
    const char *path = make_file(N);
    CHECK(path[0]);
    int fd;
    bool d;
    k3_err err = {0};
    CHECKF(k3_dio_open(path, true, &fd, &d, &err) == 0, "%s", err.msg);
    if (!d) {
        close(fd);
        SKIP("this filesystem refuses O_DIRECT at open");
    }
    /* a buffer off the block alignment: the kernel refuses the O_DIRECT read
     * (EINVAL), the reader drops O_DIRECT on the descriptor and reads buffered */
    uint8_t *raw = k3_dio_alloc(4 * K3_DIO_ALIGN);
    uint8_t *buf = raw + 64;
    const uint64_t off = 5000, len = 3000;
    CHECKF(k3_dio_read_span(fd, buf, off, len, path, &err) == 0, "%s", err.msg);
    const uint8_t *got = buf + (off - k3_dio_floor(off));
    for (uint64_t j = 0; j < len; j++) CHECKF(got[j] == pattern(off + j), "byte %llu", (unsigned long long)j);
    CHECK(!fd_is_direct(fd));
    /* and the same descriptor, buffered now, still gives the exact bytes */
    int bad = check_ranges(fd, path, N, 8, 5);
    CHECKF(!bad, "range %d", bad - 1);
    free(raw);
    close(fd);
}

TEST(dio_past_end_is_data_error_naming_file) {
    const size_t N = 3 * K3_DIO_ALIGN + 100;
    const char *path = make_file(N);
    CHECK(path[0]);
    for (int direct = 0; direct < 2; direct++) {
        int fd;
        k3_err err = {0};
        CHECK(k3_dio_open(path, direct, &fd, NULL, &err) == 0);
        uint8_t buf[300];
        CHECK(k3_dio_pread(fd, buf, N - 50, 200, path, &err) == K3_EXIT_DATA);
        CHECKF(strstr(err.msg, path) && strstr(err.msg, "offset") && strstr(err.msg, "150 bytes early"), "%s",
               err.msg);
        /* what lies inside the file is still read whole */
        CHECK(k3_dio_pread(fd, buf, N - 200, 200, path, &err) == 0);
        for (int j = 0; j < 200; j++) CHECK(buf[j] == pattern(N - 200 + (uint64_t)j));
        /* a span past the end is fine when the range is inside */
        uint8_t *a = k3_dio_alloc(k3_dio_span(N - 30, 30));
        CHECKF(k3_dio_read_span(fd, a, N - 30, 30, path, &err) == 0, "%s", err.msg);
        CHECK(a[(N - 30) - k3_dio_floor(N - 30)] == pattern(N - 30));
        memset(&err, 0, sizeof err);
        CHECK(k3_dio_read_span(fd, a, N - 30, 31, NULL, &err) == K3_EXIT_DATA && strstr(err.msg, "1 bytes early"));
        free(a);
        close(fd);
    }
}
