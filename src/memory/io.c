/* io.c: see io.h. */
#include "memory/io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

struct k3_io {
    int depth;
    bool direct;
    bool have_ring;
    struct io_uring ring;
    uint64_t bytes;
    double seconds;
    /* asynchronous use (k3_io_submit / k3_io_complete) */
    int inflight;              /* submitted, not yet completed */
    k3_io_req **done;          /* pread backend: finished in submit, [depth] */
    int ndone;
    /* buffers registered with the ring (k3_io_register): reads into them skip
     * the per-read pinning of user pages that O_DIRECT otherwise costs */
    struct iovec reg[K3_IO_MAXREG];
    int nreg;
};

k3_io *k3_io_new(int depth, bool direct) {
    k3_io *io = xcalloc(1, sizeof *io);
    io->depth = depth < 1 ? 1 : depth;
    io->direct = direct;
    if (io->depth > 1 && io_uring_queue_init((unsigned)io->depth, &io->ring, 0) == 0) io->have_ring = true;
    return io;
}

void k3_io_free(k3_io *io) {
    if (!io) return;
    /* requests still in flight write into their buffers: wait for them first */
    while (io->have_ring && io->inflight > 0) {
        struct io_uring_cqe *cqe;
        if (io_uring_wait_cqe(&io->ring, &cqe) < 0) break;
        io_uring_cqe_seen(&io->ring, cqe);
        io->inflight--;
    }
    if (io->have_ring) io_uring_queue_exit(&io->ring);
    free(io->done);
    free(io);
}

const char *k3_io_backend(const k3_io *io) { return io->have_ring ? "io_uring" : "pread"; }
uint64_t k3_io_bytes(const k3_io *io) { return io->bytes; }
double k3_io_seconds(const k3_io *io) { return io->seconds; }

int k3_io_open(k3_io *io, const char *path, int *fd, bool *is_direct, k3_err *err) {
    int f = -1;
    bool d = false;
    if (io->direct) {
        f = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
        if (f >= 0) d = true;
    }
    if (f < 0) f = open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", path, strerror(errno));
    *fd = f;
    if (is_direct) *is_direct = d;
    return K3_OK;
}

void *k3_io_alloc(uint64_t size) {
    void *p = NULL;
    uint64_t r = (size + K3_IO_ALIGN - 1) & ~(uint64_t)(K3_IO_ALIGN - 1);
    if (r < size || posix_memalign(&p, K3_IO_ALIGN, r ? r : K3_IO_ALIGN) != 0) {
        fprintf(stderr, "k3: out of memory (%llu bytes)\n", (unsigned long long)size);
        exit(K3_EXIT_RUNTIME);
    }
    return p;
}

uint64_t k3_io_span(uint64_t offset, uint64_t len) {
    uint64_t a = offset & ~(uint64_t)(K3_IO_ALIGN - 1);
    uint64_t b = (offset + len + K3_IO_ALIGN - 1) & ~(uint64_t)(K3_IO_ALIGN - 1);
    return b - a;
}

static int cmp_req(const void *x, const void *y) {
    const k3_io_req *a = *(k3_io_req *const *)x, *b = *(k3_io_req *const *)y;
    if (a->fd != b->fd) return a->fd < b->fd ? -1 : 1;
    return a->offset < b->offset ? -1 : (a->offset > b->offset);
}

/* One aligned read; if the fd is O_DIRECT and the filesystem refuses the
 * read (EINVAL), drop O_DIRECT on that descriptor and go on buffered: the
 * bytes are the same, only the page cache is involved. */
static int read_full(int fd, void *buf, uint64_t len, uint64_t off, uint64_t need, k3_err *err) {
    uint64_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, (char *)buf + got, len - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == EINVAL) {
            int fl = fcntl(fd, F_GETFL);
            if (fl >= 0 && (fl & O_DIRECT) && fcntl(fd, F_SETFL, fl & ~O_DIRECT) == 0) continue;
        }
        if (r < 0)
            return k3_fail(err, K3_EXIT_RUNTIME, "read of %llu bytes at offset %llu failed: %s",
                           (unsigned long long)len, (unsigned long long)off, strerror(errno));
        if (r == 0) break;
        got += (uint64_t)r;
    }
    if (got < need)
        return k3_fail(err, K3_EXIT_DATA, "short read at offset %llu: file ends %llu bytes early",
                       (unsigned long long)off, (unsigned long long)(need - got));
    return K3_OK;
}

/* Fault injection for tests: K3_IO_FAIL_AFTER=N makes every request after the
 * first N fail as an I/O error would. Requests are counted (over the whole
 * process) only while the variable is set, so a test may set it after some
 * reads were made; it is read on every call (tests set it between runs). */
static long injected_count;

static long fail_after(void) {
    const char *e = getenv("K3_IO_FAIL_AFTER");
    if (!e || !*e) {
        __atomic_store_n(&injected_count, 0, __ATOMIC_RELAXED);
        return -1;
    }
    return strtol(e, NULL, 10);
}

int k3_io_read(k3_io *io, k3_io_req *reqs, size_t n, k3_err *err) {
    long fa = fail_after();
    if (fa >= 0 && n > 0) {
        long before = __atomic_fetch_add(&injected_count, (long)n, __ATOMIC_RELAXED);
        if (before + (long)n > fa) {
            const k3_io_req *q = &reqs[fa > before ? fa - before : 0];
            return k3_fail(err, K3_EXIT_RUNTIME, "read of %llu bytes at offset %llu failed: %s (K3_IO_FAIL_AFTER)",
                           (unsigned long long)q->len, (unsigned long long)q->offset, strerror(EIO));
        }
    }
    double t0 = k3_now();
    k3_io_req **order = xmalloc_array(n ? n : 1, sizeof *order);
    for (size_t i = 0; i < n; i++) order[i] = &reqs[i];
    qsort(order, n, sizeof *order, cmp_req);
    int rc = K3_OK;
    if (!io->have_ring) {
        for (size_t i = 0; i < n && rc == K3_OK; i++) {
            k3_io_req *q = order[i];
            uint64_t a = q->offset & ~(uint64_t)(K3_IO_ALIGN - 1);
            uint64_t span = k3_io_span(q->offset, q->len);
            rc = read_full(q->fd, q->buf, span, a, q->offset - a + q->len, err);
            q->data = (const char *)q->buf + (q->offset - a);
            io->bytes += span;
        }
    } else {
        size_t next = 0, done = 0, inflight = 0;
        while (done < n && rc == K3_OK) {
            while (next < n && inflight < (size_t)io->depth) {
                struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
                if (!sqe) break;
                k3_io_req *q = order[next];
                uint64_t a = q->offset & ~(uint64_t)(K3_IO_ALIGN - 1);
                io_uring_prep_read(sqe, q->fd, q->buf, (unsigned)k3_io_span(q->offset, q->len), a);
                io_uring_sqe_set_data(sqe, q);
                next++;
                inflight++;
            }
            io_uring_submit(&io->ring);
            struct io_uring_cqe *cqe;
            int w = io_uring_wait_cqe(&io->ring, &cqe);
            if (w < 0) { rc = k3_fail(err, K3_EXIT_RUNTIME, "io_uring wait failed: %s", strerror(-w)); break; }
            k3_io_req *q = io_uring_cqe_get_data(cqe);
            int res = cqe->res;
            io_uring_cqe_seen(&io->ring, cqe);
            inflight--;
            done++;
            uint64_t a = q->offset & ~(uint64_t)(K3_IO_ALIGN - 1);
            uint64_t span = k3_io_span(q->offset, q->len), need = q->offset - a + q->len;
            q->data = (const char *)q->buf + (q->offset - a);
            if (res >= 0 && (uint64_t)res >= need) { io->bytes += (uint64_t)res; continue; }
            /* short or refused: finish this one synchronously (it reports EOF precisely) */
            rc = read_full(q->fd, q->buf, span, a, need, err);
            io->bytes += span;
        }
        /* drain anything still in flight so buffers are not written later */
        while (inflight > 0) {
            struct io_uring_cqe *cqe;
            if (io_uring_wait_cqe(&io->ring, &cqe) < 0) break;
            io_uring_cqe_seen(&io->ring, cqe);
            inflight--;
        }
    }
    free(order);
    io->seconds += k3_now() - t0;
    return rc;
}

/* ---- asynchronous use ------------------------------------------------------ */

int k3_io_inflight(const k3_io *io) { return io->inflight + io->ndone; }

bool k3_io_register(k3_io *io, void *const *bufs, const uint64_t *lens, int n) {
    if (!io->have_ring || io->nreg || n <= 0 || n > K3_IO_MAXREG) return false;
    const char *e = getenv("K3_IO_REGISTER");
    if (e && !strcmp(e, "0")) return false;
    struct iovec v[K3_IO_MAXREG];
    for (int i = 0; i < n; i++) {
        if (!bufs[i] || lens[i] == 0 || lens[i] > (1ull << 30)) return false; /* the kernel's limit per buffer */
        v[i] = (struct iovec){.iov_base = bufs[i], .iov_len = (size_t)lens[i]};
    }
    /* refused (e.g. RLIMIT_MEMLOCK for an unprivileged user): plain reads */
    if (io_uring_register_buffers(&io->ring, v, (unsigned)n) != 0) return false;
    memcpy(io->reg, v, (size_t)n * sizeof *v);
    io->nreg = n;
    return true;
}

/* Prepares q's read, from a registered buffer when q lies in one. */
static void prep(k3_io *io, struct io_uring_sqe *sqe, k3_io_req *q) {
    uint64_t a = q->offset & ~(uint64_t)(K3_IO_ALIGN - 1);
    unsigned len = (unsigned)k3_io_span(q->offset, q->len);
    const char *b = q->buf;
    for (int i = 0; i < io->nreg; i++) {
        const char *r0 = io->reg[i].iov_base;
        if (b >= r0 && b + len <= r0 + io->reg[i].iov_len) {
            io_uring_prep_read_fixed(sqe, q->fd, q->buf, len, a, i);
            io_uring_sqe_set_data(sqe, q);
            return;
        }
    }
    io_uring_prep_read(sqe, q->fd, q->buf, len, a);
    io_uring_sqe_set_data(sqe, q);
}

int k3_io_submit(k3_io *io, k3_io_req *q, k3_err *err) {
    long fa = fail_after();
    if (fa >= 0 && __atomic_fetch_add(&injected_count, 1, __ATOMIC_RELAXED) + 1 > fa)
        return k3_fail(err, K3_EXIT_RUNTIME, "read of %llu bytes at offset %llu failed: %s (K3_IO_FAIL_AFTER)",
                       (unsigned long long)q->len, (unsigned long long)q->offset, strerror(EIO));
    if (k3_io_inflight(io) >= io->depth)
        return k3_fail(err, K3_EXIT_RUNTIME, "k3_io_submit: %d reads already in flight", io->depth);
    uint64_t a = q->offset & ~(uint64_t)(K3_IO_ALIGN - 1);
    q->data = (const char *)q->buf + (q->offset - a);
    if (!io->have_ring) { /* read now; k3_io_complete hands it back */
        double t0 = k3_now();
        int rc = read_full(q->fd, q->buf, k3_io_span(q->offset, q->len), a, q->offset - a + q->len, err);
        io->seconds += k3_now() - t0;
        if (rc) return rc;
        io->bytes += k3_io_span(q->offset, q->len);
        if (!io->done) io->done = xmalloc_array((size_t)io->depth, sizeof *io->done);
        io->done[io->ndone++] = q;
        return K3_OK;
    }
    struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
    if (!sqe) return k3_fail(err, K3_EXIT_RUNTIME, "io_uring: no free submission entry");
    prep(io, sqe, q);
    int r = io_uring_submit(&io->ring);
    if (r < 0) return k3_fail(err, K3_EXIT_RUNTIME, "io_uring submit failed: %s", strerror(-r));
    io->inflight++;
    return K3_OK;
}

int k3_io_submit_batch(k3_io *io, k3_io_req *const *qs, int n, k3_err *err) {
    if (n <= 0) return K3_OK;
    if (k3_io_inflight(io) + n > io->depth)
        return k3_fail(err, K3_EXIT_RUNTIME, "k3_io_submit_batch: %d reads would exceed the depth %d",
                       k3_io_inflight(io) + n, io->depth);
    long fa = fail_after();
    if (fa >= 0) { /* counted per request, as k3_io_submit and k3_io_read do */
        long before = __atomic_fetch_add(&injected_count, (long)n, __ATOMIC_RELAXED);
        if (before + (long)n > fa) {
            const k3_io_req *q = qs[fa > before ? fa - before : 0];
            return k3_fail(err, K3_EXIT_RUNTIME, "read of %llu bytes at offset %llu failed: %s (K3_IO_FAIL_AFTER)",
                           (unsigned long long)q->len, (unsigned long long)q->offset, strerror(EIO));
        }
    }
    if (!io->have_ring) {
        for (int i = 0; i < n; i++) {
            k3_io_req *q = qs[i];
            uint64_t a = q->offset & ~(uint64_t)(K3_IO_ALIGN - 1);
            q->data = (const char *)q->buf + (q->offset - a);
            double t0 = k3_now();
            int rc = read_full(q->fd, q->buf, k3_io_span(q->offset, q->len), a, q->offset - a + q->len, err);
            io->seconds += k3_now() - t0;
            if (rc) return rc; /* the ones read already are handed back by k3_io_complete */
            io->bytes += k3_io_span(q->offset, q->len);
            if (!io->done) io->done = xmalloc_array((size_t)io->depth, sizeof *io->done);
            io->done[io->ndone++] = q;
        }
        return K3_OK;
    }
    for (int i = 0; i < n; i++) {
        k3_io_req *q = qs[i];
        uint64_t a = q->offset & ~(uint64_t)(K3_IO_ALIGN - 1);
        q->data = (const char *)q->buf + (q->offset - a);
        struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
        if (!sqe) { /* (not within the depth: the ring has depth entries) */
            int r = io_uring_submit(&io->ring);
            if (r > 0) io->inflight += r;
            return k3_fail(err, K3_EXIT_RUNTIME, "io_uring: no free submission entry");
        }
        prep(io, sqe, q);
    }
    int r = io_uring_submit(&io->ring);
    if (r < 0) return k3_fail(err, K3_EXIT_RUNTIME, "io_uring submit failed: %s", strerror(-r));
    io->inflight += n;
    return K3_OK;
}

int k3_io_complete(k3_io *io, k3_io_req **done, k3_err *err) {
    *done = NULL;
    if (io->ndone > 0) {
        *done = io->done[0];
        memmove(io->done, io->done + 1, (size_t)(--io->ndone) * sizeof *io->done);
        return K3_OK;
    }
    if (io->inflight == 0) return k3_fail(err, K3_EXIT_RUNTIME, "k3_io_complete: nothing in flight");
    struct io_uring_cqe *cqe;
    double t0 = k3_now();
    int w;
    do w = io_uring_wait_cqe(&io->ring, &cqe);
    while (w == -EINTR);
    io->seconds += k3_now() - t0;
    if (w < 0) return k3_fail(err, K3_EXIT_RUNTIME, "io_uring wait failed: %s", strerror(-w));
    k3_io_req *q = io_uring_cqe_get_data(cqe);
    int res = cqe->res;
    io_uring_cqe_seen(&io->ring, cqe);
    io->inflight--;
    *done = q;
    uint64_t a = q->offset & ~(uint64_t)(K3_IO_ALIGN - 1);
    uint64_t span = k3_io_span(q->offset, q->len), need = q->offset - a + q->len;
    if (res >= 0 && (uint64_t)res >= need) {
        io->bytes += (uint64_t)res;
        return K3_OK;
    }
    /* short or refused: finish this one synchronously (it reports EOF precisely) */
    io->bytes += span;
    return read_full(q->fd, q->buf, span, a, need, err);
}

bool k3_largest_shard(const char *dir, char *buf, size_t cap, uint64_t *size) {
    *size = 0;
    if (cap) buf[0] = 0;
    DIR *d = opendir(dir);
    if (!d) return false;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l < 12 || strcmp(e->d_name + l - 12, ".safetensors")) continue;
        char p[4096];
        if (snprintf(p, sizeof p, "%s/%s", dir, e->d_name) >= (int)sizeof p || strlen(p) >= cap) continue;
        struct stat st;
        if (stat(p, &st) == 0 && (uint64_t)st.st_size > *size) {
            *size = (uint64_t)st.st_size;
            memcpy(buf, p, strlen(p) + 1);
        }
    }
    closedir(d);
    return *size > 0;
}
