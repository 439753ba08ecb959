/* http_client.c: a tiny HTTP client for the dashboard tests (built by
 * tests/cli/test_dashboard.sh). It talks to loopback only.
 *
 *   http_client PORT raw            send stdin byte for byte, print the whole
 *                                   response (until the server closes, or 2 s of silence)
 *   http_client PORT load N PATH... N GET requests cycling through PATHs, nine
 *                                   in ten asking to keep the connection, one
 *                                   in ten asking to close it; a connection
 *                                   the answer closes (Connection: close) is
 *                                   not used again, as HTTP/1.1 says. Every
 *                                   response must be a complete 200. Prints
 *                                   "ok=N bad=M". */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

static int connect_port(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = {.tv_sec = 2};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int raw(int port) {
    static char req[1 << 20];
    size_t n = fread(req, 1, sizeof req, stdin);
    int fd = connect_port(port);
    if (fd < 0) { perror("connect"); return 2; }
    send_all(fd, req, n); /* the server may close early on garbage: fine */
    char buf[65536];
    ssize_t k;
    while ((k = recv(fd, buf, sizeof buf, 0)) > 0) fwrite(buf, 1, (size_t)k, stdout);
    close(fd);
    return 0;
}

/* Reads one response on fd; returns its status, or -1, and whether it
 * closes the connection. Body is read and dropped. */
static int read_response(int fd, char *buf, size_t cap, size_t *have, bool *closes) {
    char *end = NULL;
    for (;;) {
        buf[*have] = 0;
        if ((end = strstr(buf, "\r\n\r\n")) != NULL) break;
        if (*have + 1 >= cap) return -1;
        ssize_t k = recv(fd, buf + *have, cap - 1 - *have, 0);
        if (k <= 0) return -1;
        *have += (size_t)k;
    }
    int status = 0;
    if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1) return -1;
    long long clen = -1;
    for (char *h = strstr(buf, "\r\n"); h && h < end; h = strstr(h + 2, "\r\n"))
        if (!strncasecmp(h + 2, "Content-Length:", 15)) clen = atoll(h + 17);
        else if (!strncasecmp(h + 2, "Connection: close\r\n", 19)) *closes = true;
    if (clen < 0) return -1;
    size_t head = (size_t)(end - buf) + 4;
    size_t body = *have - head;
    while (body < (size_t)clen) { /* drain the rest of the body */
        char tmp[65536];
        size_t want = (size_t)clen - body < sizeof tmp ? (size_t)clen - body : sizeof tmp;
        ssize_t k = recv(fd, tmp, want, 0);
        if (k <= 0) return -1;
        body += (size_t)k;
    }
    size_t extra = body - (size_t)clen; /* pipelined bytes: none expected */
    memmove(buf, buf + head + (size_t)clen, extra);
    *have = extra;
    return status;
}

static int load(int port, long n, char **paths, int npaths) {
    static char buf[1 << 20];
    long ok = 0, bad = 0;
    int fd = -1;
    size_t have = 0;
    for (long i = 0; i < n; i++) {
        bool fresh = i % 10 == 0;
        if (fresh && fd >= 0) { close(fd); fd = -1; }
        if (fd < 0) { fd = connect_port(port); have = 0; }
        if (fd < 0) { bad++; continue; }
        char req[2048];
        int len = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s\r\n", paths[i % npaths],
                           port, fresh ? "Connection: close\r\n" : "");
        if (len < 0 || (size_t)len >= sizeof req || send_all(fd, req, (size_t)len) != 0) {
            bad++; close(fd); fd = -1; continue;
        }
        bool closes = false;
        int st = read_response(fd, buf, sizeof buf, &have, &closes);
        if (st == 200) ok++;
        else {
            if (bad < 5) fprintf(stderr, "request %ld (%s): status %d\n", i, paths[i % npaths], st);
            bad++;
        }
        if (st < 0 || fresh || closes) { close(fd); fd = -1; }
    }
    if (fd >= 0) close(fd);
    printf("ok=%ld bad=%ld\n", ok, bad);
    return bad ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[2], "raw")) return raw(atoi(argv[1]));
    if (argc >= 5 && !strcmp(argv[2], "load")) return load(atoi(argv[1]), atol(argv[3]), argv + 4, argc - 4);
    fprintf(stderr, "usage: http_client PORT raw | http_client PORT load N PATH...\n");
    return 2;
}
