/* common.h: what every k3 module shares: exit codes, the error record, checked
 * allocation, number conversions, atomic file writes, timing and progress.
 *
 * Error convention. A function that can fail returns an int: K3_OK (0) on
 * success, else one of the exit codes below, and fills a k3_err with ONE line
 * that names the file (or input) and the problem. The CLI prints that line as
 * "k3: <msg>" and exits with the code. Library code never exits, except on
 * allocation failure (xmalloc & co. print one line and exit K3_EXIT_RUNTIME). */
#ifndef K3_COMMON_H
#define K3_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdio.h>

enum {
    K3_OK = 0,
    K3_EXIT_RUNTIME = 1, /* I/O failure, out of memory, internal error */
    K3_EXIT_USAGE = 2,   /* bad flags, invalid config or input */
    K3_EXIT_BUDGET = 3,  /* refused up front: cannot fit the memory budget */
    K3_EXIT_DATA = 4,    /* checkpoint data error: truncated shard, bad header, wrong dtype/shape */
};

typedef struct {
    int code;       /* one of the K3_EXIT_* codes, 0 when no error */
    char msg[1024]; /* one line, no trailing newline */
} k3_err;

/* Sets err (may be NULL) and returns code, so callers can write
 * `return k3_fail(err, K3_EXIT_DATA, "%s: header past end of file", path);` */
int k3_fail(k3_err *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Checked allocation: never returns NULL; on failure prints
 * "k3: out of memory (N bytes)" and exits K3_EXIT_RUNTIME.
 * xmalloc_array/xcalloc check n*size for overflow. */
void *xmalloc(size_t size);
void *xcalloc(size_t n, size_t size);
void *xmalloc_array(size_t n, size_t size);
void *xrealloc(void *p, size_t size);
void *xrealloc_array(void *p, size_t n, size_t size);
char *xstrdup(const char *s);
/* 64-byte aligned (for SIMD); free with free(). */
void *xmalloc_aligned(size_t size);

/* A growable byte string, always NUL-terminated (it may hold NULs): start
 * from {0}, append, free with k3_sb_free (which leaves it empty again). */
typedef struct {
    char *p;
    size_t n, cap;
} k3_sbuf;
void k3_sb_put(k3_sbuf *b, const void *s, size_t n);
void k3_sb_puts(k3_sbuf *b, const char *s);
void k3_sb_putc(k3_sbuf *b, char c);
void k3_sb_printf(k3_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void k3_sb_free(k3_sbuf *b);

/* a*b with overflow detection: returns false on overflow. */
bool k3_mul_ok(uint64_t a, uint64_t b, uint64_t *out);

/* Exact conversions of 16-bit floats to f32, and round-to-nearest-even back. */
static inline float k3_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}
uint16_t k3_f32_to_bf16(float f);
float k3_f16_to_f32(uint16_t h);
uint16_t k3_f32_to_f16(float f);

/* Whole-file read (NUL-terminated for convenience) of at most max bytes;
 * path "-" reads stdin. A regular file over max is refused before it is
 * read, a pipe or terminal once it goes past max; a directory, device (such
 * as /dev/zero) or other non-regular file is refused, and with regular_only
 * anything but a regular file (where its size must be known). Those refusals
 * are K3_EXIT_USAGE, one line naming the path (and the maximum); a read error
 * is K3_EXIT_RUNTIME. k3_read_file reads texts, manifests and small JSON
 * files: at most K3_READ_MAX (1 GiB), regular files, pipes or terminals. */
#define K3_READ_MAX ((uint64_t)1 << 30)
int k3_read_file(const char *path, char **data, size_t *len, k3_err *err);
int k3_read_file_max(const char *path, uint64_t max, bool regular_only, char **data, size_t *len, k3_err *err);

/* Atomic write of a small file: temp file in the same directory, fsync,
 * rename over path, fsync the directory. Only regular files (or missing
 * paths) are replaced that way; a symlink to a regular file has its target
 * replaced, and a device, FIFO or socket is written in place (so
 * /dev/stdout stays a device). The temp file is PATH.tmp.PID; opening removes
 * temp files of PATH left by processes that no longer exist. Write errors
 * (a full disk or device) are reported, never ignored. */
int k3_write_file_atomic(const char *path, const void *data, size_t len, k3_err *err);

/* Streaming atomic writer for large outputs (checkpoints, packed trunks). */
typedef struct {
    char *path, *tmp;  /* tmp NULL when written in place */
    char *shown;       /* the path as given, for messages */
    FILE *f;
    bool inplace;      /* not a regular file: written directly */
} k3_atomic_file;
int k3_atomic_open(k3_atomic_file *af, const char *path, k3_err *err);
int k3_atomic_write(k3_atomic_file *af, const void *data, size_t len, k3_err *err);
/* Appends len zero bytes as a hole (no disk blocks) in a regular file; a
 * device or FIFO written in place gets the zeros written. */
int k3_atomic_skip(k3_atomic_file *af, uint64_t len, k3_err *err);
int k3_atomic_commit(k3_atomic_file *af, k3_err *err); /* fsync + rename + dir fsync */
void k3_atomic_abort(k3_atomic_file *af);              /* unlink the temp file */
/* Up-front check of an output path (before any long work), K3_EXIT_USAGE
 * naming `what` (the flag) when it is empty, a directory, in a missing or
 * unwritable directory, or an existing non-regular file that is not writable. */
int k3_check_output_path(const char *path, const char *what, k3_err *err);
/* Creates dir and its missing parents (mode 0777 less the umask), as
 * `mkdir -p`: an output folder such as runs/new/x needs no step before it.
 * K3_EXIT_RUNTIME when one cannot be made, K3_EXIT_USAGE when dir exists and
 * is not a directory. */
int k3_mkdir_p(const char *dir, k3_err *err);

/* "dir/name", allocated (xmalloc: never NULL); no second '/' when dir ends
 * in one, and an empty dir (the working directory) gives name, never "/name". */
char *k3_path_join(const char *dir, const char *name);

/* Leftovers of killed writers (NAME.tmp.PID files, staging and sample
 * folders) carry the writer's PID. True when pid names no live process and is
 * not this one, i.e. nothing can still be writing there (a PID reused by an
 * unrelated process only delays the clean-up). */
bool k3_pid_gone(int64_t pid);
/* Removes dir and the plain files in it (best effort: leftovers only). */
void k3_remove_flat_dir(const char *dir);

/* CRC-32C (Castagnoli), hardware-accelerated where the CPU has SSE4.2.
 * Start with crc = 0; feed chunks by passing the previous result. */
uint32_t k3_crc32c(uint32_t crc, const void *data, size_t n);
/* k3_crc32c(crc, n zero bytes) in O(log n) time: a hole of any size. */
uint32_t k3_crc32c_zeros(uint32_t crc, uint64_t n);
/* FNV-1a 64-bit, for identities of small byte strings (headers, names). */
uint64_t k3_fnv1a64(uint64_t h, const void *data, size_t n);
#define K3_FNV_OFFSET 0xcbf29ce484222325ULL

/* A byte count in the unit that fits, 3 significant digits: "512 B",
 * "25.4 kB", "1.23 MB", "3.50 GB" (decimal units). Returns one of 8
 * thread-local buffers in turn, so a message may hold up to 8 of them. */
const char *k3_size_str(uint64_t bytes);

double k3_now(void);               /* monotonic seconds */
uint64_t k3_peak_rss_bytes(void);  /* getrusage ru_maxrss */
/* Memory sizing never plans past what the process may really take: the least
 * of /proc/meminfo's MemAvailable and the headroom under a memory cgroup
 * limit (a container's or a systemd slice's, which the kernel enforces by
 * killing the process, while MemAvailable is only an estimate).
 * k3_mem_available_bytes: that least, 0 if nothing can be read.
 * k3_mem_limit: the budget a run plans within: --max-memory (max_memory, 0
 * when not given) or else MemAvailable, either one lowered to the cgroup's
 * headroom; *what (may be NULL) names the bound that won, for messages. */
uint64_t k3_mem_available_bytes(void);
uint64_t k3_mem_limit(uint64_t max_memory, const char **what);
/* The headroom under the memory cgroup limits of the process whose
 * /proc/PID/cgroup and /proc/PID/mountinfo are given: for its own cgroup and
 * each ancestor up to the mount, v2 (cgroup2: memory.max less memory.current)
 * and v1 (memory.limit_in_bytes less memory.usage_in_bytes), usage counted
 * without the inactive file cache (memory.stat), which the kernel reclaims
 * before it kills; the least over all. UINT64_MAX when no limit is set or
 * none can be read. *limit (may be NULL): the limit of the group that bound. */
uint64_t k3_cgroup_headroom(const char *proc_cgroup, const char *mountinfo, uint64_t *limit);

/* A one-line progress bar on stderr (only when stderr is a terminal, or when
 * K3_PROGRESS=1): "label [=====>    ] 42% 1.2/3.0 GB 350 MB/s ETA 5s". */
typedef struct {
    const char *label;
    uint64_t total, done;
    double t0, last;
    bool enabled, bytes;
} k3_progress;
void k3_progress_start(k3_progress *p, const char *label, uint64_t total, bool bytes);
void k3_progress_update(k3_progress *p, uint64_t done);
void k3_progress_finish(k3_progress *p);

/* The program's one pseudo-random generator: splitmix64, whose sequence is
 * the same on every machine, so initialisation, data order and sampling are
 * reproducible from a seed. k3_mix64 is its output function, also used as a
 * hash of counters (the draw for step s depends only on (seed, s)). */
static inline uint64_t k3_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
#define K3_GOLDEN64 0x9E3779B97F4A7C15ull /* 2^64 / golden ratio: splitmix64's increment */
static inline uint64_t k3_rng_next(uint64_t *state) { return k3_mix64(*state += K3_GOLDEN64); }
/* Uniform in [0, 1) with 53 random bits. */
static inline double k3_rng_unit(uint64_t *state) { return (double)(k3_rng_next(state) >> 11) * 0x1p-53; }

/* Parses a whole decimal integer in [lo, hi]; false on anything else
 * (empty, trailing characters, overflow, out of range). */
bool k3_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);

/* Parses a whole finite decimal number ("0.9", "1e-3"); false on anything
 * else (empty, trailing characters, overflow, inf, nan). */
bool k3_parse_f64(const char *s, double *out);

/* Parses a size with an optional binary unit, "4096", "512K", "8G", "1.5T"
 * (K = 1024 bytes), and an optional trailing B; false on anything else. */
bool k3_parse_size(const char *s, uint64_t *out);

/* Parses "1,2,3" into ids; rejects anything but decimal integers in [0, max). */
int k3_parse_ids(const char *s, int64_t max, int32_t **ids, size_t *n, k3_err *err);

#endif
