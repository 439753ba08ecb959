/* http.c: the HTTP pieces k3 serve and k3 dashboard share (http.h). */
#include "web/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

bool k3_http_is_loopback(const char *host) {
    if (!host) return true;
    if (!strcasecmp(host, "localhost")) return true;
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
    return false;
}

bool k3_http_host_allowed(const char *host) {
    if (!host) return true; /* HTTP/1.0 without Host */
    char h[256];
    size_t n = strlen(host);
    if (n == 0 || n >= sizeof h) return false;
    if (host[0] == '[') {
        const char *end = strchr(host, ']');
        if (!end) return false;
        snprintf(h, sizeof h, "%.*s", (int)(end - host - 1), host + 1);
    } else {
        const char *colon = strchr(host, ':');
        snprintf(h, sizeof h, "%.*s", (int)(colon ? (size_t)(colon - host) : n), host);
    }
    return k3_http_is_loopback(h);
}

int k3_http_listen(const char *host, int port, int *out_fd, int *bound_port, k3_err *err) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *res = NULL;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    int g = getaddrinfo(host, portstr, &hints, &res);
    if (g != 0) return k3_fail(err, K3_EXIT_USAGE, "--host %s: %s", host, gai_strerror(g));
    int fd = -1, e = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) { e = errno; continue; }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 64) == 0) break;
        e = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) return k3_fail(err, K3_EXIT_RUNTIME, "%s:%d: cannot listen: %s", host, port, strerror(e));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
        close(fd);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: getsockname: %s", host, strerror(errno));
    }
    *bound_port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                 : ((struct sockaddr_in *)&ss)->sin_port);
    *out_fd = fd;
    return K3_OK;
}

/* the headers every response carries beside its Content-Type; Connection:
 * close keeps a connection to the one request the door checked */
static const char *const HEADERS[][2] = {
    {"Cache-Control", "no-store"}, {"X-Content-Type-Options", "nosniff"}, {"Referrer-Policy", "no-referrer"},
    {"X-Frame-Options", "DENY"},   {"Connection", "close"},
};
static const char PAGE_CSP[] = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

void k3_http_headers(struct MHD_Response *r, const char *type) {
    MHD_add_response_header(r, "Content-Type", type);
    for (size_t i = 0; i < sizeof HEADERS / sizeof *HEADERS; i++) MHD_add_response_header(r, HEADERS[i][0], HEADERS[i][1]);
    if (!strncmp(type, "text/html", 9)) MHD_add_response_header(r, "Content-Security-Policy", PAGE_CSP);
}

void k3_http_header_lines(k3_sbuf *b, const char *type) {
    k3_sb_printf(b, "Content-Type: %s\r\n", type);
    for (size_t i = 0; i < sizeof HEADERS / sizeof *HEADERS; i++) k3_sb_printf(b, "%s: %s\r\n", HEADERS[i][0], HEADERS[i][1]);
    if (!strncmp(type, "text/html", 9)) k3_sb_printf(b, "Content-Security-Policy: %s\r\n", PAGE_CSP);
}

struct MHD_Response *k3_http_buffer(const char *type, void *body, size_t len, enum MHD_ResponseMemoryMode mode) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
    if (!r) {
        if (mode == MHD_RESPMEM_MUST_FREE) free(body);
        return NULL;
    }
    k3_http_headers(r, type);
    return r;
}

enum MHD_Result k3_http_queue(struct MHD_Connection *c, unsigned code, struct MHD_Response *r) {
    if (!r) return MHD_NO;
    enum MHD_Result ret = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ret;
}

void k3_http_block_stop_signals(sigset_t *stop) {
    sigemptyset(stop);
    sigaddset(stop, SIGINT);
    sigaddset(stop, SIGTERM);
    sigaddset(stop, SIGHUP);
    pthread_sigmask(SIG_BLOCK, stop, NULL);
    signal(SIGPIPE, SIG_IGN);
}

int k3_http_wait_stop(const sigset_t *stop) {
    int sig = 0;
    while (sigwait(stop, &sig) != 0) {}
    return sig;
}

/* ---- slow clients ---- */
typedef struct guard_conn {
    struct guard_conn *prev, *next;
    k3_http_guard *g;
    int fd;
    double due; /* k3_now() by which the next step must come; 0: none runs */
    bool dropped;
} guard_conn;

struct k3_http_guard {
    pthread_mutex_t mu;
    pthread_t thread;
    atomic_bool stop;
    double request_s;
    guard_conn *head;
    atomic_uint_fast64_t dropped;
};

static void *guard_main(void *arg) {
    k3_http_guard *g = arg;
    const struct timespec tick = {.tv_sec = 0, .tv_nsec = 250 * 1000 * 1000};
    while (!atomic_load(&g->stop)) {
        nanosleep(&tick, NULL);
        double now = k3_now();
        pthread_mutex_lock(&g->mu);
        /* the socket stays open while it is listed: MHD notifies the close
         * (which unlists it under this lock) before it closes the socket */
        for (guard_conn *gc = g->head; gc; gc = gc->next)
            if (gc->due > 0 && now > gc->due) {
                shutdown(gc->fd, SHUT_RDWR);
                gc->due = 0;
                gc->dropped = true;
                atomic_fetch_add(&g->dropped, 1);
            }
        pthread_mutex_unlock(&g->mu);
    }
    return NULL;
}

int k3_http_guard_new(double request_s, k3_http_guard **out, k3_err *err) {
    k3_http_guard *g = xcalloc(1, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    atomic_init(&g->stop, false);
    atomic_init(&g->dropped, 0);
    g->request_s = request_s;
    if (pthread_create(&g->thread, NULL, guard_main, g) != 0) {
        pthread_mutex_destroy(&g->mu);
        free(g);
        return k3_fail(err, K3_EXIT_RUNTIME, "cannot start the slow-client watchdog thread");
    }
    *out = g;
    return K3_OK;
}

void k3_http_guard_free(k3_http_guard *g) {
    if (!g) return;
    atomic_store(&g->stop, true);
    pthread_join(g->thread, NULL);
    while (g->head) { /* none after MHD_stop_daemon; kept safe regardless */
        guard_conn *gc = g->head;
        g->head = gc->next;
        free(gc);
    }
    pthread_mutex_destroy(&g->mu);
    free(g);
}

uint64_t k3_http_guard_dropped(const k3_http_guard *g) { return g ? atomic_load(&g->dropped) : 0; }

void k3_http_guard_notify(void *cls, struct MHD_Connection *c, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode code) {
    k3_http_guard *g = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (!ci) return;
        guard_conn *gc = xcalloc(1, sizeof *gc);
        gc->g = g;
        gc->fd = ci->connect_fd;
        pthread_mutex_lock(&g->mu);
        gc->due = k3_now() + g->request_s;
        gc->next = g->head;
        if (g->head) g->head->prev = gc;
        g->head = gc;
        pthread_mutex_unlock(&g->mu);
        *socket_ctx = gc;
    } else if (code == MHD_CONNECTION_NOTIFY_CLOSED && *socket_ctx) {
        guard_conn *gc = *socket_ctx;
        pthread_mutex_lock(&g->mu);
        if (gc->prev) gc->prev->next = gc->next;
        else g->head = gc->next;
        if (gc->next) gc->next->prev = gc->prev;
        pthread_mutex_unlock(&g->mu);
        free(gc);
        *socket_ctx = NULL;
    }
}

static guard_conn *guard_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

void k3_http_guard_arrived(struct MHD_Connection *c) {
    guard_conn *gc = guard_of(c);
    if (!gc) return;
    pthread_mutex_lock(&gc->g->mu);
    gc->due = 0;
    pthread_mutex_unlock(&gc->g->mu);
}
