/* jsonl.c: incremental reading of the append-only .jsonl files of a run
 * directory (docs/run-dir.md), and the name check of the /files/ route.
 *
 * The trainer appends while we read, so the last line may be partial: only
 * bytes up to the last '\n' are consumed, the rest is read again next time.
 * A resumed run rewrites the file atomically (new inode), and a user may
 * truncate it: both restart the reading from byte 0. */
#include "web/dashboard.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A record line longer than this is malformed (a train record with 64 layers of
 * 512 expert loads is ~300 KB); it is skipped rather than buffered without end. */
#define JSONL_MAX_LINE ((size_t)8 << 20)
#define JSONL_CHUNK ((size_t)1 << 20)

static void jsonl_clear(k3_jsonl *j) {
    for (size_t i = 0; i < j->n; i++) free(j->recs[i].json);
    free(j->recs);
    j->recs = NULL;
    j->n = j->cap = 0;
    j->off = 0;
    j->bad_lines = 0;
    j->skip_to_nl = false;
    j->exists = false;
}

void k3_jsonl_free(k3_jsonl *j) { jsonl_clear(j); }

static char classify(json_t *o) {
    const char *k = json_string_value(json_object_get(o, "kind"));
    if (k && !strcmp(k, "train")) return 't';
    if (k && !strcmp(k, "eval")) return 'e';
    if (k) return '?';
    if (json_object_get(o, "train_loss")) return 't';
    if (json_object_get(o, "val_loss")) return 'e';
    if (json_object_get(o, "text")) return 's';
    return '?';
}

static void add_line(k3_jsonl *j, const char *line, size_t len) {
    while (len && (line[len - 1] == '\r' || line[len - 1] == ' ' || line[len - 1] == '\t')) len--;
    while (len && (*line == ' ' || *line == '\t')) line++, len--;
    if (len == 0) return; /* blank lines are not records, nor errors */
    json_error_t jerr;
    json_t *o = json_loadb(line, len, 0, &jerr);
    json_t *st = o ? json_object_get(o, "step") : NULL;
    if (!json_is_object(o) || !json_is_integer(st) || json_integer_value(st) < 0) {
        j->bad_lines++;
        json_decref(o);
        return;
    }
    char kind = classify(o);
    json_t *t = json_object_get(o, "time");
    double time = json_is_number(t) ? json_number_value(t) : NAN;
    json_t *dt = json_object_get(o, "step_time_s");
    double step_time = json_is_number(dt) ? json_number_value(dt) : NAN;
    if (j->strip_loads) json_object_del(o, "expert_load");
    /* 15 significant digits: Unix times keep their milliseconds, and a value
     * the trainer wrote with %.9g reads back as written (0.0006, not 0.00059999). */
    char *s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(15));
    if (!s) {
        fprintf(stderr, "k3: out of memory (serialising a %zu-byte record)\n", len);
        exit(K3_EXIT_RUNTIME);
    }
    if (j->n == j->cap) {
        j->cap = j->cap ? 2 * j->cap : 256;
        j->recs = xrealloc_array(j->recs, j->cap, sizeof *j->recs);
    }
    j->recs[j->n++] = (k3_jrec){
        .step = json_integer_value(st), .time = time, .step_time = step_time, .kind = kind, .json = s, .len = strlen(s)};
    json_decref(o);
}

int k3_jsonl_refresh(k3_jsonl *j, int dirfd, k3_err *err) {
    int fd = openat(dirfd, j->name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) { /* not written yet, or removed: nothing to show */
            jsonl_clear(j);
            return K3_OK;
        }
        if (e == ELOOP) return k3_fail(err, K3_EXIT_USAGE, "%s: is a symbolic link; refusing to follow it", j->name);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: %s", j->name, strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return k3_fail(err, K3_EXIT_USAGE, "%s: not a regular file", j->name);
    }
    if (!j->exists || st.st_dev != j->dev || st.st_ino != j->ino || st.st_size < j->off) {
        jsonl_clear(j);
        j->exists = true;
        j->dev = st.st_dev;
        j->ino = st.st_ino;
    }
    char *buf = NULL;
    size_t blen = 0; /* bytes in buf: the unconsumed tail of the file read so far */
    off_t pos = j->off;
    int rc = K3_OK;
    while (pos < st.st_size) {
        size_t want = (size_t)(st.st_size - pos) < JSONL_CHUNK ? (size_t)(st.st_size - pos) : JSONL_CHUNK;
        buf = xrealloc(buf, blen + want);
        ssize_t r = pread(fd, buf + blen, want, pos);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: read failed: %s", j->name, strerror(errno));
            break;
        }
        if (r == 0) break; /* truncated under us: the next refresh sees the new size */
        blen += (size_t)r;
        pos += r;
        size_t start = 0;
        char *nl;
        while ((nl = memchr(buf + start, '\n', blen - start)) != NULL) {
            size_t len = (size_t)(nl - (buf + start));
            if (j->skip_to_nl) j->skip_to_nl = false;
            else add_line(j, buf + start, len);
            start += len + 1;
        }
        j->off += (off_t)start;
        memmove(buf, buf + start, blen - start);
        blen -= start;
        if (blen > JSONL_MAX_LINE) { /* no end in sight: count it once, drop it */
            if (!j->skip_to_nl) j->bad_lines++;
            j->skip_to_nl = true;
            j->off += (off_t)blen;
            blen = 0;
        }
    }
    free(buf);
    close(fd);
    return rc;
}

const char *k3_dashboard_file_type(const char *name) {
    static const struct { const char *ext, *type; } types[] = {
        {".svg", "image/svg+xml"},
        {".png", "image/png"},
        {".json", "application/json; charset=utf-8"},
        {".jsonl", "text/plain; charset=utf-8"},
        {".txt", "text/plain; charset=utf-8"},
        {".log", "text/plain; charset=utf-8"},
        {".md", "text/plain; charset=utf-8"},
        {".csv", "text/csv; charset=utf-8"},
    };
    size_t n = strlen(name);
    if (n == 0 || n > 128 || name[0] == '.') return NULL;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == '-';
        if (!ok) return NULL;
    }
    if (strstr(name, "..")) return NULL;
    const char *dot = strrchr(name, '.');
    if (!dot) return NULL;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (!strcmp(dot, types[i].ext)) return types[i].type;
    return NULL;
}
