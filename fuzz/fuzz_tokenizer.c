/* libFuzzer harness for the tokenizer: tiktoken.model, tokenizer_config.json
 * and encode/decode of arbitrary bytes.
 *
 * Input framing: byte 0 holds flags (bit 0: allow specials when encoding;
 * bit 1: write a tokenizer_config.json), bytes 1-2 and 3-4 the lengths
 * (little-endian, clamped to what is left) of the tiktoken.model text and of
 * the config text; the rest is the text to encode. The two files are written
 * into a private temporary directory and loaded with tok_load.
 *
 * Contract checked (anything else aborts, which libFuzzer reports):
 *   - a refused load, encode or decode returns an exit code (1, 2 or 4) and
 *     one non-empty line;
 *   - an encoded id is inside the vocabulary, and decoding the ids gives the
 *     text back byte for byte (the tokenizer is byte-level and lossless);
 *   - the incremental decoder's output (feed + flush) is exactly the decoded
 *     bytes;
 *   - decoding arbitrary ids (the text's bytes taken as ids, some outside the
 *     vocabulary) is a clean refusal or a success, never a crash. */
#include "tokenizer/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char dir[4096];

static void put_file(const char *name, const uint8_t *p, size_t n) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (n && fwrite(p, 1, n, f) != n) abort();
    if (fclose(f) != 0) abort();
}

static void check_err(int rc, const k3_err *e) {
    if (rc != K3_EXIT_RUNTIME && rc != K3_EXIT_USAGE && rc != K3_EXIT_DATA) abort();
    if (!e->msg[0] || strchr(e->msg, '\n')) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!dir[0]) {
        const char *tmp = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/k3-fuzz-tok-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(dir)) abort();
    }
    if (size < 5) return 0;
    const bool allow = data[0] & 1, with_cfg = data[0] & 2;
    size_t a = (size_t)data[1] | (size_t)data[2] << 8, b = (size_t)data[3] | (size_t)data[4] << 8;
    const uint8_t *p = data + 5;
    size_t left = size - 5;
    if (a > left) a = left;
    const uint8_t *model = p;
    p += a, left -= a;
    if (b > left) b = left;
    const uint8_t *cfg = p;
    p += b, left -= b;
    const char *text = (const char *)p;
    const size_t tlen = left;

    put_file("tiktoken.model", model, a);
    char cpath[4200];
    snprintf(cpath, sizeof cpath, "%s/tokenizer_config.json", dir);
    if (with_cfg) put_file("tokenizer_config.json", cfg, b);
    else unlink(cpath);

    k3_err err = {0};
    k3_tokenizer *t = NULL;
    int rc = tok_load(dir, &t, &err);
    if (rc) {
        check_err(rc, &err);
        return 0;
    }
    const int V = tok_vocab_size(t);
    if (V <= 0 || tok_n_base(t) <= 0 || tok_n_base(t) > V) abort();

    int32_t *ids = NULL;
    size_t n = 0;
    rc = tok_encode(t, text, tlen, allow, &ids, &n, &err);
    if (rc) {
        check_err(rc, &err);
    } else {
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= V) abort();
        uint8_t *back = NULL;
        size_t blen = 0;
        k3_err e2 = {0};
        if (tok_decode(t, ids, n, &back, &blen, &e2)) abort(); /* its own ids always decode */
        if (blen != tlen || memcmp(back, text, tlen) != 0) abort();
        /* the streaming decoder gives the same bytes */
        size_t cap = tok_max_token_bytes(t) + 16, got = 0;
        uint8_t *chunk = malloc(cap), *all = malloc(blen + cap + 1);
        if (!chunk || !all) abort();
        tok_stream s;
        tok_stream_init(&s, t);
        for (size_t i = 0; i < n; i++) {
            size_t k = tok_stream_feed(&s, ids[i], chunk, cap);
            if (got + k > blen) abort();
            memcpy(all + got, chunk, k);
            got += k;
        }
        size_t k = tok_stream_flush(&s, chunk, cap);
        if (got + k != blen) abort();
        memcpy(all + got, chunk, k);
        if (memcmp(all, back, blen) != 0) abort();
        free(chunk);
        free(all);
        free(back);
    }
    free(ids);

    /* arbitrary ids: the text's bytes in pairs, reaching past the vocabulary */
    size_t m = tlen / 2;
    int32_t *raw = malloc((m ? m : 1) * sizeof *raw);
    if (!raw) abort();
    for (size_t i = 0; i < m; i++) {
        int v = (int)((unsigned)(uint8_t)text[2 * i] | (unsigned)(uint8_t)text[2 * i + 1] << 8);
        raw[i] = (int32_t)(v % (V + 3)) - (v & 0x8000 ? 1 : 0);
    }
    uint8_t *out = NULL;
    size_t olen = 0;
    k3_err e3 = {0};
    rc = tok_decode(t, raw, m, &out, &olen, &e3);
    if (rc) check_err(rc, &e3);
    free(out);
    free(raw);
    tok_free(t);
    return 0;
}
