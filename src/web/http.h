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

/* Content-Type, no caching, no MIME sniffing, no referrer, no framing; an
 * HTML page also gets a Content-Security-Policy that allows only its own
 * scripts, styles and connections. */
void k3_http_headers(struct MHD_Response *r, const char *type);
/* A response holding body[0..len) with k3_http_headers, or NULL (a
 * MHD_RESPMEM_MUST_FREE body is then freed). */
struct MHD_Response *k3_http_buffer(const char *type, void *body, size_t len, enum MHD_ResponseMemoryMode mode);
/* Queues r (NULL: MHD_NO, the connection is closed) and releases it. */
enum MHD_Result k3_http_queue(struct MHD_Connection *c, unsigned code, struct MHD_Response *r);

/* ---- what libmicrohttpd passes that k3 refuses itself ----
 * libmicrohttpd answers a request it cannot hold in a connection's memory
 * (K3_HTTP_MEMORY: request line and headers) with its own HTML page, before
 * any k3 code runs. The memory is sized far above the limits below, so that
 * every request within it reaches the server, which refuses it with its own
 * error body. What libmicrohttpd still answers itself (docs/serve.md): a head
 * over K3_HTTP_MEMORY, a version other than HTTP/1.x, a malformed request
 * line or Content-Length, bad chunk syntax. */
#define K3_HTTP_MAX_URI ((size_t)8 << 10)   /* the request target, query included */
#define K3_HTTP_MAX_HEAD ((size_t)32 << 10) /* request line and headers */
#define K3_HTTP_MEMORY ((size_t)256 << 10)  /* MHD_OPTION_CONNECTION_MEMORY_LIMIT */
/* The first thing wrong with a request's line and headers, checked on the
 * handler's first call: 505 (a version other than HTTP/1.0 and HTTP/1.1),
 * 414 (a target over K3_HTTP_MAX_URI; needs the guard's URI callback, below),
 * 431 (a head over K3_HTTP_MAX_HEAD), 501 (a Transfer-Encoding other than
 * chunked, whose body's end libmicrohttpd cannot find). Returns the status
 * with *code (an error code name) and msg[0..cap) set, or 0. */
unsigned k3_http_check_request(struct MHD_Connection *c, const char *version, const char **code, char *msg,
                               size_t cap);

/* ---- slow clients ----
 * libmicrohttpd's own timeout counts idleness: a client that sends one
 * header byte every few seconds is never idle and holds its connection (and,
 * with enough of them, every connection) forever. A guard gives each request
 * a deadline instead: a connection must deliver a request's line within
 * request_s of opening (idle_s of its previous answer: keep-alive), and the
 * request's headers and body within request_s of its line; one that misses it is shut down (its
 * socket, so the connection's thread sees the end and closes it). While a
 * request is answered no deadline runs (a long generation is not slow input).
 * A watchdog thread checks four times a second. Wiring, all four needed:
 * MHD_OPTION_NOTIFY_CONNECTION k3_http_guard_notify and
 * MHD_OPTION_URI_LOG_CALLBACK k3_http_guard_uri (cls: the guard), then
 * k3_http_guard_arrived from the handler once the body is complete and
 * k3_http_guard_answered from MHD_OPTION_NOTIFY_COMPLETED. */
typedef struct k3_http_guard k3_http_guard;
/* K3_EXIT_RUNTIME when the thread cannot start. */
int k3_http_guard_new(double request_s, double idle_s, k3_http_guard **out, k3_err *err);
/* After MHD_stop_daemon (no connection left). NULL: nothing. */
void k3_http_guard_free(k3_http_guard *g);
void k3_http_guard_notify(void *cls, struct MHD_Connection *c, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode code);
/* Returns NULL (the request's first con_cls stays NULL). */
void *k3_http_guard_uri(void *cls, const char *uri, struct MHD_Connection *c);
void k3_http_guard_arrived(struct MHD_Connection *c);
void k3_http_guard_answered(struct MHD_Connection *c);
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
