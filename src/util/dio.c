/* dio.c: see dio.h. */
#include "util/dio.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The largest bounce buffer k3_dio_pread takes: large enough that a tensor
 * costs few system calls, small enough not to matter beside the weights. */
#define DIO_BOUNCE (8u << 20)

int k3_dio_open(const char *path, bool direct, int *fd, bool *is_direct, k3_err *err) {
    int f = -1;
    bool d = false;
    if (direct) {
        f = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
        d = f >= 0;
    }
    if (f < 0) f = open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", path, strerror(errno));
    *fd = f;
    if (is_direct) *is_direct = d;
    return K3_OK;
}

void *k3_dio_alloc(uint64_t size) {
    void *p = NULL;
    uint64_t r = (size + K3_DIO_ALIGN - 1) & ~(uint64_t)(K3_DIO_ALIGN - 1);
    if (r < size || posix_memalign(&p, K3_DIO_ALIGN, r ? r : K3_DIO_ALIGN) != 0) {
        fprintf(stderr, "k3: out of memory (%llu bytes)\n", (unsigned long long)size);
        exit(K3_EXIT_RUNTIME);
    }
    return p;
}

static bool is_direct_fd(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl >= 0 && (fl & O_DIRECT);
}

/* After EINVAL: true when fd was O_DIRECT and is buffered now (the read is
 * worth retrying), false when EINVAL meant something else. */
static bool drop_direct(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl >= 0 && (fl & O_DIRECT) && fcntl(fd, F_SETFL, fl & ~O_DIRECT) == 0;
}

static int read_failed(k3_err *err, const char *path, uint64_t len, uint64_t off, int e) {
    return k3_fail(err, K3_EXIT_RUNTIME, "%s%sread of %llu bytes at offset %llu failed: %s", path ? path : "",
                   path ? ": " : "", (unsigned long long)len, (unsigned long long)off, strerror(e));
}

static int ends_early(k3_err *err, const char *path, uint64_t len, uint64_t off, uint64_t missing) {
    return k3_fail(err, K3_EXIT_DATA, "%s%sshort read of %llu bytes at offset %llu: the file ends %llu bytes early",
                   path ? path : "", path ? ": " : "", (unsigned long long)len, (unsigned long long)off,
                   (unsigned long long)missing);
}

/* Reads [off, off+len) into dst, or as much as the file has: *got says how
 * much (the callers decide whether that is enough). */
static int read_upto(int fd, void *dst, uint64_t len, uint64_t off, uint64_t *got, const char *path, k3_err *err) {
    *got = 0;
    while (*got < len) {
        uint64_t want = len - *got;
        if (want > ((size_t)1 << 30)) want = (size_t)1 << 30; /* Linux moves at most ~2 GiB per call */
        ssize_t r = pread(fd, (char *)dst + *got, (size_t)want, (off_t)(off + *got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == EINVAL && drop_direct(fd)) continue;
        if (r < 0) return read_failed(err, path, len, off, errno);
        if (r == 0) break;
        *got += (uint64_t)r;
    }
    return K3_OK;
}

int k3_dio_read_span(int fd, void *buf, uint64_t off, uint64_t len, const char *path, k3_err *err) {
    uint64_t a = k3_dio_floor(off), need = off - a + len, got;
    int rc = read_upto(fd, buf, k3_dio_span(off, len), a, &got, path, err);
    if (rc) return rc;
    if (got < need) return ends_early(err, path, len, off, need - got);
    return K3_OK;
}

int k3_dio_pread(int fd, void *dst, uint64_t off, uint64_t len, const char *path, k3_err *err) {
    if (len == 0) return K3_OK;
    uint64_t end = off + len, done = off; /* [off, done) is in dst */
    unsigned char *bounce = NULL;
    if (is_direct_fd(fd)) {
        uint64_t span = k3_dio_span(off, len);
        size_t bsz = (size_t)(span < DIO_BOUNCE ? span : DIO_BOUNCE);
        /* no memory for the bounce buffer: the buffered read below gives the same bytes */
        if (posix_memalign((void **)&bounce, K3_DIO_ALIGN, bsz) != 0) bounce = NULL;
        for (uint64_t pos = k3_dio_floor(off); bounce && done < end;) {
            size_t want = (size_t)(k3_dio_span(pos, end - pos) < bsz ? k3_dio_span(pos, end - pos) : bsz);
            ssize_t r = pread(fd, bounce, want, (off_t)pos);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && errno == EINVAL && drop_direct(fd)) break; /* the rest buffered, below */
            if (r < 0) {
                int e = errno;
                free(bounce);
                return read_failed(err, path, len, off, e);
            }
            uint64_t got_end = pos + (uint64_t)r, hi = got_end < end ? got_end : end;
            if (hi <= done) { /* no new byte: the file ends here */
                free(bounce);
                return ends_early(err, path, len, off, end - done);
            }
            memcpy((unsigned char *)dst + (done - off), bounce + (done - pos), (size_t)(hi - done));
            done = hi;
            /* a short read that is not at the end of the file goes on from
             * the aligned position below where it stopped */
            pos = k3_dio_floor(got_end);
        }
        free(bounce);
    }
    if (done == end) return K3_OK;
    uint64_t got;
    int rc = read_upto(fd, (unsigned char *)dst + (done - off), end - done, done, &got, path, err);
    if (rc) return rc;
    if (got < end - done) return ends_early(err, path, len, off, end - done - got);
    return K3_OK;
}
