/* serve_impl.h: what server.c (HTTP, queue, slots) and gen.c (a slot's jobs)
 * share. Not a public header. */
#ifndef K3_SERVE_IMPL_H
#define K3_SERVE_IMPL_H

#include "serve/serve.h"
#include "web/http.h"

#include <pthread.h>
#include <stdatomic.h>

/* A Prometheus histogram of seconds over fixed bounds (server.c). */
#define K3_HIST_N 14
typedef struct {
    uint64_t le[K3_HIST_N];    /* observations <= each bound (cumulative when printed) */
    uint64_t n;
    double sum;
} k3_hist;

typedef struct k3_job k3_job;
struct k3_job {
    /* set by the connection thread before the job is queued, then read-only */
    k3_serve_req req;
    int32_t *ids;              /* the prompt */
    size_t n;
    size_t *marks;             /* chat: where each rendered message ends (snapshotted by the prefill) */
    size_t nmarks;
    int64_t max_tokens;        /* resolved */
    char id[48];               /* chatcmpl-... / cmpl-... */
    int64_t created;
    int fd;                    /* the client's socket, watched for a hang-up */
    int slot;                  /* the model slot it computes on (set when a worker takes it) */
    double queued_at;          /* k3_now() when it was queued (time to first token counts from there) */
    double last_token_at;      /* k3_now() of its last sampled token (0: none yet); under k3_serve.mu */
    /* shared, under k3_serve.mu */
    int refs;                  /* the connection and, while queued or running, the workers' */
    k3_sbuf out;               /* response bytes the worker produced (append only) */
    size_t sent;               /* bytes of out the connection has taken */
    int status;                /* HTTP status of a non-streamed response (set when done) */
    bool done;
    pthread_cond_t cv;         /* signalled when out grows or done is set */
    k3_job *next;              /* queue link */
    /* set by anyone, polled by the worker */
    atomic_int cancel;         /* 1: the client went away (or the server stops) */
};

/* A model slot's worker thread and the job it computes (under k3_serve.mu). */
typedef struct {
    struct k3_serve *s;
    int index;
    pthread_t thread;
    bool started;
    k3_job *job;               /* NULL: free */
    pthread_cond_t cv;         /* signalled when a job is handed to it, or at the stop */
} k3_serve_slot;

struct k3_serve {
    k3_serve_opts o;
    k3_serve_model m;
    char model_id[128];
    struct MHD_Daemon *mhd;
    k3_http_guard *guard;      /* slow clients: the request deadline */
    k3_http_door *door;        /* accepts connections, checks heads (owns listen_fd once open) */
    int listen_fd, port;
    bool loopback;
    int64_t started;
    pthread_mutex_t mu;
    k3_serve_slot *slots;      /* [m.slots]: a worker thread each */
    int nbusy;                 /* slots computing a job */
    double busy_from;          /* k3_now() when nbusy last rose from 0 */
    k3_job *head, *tail;       /* waiting jobs */
    int nwaiting;
    bool stopping;
    /* requests whose answer has not been sent yet: a stop waits (bounded)
     * for the 503s it hands to queued jobs to reach their clients */
    atomic_int n_open;
    /* counters for /health and /metrics (under mu) */
    uint64_t n_ok, n_cancelled, n_refused, n_failed, n_tokens;
    uint64_t n_prompt, n_cached, n_cache_hits; /* prompt tokens, those a saved state held, requests with any */
    uint64_t by_status[600];   /* responses by HTTP status */
    k3_hist ttft, tpot;        /* time to first token, time per later token (seconds) */
    double busy_s;             /* seconds some slot computed */
    k3_tokbytes *tb;           /* the tokenizer's ids by bytes, for structured output (made at first use, under mu; then read-only) */
};

/* gen.c, once per sampled token: feeds the latency histograms. */
void k3_serve_note_token(k3_serve *s, k3_job *j);

/* gen.c: computes one job on its slot's worker thread, writing its response into
 * job->out (under s->mu) and setting done. */
void k3_gen_run(k3_serve *s, k3_job *j);
/* gen.c: text as a JSON string, its invalid UTF-8 bytes as U+FFFD (decoded
 * ids need not form whole characters; jansson refuses such strings). */
json_t *k3_serve_json_text(const char *p, size_t n);
/* An OpenAI error object as a compact JSON string (malloc'd). */
char *k3_serve_error_json(const k3_serve_error *e);
/* Appends bytes to a job's output and wakes its connection. */
void k3_job_emit(k3_serve *s, k3_job *j, const char *p, size_t n);
/* Ends a job with a complete body / final bytes. */
void k3_job_finish(k3_serve *s, k3_job *j, int status);

#endif
