/* door.c: the door in front of libmicrohttpd (http.h): a request's head is
 * checked, and a chunked body decoded, before the library reads them. */
#include "web/http.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- the head ---- */

static bool tchar(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

/* The line at b[at..n): its end (before CR LF or LF) in *end and the next
 * line's start in *next; false when its LF has not come. */
static bool line_at(const char *b, size_t n, size_t at, size_t *end, size_t *next) {
    const char *lf = memchr(b + at, '\n', n - at);
    if (!lf) return false;
    size_t e = (size_t)(lf - b);
    *next = e + 1;
    *end = e > at && b[e - 1] == '\r' ? e - 1 : e;
    return true;
}

static unsigned fail(unsigned st, const char *c, const char **code, char *msg, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static unsigned fail(unsigned st, const char *c, const char **code, char *msg, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, cap, fmt, ap);
    va_end(ap);
    *code = c;
    return st;
}

/* The request line b[at..end): 0, or the status of what is wrong with it. */
static unsigned check_line(const char *b, size_t at, size_t end, bool whole, const char **code, char *msg,
                           size_t cap) {
    size_t i = at;
    while (i < end && tchar((unsigned char)b[i])) i++;
    if (i == end && !whole) return 0; /* the method so far */
    if (i == at || i == end || b[i] != ' ')
        return fail(400, "invalid_request_line", code, msg, cap, "malformed request line: expected 'METHOD TARGET "
                    "HTTP/1.1'");
    size_t t = ++i;
    while (i < end && (unsigned char)b[i] > ' ' && b[i] != 0x7f) i++;
    if (i - t > K3_HTTP_MAX_URI)
        return fail(414, "uri_too_long", code, msg, cap, "the request target is over the limit of %zu bytes",
                    K3_HTTP_MAX_URI);
    const char *q = memchr(b + t, '?', i - t);
    size_t params = 0;
    for (; q && q < b + i; q++) params += *q == '&' || *q == '?';
    if (params > K3_HTTP_MAX_FIELDS)
        return fail(414, "uri_too_long", code, msg, cap, "the request target has over %d query parameters",
                    K3_HTTP_MAX_FIELDS);
    if (!whole) return i == end ? 0 : (b[i] == ' ' ? 0 : fail(400, "invalid_request_line", code, msg, cap,
                                                                  "malformed request target: a control byte"));
    if (i == t || (i < end && b[i] != ' '))
        return fail(400, "invalid_request_line", code, msg, cap, "malformed request line: expected 'METHOD TARGET "
                    "HTTP/1.1'");
    if (i == end)
        return fail(505, "http_version_not_supported", code, msg, cap, "a request line without an HTTP version "
                    "(HTTP/0.9) is not supported: send HTTP/1.1 or HTTP/1.0");
    const char *v = b + i + 1;
    size_t vn = end - i - 1;
    if (vn != 8 || memcmp(v, "HTTP/", 5) || v[5] < '0' || v[5] > '9' || v[6] != '.' || v[7] < '0' || v[7] > '9')
        return fail(400, "invalid_request_line", code, msg, cap, "malformed HTTP version '%.*s'",
                    (int)(vn > 20 ? 20 : vn), v);
    if (memcmp(v, "HTTP/1.1", 8) && memcmp(v, "HTTP/1.0", 8))
        return fail(505, "http_version_not_supported", code, msg, cap, "HTTP version '%.8s' is not supported: send "
                    "HTTP/1.1 or HTTP/1.0", v);
    return 0;
}

unsigned k3_http_check_head(const char *b, size_t n, k3_http_head *h, const char **code, char *msg, size_t cap) {
    size_t at = 0, end, next;
    while (at < n && (b[at] == '\r' || b[at] == '\n')) at++;
    if (!line_at(b, n, at, &end, &next)) {
        size_t e = n - at > K3_HTTP_MAX_HEAD ? at + K3_HTTP_MAX_HEAD : n;
        unsigned st = check_line(b, at, e, false, code, msg, cap);
        if (st) return st;
        if (n - at > K3_HTTP_MAX_HEAD) goto too_big;
        return K3_HTTP_MORE;
    }
    unsigned st = check_line(b, at, end, true, code, msg, cap);
    if (st) return st;
    *h = (k3_http_head){0};
    int lengths = 0, encodings = 0, lines = 0, cookies = 0;
    for (at = next;;) {
        if (at - 0 > K3_HTTP_MAX_HEAD) goto too_big;
        if (!line_at(b, n, at, &end, &next)) {
            if (n > K3_HTTP_MAX_HEAD) goto too_big;
            return K3_HTTP_MORE;
        }
        if (next > K3_HTTP_MAX_HEAD) goto too_big;
        if (end == at) { /* the blank line */
            h->blank_at = at;
            h->len = next;
            break;
        }
        if (b[at] == ' ' || b[at] == '\t')
            return fail(400, "invalid_header", code, msg, cap, "a folded header line (one starting with a space) is "
                        "not accepted");
        if (++lines > K3_HTTP_MAX_FIELDS)
            return fail(431, "request_header_fields_too_large", code, msg, cap, "the request has over %d header "
                        "lines", K3_HTTP_MAX_FIELDS);
        size_t k = at;
        while (k < end && tchar((unsigned char)b[k])) k++;
        if (k == at || k == end || b[k] != ':')
            return fail(400, "invalid_header", code, msg, cap, "malformed header line '%.*s': expected 'Name: value'",
                        (int)(end - at > 40 ? 40 : end - at), b + at);
        size_t v = k + 1, ve = end;
        for (size_t j = v; j < ve; j++)
            if (((unsigned char)b[j] < ' ' && b[j] != '\t') || b[j] == 0x7f)
                return fail(400, "invalid_header", code, msg, cap, "the header '%.*s' holds a control byte",
                            (int)(k - at > 40 ? 40 : k - at), b + at);
        while (v < ve && (b[v] == ' ' || b[v] == '\t')) v++;
        while (ve > v && (b[ve - 1] == ' ' || b[ve - 1] == '\t')) ve--;
        if (k - at == 14 && !strncasecmp(b + at, "Content-Length", 14)) {
            lengths++;
            size_t j = v;
            while (j < ve && b[j] >= '0' && b[j] <= '9') j++;
            if (j == v || j != ve)
                return fail(400, "invalid_content_length", code, msg, cap, "Content-Length '%.*s' is not a "
                            "non-negative whole number", (int)(ve - v > 30 ? 30 : ve - v), b + v);
            if (ve != end) /* libmicrohttpd cannot read one */
                return fail(400, "invalid_content_length", code, msg, cap, "Content-Length has whitespace after "
                            "its digits: send the digits alone");
            while (v < ve - 1 && b[v] == '0') v++;
            if (ve - v > 19 || (ve - v == 19 && memcmp(b + v, "9223372036854775807", 19) > 0))
                return fail(413, "request_too_large", code, msg, cap, "Content-Length %.*s is over 2^63 - 1 bytes",
                            (int)(ve - v > 30 ? 30 : ve - v), b + v);
        } else if (k - at == 17 && !strncasecmp(b + at, "Transfer-Encoding", 17)) {
            encodings++;
            if (ve - v != 7 || strncasecmp(b + v, "chunked", 7))
                return fail(501, "unsupported_transfer_encoding", code, msg, cap, "a Transfer-Encoding other than "
                            "chunked is not supported: send chunked, or a Content-Length");
            h->chunked = true;
            h->te_at = at;
            h->te_len = next - at;
        } else if (k - at == 6 && !strncasecmp(b + at, "Cookie", 6)) {
            cookies++;
            for (size_t j = v; j < ve; j++) cookies += b[j] == ';';
            if (cookies > K3_HTTP_MAX_FIELDS)
                return fail(431, "request_header_fields_too_large", code, msg, cap, "the request has over %d "
                            "cookies", K3_HTTP_MAX_FIELDS);
        } else if (k - at == 6 && !strncasecmp(b + at, "Expect", 6) && ve - v == 12 &&
                   !strncasecmp(b + v, "100-continue", 12)) {
            h->ex_at = at;
            h->ex_len = next - at;
        }
        at = next;
    }
    if (lengths > 1 || encodings > 1)
        return fail(400, "invalid_framing", code, msg, cap, "the request has %d %s headers: send one",
                    lengths > 1 ? lengths : encodings, lengths > 1 ? "Content-Length" : "Transfer-Encoding");
    if (lengths && encodings)
        return fail(400, "invalid_framing", code, msg, cap, "the request has both Content-Length and "
                    "Transfer-Encoding: send one");
    return 0;
too_big:
    return fail(431, "request_header_fields_too_large", code, msg, cap, "the request line and headers are over the "
                "limit of %zu bytes", K3_HTTP_MAX_HEAD);
}

/* ---- a chunked body ---- */

enum { DC_SIZE, DC_EXT, DC_SIZE_LF, DC_DATA, DC_DATA_CR, DC_DATA_LF, DC_TRAILER, DC_TRAILER_LF, DC_DONE };
#define DC_MAX_LINE 4096 /* a size line's extensions, a trailer line */

static int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A byte c of a chunk extension or a trailer line (at *i): the line's end
 * moves to lf_state (a CR is taken, the LF is left to it); false for a
 * control byte or a line over DC_MAX_LINE. */
static bool text_byte(k3_http_dechunk *d, unsigned char c, int lf_state, size_t *i) {
    if (c == '\r' || c == '\n') {
        d->state = lf_state;
        *i += c == '\r';
        return true;
    }
    if ((c < ' ' && c != '\t') || ++d->line > DC_MAX_LINE) return false;
    ++*i;
    return true;
}

unsigned k3_http_dechunk_feed(k3_http_dechunk *d, const char *b, size_t n, size_t max, k3_sbuf *out, size_t *used,
                              char *msg, size_t cap) {
    const char *code;
    size_t i = 0;
    while (i < n && d->state != DC_DONE) {
        unsigned char c = (unsigned char)b[i];
        switch (d->state) {
        case DC_SIZE: {
            int x = hexval(c);
            if (x >= 0) {
                if (d->left >> 60) return fail(413, "", &code, msg, cap, "a chunk size is over 2^64 bytes");
                d->left = d->left * 16 + (uint64_t)x;
                d->line++;
                i++;
            } else if (d->line == 0) {
                return fail(400, "", &code, msg, cap, "bad chunk syntax: a chunk size must start with a hex digit");
            } else if (c == ';') {
                d->state = DC_EXT;
                i++;
            } else if (c == '\r') {
                d->state = DC_SIZE_LF;
                i++;
            } else if (c == '\n') {
                d->state = DC_SIZE_LF;
            } else {
                return fail(400, "", &code, msg, cap, "bad chunk syntax: byte 0x%02x in a chunk size line", c);
            }
            break;
        }
        case DC_EXT:
            if (!text_byte(d, c, DC_SIZE_LF, &i))
                return fail(400, "", &code, msg, cap, "bad chunk syntax: a chunk extension too long or holding a "
                            "control byte");
            break;
        case DC_SIZE_LF:
            if (c != '\n') return fail(400, "", &code, msg, cap, "bad chunk syntax: CR without LF after a chunk size");
            i++;
            d->line = 0;
            if (d->left == 0) {
                d->state = DC_TRAILER;
            } else {
                if (d->left > max - (out->n < max ? out->n : max) || out->n >= max)
                    return fail(413, "", &code, msg, cap, "the request body is over the limit of %zu bytes", max);
                d->state = DC_DATA;
            }
            break;
        case DC_DATA: {
            size_t take = n - i < d->left ? n - i : (size_t)d->left;
            k3_sb_put(out, b + i, take);
            i += take;
            d->left -= take;
            if (d->left == 0) d->state = DC_DATA_CR;
            break;
        }
        case DC_DATA_CR:
            if (c == '\r') d->state = DC_DATA_LF, i++;
            else if (c == '\n') d->state = DC_DATA_LF;
            else return fail(400, "", &code, msg, cap, "bad chunk syntax: a chunk's data is longer than its size");
            break;
        case DC_DATA_LF:
            if (c != '\n') return fail(400, "", &code, msg, cap, "bad chunk syntax: CR without LF after a chunk");
            i++;
            d->state = DC_SIZE;
            break;
        case DC_TRAILER: /* trailer lines until a blank one; their content is dropped */
            if (!text_byte(d, c, DC_TRAILER_LF, &i))
                return fail(400, "", &code, msg, cap, "bad chunk syntax: a trailer line too long or holding a control "
                            "byte");
            break;
        case DC_TRAILER_LF:
            if (c != '\n') return fail(400, "", &code, msg, cap, "bad chunk syntax: CR without LF in the trailers");
            i++;
            if (d->line == 0) d->state = DC_DONE;
            else d->line = 0, d->state = DC_TRAILER;
            break;
        }
    }
    *used = i;
    return d->state == DC_DONE ? 0 : K3_HTTP_MORE;
}

/* ---- the door ---- */

#define DOOR_MAX 256      /* connections at the door at once (libmicrohttpd's own limit is as many) */
#define LINGER_S 2.0      /* after an error: how long unread input is drained so the answer is not reset */
#define HEAD_CAP (K3_HTTP_MAX_HEAD + 8)

enum { AT_HEAD, AT_BODY, AT_LINGER };

typedef struct {
    int fd, state;
    double due;
    struct sockaddr_storage addr;
    socklen_t addr_len;
    k3_sbuf req, body;        /* a chunked request: its head as rewritten, its decoded body */
    k3_http_dechunk dc;
} door_conn;

typedef struct relay {
    struct relay *next;
    k3_http_door *d;
    int client, pair;
    k3_sbuf req;
} relay;

struct k3_http_door {
    k3_http_door_opts o;
    int wake[2];
    pthread_t thread;
    atomic_bool stop;
    door_conn conns[DOOR_MAX];
    int n;
    double accept_at; /* k3_now() before which the listening socket is left alone (out of descriptors) */
    char head[HEAD_CAP];
    pthread_mutex_t mu; /* the relays */
    pthread_cond_t cv;
    relay *relays;
    int n_relays;
};

static bool same_client(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) return false;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr == ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, &((const struct sockaddr_in6 *)b)->sin6_addr,
                       sizeof(struct in6_addr));
    return true;
}

static void set_lowat(int fd, size_t n) {
    int v = n > (size_t)1 << 30 ? 1 << 30 : (int)n;
    setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);
}

static void drop(k3_http_door *d, int i, bool close_fd) {
    door_conn *c = &d->conns[i];
    if (close_fd) close(c->fd);
    k3_sb_free(&c->req);
    k3_sb_free(&c->body);
    d->conns[i] = d->conns[--d->n];
}

/* The server's error answer, then the connection lingers: closing a socket
 * with unread input resets it, and the client may lose the answer. */
static void answer(k3_http_door *d, int i, unsigned status, const char *code, const char *msg) {
    door_conn *c = &d->conns[i];
    char *body = d->o.error(d->o.error_cls, status, code, msg);
    k3_sbuf r = {0};
    const char *reason = MHD_get_reason_phrase_for(status);
    k3_sb_printf(&r, "HTTP/1.1 %u %s\r\n", status, reason && *reason ? reason : "Error");
    k3_http_header_lines(&r, "application/json; charset=utf-8");
    k3_sb_printf(&r, "Content-Length: %zu\r\n\r\n", body ? strlen(body) : 0);
    if (body) k3_sb_puts(&r, body);
    free(body);
    ssize_t off = 0;
    while ((size_t)off < r.n) {
        ssize_t w = send(c->fd, r.p + off, r.n - (size_t)off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w <= 0) break;
        off += w;
    }
    k3_sb_free(&r);
    shutdown(c->fd, SHUT_WR);
    set_lowat(c->fd, 1);
    c->state = AT_LINGER;
    c->due = k3_now() + LINGER_S;
}

static void *relay_main(void *arg);

/* A decoded chunked request goes to libmicrohttpd through a socket pair. */
static void hand_chunked(k3_http_door *d, int i) {
    door_conn *c = &d->conns[i];
    k3_sb_printf(&c->req, "Content-Length: %zu\r\n\r\n", c->body.n);
    k3_sb_put(&c->req, c->body.p, c->body.n);
    k3_sb_free(&c->body);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        answer(d, i, 503, "server_busy", "cannot open a socket pair for the request");
        return;
    }
    relay *r = xcalloc(1, sizeof *r);
    r->d = d;
    r->client = c->fd;
    r->pair = sv[1];
    r->req = c->req;
    c->req = (k3_sbuf){0};
    pthread_mutex_lock(&d->mu);
    r->next = d->relays;
    d->relays = r;
    d->n_relays++;
    pthread_mutex_unlock(&d->mu);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    /* the relay owns the client's socket from here */
    if (pthread_create(&t, &at, relay_main, r) != 0) {
        pthread_mutex_lock(&d->mu);
        relay **p = &d->relays;
        while (*p != r) p = &(*p)->next;
        *p = r->next;
        d->n_relays--;
        pthread_mutex_unlock(&d->mu);
        k3_sb_free(&r->req);
        free(r);
        close(sv[0]);
        close(sv[1]);
        answer(d, i, 503, "server_busy", "cannot start a thread for the request");
        pthread_attr_destroy(&at);
        return;
    }
    pthread_attr_destroy(&at);
    MHD_add_connection(d->o.mhd, sv[0], (const struct sockaddr *)&c->addr, c->addr_len); /* closes sv[0] on failure */
    drop(d, i, false);
}

static void send_all(int fd, const char *p, size_t n, bool *ok) {
    while (*ok && n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) *ok = false;
        else p += w, n -= (size_t)w;
    }
}

/* Writes the request to libmicrohttpd's end of the pair, then copies its
 * answer to the client until the library ends it or the client cannot take
 * it. A client that stops sending has its end passed on to the pair, so the
 * library sees what it sees of a client on its own socket (a hang-up
 * cancels a generation). */
static void *relay_main(void *arg) {
    relay *r = arg;
    k3_http_door *d = r->d;
    bool ok = true, client_open = true;
    send_all(r->pair, r->req.p, r->req.n, &ok);
    k3_sb_free(&r->req);
    char buf[16384];
    while (ok) {
        struct pollfd p[2] = {{.fd = r->pair, .events = POLLIN},
                              {.fd = client_open ? r->client : -1, .events = POLLRDHUP}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (p[1].revents & (POLLHUP | POLLERR | POLLNVAL)) break;
        if (p[1].revents & POLLRDHUP) {
            shutdown(r->pair, SHUT_WR);
            client_open = false;
        }
        if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t n = read(r->pair, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            send_all(r->client, buf, (size_t)n, &ok);
        }
    }
    pthread_mutex_lock(&d->mu);
    relay **p = &d->relays;
    while (*p != r) p = &(*p)->next;
    *p = r->next;
    close(r->pair);
    close(r->client);
    free(r);
    if (--d->n_relays == 0) pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* A head that has come whole: answered, handed on, or its chunked body read next. */
static void head_in(k3_http_door *d, int i, const char *b, const k3_http_head *h) {
    door_conn *c = &d->conns[i];
    set_lowat(c->fd, 1);
    if (!h->chunked) {
        int fd = c->fd;
        struct sockaddr_storage a = c->addr;
        socklen_t al = c->addr_len;
        drop(d, i, false);
        MHD_add_connection(d->o.mhd, fd, (const struct sockaddr *)&a, al); /* closes fd on failure */
        return;
    }
    /* the head goes on without its Transfer-Encoding line, with a length;
     * a client that waits for 100 Continue before its body gets it from the
     * door, and the library (which gets the body at once) no Expect */
    size_t cut[2][2] = {{h->te_at, h->te_len}, {h->ex_at, h->ex_len}}, at = 0;
    if (h->ex_len && h->ex_at < h->te_at) {
        cut[0][0] = h->ex_at, cut[0][1] = h->ex_len;
        cut[1][0] = h->te_at, cut[1][1] = h->te_len;
    }
    for (int k = 0; k < 2; k++) {
        if (!cut[k][1]) continue;
        k3_sb_put(&c->req, b + at, cut[k][0] - at);
        at = cut[k][0] + cut[k][1];
    }
    k3_sb_put(&c->req, b + at, h->blank_at - at);
    if (h->ex_len) send(c->fd, "HTTP/1.1 100 Continue\r\n\r\n", 25, MSG_NOSIGNAL | MSG_DONTWAIT);
    char sink[HEAD_CAP];
    size_t left = h->len;
    while (left) { /* take the head off the socket: it is all there, peeked */
        ssize_t r = recv(c->fd, sink, left < sizeof sink ? left : sizeof sink, MSG_DONTWAIT);
        if (r <= 0) {
            drop(d, i, true);
            return;
        }
        left -= (size_t)r;
    }
    c->state = AT_BODY;
}

/* The connection at i can be read (or ended). */
static void step(k3_http_door *d, int i, bool hup) {
    door_conn *c = &d->conns[i];
    char msg[256];
    const char *code;
    if (c->state == AT_HEAD) {
        ssize_t r = recv(c->fd, d->head, HEAD_CAP, MSG_PEEK | MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
        if (r <= 0) {
            drop(d, i, true);
            return;
        }
        k3_http_head h;
        unsigned st = k3_http_check_head(d->head, (size_t)r, &h, &code, msg, sizeof msg);
        if (st == 0) head_in(d, i, d->head, &h);
        else if (st != K3_HTTP_MORE) answer(d, i, st, code, msg);
        else if (hup) answer(d, i, 400, "incomplete_request", "the connection ended inside the request's head");
        else set_lowat(c->fd, (size_t)r + 1); /* poll again only once more has come */
        return;
    }
    char buf[16384];
    ssize_t r = recv(c->fd, buf, sizeof buf, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (r == 0 && c->state == AT_BODY) {
        answer(d, i, 400, "incomplete_request", "the connection ended inside the request's chunked body");
        return;
    }
    if (r <= 0) {
        drop(d, i, true);
        return;
    }
    if (c->state == AT_LINGER) return;
    size_t used;
    unsigned st = k3_http_dechunk_feed(&c->dc, buf, (size_t)r, d->o.max_body, &c->body, &used, msg, sizeof msg);
    if (st == 0) hand_chunked(d, i); /* what follows the body is not read: one request a connection */
    else if (st == 400) answer(d, i, 400, "invalid_chunked_body", msg);
    else if (st == 413) answer(d, i, 413, "request_too_large", msg);
}

static void *door_main(void *arg) {
    k3_http_door *d = arg;
    struct pollfd p[DOOR_MAX + 2];
    while (!atomic_load(&d->stop)) {
        double now = k3_now(), next = now + 0.25;
        p[0] = (struct pollfd){.fd = d->wake[0], .events = POLLIN};
        bool accepting = d->n < DOOR_MAX && now >= d->accept_at;
        p[1] = (struct pollfd){.fd = accepting ? d->o.listen_fd : -1, .events = POLLIN};
        if (!accepting && d->accept_at > now && d->accept_at < next) next = d->accept_at;
        for (int i = 0; i < d->n; i++) {
            p[i + 2] = (struct pollfd){.fd = d->conns[i].fd, .events = POLLIN | POLLRDHUP};
            if (d->conns[i].due < next) next = d->conns[i].due;
        }
        int n = d->n;
        int ms = next > now ? (int)((next - now) * 1000) + 1 : 0;
        if (poll(p, (nfds_t)n + 2, ms) < 0 && errno != EINTR) break;
        now = k3_now();
        for (int i = n - 1; i >= 0; i--) { /* from the end: drop() moves the last into i */
            short ev = p[i + 2].revents;
            if (ev & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))
                step(d, i, (ev & (POLLRDHUP | POLLHUP | POLLERR)) != 0);
            else if (now > d->conns[i].due)
                drop(d, i, true); /* a head or body too slow, or a lingering one done */
        }
        if (p[1].revents & POLLIN) {
            door_conn c = {.addr_len = sizeof c.addr};
            c.fd = accept4(d->o.listen_fd, (struct sockaddr *)&c.addr, &c.addr_len, SOCK_CLOEXEC);
            if (c.fd < 0) {
                /* out of descriptors or memory: the socket stays readable, so
                 * wait a little instead of spinning on it */
                if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) d->accept_at = now + 0.1;
                continue;
            }
            unsigned same = 0;
            for (int i = 0; i < d->n; i++) same += same_client(&d->conns[i].addr, &c.addr);
            if (same >= d->o.per_client) {
                close(c.fd);
                continue;
            }
            c.state = AT_HEAD;
            c.due = now + d->o.head_s;
            d->conns[d->n++] = c;
        }
    }
    return NULL;
}

int k3_http_door_open(const k3_http_door_opts *o, k3_http_door **out, k3_err *err) {
    k3_http_door *d = xcalloc(1, sizeof *d);
    d->o = *o;
    if (d->o.per_client == 0) d->o.per_client = DOOR_MAX;
    atomic_init(&d->stop, false);
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    const char *why = NULL;
    if (pipe2(d->wake, O_CLOEXEC) != 0) {
        why = "cannot open the HTTP door's pipe";
    } else if (pthread_create(&d->thread, NULL, door_main, d) != 0) {
        close(d->wake[0]);
        close(d->wake[1]);
        why = "cannot start the HTTP door's thread";
    }
    if (why) {
        pthread_mutex_destroy(&d->mu);
        pthread_cond_destroy(&d->cv);
        free(d);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s", why);
    }
    *out = d;
    return K3_OK;
}

void k3_http_door_close(k3_http_door *d) {
    if (!d) return;
    atomic_store(&d->stop, true);
    ssize_t w = write(d->wake[1], "", 1);
    (void)w;
    pthread_join(d->thread, NULL);
    while (d->n) drop(d, d->n - 1, true);
    close(d->o.listen_fd);
    close(d->wake[0]);
    close(d->wake[1]);
    pthread_mutex_lock(&d->mu);
    for (relay *r = d->relays; r; r = r->next) {
        shutdown(r->client, SHUT_RDWR);
        shutdown(r->pair, SHUT_RDWR);
    }
    while (d->n_relays) pthread_cond_wait(&d->cv, &d->mu);
    pthread_mutex_unlock(&d->mu);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    free(d);
}
