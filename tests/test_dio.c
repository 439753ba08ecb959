/* The one positional reader (util/dio.h) under the shards' index and the
 * streaming reads: any range read through an O_DIRECT descriptor, a buffered
 * one, or one whose O_DIRECT read was refused, gives the file's exact bytes;
 * a refusal leaves the descriptor buffered; a range past the end of the file
 * is a data error naming the file and the offset. */
#include "harness.h"
#include "util/dio.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint8_t pattern(uint64_t i) { return (uint8_t)((i * 2654435761u) >> 11 ^ i); }

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
