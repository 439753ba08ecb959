/* io.h: batched positional reads for streaming weights from disk.
 *
 * The engine reads large runs (a trunk layer, a routed expert's six tensors)
 * whose offsets are not page aligned. With O_DIRECT the kernel needs aligned
 * offsets, lengths and buffers, so each request reads the aligned superset of
 * its range into a caller-provided aligned buffer and reports where its bytes
 * start inside it. Batches are submitted through io_uring (several reads in
 * flight, sorted by file and offset, which is what made expert reads fast on
 * NVMe); where io_uring or O_DIRECT is refused, plain pread is the fallback,
 * and the result bytes are the same either way. Opening, alignment and the
 * synchronous reads (with O_DIRECT given up on refusal) are util/dio.h's, the
 * one reader the shards' index uses too. */
#ifndef K3_MEMORY_IO_H
#define K3_MEMORY_IO_H

#include "util/common.h"
#include "util/dio.h"

typedef struct {
    int fd;                /* an fd from k3_io_open (O_DIRECT if it was allowed) */
    uint64_t offset, len;  /* the bytes wanted */
    void *buf;             /* K3_DIO_ALIGN-aligned, capacity >= k3_dio_span(offset, len) */
    const void *data;      /* out: where the wanted bytes start inside buf */
} k3_io_req;

typedef struct k3_io k3_io;

/* depth: reads in flight (1 = synchronous pread). direct: try O_DIRECT. */
k3_io *k3_io_new(int depth, bool direct);
void k3_io_free(k3_io *io);
/* Opens path read-only, with O_DIRECT when the io was created with direct and
 * the filesystem accepts it (else buffered); k3_dio_open. The io remembers
 * the path so that a failed read names the file. */
int k3_io_open(k3_io *io, const char *path, int *fd, bool *is_direct, k3_err *err);
/* Reads every request (any order of completion; submission sorted by fd then
 * offset). Short reads past end of file are an error naming the request. */
int k3_io_read(k3_io *io, k3_io_req *reqs, size_t n, k3_err *err);
/* Asynchronous use, from one thread at a time: k3_io_submit sends one request
 * at once (at most `depth` may be outstanding; the request and its buffer must
 * stay valid until it is completed); k3_io_complete waits for any one of them
 * and returns it in *done (an error is that request's: *done is set). With the
 * pread backend the read happens inside k3_io_submit. k3_io_free waits for
 * requests still in flight. */
int k3_io_submit(k3_io *io, k3_io_req *q, k3_err *err);
int k3_io_complete(k3_io *io, k3_io_req **done, k3_err *err);
/* Sends qs[0..n) with one submission (one system call for the batch, where
 * k3_io_submit makes one per request), in the order given; n must not exceed
 * the free depth. On an error, the requests sent before it stay in flight
 * (k3_io_inflight counts them; complete them before freeing their buffers). */
int k3_io_submit_batch(k3_io *io, k3_io_req *const *qs, int n, k3_err *err);
int k3_io_inflight(const k3_io *io);  /* submitted, not yet returned by k3_io_complete */
/* Registers up to K3_IO_MAXREG long-lived buffers (each at most 1 GiB) with
 * the ring, once: later reads into them (k3_io_submit, k3_io_submit_batch)
 * skip the pinning of user pages each O_DIRECT read otherwise costs. The
 * buffers must outlive io. False (and plain reads, same bytes) where refused:
 * no ring, RLIMIT_MEMLOCK, K3_IO_REGISTER=0. */
#define K3_IO_MAXREG 4
bool k3_io_register(k3_io *io, void *const *bufs, const uint64_t *lens, int n);
/* (Tests: K3_IO_FAIL_AFTER=N in the environment fails every read request
 * after the first N made while it is set with EIO.) */
/* Cumulative bytes read from disk and seconds spent waiting in k3_io_read. */
uint64_t k3_io_bytes(const k3_io *io);
double k3_io_seconds(const k3_io *io);
const char *k3_io_backend(const k3_io *io); /* "io_uring" or "pread" */

/* The largest *.safetensors file in dir (what storage measurements read):
 * its path into buf (cap bytes) and its size; false when there is none. */
bool k3_largest_shard(const char *dir, char *buf, size_t cap, uint64_t *size);

#endif
