/* test_http.c: the door's checks of a request's head and its decoder of a
 * chunked body (src/web/door.c), against what HTTP/1.1 (RFC 9112) says of
 * each case. The serve and dashboard CLI tests send the same over sockets. */
#include "harness.h"
#include "web/http.h"

#include <stdlib.h>
#include <string.h>

static unsigned head_of(const char *s, k3_http_head *h, const char **code) {
    char msg[256];
    *code = "";
    return k3_http_check_head(s, strlen(s), h, code, msg, sizeof msg);
}

/* status and code of a head, as "STATUS CODE" */
static const char *verdict(const char *s) {
    static char out[128];
    k3_http_head h;
    const char *code;
    unsigned st = head_of(s, &h, &code);
    snprintf(out, sizeof out, "%u %s", st, st > 1 ? code : "");
    return out;
}

#define H "Host: 127.0.0.1\r\n"

/* Each case's head gets its expected verdict; the first that does not is
 * reported. */
#define VERDICTS(...)                                                                            \
    do {                                                                                         \
        static const char *const cases[][2] = {__VA_ARGS__};                                     \
        for (size_t i_ = 0; i_ < sizeof cases / sizeof *cases; i_++)                             \
            CHECKF(!strcmp(verdict(cases[i_][0]), cases[i_][1]), "case %zu: '%.60s': %s, wanted %s", \
                   i_, cases[i_][0], verdict(cases[i_][0]), cases[i_][1]);                        \
    } while (0)

TEST(http_head_well_formed) {
    k3_http_head h;
    const char *code;
    const char *get = "GET /health HTTP/1.1\r\n" H "\r\n";
    CHECK(head_of(get, &h, &code) == 0);
    CHECK(h.len == strlen(get) && h.blank_at == strlen(get) - 2 && !h.chunked && h.te_len == 0);
    /* bare LF line ends, leading blank lines, HTTP/1.0 without Host */
    const char *lf = "\r\n\nGET / HTTP/1.0\nX-A:\tb c \n\nBODY";
    CHECK(head_of(lf, &h, &code) == 0);
    CHECK(h.len == strlen(lf) - 4 && h.blank_at == strlen(lf) - 5);
    const char *te = "POST /v1/completions HTTP/1.1\r\n" H "transfer-encoding: Chunked\r\nX-B: 1\r\n\r\n";
    CHECK(head_of(te, &h, &code) == 0);
    CHECK(h.chunked && !strncmp(te + h.te_at, "transfer-encoding", 17) && h.te_len == strlen("transfer-encoding: Chunked\r\n"));
    CHECK(!strcmp(verdict("POST / HTTP/1.1\r\nContent-Length: \t0042\r\n\r\n"), "0 "));
    CHECK(!strcmp(verdict("POST / HTTP/1.1\r\nContent-Length: 9223372036854775807\r\n\r\n"), "0 "));
    CHECK(!strcmp(verdict("POST / HTTP/1.1\r\nContent-Length: 00009223372036854775807\r\n\r\n"), "0 "));
}

TEST(http_head_incomplete_asks_for_more) {
    CHECK(!strcmp(verdict(""), "1 "));
    CHECK(!strcmp(verdict("\r\n"), "1 "));
    CHECK(!strcmp(verdict("GE"), "1 "));
    CHECK(!strcmp(verdict("GET /hea"), "1 "));
    CHECK(!strcmp(verdict("GET /health HTTP/1.1"), "1 "));
    CHECK(!strcmp(verdict("GET /health HTTP/1.1\r\n" H), "1 "));
    CHECK(!strcmp(verdict("GET /health HTTP/1.1\r\n" H "\r"), "1 "));
    /* what is already wrong is said before the rest comes */
    CHECK(!strcmp(verdict("G@T /"), "400 invalid_request_line"));
    CHECK(!strcmp(verdict("GET /a\x01"), "400 invalid_request_line"));
}

TEST(http_head_request_line) {
    VERDICTS({"GET  /health HTTP/1.1\r\n\r\n", "400 invalid_request_line"},
             {" GET /health HTTP/1.1\r\n\r\n", "400 invalid_request_line"},
             {"GET\r\n\r\n", "400 invalid_request_line"},
             {"GET /health HTTP/1.1 x\r\n\r\n", "400 invalid_request_line"},
             {"GET /health HTTP/1.1x\r\n\r\n", "400 invalid_request_line"},
             {"GET /health http/1.1\r\n\r\n", "400 invalid_request_line"},
             {"GET /health HTTP/1.\r\n\r\n", "400 invalid_request_line"},
             {"GET /health HTTP/2.0\r\n\r\n", "505 http_version_not_supported"},
             {"GET /health HTTP/1.7\r\n\r\n", "505 http_version_not_supported"},
             {"GET /health HTTP/0.9\r\n\r\n", "505 http_version_not_supported"},
             {"GET /health\r\n\r\n", "505 http_version_not_supported"});
}

/* a head of exactly n bytes: a request line with a target of `target`
 * bytes, then one header padding it out */
static char *sized_head(size_t target, size_t n) {
    char *b = xmalloc(n + 1);
    size_t at = 0;
    memcpy(b, "GET /", 5);
    at = 5;
    memset(b + at, 'a', target - 1);
    at += target - 1;
    memcpy(b + at, " HTTP/1.1\r\nX: ", 14);
    at += 14;
    if (n < at + 4) {
        free(b);
        return NULL;
    }
    memset(b + at, 'v', n - at - 4);
    memcpy(b + n - 4, "\r\n\r\n", 4);
    b[n] = 0;
    return b;
}

TEST(http_head_limits) {
    const size_t U = K3_HTTP_MAX_URI, M = K3_HTTP_MAX_HEAD;
    char *b = sized_head(U, M);
    CHECK(b && !strcmp(verdict(b), "0 "));
    free(b);
    b = sized_head(U + 1, M);
    CHECK(b && !strcmp(verdict(b), "414 uri_too_long"));
    free(b);
    b = sized_head(10, M + 1);
    CHECK(b && !strcmp(verdict(b), "431 request_header_fields_too_large"));
    free(b);
    /* the limit passed before the head's end came */
    b = sized_head(10, M + 100);
    CHECK(b);
    memset(b + M + 96, 'v', 4);
    CHECK(!strcmp(verdict(b), "431 request_header_fields_too_large"));
    free(b);
    /* a target over the limit, its line not yet ended */
    b = sized_head(U + 1, U + 40);
    CHECK(b);
    b[U + 5] = 0;
    CHECK(!strcmp(verdict(b), "414 uri_too_long"));
    free(b);
}

TEST(http_head_header_lines) {
    VERDICTS({"GET / HTTP/1.1\r\nNo colon\r\n\r\n", "400 invalid_header"},
             {"GET / HTTP/1.1\r\nName : v\r\n\r\n", "400 invalid_header"},
             {"GET / HTTP/1.1\r\n: v\r\n\r\n", "400 invalid_header"},
             {"GET / HTTP/1.1\r\nX-A: 1\r\n continued\r\n\r\n", "400 invalid_header"},
             {"GET / HTTP/1.1\r\nX-A: 1\x01\r\n\r\n", "400 invalid_header"},
             {"GET / HTTP/1.1\r\nX-A: 1\r2\r\n\r\n", "400 invalid_header"});
}

TEST(http_head_framing) {
    VERDICTS({"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "400 invalid_content_length"},
             {"POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n", "400 invalid_content_length"},
             {"POST / HTTP/1.1\r\nContent-Length:\r\n\r\n", "400 invalid_content_length"},
             {"POST / HTTP/1.1\r\nContent-Length: 12abc\r\n\r\n", "400 invalid_content_length"},
             {"POST / HTTP/1.1\r\nContent-Length: 1 2\r\n\r\n", "400 invalid_content_length"},
             /* whitespace after the digits: libmicrohttpd would answer 400 itself */
             {"POST / HTTP/1.1\r\nContent-Length: 12 \r\n\r\n", "400 invalid_content_length"},
             {"POST / HTTP/1.1\r\nContent-Length: 12\t\r\n\r\n", "400 invalid_content_length"},
             {"POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n", "400 invalid_content_length"},
             {"POST / HTTP/1.1\r\nContent-Length: 9223372036854775808\r\n\r\n", "413 request_too_large"},
             {"POST / HTTP/1.1\r\nContent-Length: 36893488147419103232\r\n\r\n", "413 request_too_large"},
             {"POST / HTTP/1.1\r\nContent-Length: 2\r\ncontent-length: 2\r\n\r\n", "400 invalid_framing"},
             {"POST / HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", "400 invalid_framing"},
             {"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", "400 invalid_framing"},
             {"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", "501 unsupported_transfer_encoding"},
             {"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "501 unsupported_transfer_encoding"});
}

/* feeds s in pieces of `step` bytes; "STATUS body" */
static const char *dechunk(const char *s, size_t step, size_t max, size_t *taken) {
    static char out[256];
    k3_http_dechunk d = {0};
    k3_sbuf body = {0};
    char msg[128];
    size_t n = strlen(s), at = 0;
    unsigned st = K3_HTTP_MORE;
    while (at < n && st == K3_HTTP_MORE) {
        size_t len = n - at < step ? n - at : step, used = 0;
        st = k3_http_dechunk_feed(&d, s + at, len, max, &body, &used, msg, sizeof msg);
        if (st == 0 || st == K3_HTTP_MORE) at += used;
    }
    *taken = at;
    snprintf(out, sizeof out, "%u %s", st, body.p ? body.p : "");
    k3_sb_free(&body);
    return out;
}

TEST(http_dechunk_bodies) {
    size_t taken;
    const char *one = "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n";
    for (size_t step = 1; step <= strlen(one); step++) {
        CHECK(!strcmp(dechunk(one, step, 100, &taken), "0 hello world"));
        CHECK(taken == strlen(one));
    }
    /* extensions, upper-case hex, LF ends, trailers; what follows is not taken */
    const char *ext = "A;name=\"v\"\n0123456789\n0;x\nX-T: 1\nY: 2\n\nGET /next";
    CHECK(!strcmp(dechunk(ext, 1000, 100, &taken), "0 0123456789"));
    CHECK(taken == strlen(ext) - strlen("GET /next"));
    CHECK(!strcmp(dechunk("0\r\n\r\n", 3, 100, &taken), "0 "));
    CHECK(!strcmp(dechunk("000\r\n\r\n", 1, 100, &taken), "0 "));
    /* incomplete */
    CHECK(!strcmp(dechunk("5\r\nhel", 2, 100, &taken), "1 hel"));
    CHECK(!strcmp(dechunk("5\r\nhello\r\n0\r\n", 2, 100, &taken), "1 hello"));
}

TEST(http_dechunk_refusals) {
    size_t taken;
    CHECK(!strcmp(dechunk("zz\r\n{}\r\n0\r\n\r\n", 4, 100, &taken), "400 "));
    CHECK(!strcmp(dechunk("\r\n", 4, 100, &taken), "400 "));
    CHECK(!strcmp(dechunk(" 2\r\n{}\r\n0\r\n\r\n", 4, 100, &taken), "400 "));
    CHECK(!strcmp(dechunk("2 \r\n{}\r\n0\r\n\r\n", 4, 100, &taken), "400 "));
    CHECK(!strcmp(dechunk("2\r\n{}xx\r\n0\r\n\r\n", 4, 100, &taken), "400 {}"));
    CHECK(!strcmp(dechunk("2\r{}\r\n0\r\n\r\n", 4, 100, &taken), "400 "));
    CHECK(!strcmp(dechunk("2\r\n{}\rx0\r\n\r\n", 4, 100, &taken), "400 {}"));
    CHECK(!strcmp(dechunk("2\r\n{}\r\n0\r\nX\x01\r\n\r\n", 4, 100, &taken), "400 {}"));
    /* the decoded limit, and sizes past 2^64 */
    CHECK(!strcmp(dechunk("5\r\nhello\r\n", 100, 5, &taken), "1 hello"));
    CHECK(!strcmp(dechunk("5\r\nhello\r\n1\r\n!\r\n0\r\n\r\n", 100, 5, &taken), "413 hello"));
    CHECK(!strcmp(dechunk("10000000000000000\r\n", 100, 5, &taken), "413 "));
    CHECK(!strcmp(dechunk("ffffffffffffffff\r\n", 100, 5, &taken), "413 "));
}

/* A request of n query parameters, n header lines and n cookies (split
 * over two Cookie headers), each part counted alone when the others are 1. */
static char *counted_head(int params, int lines, int cookies) {
    k3_sbuf b = {0};
    k3_sb_puts(&b, "GET /health?p");
    for (int i = 1; i < params; i++) k3_sb_puts(&b, "&p");
    k3_sb_puts(&b, " HTTP/1.1\r\n");
    for (int i = 0; i < lines - 2; i++) k3_sb_puts(&b, "a:\r\n");
    k3_sb_puts(&b, "Cookie: c=1");
    for (int i = 1; i < cookies / 2; i++) k3_sb_puts(&b, ";c");
    k3_sb_puts(&b, "\r\nCookie: c");
    for (int i = cookies / 2 + 1; i < cookies; i++) k3_sb_puts(&b, "; c");
    k3_sb_puts(&b, "\r\n\r\n");
    return b.p;
}

TEST(http_head_field_counts) {
    const int F = K3_HTTP_MAX_FIELDS;
    char *h = counted_head(F, F, F);
    CHECK(!strcmp(verdict(h), "0 "));
    free(h);
    h = counted_head(F + 1, 2, 2);
    CHECK(!strcmp(verdict(h), "414 uri_too_long"));
    free(h);
    h = counted_head(1, F + 1, 2);
    CHECK(!strcmp(verdict(h), "431 request_header_fields_too_large"));
    free(h);
    h = counted_head(1, 2, F + 1);
    CHECK(!strcmp(verdict(h), "431 request_header_fields_too_large"));
    free(h);
}
