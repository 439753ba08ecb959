/* http.c: the HTTP pieces k3 serve and k3 dashboard share (http.h). */
#include "web/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
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

void k3_http_headers(struct MHD_Response *r, const char *type) {
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(r, "X-Frame-Options", "DENY");
    if (!strncmp(type, "text/html", 9))
        MHD_add_response_header(r, "Content-Security-Policy",
                                "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'");
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
