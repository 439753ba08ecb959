/* http.h: what k3's two HTTP servers (k3 serve, src/serve/; k3 dashboard,
 * src/web/dashboard.c) share: the listening socket, the Host check against
 * DNS rebinding, the security headers every response carries, and the stop
 * signals of a server's main thread. Each server keeps its own routes, its
 * own error bodies (OpenAI's error object, the dashboard's {"error": msg})
 * and its own threading. Both use the request checks and the slow-client
 * guard below. */
#ifndef K3_WEB_HTTP_H
#define K3_WEB_HTTP_H

#include "util/common.h"

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>

#include <microhttpd.h>

/* True for 127.0.0.0/8, ::1 and "localhost" (NULL: true). */
bool k3_http_is_loopback(const char *host);

/* A server listening on loopback answers only requests whose Host header
 * (NULL: none, as HTTP/1.0 may send) names a loopback address, with or
 * without a port, so that a web page on another origin cannot reach it
 * through a DNS name rebound to 127.0.0.1. */
bool k3_http_host_allowed(const char *host_header);

/* Binds and listens on host:port (port 0: a free one); *fd, *bound_port.
 * Errors: an unknown host (K3_EXIT_USAGE, naming --host), cannot bind or
 * listen (K3_EXIT_RUNTIME). */
int k3_http_listen(const char *host, int port, int *fd, int *bound_port, k3_err *err);

/* Content-Type, no caching, no MIME sniffing, no referrer, no framing, the
 * connection closed after the answer; an HTML page also gets a Content-Security-Policy that allows only its own
 * scripts, styles and connections. */
void k3_http_headers(struct MHD_Response *r, const char *type);
/* The same headers as "Name: value\r\n" lines, for an answer k3 writes
 * to the socket itself (the door's). */
void k3_http_header_lines(k3_sbuf *b, const char *type);
/* A response holding body[0..len) with k3_http_headers, or NULL (a
 * MHD_RESPMEM_MUST_FREE body is then freed). */
struct MHD_Response *k3_http_buffer(const char *type, void *body, size_t len, enum MHD_ResponseMemoryMode mode);
/* Queues r (NULL: MHD_NO, the connection is closed) and releases it. */
enum MHD_Result k3_http_queue(struct MHD_Connection *c, unsigned code, struct MHD_Response *r);

/* ---- the door: a request's head, checked before libmicrohttpd reads it ----
 * libmicrohttpd answers a request line, header or chunked body it cannot
 * parse or hold with its own HTML page, before any k3 code runs, and passes
 * some it should refuse. The door stands in front of it: a thread that
 * accepts each connection and looks at its request line and headers without
 * taking them (MSG_PEEK). A head with anything below wrong is answered by the
 * door with the server's own error body and the connection closed; a well
 * formed one is handed to libmicrohttpd (MHD_add_connection, on a daemon
 * started with MHD_USE_NO_LISTEN_SOCKET), which reads the same bytes. A
 * chunked body, the one part past the head the library parses, is read and
 * decoded by the door and handed on with a Content-Length through a socket
 * pair the door relays. Every response says Connection: close
 * (k3_http_headers), so a connection carries the one request the door
 * checked. The door also holds the head's deadline and the per-client
 * connection limit while a head arrives. */
#define K3_HTTP_MAX_URI ((size_t)8 << 10)   /* the request target, query included */
#define K3_HTTP_MAX_HEAD ((size_t)32 << 10) /* request line and headers */
#define K3_HTTP_MEMORY ((size_t)256 << 10)  /* MHD_OPTION_CONNECTION_MEMORY_LIMIT */
/* Header lines, query parameters, cookies: each costs libmicrohttpd a record
 * in the connection's memory (about 3,000 of any fill it within a head of
 * the limits above, and it answers with its own page, or not at all); a
 * head within these leaves it room for all three at once. */
#define K3_HTTP_MAX_FIELDS 1000
#define K3_HTTP_MORE 1                      /* k3_http_check_head: the head is not all in yet */

/* Where a well-formed head's parts lie in the bytes checked. */
typedef struct {
    size_t len;            /* the head, its blank line included */
    size_t blank_at;       /* where its blank line starts */
    size_t te_at, te_len;  /* the Transfer-Encoding line (0, 0: none) */
    size_t ex_at, ex_len;  /* the Expect: 100-continue line (0, 0: none) */
    bool chunked;          /* Transfer-Encoding: chunked */
} k3_http_head;

/* Checks the head at the start of b[0..n), leading blank lines skipped. The
 * first thing wrong, as a status with *code (an error code name) and
 * msg[0..cap): 400 (a malformed request line, header line, folded header,
 * Content-Length, or two of them, or one beside Transfer-Encoding:
 * invalid_request_line / invalid_header / invalid_content_length /
 * invalid_framing), 413 (a Content-Length over 2^63 - 1:
 * request_too_large), 414 (a target over K3_HTTP_MAX_URI or with more query
 * parameters than K3_HTTP_MAX_FIELDS), 431 (a head over K3_HTTP_MAX_HEAD, or
 * more header lines or cookies than K3_HTTP_MAX_FIELDS), 501 (a
 * Transfer-Encoding other than chunked), 505 (a
 * version other than HTTP/1.0 and HTTP/1.1, or none). K3_HTTP_MORE: all
 * well so far, more bytes needed. 0: well formed, *h set. Lines may end in
 * CRLF or LF. */
unsigned k3_http_check_head(const char *b, size_t n, k3_http_head *h, const char **code, char *msg, size_t cap);

/* A chunked body's decoder: feed it the bytes after the head as they come. */
typedef struct {
    int state;
    uint64_t left; /* bytes left in the current chunk */
    size_t line;   /* bytes of the current size or trailer line so far */
} k3_http_dechunk;
/* Decodes b[0..n) (the next bytes of the body) onto out, *used: how many of
 * them it took. Returns K3_HTTP_MORE (all taken, the body goes on), 0 (the
 * body ended after *used bytes: what follows is not its), 400 (bad chunk
 * syntax, msg set) or 413 (the decoded body would pass max: msg set). */
unsigned k3_http_dechunk_feed(k3_http_dechunk *d, const char *b, size_t n, size_t max, k3_sbuf *out, size_t *used,
                              char *msg, size_t cap);

/* The server's error body for a status the door answers: an allocated
 * string (the door frees it). Called on the door's thread. */
typedef char *(*k3_http_error_fn)(void *cls, unsigned status, const char *code, const char *msg);
typedef struct {
    int listen_fd;           /* the door takes it (k3_http_door_close closes it) */
    struct MHD_Daemon *mhd;  /* started with MHD_USE_NO_LISTEN_SOCKET */
    unsigned per_client;     /* connections at the door from one address; beyond: closed at once */
    double head_s;           /* a head must be in within this of the connection */
    size_t max_body;         /* a chunked body's decoded limit (413) */
    k3_http_error_fn error;
    void *error_cls;
} k3_http_door_opts;
typedef struct k3_http_door k3_http_door;
/* K3_EXIT_RUNTIME when its thread cannot start. */
int k3_http_door_open(const k3_http_door_opts *o, k3_http_door **out, k3_err *err);
/* Stops accepting, closes the connections still at the door and the
 * listening socket, cuts the relays of chunked requests and waits for them.
 * Before MHD_stop_daemon. NULL: nothing. */
void k3_http_door_close(k3_http_door *d);

/* ---- slow clients ----
 * libmicrohttpd's own timeout counts idleness: a client that sends one byte
 * every few seconds is never idle and holds its connection (and, with enough
 * of them, every connection) forever. The door gives a request's head a
 * deadline; a guard gives its body one: the body must be in within
 * request_s of the connection reaching libmicrohttpd, or the connection is
 * shut down (its socket, so the connection's thread sees the end and closes
 * it). Once the body is in no deadline runs (a long generation is not slow
 * input), and the connection ends with its answer (Connection: close). A
 * watchdog thread checks four times a second. Wiring:
 * MHD_OPTION_NOTIFY_CONNECTION k3_http_guard_notify (cls: the guard), and
 * k3_http_guard_arrived from the handler once the body is complete. */
typedef struct k3_http_guard k3_http_guard;
/* K3_EXIT_RUNTIME when the thread cannot start. */
int k3_http_guard_new(double request_s, k3_http_guard **out, k3_err *err);
/* After MHD_stop_daemon (no connection left). NULL: nothing. */
void k3_http_guard_free(k3_http_guard *g);
void k3_http_guard_notify(void *cls, struct MHD_Connection *c, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode code);
void k3_http_guard_arrived(struct MHD_Connection *c);
/* Connections shut down for missing a deadline so far. */
uint64_t k3_http_guard_dropped(const k3_http_guard *g);

/* A server's main thread, before any other thread exists: blocks SIGINT,
 * SIGTERM and SIGHUP (every thread inherits the mask, so they reach only
 * k3_http_wait_stop) and ignores SIGPIPE (a client that hangs up must not
 * kill the server). */
void k3_http_block_stop_signals(sigset_t *stop);
/* Waits for one of them; returns it. */
int k3_http_wait_stop(const sigset_t *stop);

#endif
