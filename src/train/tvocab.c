/* tvocab.c: the token -> bytes table of a prepared data directory, read
 * straight from its tiktoken.model ("base64 rank" per line) and the named
 * specials of tokenizer_config.json. The trainer needs only this much of a
 * tokenizer: byte counts for bits per byte, and bytes to print samples. */
#include "train/tvocab.h"

#include <jansson.h>
#include <string.h>

static int b64v(int c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

int tvocab_load(const char *dir, int vocab, tvocab *v, k3_err *err) {
    memset(v, 0, sizeof *v);
    char path[4096];
    int n = snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    if (n < 0 || (size_t)n >= sizeof path) return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
    char *text;
    size_t len;
    int rc = k3_read_file(path, &text, &len, err);
    if (rc) return rc;
    v->n = vocab;
    v->bytes = xcalloc((size_t)vocab, sizeof(uint8_t *));
    v->len = xcalloc((size_t)vocab, sizeof(int));
    v->special = xcalloc((size_t)vocab, sizeof(bool));
    v->eot = -1;
    char *p = text, *end = text + len;
    while (p < end) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl) nl = end;
        char *sp = memchr(p, ' ', (size_t)(nl - p));
        if (sp) {
            long rank = strtol(sp + 1, NULL, 10);
            if (rank >= 0 && rank < vocab && !v->bytes[rank]) {
                uint8_t *out = xmalloc((size_t)(sp - p) + 1);
                int o = 0, acc = 0, bits = 0;
                for (char *q = p; q < sp; q++) {
                    int d = b64v((unsigned char)*q);
                    if (d < 0) continue;
                    acc = (acc << 6) | d;
                    bits += 6;
                    if (bits >= 8) { bits -= 8; out[o++] = (uint8_t)((acc >> bits) & 0xff); }
                }
                v->bytes[rank] = out;
                v->len[rank] = o;
            }
        }
        p = nl + 1;
    }
    free(text);
    n = snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (n > 0 && (size_t)n < sizeof path) {
        json_error_t je;
        json_t *cfg = json_load_file(path, 0, &je);
        json_t *added = cfg ? json_object_get(cfg, "added_tokens_decoder") : NULL;
        const char *key;
        json_t *val;
        json_object_foreach(added, key, val) {
            long id = strtol(key, NULL, 10);
            const char *content = json_string_value(json_object_get(val, "content"));
            if (id < 0 || id >= vocab || !content) continue;
            free(v->bytes[id]);
            v->bytes[id] = (uint8_t *)xstrdup(content);
            v->len[id] = (int)strlen(content);
            v->special[id] = true;
            if (strcmp(content, "<|endoftext|>") == 0) v->eot = (int)id;
        }
        json_decref(cfg);
    }
    return K3_OK;
}

void tvocab_free(tvocab *v) {
    for (int i = 0; i < v->n; i++) free(v->bytes[i]);
    free(v->bytes);
    free(v->len);
    free(v->special);
    memset(v, 0, sizeof *v);
}

int tvocab_text_bytes(const tvocab *v, int id) {
    if (id < 0 || id >= v->n || v->special[id]) return 0;
    return v->len[id];
}
