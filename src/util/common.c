/* common.c: see common.h. */
#include "util/common.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int k3_fail(k3_err *err, int code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        /* one line only: a message must never spill onto a second line */
        for (char *c = err->msg; *c; c++)
            if (*c == '\n' || *c == '\r') *c = ' ';
        err->code = code;
    }
    return code;
}

static void oom(size_t n) {
    fprintf(stderr, "k3: out of memory (%zu bytes)\n", n);
    exit(K3_EXIT_RUNTIME);
}

void *xmalloc(size_t size) {
    void *p = malloc(size ? size : 1);
    if (!p) oom(size);
    return p;
}

void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) oom(n * size);
    return p;
}

void k3_sb_put(k3_sbuf *b, const void *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        b->p = xrealloc(b->p, cap);
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
void k3_sb_puts(k3_sbuf *b, const char *s) { k3_sb_put(b, s, strlen(s)); }
void k3_sb_putc(k3_sbuf *b, char c) { k3_sb_put(b, &c, 1); }
void k3_sb_printf(k3_sbuf *b, const char *fmt, ...) {
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (k < 0) return;
    if ((size_t)k < sizeof small) {
        k3_sb_put(b, small, (size_t)k);
        return;
    }
    char *big = xmalloc((size_t)k + 1);
    va_start(ap, fmt);
    vsnprintf(big, (size_t)k + 1, fmt, ap);
    va_end(ap);
    k3_sb_put(b, big, (size_t)k);
    free(big);
}
void k3_sb_free(k3_sbuf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

bool k3_mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) return false;
    if (out) *out = r;
    return true;
}

void *xmalloc_array(size_t n, size_t size) {
    size_t t;
    if (__builtin_mul_overflow(n, size, &t)) oom(SIZE_MAX);
    return xmalloc(t);
}

void *xrealloc(void *p, size_t size) {
    void *q = realloc(p, size ? size : 1);
    if (!q) oom(size);
    return q;
}

void *xrealloc_array(void *p, size_t n, size_t size) {
    size_t t;
    if (__builtin_mul_overflow(n, size, &t)) oom(SIZE_MAX);
    return xrealloc(p, t);
}

char *xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = xmalloc(n);
    memcpy(d, s, n);
    return d;
}

void *xmalloc_aligned(size_t size) {
    void *p = NULL;
    size_t rounded = (size + 63) & ~(size_t)63;
    if (rounded < size || posix_memalign(&p, 64, rounded ? rounded : 64) != 0) oom(size);
    return p;
}

uint16_t k3_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    if (isnan(f)) return (uint16_t)((v.u >> 16) | 0x40); /* quiet NaN, keep sign */
    uint32_t lsb = (v.u >> 16) & 1;
    v.u += 0x7fff + lsb;
    return (uint16_t)(v.u >> 16);
}

float k3_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in f32 */
        float m = (float)man * 0x1p-24f;
        return sign ? -m : m;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return v.f;
}

uint16_t k3_f32_to_f16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    uint16_t sign = (uint16_t)((v.u >> 16) & 0x8000);
    if (isnan(f)) return sign | 0x7e00;
    float a = fabsf(f);
    if (a >= 65520.0f) return sign | 0x7c00; /* rounds to inf */
    if (a < 0x1p-14f) {
        /* subnormal: round a / 2^-24 to nearest even integer */
        float q = nearbyintf(a * 0x1p24f);
        return sign | (uint16_t)q;
    }
    uint32_t u = v.u & 0x7fffffffu;
    uint32_t lsb = (u >> 13) & 1;
    u += 0xfff + lsb;
    uint32_t exp = (u >> 23) - 112, man = (u >> 13) & 0x3ff;
    return sign | (uint16_t)((exp << 10) | man);
}

bool k3_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool k3_parse_f64(const char *s, double *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

bool k3_parse_size(const char *s, uint64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0 || !isfinite(v)) return false;
    double mul = 1;
    if (*end) {
        switch (*end) {
        case 'k': case 'K': mul = 1024.0; break;
        case 'm': case 'M': mul = 1024.0 * 1024; break;
        case 'g': case 'G': mul = 1024.0 * 1024 * 1024; break;
        case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; break;
        default: return false;
        }
        end++;
        if (*end == 'B' || *end == 'b') end++;
        if (*end) return false;
    }
    double b = v * mul;
    if (b >= 1.8e19) return false;
    *out = (uint64_t)b;
    return true;
}

int k3_read_file(const char *path, char **data, size_t *len, k3_err *err) {
    return k3_read_file_max(path, K3_READ_MAX, false, data, len, err);
}

int k3_read_file_max(const char *path, uint64_t max, bool regular_only, char **data, size_t *len, k3_err *err) {
    bool std_in = strcmp(path, "-") == 0;
    FILE *f = std_in ? stdin : fopen(path, "rb");
    if (std_in) path = "standard input";
    if (!f) return k3_fail(err, K3_EXIT_USAGE, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    const char *bad = NULL;
    if (fstat(fileno(f), &st) != 0) bad = "cannot stat";
    else if (S_ISDIR(st.st_mode)) bad = "is a directory, not a file"; /* fopen succeeds on one; fread then fails */
    else if (regular_only && !S_ISREG(st.st_mode)) bad = "not a regular file";
    /* a pipe or a terminal is read up to max; a device such as /dev/zero or
     * /dev/urandom never ends and is no text */
    else if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode) && !S_ISSOCK(st.st_mode) && !isatty(fileno(f)))
        bad = "not a regular file, pipe or terminal";
    else if (S_ISREG(st.st_mode) && (uint64_t)st.st_size > max) bad = "too large";
    if (bad) {
        if (!std_in) fclose(f);
        if (!strcmp(bad, "too large"))
            return k3_fail(err, K3_EXIT_USAGE, "%s: %s, over the %s k3 reads of it", path, k3_size_str((uint64_t)st.st_size),
                           k3_size_str(max));
        return k3_fail(err, K3_EXIT_USAGE, "%s: %s", path, bad);
    }
    size_t cap = 1 << 16, n = 0;
    if (S_ISREG(st.st_mode) && (uint64_t)st.st_size < SIZE_MAX - 1 && (size_t)st.st_size + 1 > cap)
        cap = (size_t)st.st_size + 1;
    char *buf = xmalloc(cap);
    bool over = false;
    uint64_t lim = max == UINT64_MAX ? max : max + 1; /* one byte past max tells */
    for (;;) {
        if (n + 1 >= cap) buf = xrealloc(buf, cap *= 2);
        size_t want = cap - n - 1;
        if ((uint64_t)n + want > lim) want = (size_t)(lim - n);
        size_t r = want ? fread(buf + n, 1, want, f) : 0;
        n += r;
        if ((uint64_t)n > max) { over = true; break; }
        if (r == 0) break;
    }
    int bad_io = ferror(f), e = errno;
    if (!std_in) fclose(f);
    if (over) {
        free(buf);
        return k3_fail(err, K3_EXIT_USAGE, "%s: longer than the %s k3 reads of it", path, k3_size_str(max));
    }
    if (bad_io) {
        free(buf);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: read error: %s", path, strerror(e));
    }
    buf[n] = 0;
    *data = buf;
    if (len) *len = n;
    return K3_OK;
}

static int fsync_dir_of(const char *path) {
    char *copy = xstrdup(path);
    int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY);
    free(copy);
    if (fd < 0) return -1;
    int r = fsync(fd);
    close(fd);
    return r;
}

/* Temp files are NAME.tmp.PID: a writer killed before its rename leaves one
 * behind, and the next writer of NAME removes those whose PID is gone. */
static void remove_stale_temps(const char *path) {
    char *copy = xstrdup(path), *copy2 = xstrdup(path);
    const char *dir = dirname(copy), *base = basename(copy2);
    size_t bl = strlen(base);
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            const char *n = e->d_name;
            if (strncmp(n, base, bl) != 0 || strncmp(n + bl, ".tmp.", 5) != 0) continue;
            int64_t pid;
            if (!k3_parse_i64(n + bl + 5, 1, INT32_MAX, &pid) || !k3_pid_gone(pid)) continue;
            char *p = k3_path_join(dir, n);
            unlink(p);
            free(p);
        }
        closedir(d);
    }
    free(copy);
    free(copy2);
}

char *k3_path_join(const char *dir, const char *name) {
    size_t d = strlen(dir), n = d + strlen(name) + 2;
    char *p = xmalloc(n);
    snprintf(p, n, "%s%s%s", dir, d == 0 || dir[d - 1] == '/' ? "" : "/", name);
    return p;
}

bool k3_pid_gone(int64_t pid) {
    if (pid <= 0 || pid > INT32_MAX || pid == (int64_t)getpid()) return false;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

void k3_remove_flat_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char *p = k3_path_join(dir, e->d_name);
            unlink(p);
            free(p);
        }
        closedir(d);
    }
    rmdir(dir);
}

int k3_mkdir_p(const char *dir, k3_err *err) {
    if (!*dir) return k3_fail(err, K3_EXIT_USAGE, "empty directory name");
    char *p = xstrdup(dir);
    int rc = K3_OK;
    /* every prefix that ends before a '/', then the whole path */
    for (char *s = p + 1;; s++) {
        bool last = !*s;
        if (!last && *s != '/') continue;
        *s = 0;
        if (mkdir(p, 0777) != 0 && errno != EEXIST) {
            int e = errno;
            if (last) rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot create: %s", dir, strerror(e));
            else rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot create its parent %s: %s", dir, p, strerror(e));
            break;
        }
        if (last) break;
        *s = '/';
    }
    free(p);
    struct stat st;
    if (!rc && (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)))
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: not a directory", dir);
    return rc;
}

int k3_check_output_path(const char *path, const char *what, k3_err *err) {
    if (!path || !*path) return k3_fail(err, K3_EXIT_USAGE, "%s: empty output path", what);
    struct stat st;
    if (stat(path, &st) == 0) {
        if (S_ISDIR(st.st_mode)) return k3_fail(err, K3_EXIT_USAGE, "%s: %s: is a directory", what, path);
        /* a regular file is replaced by rename (the directory must be
         * writable); anything else is written in place */
        if (!S_ISREG(st.st_mode)) {
            if (access(path, W_OK) != 0)
                return k3_fail(err, K3_EXIT_USAGE, "%s: %s: not writable: %s", what, path, strerror(errno));
            return K3_OK;
        }
    } else if (errno != ENOENT) {
        return k3_fail(err, K3_EXIT_USAGE, "%s: %s: %s", what, path, strerror(errno));
    }
    char *real = realpath(path, NULL); /* the target of a symlink is what gets replaced */
    char *copy = xstrdup(real ? real : path);
    free(real);
    const char *dir = dirname(copy);
    int rc = K3_OK;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: %s: directory %s does not exist", what, path, dir);
    else if (access(dir, W_OK | X_OK) != 0)
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: %s: directory %s is not writable: %s", what, path, dir, strerror(errno));
    free(copy);
    return rc;
}

/* /dev/stdout and its kind link into /proc/PID/fd: the file behind them is an
 * open descriptor of someone else, to be written through, never replaced. */
static bool is_proc_link(const char *path) {
    if (!strncmp(path, "/proc/", 6) || !strncmp(path, "/dev/", 5)) return true;
    char buf[64];
    ssize_t n = readlink(path, buf, sizeof buf - 1);
    if (n <= 0) return false;
    buf[n] = 0;
    return !strncmp(buf, "/proc/", 6) || !strncmp(buf, "/dev/", 5);
}

int k3_atomic_open(k3_atomic_file *af, const char *path, k3_err *err) {
    memset(af, 0, sizeof *af);
    if (!*path) return k3_fail(err, K3_EXIT_USAGE, "empty output path");
    struct stat st;
    bool exists = stat(path, &st) == 0;
    if (exists && S_ISDIR(st.st_mode)) return k3_fail(err, K3_EXIT_USAGE, "%s: is a directory", path);
    if (exists && (!S_ISREG(st.st_mode) || is_proc_link(path))) {
        /* a device, FIFO or socket (or a link to one) is written in place:
         * replacing it with a regular file would break what it is */
        af->path = xstrdup(path);
        af->inplace = true;
        af->f = fopen(path, "wb");
        if (!af->f) {
            int e = errno;
            free(af->path);
            af->path = NULL;
            return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot open: %s", path, strerror(e));
        }
        return K3_OK;
    }
    /* a symlink to a regular file: replace the target, keep the link */
    char *real = exists ? realpath(path, NULL) : NULL;
    af->path = real ? real : xstrdup(path);
    af->shown = xstrdup(path);
    size_t n = strlen(af->path) + 32;
    af->tmp = xmalloc(n);
    snprintf(af->tmp, n, "%s.tmp.%ld", af->path, (long)getpid());
    remove_stale_temps(af->path);
    af->f = fopen(af->tmp, "wb");
    if (!af->f) {
        int e = errno;
        free(af->path); free(af->tmp); free(af->shown);
        memset(af, 0, sizeof *af);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot create: %s", path, strerror(e));
    }
    return K3_OK;
}

static const char *af_name(const k3_atomic_file *af) { return af->shown ? af->shown : af->path; }

int k3_atomic_write(k3_atomic_file *af, const void *data, size_t len, k3_err *err) {
    if (len && fwrite(data, 1, len, af->f) != len)
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: write failed: %s", af_name(af), strerror(errno));
    return K3_OK;
}

int k3_atomic_skip(k3_atomic_file *af, uint64_t len, k3_err *err) {
    if (af->inplace) {
        static const uint8_t zeros[65536];
        for (uint64_t c = 0; c < len; c += sizeof zeros) {
            int rc = k3_atomic_write(af, zeros, len - c < sizeof zeros ? (size_t)(len - c) : sizeof zeros, err);
            if (rc) return rc;
        }
        return K3_OK;
    }
    if (len > (uint64_t)INT64_MAX || fseeko(af->f, (off_t)len, SEEK_CUR) != 0)
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: seek failed: %s", af_name(af), strerror(errno));
    return K3_OK;
}

static void af_free(k3_atomic_file *af) {
    free(af->path); free(af->tmp); free(af->shown);
    memset(af, 0, sizeof *af);
}

int k3_atomic_commit(k3_atomic_file *af, k3_err *err) {
    int rc = K3_OK;
    if (fflush(af->f) != 0)
        rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: write failed: %s", af_name(af), strerror(errno));
    /* a file ending in a hole (k3_atomic_skip) gets its size only here; a
     * writer that went back to patch a header (the token shards) is not at
     * its end, and the file never shrinks */
    off_t end = af->inplace ? -1 : ftello(af->f);
    struct stat st;
    if (rc == K3_OK && end > 0 && fstat(fileno(af->f), &st) == 0 && end > st.st_size &&
        ftruncate(fileno(af->f), end) != 0)
        rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot set size: %s", af_name(af), strerror(errno));
    /* fsync of a pipe or a character device says EINVAL: nothing to sync */
    if (rc == K3_OK && fsync(fileno(af->f)) != 0 && !(af->inplace && (errno == EINVAL || errno == EROFS)))
        rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: flush failed: %s", af_name(af), strerror(errno));
    if (fclose(af->f) != 0 && rc == K3_OK)
        rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: close failed: %s", af_name(af), strerror(errno));
    af->f = NULL;
    if (!af->inplace) {
        if (rc == K3_OK && rename(af->tmp, af->path) != 0)
            rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: rename failed: %s", af_name(af), strerror(errno));
        if (rc == K3_OK) fsync_dir_of(af->path);
        else unlink(af->tmp);
    }
    af_free(af);
    return rc;
}

void k3_atomic_abort(k3_atomic_file *af) {
    if (af->f) fclose(af->f);
    if (af->tmp) unlink(af->tmp);
    af_free(af);
}

int k3_write_file_atomic(const char *path, const void *data, size_t len, k3_err *err) {
    k3_atomic_file af;
    int rc = k3_atomic_open(&af, path, err);
    if (rc) return rc;
    if ((rc = k3_atomic_write(&af, data, len, err))) {
        k3_atomic_abort(&af);
        return rc;
    }
    return k3_atomic_commit(&af, err);
}

const char *k3_size_str(uint64_t b) {
    static __thread char ring[8][32];
    static __thread int next;
    char *buf = ring[next];
    next = (next + 1) % 8;
    static const char *const unit[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
    double v = (double)b;
    int u = 0;
    while (v >= 999.5 && u < 6) { v /= 1000.0; u++; }
    if (u == 0) snprintf(buf, 32, "%llu B", (unsigned long long)b);
    else snprintf(buf, 32, v >= 99.95 ? "%.0f %s" : v >= 9.995 ? "%.1f %s" : "%.2f %s", v, unit[u]);
    return buf;
}

double k3_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

uint64_t k3_peak_rss_bytes(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (uint64_t)ru.ru_maxrss * 1024u;
}

static uint64_t meminfo_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return kb > UINT64_MAX / 1024u ? UINT64_MAX : (uint64_t)kb * 1024u;
}

/* A cgroup file's first word as a byte count: false when missing or not a
 * whole number; "max" (v2) and v1's near-2^63 "no limit" give UINT64_MAX. */
static bool cg_read_u64(const char *dir, const char *name, uint64_t *v) {
    char *path = k3_path_join(dir, name);
    FILE *f = fopen(path, "r");
    free(path);
    if (!f) return false;
    char word[64] = "";
    bool ok = fscanf(f, "%63s", word) == 1;
    fclose(f);
    if (!ok) return false;
    if (!strcmp(word, "max")) { *v = UINT64_MAX; return true; }
    if (word[0] < '0' || word[0] > '9') return false;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(word, &end, 10);
    if (*end || errno) return false;
    *v = x >= (1ull << 62) ? UINT64_MAX : (uint64_t)x;
    return true;
}

/* The value of "key N" in a memory.stat, 0 when absent. */
static uint64_t cg_stat(const char *dir, const char *key) {
    char *path = k3_path_join(dir, "memory.stat");
    FILE *f = fopen(path, "r");
    free(path);
    if (!f) return 0;
    char k[128];
    unsigned long long v;
    uint64_t out = 0;
    while (fscanf(f, "%127s %llu", k, &v) == 2)
        if (!strcmp(k, key)) { out = (uint64_t)v; break; }
    fclose(f);
    return out;
}

/* Headroom of one cgroup directory, UINT64_MAX when it has no limit. */
static uint64_t cg_dir_headroom(const char *dir, bool v2, uint64_t *limit) {
    uint64_t lim, use = 0;
    if (!cg_read_u64(dir, v2 ? "memory.max" : "memory.limit_in_bytes", &lim) || lim == UINT64_MAX) return UINT64_MAX;
    if (!cg_read_u64(dir, v2 ? "memory.current" : "memory.usage_in_bytes", &use) || use == UINT64_MAX) use = 0;
    uint64_t cache = v2 ? cg_stat(dir, "inactive_file") : cg_stat(dir, "total_inactive_file");
    if (!v2 && !cache) cache = cg_stat(dir, "inactive_file");
    use -= cache < use ? cache : use;
    *limit = lim;
    return lim > use ? lim - use : 0;
}

/* mountinfo writes space, tab, newline and backslash as \ooo */
static void unescape_octal(char *s) {
    char *o = s;
    for (; *s; s++) {
        if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' && s[2] <= '7' && s[3] >= '0' && s[3] <= '7') {
            *o++ = (char)((s[1] - '0') * 64 + (s[2] - '0') * 8 + (s[3] - '0'));
            s += 3;
        } else {
            *o++ = *s;
        }
    }
    *o = 0;
}

static bool has_item(const char *list, const char *item) {
    size_t n = strlen(item);
    for (const char *p = list;;) {
        const char *e = strchr(p, ',');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == n && !memcmp(p, item, n)) return true;
        if (!e) return false;
        p = e + 1;
    }
}

/* The least headroom from the group at path (as /proc/PID/cgroup names it)
 * up to the root of the hierarchy mounted at mnt, whose mount root is root. */
static uint64_t cg_hierarchy(const char *mnt, const char *root, const char *path, bool v2, uint64_t *limit) {
    const char *rel = path;
    size_t rl = strlen(root);
    if (strcmp(root, "/")) {
        /* a container's view: the mount shows only its part of the tree;
         * a path outside it (another cgroup namespace) is the mount itself */
        if (!strncmp(path, root, rl) && (path[rl] == '/' || !path[rl])) rel = path + rl;
        else rel = "";
    }
    if (!strcmp(rel, "/")) rel = "";
    size_t base = strlen(mnt), len = base + strlen(rel);
    if (len > 4095) return UINT64_MAX;
    char dir[4096];
    memcpy(dir, mnt, base);
    memcpy(dir + base, rel, len - base + 1);
    uint64_t best = UINT64_MAX;
    for (;;) {
        uint64_t l = 0, h = cg_dir_headroom(dir, v2, &l);
        if (h < best) { best = h; *limit = l; }
        char *slash = strrchr(dir, '/');
        if (strlen(dir) <= base || !slash || (size_t)(slash - dir) < base) break;
        *slash = 0;
    }
    return best;
}

uint64_t k3_cgroup_headroom(const char *proc_cgroup, const char *mountinfo, uint64_t *limit) {
    uint64_t lim = 0, best = UINT64_MAX;
    char *v1 = NULL, *v2 = NULL, *line = NULL;
    size_t cap = 0;
    FILE *f = fopen(proc_cgroup, "r");
    if (!f) return UINT64_MAX;
    while (getline(&line, &cap, f) > 0) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c1 = *c2 = 0;
        if (!strcmp(line, "0") && c2 == c1 + 1 && !v2) v2 = xstrdup(c2 + 1);
        else if (has_item(c1 + 1, "memory") && !v1) v1 = xstrdup(c2 + 1);
    }
    fclose(f);
    f = (v1 || v2) ? fopen(mountinfo, "r") : NULL;
    while (f && getline(&line, &cap, f) > 0) {
        line[strcspn(line, "\n")] = 0;
        /* ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS */
        char *tok[32], *save = NULL;
        int n = 0;
        for (char *t = strtok_r(line, " ", &save); t && n < 32; t = strtok_r(NULL, " ", &save)) tok[n++] = t;
        int dash = -1;
        for (int i = 6; i < n; i++)
            if (!strcmp(tok[i], "-")) { dash = i; break; }
        if (dash < 0 || dash + 1 >= n) continue;
        const char *fstype = tok[dash + 1], *super = dash + 3 < n ? tok[dash + 3] : "";
        bool is2 = !strcmp(fstype, "cgroup2") && v2, is1 = !strcmp(fstype, "cgroup") && v1 && has_item(super, "memory");
        if (!is1 && !is2) continue;
        unescape_octal(tok[3]);
        unescape_octal(tok[4]);
        uint64_t l = 0, h = cg_hierarchy(tok[4], tok[3], is2 ? v2 : v1, is2, &l);
        if (h < best) { best = h; lim = l; }
    }
    if (f) fclose(f);
    free(line);
    free(v1);
    free(v2);
    if (limit) *limit = best == UINT64_MAX ? 0 : lim;
    return best;
}

uint64_t k3_mem_limit(uint64_t max_memory, const char **what) {
    uint64_t b = max_memory ? max_memory : meminfo_available();
    const char *w = max_memory ? "--max-memory" : "MemAvailable";
    uint64_t cg = k3_cgroup_headroom("/proc/self/cgroup", "/proc/self/mountinfo", NULL);
    if (cg != UINT64_MAX && (!b || cg < b)) {
        b = cg;
        w = "the memory cgroup's headroom";
    }
    if (what) *what = w;
    return b;
}

uint64_t k3_mem_available_bytes(void) { return k3_mem_limit(0, NULL); }

void k3_progress_start(k3_progress *p, const char *label, uint64_t total, bool bytes) {
    memset(p, 0, sizeof *p);
    p->label = label;
    p->total = total;
    p->bytes = bytes;
    p->t0 = p->last = k3_now();
    const char *env = getenv("K3_PROGRESS");
    p->enabled = env ? atoi(env) != 0 : isatty(2);
}

static void fmt_amount(char *buf, size_t n, double v, bool bytes) {
    if (!bytes) { snprintf(buf, n, "%.0f", v); return; }
    const char *u[] = {"B", "KB", "MB", "GB", "TB"};
    int i = 0;
    while (v >= 1000.0 && i < 4) { v /= 1000.0; i++; }
    snprintf(buf, n, "%.1f %s", v, u[i]);
}

static void progress_draw(k3_progress *p, bool final) {
    double el = k3_now() - p->t0;
    double frac = p->total ? (double)p->done / (double)p->total : 1.0;
    if (frac > 1.0) frac = 1.0;
    char bar[31];
    int fill = (int)(frac * 30.0);
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
    bar[30] = 0;
    char done[32], total[32], rate[32];
    fmt_amount(done, sizeof done, (double)p->done, p->bytes);
    fmt_amount(total, sizeof total, (double)p->total, p->bytes);
    fmt_amount(rate, sizeof rate, el > 0 ? (double)p->done / el : 0.0, p->bytes);
    double eta = (frac > 0 && !final) ? el * (1.0 - frac) / frac : 0.0;
    fprintf(stderr, "\r%s [%s] %3.0f%% %s/%s %s/s ETA %.0fs%s", p->label, bar, frac * 100.0,
            done, total, rate, eta, final ? "\n" : "");
    fflush(stderr);
}

void k3_progress_update(k3_progress *p, uint64_t done) {
    p->done = done;
    if (!p->enabled) return;
    double now = k3_now();
    if (now - p->last < 0.2) return;
    p->last = now;
    progress_draw(p, false);
}

void k3_progress_finish(k3_progress *p) {
    if (p->enabled) progress_draw(p, true);
}

int k3_parse_ids(const char *s, int64_t max, int32_t **ids, size_t *n, k3_err *err) {
    size_t cap = 16, cnt = 0;
    int32_t *out = xmalloc_array(cap, sizeof *out);
    const char *c = s;
    while (*c) {
        while (*c == ' ') c++;
        if (*c < '0' || *c > '9') {
            free(out);
            return k3_fail(err, K3_EXIT_USAGE, "--ids: expected a decimal id at '%.20s'", c);
        }
        int64_t v = 0;
        while (*c >= '0' && *c <= '9') {
            v = v * 10 + (*c - '0');
            if (v >= max) {
                free(out);
                return k3_fail(err, K3_EXIT_USAGE, "--ids: id out of range (vocabulary has %lld ids)",
                               (long long)max);
            }
            c++;
        }
        while (*c == ' ') c++;
        if (*c == ',') c++;
        else if (*c) {
            free(out);
            return k3_fail(err, K3_EXIT_USAGE, "--ids: unexpected '%c'", *c);
        }
        if (cnt == cap) out = xrealloc_array(out, cap *= 2, sizeof *out);
        out[cnt++] = (int32_t)v;
    }
    *ids = out;
    *n = cnt;
    return K3_OK;
}
