/* dist.c: the job's ranks over Open MPI (dist.h). Built without MPI
 * (K3_NO_MPI, when the Makefile finds no mpicc) it is a job of one rank. */
#include "dist/dist.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef K3_NO_MPI
#include <mpi.h>
#endif

#define HOST_LEN 64

static struct {
    bool active;
    int rank, size;
    char (*hosts)[HOST_LEN];
    double timeout;
    k3_dist_stats st;
    bool deferred;
    bool funneled;          /* MPI granted less than MPI_THREAD_SERIALIZED */
    k3_err err;             /* the deferred line */
    /* K3_DIST_FAULT */
    char fault_kind;        /* 'd', 'h', 'e' or 0 */
    int fault_rank;
    uint64_t fault_at, nexch;
    FILE *err_out;          /* the job's error lines (stderr, kept when silenced) */
} G = {.size = 1, .timeout = 600};

/* errf, now_s and fault_check serve the MPI build only (K3_NO_MPI leaves them unused) */
__attribute__((unused)) static FILE *errf(void) { return G.err_out ? G.err_out : stderr; }

__attribute__((unused)) static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

bool k3_dist_active(void) { return G.active; }
bool k3_dist_any_thread(void) { return !G.funneled; }
int k3_dist_rank(void) { return G.rank; }
int k3_dist_size(void) { return G.size; }
const char *k3_dist_host(int r) { return G.hosts && r >= 0 && r < G.size ? G.hosts[r] : ""; }
k3_dist_stats k3_dist_get_stats(void) { return G.st; }
void k3_dist_note_split(const k3_dist_stats *d) {
    G.st.split_gathers += d->split_gathers;
    G.st.split_bytes_sent += d->split_bytes_sent;
    G.st.split_wait_s += d->split_wait_s;
    G.st.split_read += d->split_read;
    G.st.split_whole += d->split_whole;
}

bool k3_dist_with_mpi(void) {
#ifdef K3_NO_MPI
    return false;
#else
    return true;
#endif
}

bool k3_dist_defer_error(int code, const char *msg) {
    if (!G.active) return false;
    if (!G.deferred) { /* the first error is the one that counts */
        G.deferred = true;
        G.err.code = code ? code : K3_EXIT_RUNTIME;
        snprintf(G.err.msg, sizeof G.err.msg, "%s", msg);
    }
    return true;
}

static void parse_fault(void) {
    const char *f = getenv("K3_DIST_FAULT");
    if (!f || !*f) return;
    char kind[16] = {0};
    int rank = -1;
    unsigned long long at = 1;
    int n = sscanf(f, "%15[a-z]:%d:%llu", kind, &rank, &at);
    if (n < 2 || rank < 0 || at < 1) return;
    G.fault_kind = !strcmp(kind, "die") ? 'd' : !strcmp(kind, "hang") ? 'h' : !strcmp(kind, "error") ? 'e' : 0;
    G.fault_rank = rank;
    G.fault_at = at;
}

bool k3_dist_fault_error(void) {
    return G.fault_kind == 'e' && G.rank == G.fault_rank && G.nexch + 1 == G.fault_at;
}

__attribute__((unused)) static void fault_check(void) {
    if (!G.fault_kind || G.rank != G.fault_rank || G.nexch != G.fault_at) return;
    if (G.fault_kind == 'd') raise(SIGKILL);
    if (G.fault_kind == 'h')
        for (;;) pause();
}

int k3_gather_rounds(int R) {
    int s = 0;
    while (s < 31 && (1 << s) < R) s++;
    return s;
}

void k3_gather_round(int R, int me, int s, int *to, int *from, int *at, int *n) {
    int d = 1 << s;
    *to = (me + R - d % R) % R;
    *from = (me + d) % R;
    *at = d;
    *n = d < R - d ? d : R - d;
}

#ifdef K3_NO_MPI

int k3_dist_init(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    parse_fault();
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK")) {
        const char *n = getenv("OMPI_COMM_WORLD_SIZE");
        if (n && strcmp(n, "1")) {
            fprintf(stderr, "k3: this k3 was built without MPI (no libopenmpi-dev at build time): it cannot run as "
                            "one of %s ranks; install Open MPI (scripts/setup.sh) and rebuild\n", n);
            return K3_EXIT_USAGE;
        }
    }
    return K3_OK;
}
int k3_dist_finish(int rc) { return rc; }
long long k3_dist_getline(char **line, size_t *cap, FILE *f) { return getline(line, cap, f); }
void k3_dist_bcast(void *buf, size_t n, bool bounded, const char *what) {
    (void)buf, (void)n, (void)bounded, (void)what;
}
void k3_dist_silence_others(void) {}
int k3_dist_agree(int rc, k3_err *err, const char *what) {
    (void)err;
    (void)what;
    return rc;
}
void k3_dist_allgather(const void *mine, size_t n, void *all, const char *what) {
    (void)what;
    memcpy(all, mine, n);
}
void k3_dist_exchange(const void *mine, size_t mine_bytes, void *const *theirs, const size_t *their_bytes,
                      const char *what) {
    (void)mine, (void)mine_bytes, (void)theirs, (void)their_bytes, (void)what;
    G.nexch++;
}
void k3_dist_alltoall(const void *const *to, const size_t *to_bytes, void *const *theirs, const size_t *their_bytes,
                      const char *what) {
    (void)to, (void)to_bytes, (void)theirs, (void)their_bytes, (void)what;
    G.nexch++;
}
_Noreturn void k3_dist_abort(const k3_err *err) {
    fprintf(stderr, "k3: %s\n", err->msg[0] ? err->msg : "unknown error");
    exit(err->code ? err->code : K3_EXIT_RUNTIME);
}

#else

/* Separate tags: a rank that left the run early (and waits in the final
 * agreement) is never mistaken for an exchange block; the others time out. */
enum { TAG_GATHER = 1, TAG_EXCHANGE = 2, TAG_LINE = 3 };

static void put_prefix(char *buf, size_t n, int r) {
    snprintf(buf, n, "rank %d of %d (%s)", r, G.size, k3_dist_host(r));
}

_Noreturn void k3_dist_abort(const k3_err *err) {
    int code = err->code ? err->code : K3_EXIT_RUNTIME;
    const char *msg = err->msg[0] ? err->msg : "unknown error";
    if (!G.active) {
        fprintf(stderr, "k3: %s\n", msg);
        exit(code);
    }
    char who[128];
    put_prefix(who, sizeof who, G.rank);
    fprintf(errf(), "k3: %s: %s\n", who, msg);
    fflush(errf());
    fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, code);
    _exit(code); /* not reached */
}

static _Noreturn void fail_mpi(int mrc, const char *what) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(mrc, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "error %d", mrc);
    k3_err e = {.code = K3_EXIT_RUNTIME};
    snprintf(e.msg, sizeof e.msg, "%s: MPI failed: %s (a peer rank died or its host is unreachable)", what, s);
    k3_dist_abort(&e);
}

/* Waits for n requests; recv[i] is the peer rank of a receive (-1 for a send).
 * A rank whose message has not come within the timeout is named and the job
 * aborted. Polls with sched_yield first (oversubscribed ranks on one host let
 * each other run), then with short sleeps. */
static double stagger(int rank) { return 0.25 * (rank < 40 ? rank : 40); }

/* from: the deadline's start (0: now); later: added to it (a later round of a
 * gather waits longer, so that the rank that waits on the lost one directly
 * names it before a rank that waits on a rank stuck behind it) */
static void wait_from(int n, MPI_Request *rq, const int *recv, const char *what, bool bounded, double from,
                      double later) {
    /* staggered by rank, so that when several ranks wait for the same lost one
     * the lowest reports it and ends the job before the others print too */
    double t0 = now_s(), deadline = bounded ? (from > 0 ? from : t0) + G.timeout + later + stagger(G.rank) : 1e300;
    for (long polls = 0;; polls++) {
        int done = 0;
        int mrc = MPI_Testall(n, rq, &done, MPI_STATUSES_IGNORE);
        if (mrc != MPI_SUCCESS) fail_mpi(mrc, what);
        if (done) return;
        double t = now_s();
        if (t > deadline) {
            char names[512] = "";
            size_t at = 0;
            int missing = 0;
            for (int i = 0; i < n; i++) {
                if (recv[i] < 0) continue;
                int got = 0;
                if (MPI_Test(&rq[i], &got, MPI_STATUS_IGNORE) != MPI_SUCCESS || got) continue;
                if (missing++ < 4 && at < sizeof names - 80)
                    at += (size_t)snprintf(names + at, sizeof names - at, "%s%d (%s)", at ? ", " : "", recv[i],
                                           k3_dist_host(recv[i]));
            }
            k3_err e = {.code = K3_EXIT_RUNTIME};
            if (missing)
                snprintf(e.msg, sizeof e.msg,
                         "%s: no answer from rank%s %s%s within %.0f s: it died or hangs (K3_DIST_TIMEOUT sets the "
                         "wait)", what, missing > 1 ? "s" : "", names, missing > 4 ? ", ..." : "", G.timeout);
            else
                snprintf(e.msg, sizeof e.msg, "%s: sends not completed within %.0f s (K3_DIST_TIMEOUT sets the wait)",
                         what, G.timeout);
            k3_dist_abort(&e);
        }
        if (t - t0 < 2e-3 || polls < 64) sched_yield();
        else if (t - t0 < 1.0) nanosleep(&(struct timespec){0, 50000}, NULL);
        else nanosleep(&(struct timespec){0, 1000000}, NULL); /* a long wait (a person): less polling */
    }
}

static void wait_all(int n, MPI_Request *rq, const int *recv, const char *what, bool bounded) {
    wait_from(n, rq, recv, what, bounded, 0, 0);
}

/* Every rank sends `mine` to every other and receives rank r's block into
 * theirs[r]. The common core of agree, allgather and exchange. */
static void all_to_all(int tag, const void *mine, size_t mine_bytes, const void *const *to, const size_t *to_bytes,
                       void *const *theirs, const size_t *their_bytes, const char *what) {
    int R = G.size;
    if (R == 1) return;
    uint64_t sent = 0;
    for (int r = 0; r < R; r++) {
        if (r == G.rank) continue;
        size_t nb = to ? to_bytes[r] : mine_bytes;
        if (nb > INT_MAX) {
            k3_err e = {.code = K3_EXIT_RUNTIME};
            snprintf(e.msg, sizeof e.msg, "%s: a block of %zu bytes is too large to send", what, nb);
            k3_dist_abort(&e);
        }
        sent += nb;
    }
    double t0 = now_s();
    MPI_Request *rq = xmalloc_array(2 * (size_t)R, sizeof *rq);
    int *recv = xmalloc_array(2 * (size_t)R, sizeof *recv);
    int n = 0, mrc;
    for (int d = 1; d < R; d++) { /* receives first, so that sends find them posted */
        int r = (G.rank + R - d) % R;
        if (their_bytes[r] > INT_MAX) fail_mpi(MPI_ERR_COUNT, what);
        recv[n] = r;
        if ((mrc = MPI_Irecv(theirs[r], (int)their_bytes[r], MPI_BYTE, r, tag, MPI_COMM_WORLD, &rq[n++])))
            fail_mpi(mrc, what);
    }
    for (int d = 1; d < R; d++) {
        int r = (G.rank + d) % R;
        recv[n] = -1;
        const void *b = to ? to[r] : mine;
        int nb = (int)(to ? to_bytes[r] : mine_bytes);
        if ((mrc = MPI_Isend(b, nb, MPI_BYTE, r, tag, MPI_COMM_WORLD, &rq[n++]))) fail_mpi(mrc, what);
    }
    wait_all(n, rq, recv, what, true);
    free(rq);
    free(recv);
    G.st.collectives++;
    G.st.bytes_sent += sent;
    G.st.wait_s += now_s() - t0;
}

void k3_dist_allgather(const void *mine, size_t n, void *all, const char *what) {
    int R = G.size;
    memcpy((char *)all + (size_t)G.rank * n, mine, n);
    if (R == 1) return;
    void **to = xmalloc_array((size_t)R, sizeof *to);
    size_t *sz = xmalloc_array((size_t)R, sizeof *sz);
    for (int r = 0; r < R; r++) {
        to[r] = (char *)all + (size_t)r * n;
        sz[r] = n;
    }
    all_to_all(TAG_GATHER, mine, n, NULL, NULL, to, sz, what);
    free(to);
    free(sz);
}

/* k3_dist_exchange in k3_gather_round's rounds, through a staging area of
 * every block in relative order (kept: hundreds of calls a token). False
 * when the blocks together exceed one message's count (the caller then
 * sends them peer by peer). */
static bool gather_rounds(const void *mine, size_t mine_bytes, void *const *theirs, const size_t *their_bytes,
                          const char *what) {
    static char *stage;
    static size_t stage_cap, *off;
    static int off_n;
    int R = G.size, me = G.rank;
    if (off_n < R + 1) {
        free(off);
        off = xmalloc_array((size_t)R + 1, sizeof *off);
        off_n = R + 1;
    }
    off[0] = 0;
    for (int i = 0; i < R; i++) {
        size_t b = i ? their_bytes[(me + i) % R] : mine_bytes;
        if (b > INT_MAX || off[i] + b > INT_MAX) return false;
        off[i + 1] = off[i] + b;
    }
    if (off[R] > stage_cap) {
        free(stage);
        stage_cap = off[R] > 2 * stage_cap ? off[R] : 2 * stage_cap;
        stage = xmalloc(stage_cap);
    }
    if (mine_bytes) memcpy(stage, mine, mine_bytes);
    double t0 = now_s(), step = 1.0 + stagger(R - 1); /* a round's extra wait beyond the last rank's stagger */
    uint64_t sent = 0;
    for (int s = 0, rounds = k3_gather_rounds(R); s < rounds; s++) {
        int to, from, at, n, mrc;
        k3_gather_round(R, me, s, &to, &from, &at, &n);
        MPI_Request rq[2];
        int peer[2] = {from, -1};
        if ((mrc = MPI_Irecv(stage + off[at], (int)(off[at + n] - off[at]), MPI_BYTE, from, TAG_EXCHANGE,
                             MPI_COMM_WORLD, &rq[0])))
            fail_mpi(mrc, what);
        if ((mrc = MPI_Isend(stage, (int)off[n], MPI_BYTE, to, TAG_EXCHANGE, MPI_COMM_WORLD, &rq[1])))
            fail_mpi(mrc, what);
        wait_from(2, rq, peer, what, true, t0, s * step);
        sent += off[n];
    }
    for (int i = 1; i < R; i++) {
        int r = (me + i) % R;
        if (their_bytes[r]) memcpy(theirs[r], stage + off[i], their_bytes[r]);
    }
    G.st.collectives++;
    G.st.bytes_sent += sent;
    G.st.wait_s += now_s() - t0;
    return true;
}

void k3_dist_exchange(const void *mine, size_t mine_bytes, void *const *theirs, const size_t *their_bytes,
                      const char *what) {
    G.nexch++;
    fault_check();
    if (G.size == 1 || gather_rounds(mine, mine_bytes, theirs, their_bytes, what)) return;
    all_to_all(TAG_EXCHANGE, mine, mine_bytes, NULL, NULL, theirs, their_bytes, what);
}

void k3_dist_alltoall(const void *const *to, const size_t *to_bytes, void *const *theirs, const size_t *their_bytes,
                      const char *what) {
    G.nexch++;
    fault_check();
    all_to_all(TAG_EXCHANGE, NULL, 0, to, to_bytes, theirs, their_bytes, what);
}

/* rank 0's block to every other rank (the others receive into buf) */
static void bcast0(void *buf, size_t n, bool bounded, const char *what) {
    if (n > INT_MAX) fail_mpi(MPI_ERR_COUNT, what);
    int R = G.size, k = 0, mrc;
    MPI_Request *rq = xmalloc_array((size_t)R, sizeof *rq);
    int *recv = xmalloc_array((size_t)R, sizeof *recv);
    if (G.rank == 0) {
        for (int r = 1; r < R; r++) {
            recv[k] = -1;
            if ((mrc = MPI_Isend(buf, (int)n, MPI_BYTE, r, TAG_LINE, MPI_COMM_WORLD, &rq[k++]))) fail_mpi(mrc, what);
        }
    } else {
        recv[k] = 0;
        if ((mrc = MPI_Irecv(buf, (int)n, MPI_BYTE, 0, TAG_LINE, MPI_COMM_WORLD, &rq[k++]))) fail_mpi(mrc, what);
    }
    wait_all(k, rq, recv, what, bounded);
    free(rq);
    free(recv);
    G.st.collectives++;
    if (G.rank == 0) G.st.bytes_sent += (uint64_t)n * (uint64_t)(R - 1);
}

void k3_dist_bcast(void *buf, size_t n, bool bounded, const char *what) {
    if (G.size > 1) bcast0(buf, n, bounded, what);
}

long long k3_dist_getline(char **line, size_t *cap, FILE *f) {
    int64_t len = 0;
    if (G.rank == 0) len = getline(line, cap, f);
    if (G.size == 1) return len;
    bcast0(&len, sizeof len, false, "the next input line");
    if (len < 0) return -1;
    if (G.rank != 0 && (size_t)len + 1 > *cap) {
        *cap = (size_t)len + 1;
        *line = xrealloc(*line, *cap);
    }
    if (len > 0) bcast0(*line, (size_t)len, false, "the next input line");
    (*line)[len] = 0;
    return len;
}

typedef struct {
    int32_t code;
    char msg[sizeof(((k3_err *)0)->msg)];
} status_rec;

int k3_dist_agree(int rc, k3_err *err, const char *what) {
    if (G.size == 1) return rc;
    status_rec mine = {.code = rc};
    if (rc) snprintf(mine.msg, sizeof mine.msg, "%s", err->msg[0] ? err->msg : "unknown error");
    status_rec *all = xmalloc_array((size_t)G.size, sizeof *all);
    k3_dist_allgather(&mine, sizeof mine, all, what);
    int first = -1;
    bool alike = true;
    for (int r = 0; r < G.size; r++) {
        if (!all[r].code) {
            alike = false;
            continue;
        }
        if (first < 0) first = r;
        else if (all[r].code != all[first].code || strcmp(all[r].msg, all[first].msg)) alike = false;
    }
    if (first < 0) {
        free(all);
        return K3_OK;
    }
    int code = all[first].code;
    if (alike) {
        snprintf(err->msg, sizeof err->msg, "%s", all[first].msg);
    } else {
        char who[128];
        put_prefix(who, sizeof who, first);
        /* a line that already names its rank keeps its name */
        if (!strncmp(all[first].msg, "rank ", 5)) snprintf(err->msg, sizeof err->msg, "%s", all[first].msg);
        else {
            size_t w = strlen(who), m = strlen(all[first].msg);
            if (m > sizeof err->msg - w - 3) m = sizeof err->msg - w - 3; /* (a line ends where the record does) */
            memcpy(err->msg, who, w);
            memcpy(err->msg + w, ": ", 2);
            memcpy(err->msg + w + 2, all[first].msg, m);
            err->msg[w + 2 + m] = 0;
        }
    }
    err->code = code;
    free(all);
    return code;
}

static uint64_t self_hash(int argc, char **argv) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < argc; i++) h = k3_fnv1a64(h, argv[i], strlen(argv[i]) + 1);
    /* the binary: ranks running other builds could compute other bits */
    FILE *f = fopen("/proc/self/exe", "rb");
    if (f) {
        uint32_t crc = 0;
        static char buf[1 << 16];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, f)) > 0) crc = k3_crc32c(crc, buf, n);
        fclose(f);
        h = k3_fnv1a64(h, &crc, sizeof crc);
    }
    return h;
}

int k3_dist_init(int *argc, char ***argv) {
    parse_fault();
    if (!getenv("OMPI_COMM_WORLD_SIZE") && !getenv("PMIX_RANK")) return K3_OK;
    const char *t = getenv("K3_DIST_TIMEOUT");
    if (t && *t) {
        char *end;
        errno = 0;
        double v = strtod(t, &end);
        if (errno || *end || !(v > 0) || v > 1e6) {
            fprintf(stderr, "k3: K3_DIST_TIMEOUT: '%s' is not a number of seconds in (0, 1e6]\n", t);
            return K3_EXIT_USAGE;
        }
        G.timeout = v;
    }
    int provided = 0;
    /* serialized, not funneled: k3 serve's model worker (not the main thread)
     * makes the forward calls and their exchanges (dist.h) */
    if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "k3: MPI_Init failed (is this mpirun's Open MPI?)\n");
        return K3_EXIT_RUNTIME;
    }
    G.funneled = provided < MPI_THREAD_SERIALIZED;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &G.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &G.size);
    G.active = true;
    G.hosts = xcalloc((size_t)G.size, HOST_LEN);
    char me[HOST_LEN] = {0};
    if (gethostname(me, sizeof me - 1)) snprintf(me, sizeof me, "?");
    k3_dist_allgather(me, HOST_LEN, G.hosts, "start-up (host names)");
    for (int r = 0; r < G.size; r++) G.hosts[r][HOST_LEN - 1] = 0;
    uint64_t h = self_hash(*argc, *argv), *all = xmalloc_array((size_t)G.size, sizeof *all);
    k3_dist_allgather(&h, sizeof h, all, "start-up (identity)");
    int bad = -1;
    for (int r = 1; r < G.size && bad < 0; r++)
        if (all[r] != all[0]) bad = r;
    free(all);
    if (bad >= 0) {
        k3_err e = {.code = K3_EXIT_USAGE};
        snprintf(e.msg, sizeof e.msg,
                 "rank %d of %d (%s) runs another k3 binary or command line than rank 0 (%s): start the same build "
                 "with the same arguments on every host",
                 bad, G.size, k3_dist_host(bad), k3_dist_host(0));
        k3_dist_defer_error(e.code, e.msg);
        return e.code;
    }
    return K3_OK;
}

void k3_dist_silence_others(void) {
    if (!G.active || G.rank == 0) return;
    if (!G.err_out) {
        int fd = dup(2);
        if (fd >= 0) G.err_out = fdopen(fd, "w");
    }
    fflush(stdout);
    fflush(stderr);
    if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr)) return; /* (then they print) */
}

int k3_dist_finish(int rc) {
    if (!G.active) return rc;
    k3_err e = {0};
    if (rc) {
        if (G.deferred) e = G.err;
        else snprintf(e.msg, sizeof e.msg, "exited with code %d", rc);
        e.code = rc;
    }
    rc = k3_dist_agree(rc, &e, "the end of the run");
    if (rc && G.rank == 0) {
        fprintf(errf(), "k3: %s\n", e.msg);
        fflush(errf());
    }
    fflush(stdout);
    MPI_Finalize();
    G.active = false;
    return rc;
}

#endif
