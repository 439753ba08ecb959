/* dashboard.h: `k3 dashboard`, a local web page that follows training runs.
 *
 * The trainer writes durable files into a run directory (docs/run-dir.md);
 * this module only reads them and serves a page plus JSON endpoints over HTTP
 * (libmicrohttpd). Everything runs on the server's one internal thread, so the
 * run caches below need no locks.
 *
 * Endpoints (all GET or HEAD; RUN is a name from /api/runs, default the first):
 *   /                      the page (embedded in the binary, see assets.h)
 *   /app.js, /style.css    its assets
 *   /api/runs              [{"name","status","step","total_steps",...}, ...]
 *   /api/state?run=        state.json plus a "dashboard" object (age, stale, ETA)
 *   /api/metrics?run=&since=STEP&limit=N
 *                          metric records with step > STEP, file order
 *                          (expert_load removed; the latest is in /api/state)
 *   /api/samples?run=&since=STEP&limit=N
 *                          sample records with step > STEP, newest last
 *   /files/NAME?run=       a plain file directly inside the run directory
 *                          (known extensions only; no subdirectories, no links) */
#ifndef K3_WEB_DASHBOARD_H
#define K3_WEB_DASHBOARD_H

#include "util/common.h"

#include <sys/types.h>

#include <jansson.h>

typedef struct {
    const char *host;        /* numeric address or "localhost"; NULL = 127.0.0.1 */
    int port;                /* 0 = any free port (see k3_dashboard_port) */
    const char *const *dirs; /* run directories or parents of run directories */
    size_t ndirs;
    double stale_after_s;    /* minimum silence before a running run is stale */
    bool verbose;            /* log requests and server messages to stderr */
    double request_timeout_s; /* a request's line, headers and body must arrive within this; 0: 30 */
    unsigned client_connections; /* open connections one client address may hold; 0: 32 */
} k3_dashboard_opts;

typedef struct k3_dashboard k3_dashboard;

/* Resolves the directories, binds and starts serving on a background thread. */
int k3_dashboard_start(const k3_dashboard_opts *opts, k3_dashboard **out, k3_err *err);
int k3_dashboard_port(const k3_dashboard *d);
size_t k3_dashboard_nruns(const k3_dashboard *d);
/* Stops the server (waits for its thread) and frees everything. */
void k3_dashboard_stop(k3_dashboard *d);

/* ---- Reading a run directory (exposed for the unit tests) ---- */

/* One record of a .jsonl file, re-serialised compactly. */
typedef struct {
    int64_t step;
    double time; /* its "time" field, NAN when absent */
    double step_time; /* its "step_time_s" field, NAN when absent */
    char kind;   /* 't' train, 'e' eval, 's' sample, '?' other */
    char *json;  /* compact JSON object, NUL-terminated */
    size_t len;
} k3_jrec;

/* Incremental reader of an append-only .jsonl file: each refresh parses only
 * the complete lines added since the last one and starts over when the file
 * was replaced (new inode) or truncated. A partial last line is left for the
 * next refresh; a line that is not a JSON object with an integer "step" is
 * counted in bad_lines and skipped. */
typedef struct {
    const char *name;     /* file name inside the run directory */
    bool strip_loads;     /* drop "expert_load" from each record */
    bool exists;
    dev_t dev;
    ino_t ino;
    off_t off;            /* bytes consumed: everything up to the last '\n' */
    k3_jrec *recs;
    size_t n, cap;
    size_t bad_lines;
    bool skip_to_nl;      /* inside an over-long line: drop up to its '\n' */
} k3_jsonl;

int k3_jsonl_refresh(k3_jsonl *j, int dirfd, k3_err *err);
void k3_jsonl_free(k3_jsonl *j);

/* A file name the /files/ route may open: one path component of
 * [A-Za-z0-9._-], not starting with '.', with a known extension. Returns its
 * Content-Type, or NULL when the name is refused. */
const char *k3_dashboard_file_type(const char *name);

#endif
