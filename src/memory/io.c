/* io.c: see io.h. */
#include "memory/io.h"

#include <dirent.h>
#include <errno.h>
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
    /* the path each descriptor k3_io_open returned was opened from, by fd,
     * for the messages of failed reads */
    char **path;
    int npath;
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
    for (int i = 0; i < io->npath; i++) free(io->path[i]);
    free(io->path);
    free(io->done);
    free(io);
}

const char *k3_io_backend(const k3_io *io) { return io->have_ring ? "io_uring" : "pread"; }
uint64_t k3_io_bytes(const k3_io *io) { return io->bytes; }
double k3_io_seconds(const k3_io *io) { return io->seconds; }

int k3_io_open(k3_io *io, const char *path, int *fd, bool *is_direct, k3_err *err) {
    int rc = k3_dio_open(path, io->direct, fd, is_direct, err);
    if (rc) return rc;
    if (*fd >= io->npath) {
        int n = *fd + 1;
        io->path = xrealloc_array(io->path, (size_t)n, sizeof *io->path);
        memset(io->path + io->npath, 0, (size_t)(n - io->npath) * sizeof *io->path);
        io->npath = n;
    }
    free(io->path[*fd]);
    io->path[*fd] = xstrdup(path);
    return K3_OK;
}

/* The file behind fd for messages (NULL: not opened by k3_io_open). */
static const char *fd_path(const k3_io *io, int fd) { return fd >= 0 && fd < io->npath ? io->path[fd] : NULL; }

/* One request read synchronously (util/dio.h: the aligned span, O_DIRECT
 * dropped on that descriptor where the filesystem refuses the read). */
static int read_sync(const k3_io *io, const k3_io_req *q, k3_err *err) {
    return k3_dio_read_span(q->fd, q->buf, q->offset, q->len, fd_path(io, q->fd), err);
}

/* Where q's bytes start inside its buffer once its aligned span is read. */
static void set_data(k3_io_req *q) { q->data = (const char *)q->buf + (q->offset - k3_dio_floor(q->offset)); }

static int cmp_req(const void *x, const void *y) {
    const k3_io_req *a = *(k3_io_req *const *)x, *b = *(k3_io_req *const *)y;
    if (a->fd != b->fd) return a->fd < b->fd ? -1 : 1;
    return a->offset < b->offset ? -1 : (a->offset > b->offset);
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
            rc = read_sync(io, q, err);
            set_data(q);
            io->bytes += k3_dio_span(q->offset, q->len);
        }
    } else {
        size_t next = 0, done = 0, inflight = 0;
        while (done < n && rc == K3_OK) {
            while (next < n && inflight < (size_t)io->depth) {
                struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
                if (!sqe) break;
                k3_io_req *q = order[next];
                uint64_t a = k3_dio_floor(q->offset);
                io_uring_prep_read(sqe, q->fd, q->buf, (unsigned)k3_dio_span(q->offset, q->len), a);
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
            uint64_t a = k3_dio_floor(q->offset);
            uint64_t span = k3_dio_span(q->offset, q->len), need = q->offset - a + q->len;
            set_data(q);
            if (res >= 0 && (uint64_t)res >= need) { io->bytes += (uint64_t)res; continue; }
            /* short or refused: finish this one synchronously (it reports EOF precisely) */
            rc = read_sync(io, q, err);
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
    uint64_t a = k3_dio_floor(q->offset);
    unsigned len = (unsigned)k3_dio_span(q->offset, q->len);
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
    set_data(q);
    if (!io->have_ring) { /* read now; k3_io_complete hands it back */
        double t0 = k3_now();
        int rc = read_sync(io, q, err);
        io->seconds += k3_now() - t0;
        if (rc) return rc;
        io->bytes += k3_dio_span(q->offset, q->len);
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
            set_data(q);
            double t0 = k3_now();
            int rc = read_sync(io, q, err);
            io->seconds += k3_now() - t0;
            if (rc) return rc; /* the ones read already are handed back by k3_io_complete */
            io->bytes += k3_dio_span(q->offset, q->len);
            if (!io->done) io->done = xmalloc_array((size_t)io->depth, sizeof *io->done);
            io->done[io->ndone++] = q;
        }
        return K3_OK;
    }
    for (int i = 0; i < n; i++) {
        k3_io_req *q = qs[i];
        set_data(q);
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
    uint64_t a = k3_dio_floor(q->offset);
    uint64_t span = k3_dio_span(q->offset, q->len), need = q->offset - a + q->len;
    if (res >= 0 && (uint64_t)res >= need) {
        io->bytes += (uint64_t)res;
        return K3_OK;
    }
    /* short or refused: finish this one synchronously (it reports EOF precisely) */
    io->bytes += span;
    return read_sync(io, q, err);
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
