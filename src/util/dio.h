/* dio.h: the one positional reader of weight files, O_DIRECT or buffered.
 *
 * The shards' index (formats/safetensors) and the streaming reads
 * (memory/io) both read through here, so there is one place that knows how
 * O_DIRECT is opened, aligned and given up. It sits in util/ because
 * formats/ must not depend on memory/ (memory/ is built on formats/).
 *
 * Invariants:
 *   - k3_dio_open asks for O_DIRECT only when told to; a filesystem that
 *     refuses the flag (tmpfs and friends) gets a buffered descriptor, never
 *     an error of its own;
 *   - an O_DIRECT transfer always has a K3_DIO_ALIGN-aligned offset, length
 *     and buffer: k3_dio_read_span reads the aligned span around a range into
 *     the caller's aligned buffer, k3_dio_pread reads any range into any
 *     memory through an aligned bounce buffer;
 *   - a read the kernel refuses with EINVAL on an O_DIRECT descriptor drops
 *     O_DIRECT on that descriptor (for every later read too) and is done
 *     buffered: the bytes are the same either way, only the page cache sees
 *     them;
 *   - errors are one line naming the file (path; NULL leaves it out), the
 *     offset and the length: K3_EXIT_DATA when the file ends before the
 *     range does, K3_EXIT_RUNTIME for any other failure. */
#ifndef K3_UTIL_DIO_H
#define K3_UTIL_DIO_H

#include "util/common.h"

/* Every logical block size Linux filesystems use divides this. */
#define K3_DIO_ALIGN 4096u

/* Opens path read-only (O_CLOEXEC), with O_DIRECT when direct and accepted.
 * is_direct (may be NULL) says which it got. */
int k3_dio_open(const char *path, bool direct, int *fd, bool *is_direct, k3_err *err);
/* A K3_DIO_ALIGN-aligned buffer of at least size bytes (rounded up); free()
 * it. Exits like xmalloc when memory is short. */
void *k3_dio_alloc(uint64_t size);
/* off rounded down to K3_DIO_ALIGN. */
static inline uint64_t k3_dio_floor(uint64_t off) { return off & ~(uint64_t)(K3_DIO_ALIGN - 1); }
/* Bytes of the aligned span around [off, off+len). */
static inline uint64_t k3_dio_span(uint64_t off, uint64_t len) {
    return ((off + len + K3_DIO_ALIGN - 1) & ~(uint64_t)(K3_DIO_ALIGN - 1)) - k3_dio_floor(off);
}
/* Reads the aligned span around [off, off+len) into buf (K3_DIO_ALIGN
 * aligned, k3_dio_span(off, len) bytes); [off, off+len) then starts at
 * buf + (off - k3_dio_floor(off)). The span may run past the end of the
 * file; the range may not. */
int k3_dio_read_span(int fd, void *buf, uint64_t off, uint64_t len, const char *path, k3_err *err);
/* Reads exactly [off, off+len) into dst (any alignment): straight in on a
 * buffered descriptor, through an aligned bounce buffer on an O_DIRECT one. */
int k3_dio_pread(int fd, void *dst, uint64_t off, uint64_t len, const char *path, k3_err *err);

#endif
