/* dashboard.c: the HTTP side of `k3 dashboard`.
 *
 * libmicrohttpd runs one internal thread (epoll) that calls `handle` for every
 * request; all run state lives on that thread, so nothing here is locked (the
 * door's thread, which accepts connections and checks their heads, and the
 * slow-client guard's watchdog, http.h, touch only their own state). The
 * server never writes and never follows a name from the request onto the
 * filesystem: runs are chosen from a table by exact name, and the one route
 * that opens a file by name (/files/) accepts a single plain component, opened
 * relative to the run directory with O_NOFOLLOW and served only if regular. */
#include "web/dashboard.h"
#include "web/assets.h"
#include "web/http.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#define MAX_RUNS 256
#define MAX_STATE_BYTES ((off_t)16 << 20)
#define MAX_FILE_BYTES ((off_t)256 << 20)
#define RESCAN_INTERVAL_S 2.0
#define IDLE_S 15 /* MHD's timeout: a connection that sends nothing this long is closed */
/* 15 significant digits: Unix times keep their milliseconds, and a value the
 * trainer wrote with %.9g reads back as written. */
#define JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(15))


typedef struct {
    char *name; /* selector in ?run=, unique */
    char *path; /* the directory */
    /* state.json cache, keyed by file identity so an unchanged file is not re-parsed */
    bool st_seen;
    dev_t st_dev;
    ino_t st_ino;
    off_t st_size;
    struct timespec st_mtim;
    json_t *state;       /* last good parse, NULL if none */
    char st_error[320];  /* why the last read failed; "" when fine */
    k3_jsonl metrics, samples;
} run_t;

struct k3_dashboard {
    struct MHD_Daemon *mhd;
    k3_http_guard *guard; /* slow clients (http.h) */
    k3_http_door *door;   /* accepts connections, checks heads (owns listen_fd once open) */
    int listen_fd, port;
    bool loopback, verbose;
    double stale_after;
    run_t **runs;
    size_t nruns;
    char **parents; /* directories whose subdirectories are runs */
    size_t nparents;
    double last_scan;
    char hostname[256];
};

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- runs ---- */

static bool has_file(int dfd, const char *name) {
    struct stat st;
    return fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
}

static bool looks_like_run(int dfd) {
    return has_file(dfd, "state.json") || has_file(dfd, "metrics.jsonl") || has_file(dfd, "samples.jsonl");
}

static run_t *find_run(k3_dashboard *d, const char *name) {
    for (size_t i = 0; i < d->nruns; i++)
        if (!strcmp(d->runs[i]->name, name)) return d->runs[i];
    return NULL;
}

static run_t *find_run_path(k3_dashboard *d, const char *path) {
    for (size_t i = 0; i < d->nruns; i++)
        if (!strcmp(d->runs[i]->path, path)) return d->runs[i];
    return NULL;
}

static void add_run(k3_dashboard *d, const char *path, const char *base) {
    if (d->nruns == MAX_RUNS || find_run_path(d, path)) return;
    char name[160];
    int n = snprintf(name, sizeof name, "%s", base);
    if (n < 0 || (size_t)n >= sizeof name) n = (int)sizeof name - 1, name[n] = 0;
    for (int k = 2; find_run(d, name); k++) /* two runs called "out": out, out~2 */
        snprintf(name, sizeof name, "%.140s~%d", base, k);
    run_t *r = xcalloc(1, sizeof *r);
    r->name = xstrdup(name);
    r->path = xstrdup(path);
    r->metrics.name = "metrics.jsonl";
    r->metrics.strip_loads = true;
    r->samples.name = "samples.jsonl";
    d->runs = xrealloc_array(d->runs, d->nruns + 1, sizeof *d->runs);
    d->runs[d->nruns++] = r;
}

static void free_run(run_t *r) {
    json_decref(r->state);
    k3_jsonl_free(&r->metrics);
    k3_jsonl_free(&r->samples);
    free(r->name);
    free(r->path);
    free(r);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Adds every subdirectory of parent that holds run files, in name order. New
 * runs appear on later scans; runs that disappear stay listed (their endpoints
 * then report the missing directory), so names never change under a client. */
static void scan_parent(k3_dashboard *d, const char *parent) {
    int pfd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (pfd < 0) return;
    DIR *dir = fdopendir(pfd);
    if (!dir) { close(pfd); return; }
    char **names = NULL;
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL && n < MAX_RUNS) {
        if (e->d_name[0] == '.') continue;
        int cfd = openat(pfd, e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (cfd < 0) continue; /* files, symlinks, unreadable entries */
        bool run = looks_like_run(cfd);
        close(cfd);
        if (!run) continue;
        names = xrealloc_array(names, n + 1, sizeof *names);
        names[n++] = xstrdup(e->d_name);
    }
    closedir(dir);
    if (n) qsort(names, n, sizeof *names, cmp_str); /* names is NULL when no run was found */
    for (size_t i = 0; i < n; i++) {
        char *path = k3_path_join(parent, names[i]);
        add_run(d, path, names[i]);
        free(path);
        free(names[i]);
    }
    free(names);
}

static void rescan(k3_dashboard *d, bool force) {
    double now = k3_now();
    if (!force && now - d->last_scan < RESCAN_INTERVAL_S) return;
    d->last_scan = now;
    for (size_t i = 0; i < d->nparents; i++) scan_parent(d, d->parents[i]);
}

/* Re-reads state.json unless the same file (inode, size, mtime) is cached. A
 * file that fails to parse keeps the previous good state and records why. */
static void refresh_state(run_t *r, int dfd) {
    int fd = openat(dfd, "state.json", O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) {
            json_decref(r->state);
            r->state = NULL;
            r->st_seen = false;
            r->st_error[0] = 0;
        } else if (e == ELOOP) {
            snprintf(r->st_error, sizeof r->st_error, "state.json: is a symbolic link; refusing to follow it");
        } else {
            snprintf(r->st_error, sizeof r->st_error, "state.json: %s", strerror(e));
        }
        return;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(r->st_error, sizeof r->st_error, "state.json: not a regular file");
        close(fd);
        return;
    }
    if (r->st_seen && st.st_dev == r->st_dev && st.st_ino == r->st_ino && st.st_size == r->st_size &&
        st.st_mtim.tv_sec == r->st_mtim.tv_sec && st.st_mtim.tv_nsec == r->st_mtim.tv_nsec) {
        close(fd);
        return;
    }
    if (st.st_size > MAX_STATE_BYTES) {
        snprintf(r->st_error, sizeof r->st_error, "state.json: %lld bytes, over the %lld-byte limit",
                 (long long)st.st_size, (long long)MAX_STATE_BYTES);
        close(fd);
        return;
    }
    size_t cap = (size_t)st.st_size + 1, len = 0;
    char *buf = xmalloc(cap);
    for (;;) {
        if (len == cap) break;
        ssize_t k = read(fd, buf + len, cap - len);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        len += (size_t)k;
    }
    close(fd);
    json_error_t jerr;
    json_t *o = json_loadb(buf, len, 0, &jerr);
    free(buf);
    if (!json_is_object(o)) {
        snprintf(r->st_error, sizeof r->st_error, "state.json: %s (line %d)",
                 o ? "not a JSON object" : jerr.text, jerr.line);
        json_decref(o);
        return; /* keep the previous state; retried on the next request */
    }
    json_decref(r->state);
    r->state = o;
    r->st_error[0] = 0;
    r->st_seen = true;
    r->st_dev = st.st_dev;
    r->st_ino = st.st_ino;
    r->st_size = st.st_size;
    r->st_mtim = st.st_mtim;
}

/* Brings a run's caches up to date. Returns the directory fd (caller closes)
 * or -1 with r->st_error set when the directory itself is unreadable. */
static int refresh_run(run_t *r, bool metrics, bool samples, char *ioerr, size_t ioerr_len) {
    int dfd = open(r->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        snprintf(r->st_error, sizeof r->st_error, "run directory: %s", strerror(errno));
        return -1;
    }
    refresh_state(r, dfd);
    k3_err err = {0};
    ioerr[0] = 0;
    if (metrics && k3_jsonl_refresh(&r->metrics, dfd, &err) != K3_OK) snprintf(ioerr, ioerr_len, "%.300s", err.msg);
    if (samples && k3_jsonl_refresh(&r->samples, dfd, &err) != K3_OK) snprintf(ioerr, ioerr_len, "%.300s", err.msg);
    return dfd;
}

static bool num(json_t *v, double *out) {
    if (!json_is_number(v)) return false;
    *out = json_number_value(v);
    return isfinite(*out);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Timing of the recent train records (only those after the last step decrease,
 * i.e. written by the current trainer process). median: typical seconds per
 * step, robust to evaluation pauses (for staleness); from the records'
 * step_time_s when they have it, else from the gaps between their times.
 * mean: seconds per step over the window including pauses (for the ETA); from
 * the times when they span at least a minute, since a writer may round its
 * times (%.9g rounds a Unix time to 10 s), else from step_time_s. */
static void step_timing(const k3_jsonl *m, double *median, double *mean) {
    enum { WINDOW = 64 };
    double t[WINDOW], st[WINDOW];
    int64_t s[WINDOW];
    int n = 0;
    *median = *mean = NAN;
    for (size_t i = m->n; i-- > 0 && n < WINDOW;) {
        const k3_jrec *rec = &m->recs[i];
        if (rec->kind != 't') continue;
        if (n > 0 && rec->step >= s[n - 1]) break; /* an older process's records */
        t[n] = rec->time;
        st[n] = rec->step_time;
        s[n] = rec->step;
        n++;
    }
    double d[WINDOW];
    int nd = 0;
    for (int i = 0; i < n; i++)
        if (isfinite(st[i]) && st[i] >= 0) d[nd++] = st[i];
    double st_mean = NAN;
    if (nd > 0) {
        double sum = 0;
        for (int i = 0; i < nd; i++) sum += d[i];
        st_mean = sum / nd;
    } else {
        for (int i = 0; i + 1 < n; i++)
            if (isfinite(t[i]) && isfinite(t[i + 1]) && s[i] > s[i + 1] && t[i] >= t[i + 1])
                d[nd++] = (t[i] - t[i + 1]) / (double)(s[i] - s[i + 1]);
    }
    if (nd > 0) {
        qsort(d, (size_t)nd, sizeof d[0], cmp_double);
        *median = nd % 2 ? d[nd / 2] : 0.5 * (d[nd / 2 - 1] + d[nd / 2]);
    }
    int last = n - 1;
    while (last > 0 && !isfinite(t[last])) last--;
    if (n >= 2 && isfinite(t[0]) && s[0] > s[last] && t[0] - t[last] >= 60)
        *mean = (t[0] - t[last]) / (double)(s[0] - s[last]);
    else
        *mean = st_mean;
}

/* The "dashboard" object of /api/state: what the page derives from the files. */
static json_t *derive(k3_dashboard *d, run_t *r, const char *ioerr) {
    double now = wall_now();
    json_t *st = r->state;
    json_t *out = json_object();
    json_object_set_new(out, "run", json_string(r->name));
    json_object_set_new(out, "server_time", json_real(now));
    const char *status = st ? json_string_value(json_object_get(st, "status")) : NULL;
    bool known = status && (!strcmp(status, "running") || !strcmp(status, "finished") ||
                            !strcmp(status, "stopped") || !strcmp(status, "failed"));
    double upd = NAN, age = NAN;
    if (st && !num(json_object_get(st, "updated_at"), &upd))
        upd = (double)r->st_mtim.tv_sec + 1e-9 * (double)r->st_mtim.tv_nsec;
    if (st) age = now - upd;
    double med, mean;
    step_timing(&r->metrics, &med, &mean);
    double limit = d->stale_after;
    if (isfinite(med) && 5 * med > limit) limit = 5 * med;
    /* An evaluation, a sample, a checkpoint or the start-up writes nothing until
     * it ends, and on a CPU may take minutes: allow five times as long. */
    const char *phase = st ? json_string_value(json_object_get(st, "phase")) : NULL;
    if (phase && (!strcmp(phase, "eval") || !strcmp(phase, "sample") || !strcmp(phase, "checkpoint") ||
                  !strcmp(phase, "init")))
        limit *= 5;
    const char *reason = NULL;
    char why[160];
    if (known && !strcmp(status, "running")) {
        json_t *pid = json_object_get(st, "pid");
        const char *host = json_string_value(json_object_get(st, "hostname"));
        if (json_is_integer(pid) && json_integer_value(pid) > 0 && json_integer_value(pid) <= INT32_MAX &&
            host && !strcmp(host, d->hostname) && kill((pid_t)json_integer_value(pid), 0) != 0 &&
            errno == ESRCH) {
            snprintf(why, sizeof why, "trainer process %lld is gone", (long long)json_integer_value(pid));
            reason = why;
        } else if (age > limit) {
            snprintf(why, sizeof why, "no update for %.0f s", age);
            reason = why;
        }
    }
    const char *shown = !st ? (r->metrics.n ? "unknown" : "waiting") : reason ? "stale" : known ? status : "unknown";
    json_object_set_new(out, "status", json_string(shown));
    json_object_set_new(out, "stale", json_boolean(reason != NULL));
    if (reason) json_object_set_new(out, "stale_reason", json_string(reason));
    json_object_set_new(out, "stale_after_s", json_real(limit));
    json_object_set_new(out, "age_s", isfinite(age) ? json_real(age) : json_null());
    json_object_set_new(out, "sec_per_step", isfinite(med) ? json_real(med) : json_null());
    double step = 0, total = 0, stop_at = 0;
    bool have = st && num(json_object_get(st, "step"), &step) && num(json_object_get(st, "total_steps"), &total);
    if (have && num(json_object_get(st, "stop_at"), &stop_at) && stop_at > 0 && stop_at < total) total = stop_at;
    if (have && !reason && known && !strcmp(status, "running") && isfinite(mean) && total >= step)
        json_object_set_new(out, "eta_s", json_real((total - step) * mean));
    else
        json_object_set_new(out, "eta_s", json_null());
    json_object_set_new(out, "metrics_records", json_integer((json_int_t)r->metrics.n));
    json_object_set_new(out, "metrics_bad_lines", json_integer((json_int_t)r->metrics.bad_lines));
    json_object_set_new(out, "samples_records", json_integer((json_int_t)r->samples.n));
    json_object_set_new(out, "samples_bad_lines", json_integer((json_int_t)r->samples.bad_lines));
    const char *e = r->st_error[0] ? r->st_error : (ioerr && ioerr[0]) ? ioerr : NULL;
    json_object_set_new(out, "error", e ? json_string(e) : json_null());
    return out;
}

/* ---- HTTP ---- */

static enum MHD_Result respond(k3_dashboard *d, struct MHD_Connection *c, const char *url, unsigned code,
                               const char *type, void *body, size_t len, enum MHD_ResponseMemoryMode mode) {
    struct MHD_Response *resp = k3_http_buffer(type, body, len, mode);
    if (resp && code == MHD_HTTP_METHOD_NOT_ALLOWED) MHD_add_response_header(resp, "Allow", "GET, HEAD");
    enum MHD_Result ret = k3_http_queue(c, code, resp);
    if (d->verbose) fprintf(stderr, "k3 dashboard: %u %s\n", code, url);
    return ret;
}

/* The dashboard's error body, {"error": msg} (NULL: out of memory). */
static char *error_body(const char *msg) {
    json_t *o = json_pack("{s:s}", "error", msg);
    char *s = o ? json_dumps(o, JSON_FLAGS) : NULL;
    json_decref(o);
    return s;
}

static enum MHD_Result respond_error(k3_dashboard *d, struct MHD_Connection *c, const char *url, unsigned code,
                                     const char *msg) {
    char *s = error_body(msg);
    if (!s) return MHD_NO;
    return respond(d, c, url, code, "application/json; charset=utf-8", s, strlen(s), MHD_RESPMEM_MUST_FREE);
}

/* the door's refusals (a head libmicrohttpd would answer with HTML) */
static char *door_error(void *cls, unsigned status, const char *code, const char *msg) {
    k3_dashboard *d = cls;
    (void)code;
    if (d->verbose) fprintf(stderr, "k3 dashboard: %u (the request's head): %s\n", status, msg);
    return error_body(msg);
}

static enum MHD_Result respond_json(k3_dashboard *d, struct MHD_Connection *c, const char *url, json_t *o) {
    char *s = json_dumps(o, JSON_FLAGS);
    json_decref(o);
    if (!s) return respond_error(d, c, url, 500, "out of memory");
    return respond(d, c, url, 200, "application/json; charset=utf-8", s, strlen(s), MHD_RESPMEM_MUST_FREE);
}


static enum MHD_Result serve_file(k3_dashboard *d, struct MHD_Connection *c, const char *url, run_t *r,
                                  const char *name) {
    const char *type = k3_dashboard_file_type(name);
    if (!type) return respond_error(d, c, url, 404, "not found");
    int dfd = open(r->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return respond_error(d, c, url, 404, "not found");
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    close(dfd);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > MAX_FILE_BYTES) {
        if (fd >= 0) close(fd);
        return respond_error(d, c, url, 404, "not found");
    }
    struct MHD_Response *resp = MHD_create_response_from_fd((size_t)st.st_size, fd); /* owns fd */
    if (!resp) {
        close(fd);
        return MHD_NO;
    }
    k3_http_headers(resp, type); /* never text/html: k3_dashboard_file_type serves no page */
    /* A run file is data, never an active document (an SVG may hold script). */
    MHD_add_response_header(resp, "Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; sandbox");
    enum MHD_Result ret = k3_http_queue(c, 200, resp);
    if (d->verbose) fprintf(stderr, "k3 dashboard: 200 %s\n", url);
    return ret;
}

/* Records with step > since, in file order. Metrics: the first `limit` of them,
 * never splitting one step's records (so paging by the last step returned loses
 * nothing). Samples: the last `limit` of them. */
static enum MHD_Result serve_records(k3_dashboard *d, struct MHD_Connection *c, const char *url, const k3_jsonl *j,
                                     int64_t since, int64_t limit, bool newest) {
    size_t first = 0, matched = 0;
    if (newest) {
        for (size_t i = 0; i < j->n; i++) matched += j->recs[i].step > since;
        size_t skip = matched > (size_t)limit ? matched - (size_t)limit : 0;
        for (first = 0; first < j->n && skip; first++) skip -= j->recs[first].step > since;
    }
    k3_sbuf b = {0};
    k3_sb_put(&b, "[", 1);
    long long count = 0;
    int64_t last = -1;
    bool any = false;
    for (size_t i = first; i < j->n; i++) {
        const k3_jrec *rec = &j->recs[i];
        if (rec->step <= since) continue;
        if (!newest && count >= limit && rec->step != last) break;
        if (any) k3_sb_put(&b, ",\n", 2);
        k3_sb_put(&b, rec->json, rec->len);
        any = true;
        count++;
        last = rec->step;
    }
    k3_sb_put(&b, "]\n", 2);
    return respond(d, c, url, 200, "application/json; charset=utf-8", b.p, b.n, MHD_RESPMEM_MUST_FREE);
}

static json_t *run_summary(k3_dashboard *d, run_t *r) {
    char ioerr[320];
    int dfd = refresh_run(r, true, false, ioerr, sizeof ioerr);
    if (dfd >= 0) close(dfd);
    json_t *dash = derive(d, r, ioerr);
    json_t *o = json_object();
    json_object_set_new(o, "name", json_string(r->name));
    json_object_set(o, "status", json_object_get(dash, "status"));
    json_object_set(o, "age_s", json_object_get(dash, "age_s"));
    static const char *const keys[] = {"step", "total_steps", "updated_at", "best_val_loss"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        json_t *v = r->state ? json_object_get(r->state, keys[i]) : NULL;
        json_object_set(o, keys[i], v ? v : json_null());
    }
    json_t *latest = r->state ? json_object_get(r->state, "latest") : NULL;
    json_t *loss = json_is_object(latest) ? json_object_get(latest, "train_loss") : NULL;
    json_object_set(o, "train_loss", loss ? loss : json_null());
    json_decref(dash);
    return o;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload_data, size_t *upload_data_size,
                              void **con_cls) {
    (void)upload_data;
    k3_dashboard *d = cls;
    (void)version; /* the door let only HTTP/1.0 and HTTP/1.1 in */
    if (strcmp(method, "GET") && strcmp(method, "HEAD")) {
        *upload_data_size = 0; /* never read a body */
        return respond_error(d, c, url, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed");
    }
    /* Answer on the second call, once the headers are complete: a response
     * queued on the first call makes libmicrohttpd close the connection. */
    static int seen;
    if (*con_cls == NULL) {
        *con_cls = &seen;
        return MHD_YES;
    }
    if (*upload_data_size) { /* a GET with a body: discard it */
        *upload_data_size = 0;
        return MHD_YES;
    }
    k3_http_guard_arrived(c); /* the request is in: answering is not slow input */
    if (d->loopback && !k3_http_host_allowed(MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host")))
        return respond_error(d, c, url, 403, "Host header names no loopback address");

    for (size_t i = 0; i < k3_web_nassets; i++)
        if (!strcmp(url, k3_web_assets[i].path))
            return respond(d, c, url, 200, k3_web_assets[i].type, (void *)k3_web_assets[i].data,
                           k3_web_assets[i].len, MHD_RESPMEM_PERSISTENT);

    bool api = !strncmp(url, "/api/", 5), files = !strncmp(url, "/files/", 7);
    if (!api && !files) return respond_error(d, c, url, 404, "not found");

    if (!strcmp(url, "/api/runs")) {
        rescan(d, false);
        json_t *arr = json_array();
        for (size_t i = 0; i < d->nruns; i++) json_array_append_new(arr, run_summary(d, d->runs[i]));
        return respond_json(d, c, url, arr);
    }

    const char *name = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "run");
    run_t *r = NULL;
    if (name) {
        r = find_run(d, name);
        if (!r) {
            rescan(d, false);
            r = find_run(d, name);
        }
    } else if (d->nruns) {
        r = d->runs[0];
    }
    if (!r) return respond_error(d, c, url, 404, "no such run (see /api/runs)");
    if (files) return serve_file(d, c, url, r, url + 7);

    bool metrics = !strcmp(url, "/api/metrics"), samples = !strcmp(url, "/api/samples");
    bool state = !strcmp(url, "/api/state");
    if (!metrics && !samples && !state) return respond_error(d, c, url, 404, "not found");

    int64_t since = -1, limit = metrics ? 100000 : 100;
    const char *v = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "since");
    if (v && !k3_parse_i64(v, -1, 9007199254740992LL, &since))
        return respond_error(d, c, url, 400, "since: expected an integer step >= -1");
    v = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "limit");
    if (v && !k3_parse_i64(v, 1, 1000000, &limit))
        return respond_error(d, c, url, 400, "limit: expected an integer in [1, 1000000]");

    char ioerr[320];
    int dfd = refresh_run(r, metrics || state, samples || state, ioerr, sizeof ioerr);
    if (dfd >= 0) close(dfd);
    if (metrics) return serve_records(d, c, url, &r->metrics, since, limit, false);
    if (samples) return serve_records(d, c, url, &r->samples, since, limit, true);
    /* state: the file's object as written, plus what the dashboard derived */
    json_t *o = r->state ? json_copy(r->state) : json_object();
    json_object_set_new(o, "dashboard", derive(d, r, ioerr));
    return respond_json(d, c, url, o);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    k3_dashboard *d = cls;
    if (!d->verbose) return;
    fputs("k3 dashboard: libmicrohttpd: ", stderr);
    vfprintf(stderr, fmt, ap);
}

/* ---- start / stop ---- */

static int resolve_dirs(k3_dashboard *d, const k3_dashboard_opts *o, k3_err *err) {
    for (size_t i = 0; i < o->ndirs; i++) {
        const char *dir = o->dirs[i];
        struct stat st;
        if (stat(dir, &st) != 0) return k3_fail(err, K3_EXIT_USAGE, "%s: %s", dir, strerror(errno));
        if (!S_ISDIR(st.st_mode)) return k3_fail(err, K3_EXIT_USAGE, "%s: not a directory", dir);
        int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd < 0) return k3_fail(err, K3_EXIT_USAGE, "%s: %s", dir, strerror(errno));
        bool run = looks_like_run(dfd);
        close(dfd);
        /* a clean name for the run: the last path component */
        char *copy = xstrdup(dir);
        size_t n = strlen(copy);
        while (n > 1 && copy[n - 1] == '/') copy[--n] = 0;
        const char *base = strrchr(copy, '/') ? strrchr(copy, '/') + 1 : copy;
        if (!*base || !strcmp(base, ".") || !strcmp(base, "..")) base = "run";
        if (run) {
            add_run(d, copy, base);
        } else {
            size_t before = d->nruns;
            scan_parent(d, copy);
            if (d->nruns > before) { /* a parent of runs: rescanned for new ones */
                d->parents = xrealloc_array(d->parents, d->nparents + 1, sizeof *d->parents);
                d->parents[d->nparents++] = xstrdup(copy);
            } else {
                add_run(d, copy, base); /* empty so far: a run whose trainer has not written yet */
            }
        }
        free(copy);
    }
    if (d->nruns == 0) return k3_fail(err, K3_EXIT_USAGE, "no run directory given");
    return K3_OK;
}

int k3_dashboard_start(const k3_dashboard_opts *o, k3_dashboard **out, k3_err *err) {
    *out = NULL;
    k3_dashboard *d = xcalloc(1, sizeof *d);
    d->listen_fd = -1;
    d->verbose = o->verbose;
    d->stale_after = o->stale_after_s > 0 ? o->stale_after_s : 120;
    const char *host = o->host ? o->host : "127.0.0.1";
    d->loopback = k3_http_is_loopback(host);
    if (gethostname(d->hostname, sizeof d->hostname - 1) != 0) d->hostname[0] = 0;
    int rc = resolve_dirs(d, o, err);
    if (rc == K3_OK) rc = k3_http_listen(host, o->port, &d->listen_fd, &d->port, err);
    if (rc != K3_OK) {
        k3_dashboard_stop(d);
        return rc;
    }
    d->last_scan = k3_now();
    double request_s = o->request_timeout_s > 0 ? o->request_timeout_s : 30;
    rc = k3_http_guard_new(request_s, &d->guard, err);
    if (rc != K3_OK) {
        k3_dashboard_stop(d);
        return rc;
    }
    d->mhd = MHD_start_daemon(MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG | MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC,
                              0, NULL, NULL, handle, d,
                              MHD_OPTION_EXTERNAL_LOGGER, mhd_log, d,
                              MHD_OPTION_NOTIFY_CONNECTION, k3_http_guard_notify, d->guard,
                              MHD_OPTION_CONNECTION_LIMIT, (unsigned)128,
                              MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                              o->client_connections ? o->client_connections : 32u,
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)IDLE_S,
                              MHD_OPTION_CONNECTION_MEMORY_LIMIT, K3_HTTP_MEMORY,
                              MHD_OPTION_END);
    if (!d->mhd) {
        k3_dashboard_stop(d);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s:%d: the HTTP server did not start", host, o->port);
    }
    k3_http_door_opts door = {.listen_fd = d->listen_fd, .mhd = d->mhd,
                              .per_client = o->client_connections ? o->client_connections : 32u, .head_s = request_s,
                              .max_body = (size_t)1 << 20, .error = door_error, .error_cls = d};
    if ((rc = k3_http_door_open(&door, &d->door, err))) {
        k3_dashboard_stop(d);
        return rc;
    }
    d->listen_fd = -1; /* the door's now */
    *out = d;
    return K3_OK;
}

int k3_dashboard_port(const k3_dashboard *d) { return d->port; }
size_t k3_dashboard_nruns(const k3_dashboard *d) { return d->nruns; }

void k3_dashboard_stop(k3_dashboard *d) {
    if (!d) return;
    k3_http_door_close(d->door); /* closes the listening socket */
    if (d->listen_fd >= 0) close(d->listen_fd);
    if (d->mhd) MHD_stop_daemon(d->mhd);
    k3_http_guard_free(d->guard);
    for (size_t i = 0; i < d->nruns; i++) free_run(d->runs[i]);
    free(d->runs);
    for (size_t i = 0; i < d->nparents; i++) free(d->parents[i]);
    free(d->parents);
    free(d);
}
