/* corpus.c: reading a corpus into documents, and documents into the token
 * stream (corpus.h). */
#include "train/corpus.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* in corpus_format order */
static const char *const format_names[] = {"auto", "stories", "text", "jsonl", "raw"};
#define N_FORMATS (sizeof format_names / sizeof format_names[0])

bool corpus_parse_format(const char *s, corpus_format *out) {
    for (size_t i = 0; i < N_FORMATS; i++)
        if (!strcmp(s, format_names[i])) {
            *out = (corpus_format)i;
            return true;
        }
    return false;
}

const char *corpus_format_name(corpus_format f) { return (size_t)f < N_FORMATS ? format_names[f] : "?"; }

static void corpus_add(corpus *c, const char *p, size_t n) {
    if (c->n == c->cap) {
        c->cap = c->cap ? c->cap * 2 : 1024;
        c->doc = xrealloc_array(c->doc, c->cap, sizeof *c->doc);
        c->len = xrealloc_array(c->len, c->cap, sizeof *c->len);
    }
    c->doc[c->n] = p;
    c->len[c->n++] = n;
    c->bytes += n;
}

void corpus_free(corpus *c) {
    for (size_t i = 0; i < c->n_maps; i++) munmap(c->maps[i], c->map_lens[i]);
    for (size_t i = 0; i < c->n_owned; i++) free(c->owned[i]);
    free(c->maps);
    free(c->map_lens);
    free(c->owned);
    free(c->doc);
    free(c->len);
    memset(c, 0, sizeof *c);
}

static bool blank(const char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != ' ' && p[i] != '\t' && p[i] != '\n' && p[i] != '\r') return false;
    return true;
}

/* Start of the next line that is exactly <|endoftext|> (then \n, \r\n or end
 * of text), searching from `from`; NULL if none. */
static const char *next_separator(const char *text, size_t len, size_t from, size_t *line_len) {
    size_t sl = strlen(CORPUS_EOT_TEXT);
    while (from < len) {
        const char *q = memmem(text + from, len - from, CORPUS_EOT_TEXT, sl);
        if (!q) return NULL;
        size_t at = (size_t)(q - text), e = at + sl;
        bool start = at == 0 || text[at - 1] == '\n';
        if (e < len && text[e] == '\r') e++;
        bool end = e == len || text[e] == '\n';
        if (start && end) {
            *line_len = (e < len ? e + 1 : e) - at;
            return q;
        }
        from = at + 1;
    }
    return NULL;
}

static void split_stories(corpus *c, const char *text, size_t len) {
    size_t pos = 0, ll;
    const char *q;
    while ((q = next_separator(text, len, pos, &ll))) {
        size_t at = (size_t)(q - text), end = at;
        /* the newline that ends the story's last line belongs to the separator */
        if (end > pos && text[end - 1] == '\n') end--;
        if (end > pos && text[end - 1] == '\r') end--;
        if (!blank(text + pos, end - pos)) corpus_add(c, text + pos, end - pos);
        pos = at + ll;
    }
    size_t end = len;
    while (end > pos && (text[end - 1] == '\n' || text[end - 1] == '\r')) end--;
    if (!blank(text + pos, end - pos)) corpus_add(c, text + pos, end - pos);
}

/* Paragraphs: runs of lines separated by one or more blank lines. */
static void split_paragraphs(corpus *c, const char *text, size_t len) {
    size_t pos = 0, start = 0;
    bool in_doc = false;
    size_t last_end = 0; /* end of the last non-blank line */
    while (pos < len) {
        const char *nl = memchr(text + pos, '\n', len - pos);
        size_t e = nl ? (size_t)(nl - text) : len;
        if (blank(text + pos, e - pos)) {
            if (in_doc) corpus_add(c, text + start, last_end - start);
            in_doc = false;
        } else {
            if (!in_doc) start = pos;
            in_doc = true;
            last_end = e > pos && text[e - 1] == '\r' ? e - 1 : e;
        }
        pos = nl ? e + 1 : len;
    }
    if (in_doc) corpus_add(c, text + start, last_end - start);
}

static int split_jsonl(corpus *c, const char *path, const char *text, size_t len, k3_err *err) {
    size_t pos = 0, line = 0;
    while (pos < len) {
        line++;
        const char *nl = memchr(text + pos, '\n', len - pos);
        size_t e = nl ? (size_t)(nl - text) : len;
        if (!blank(text + pos, e - pos)) {
            json_error_t je;
            json_t *o = json_loadb(text + pos, e - pos, 0, &je);
            json_t *t = o ? json_object_get(o, "text") : NULL;
            if (!o || !json_is_string(t)) {
                json_decref(o);
                return k3_fail(err, K3_EXIT_USAGE, "%s:%zu: %s", path, line,
                               o ? "no string field \"text\"" : je.text);
            }
            size_t n = json_string_length(t);
            char *s = xmalloc(n + 1);
            memcpy(s, json_string_value(t), n);
            json_decref(o);
            if (tok_utf8_check((const uint8_t *)s, n) != n) {
                free(s);
                return k3_fail(err, K3_EXIT_USAGE, "%s:%zu: \"text\" is not valid UTF-8", path, line);
            }
            if (c->n_owned % 64 == 0) c->owned = xrealloc_array(c->owned, c->n_owned + 64, sizeof *c->owned);
            c->owned[c->n_owned++] = s;
            if (!blank(s, n)) corpus_add(c, s, n);
        }
        pos = nl ? e + 1 : len;
    }
    return 0;
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

corpus_format corpus_detect(const char *path, const char *text, size_t len, corpus_format fallback) {
    size_t i = 0, ll;
    while (i < len && (text[i] == ' ' || text[i] == '\n' || text[i] == '\r' || text[i] == '\t')) i++;
    if (ends_with(path, ".jsonl") || (i < len && text[i] == '{')) return CORPUS_JSONL;
    if (next_separator(text, len, 0, &ll)) return CORPUS_STORIES;
    return fallback;
}

int corpus_read_text(corpus *c, const char *name, const char *text, size_t len, corpus_format fmt,
                     corpus_format fallback, corpus_format *used, k3_err *err) {
    if (fmt == CORPUS_AUTO) fmt = corpus_detect(name, text, len, fallback);
    if (used) *used = fmt;
    if (fmt == CORPUS_JSONL) return split_jsonl(c, name, text, len, err);
    size_t bad = tok_utf8_check((const uint8_t *)text, len);
    if (bad != len) {
        size_t line = 1;
        for (size_t i = 0; i < bad; i++) line += text[i] == '\n';
        return k3_fail(err, K3_EXIT_USAGE, "%s:%zu: invalid UTF-8 (byte offset %zu)", name, line, bad);
    }
    if (fmt == CORPUS_STORIES) split_stories(c, text, len);
    else if (fmt == CORPUS_TEXT) split_paragraphs(c, text, len);
    else if (len) corpus_add(c, text, len); /* raw: one document, whitespace and all */
    return 0;
}

int corpus_read_file(corpus *c, const char *path, corpus_format fmt, corpus_format fallback, corpus_format *used,
                     k3_err *err) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return k3_fail(err, K3_EXIT_USAGE, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return k3_fail(err, K3_EXIT_USAGE, "%s: not a regular file", path);
    }
    size_t len = (size_t)st.st_size;
    const char *text = "";
    if (len) {
        void *m = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot map: %s", path, strerror(e));
        }
        madvise(m, len, MADV_SEQUENTIAL);
        if (c->n_maps % 16 == 0) {
            c->maps = xrealloc_array(c->maps, c->n_maps + 16, sizeof *c->maps);
            c->map_lens = xrealloc_array(c->map_lens, c->n_maps + 16, sizeof *c->map_lens);
        }
        c->maps[c->n_maps] = m;
        c->map_lens[c->n_maps++] = len;
        text = m;
    }
    close(fd);
    return corpus_read_text(c, path, text, len, fmt, fallback, used, err);
}

int32_t corpus_separator_id(const k3_tokenizer *tk) {
    int32_t id = tok_special_id(tk, CORPUS_EOT_TEXT);
    return id >= 0 ? id : tok_eos_id(tk);
}

int corpus_encode(const k3_tokenizer *tk, const char *const *doc, const size_t *len, size_t n, int32_t eot,
                  corpus_sink sink, void *ctx, k3_progress *prog, k3_err *err) {
    /* Batches of documents are encoded in parallel and handed on in document
     * order, so the stream is the same whatever the thread count. */
    const size_t batch = 4096;
    int32_t **ids = xcalloc(batch, sizeof *ids);
    size_t *nids = xcalloc(batch, sizeof *nids);
    int *rcs = xcalloc(batch, sizeof *rcs);
    k3_err *errs = xcalloc(batch, sizeof *errs);
    uint64_t done = 0;
    int rc = 0;
    for (size_t b0 = 0; b0 < n && !rc; b0 += batch) {
        size_t bn = n - b0 < batch ? n - b0 : batch;
#pragma omp parallel for schedule(dynamic, 16)
        for (size_t i = 0; i < bn; i++)
            rcs[i] = tok_encode(tk, doc[b0 + i], len[b0 + i], true, &ids[i], &nids[i], &errs[i]);
        for (size_t i = 0; i < bn; i++) {
            if (!rc && rcs[i]) {
                rc = rcs[i];
                *err = errs[i];
            }
            if (!rc) rc = sink(ctx, ids[i], nids[i], len[b0 + i], err);
            if (!rc) rc = sink(ctx, &eot, 1, 0, err);
            done += len[b0 + i];
            free(ids[i]);
            ids[i] = NULL;
        }
        if (prog) k3_progress_update(prog, done);
    }
    free(ids);
    free(nids);
    free(rcs);
    free(errs);
    return rc;
}
