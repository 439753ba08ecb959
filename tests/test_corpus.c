/* test_corpus.c: the corpus reader k3 prepare and k3 eval share
 * (src/train/corpus.h). The expected documents are written out by hand from
 * the formats' definitions (TinyStories' layout: a story, then a line that is
 * exactly <|endoftext|>), not taken from the reader; the token stream is
 * checked against tok_encode of each document with the separator after it,
 * across a batch boundary and at 1 and 2 threads. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "train/corpus.h"

/* Reads text in format f (fallback raw) and compares with the n expected
 * documents; returns false (and says why) on any difference. */
static bool docs_are(const char *name, const char *text, corpus_format f, const char *const *want, size_t n) {
    corpus c = {0};
    k3_err err = {0};
    int rc = corpus_read_text(&c, name, text, strlen(text), f, CORPUS_RAW, NULL, &err);
    bool ok = rc == 0 && c.n == n;
    if (!ok) fprintf(stderr, "%s: rc %d (%s), %zu documents, wanted %zu\n", name, rc, err.msg, c.n, n);
    uint64_t bytes = 0;
    for (size_t i = 0; ok && i < n; i++) {
        bytes += strlen(want[i]);
        if (c.len[i] != strlen(want[i]) || memcmp(c.doc[i], want[i], c.len[i])) {
            fprintf(stderr, "%s: document %zu is '%.*s', wanted '%s'\n", name, i, (int)c.len[i], c.doc[i], want[i]);
            ok = false;
        }
    }
    if (ok && c.bytes != bytes) {
        fprintf(stderr, "%s: %llu bytes counted, wanted %llu\n", name, (unsigned long long)c.bytes,
                (unsigned long long)bytes);
        ok = false;
    }
    corpus_free(&c);
    return ok;
}

TEST(corpus_stories_split_at_separator_lines) {
    const char *two[] = {"a b.", "c\nd."};
    CHECK(docs_are("plain", "a b.\n<|endoftext|>\nc\nd.\n<|endoftext|>\n", CORPUS_STORIES, two, 2));
    CHECK(docs_are("auto", "a b.\n<|endoftext|>\nc\nd.\n<|endoftext|>\n", CORPUS_AUTO, two, 2));
    CHECK(docs_are("no final separator", "a b.\n<|endoftext|>\nc\nd.\n", CORPUS_STORIES, two, 2));
    CHECK(docs_are("no final newline", "a b.\n<|endoftext|>\nc\nd.\n<|endoftext|>", CORPUS_STORIES, two, 2));
    const char *crlf[] = {"a", "b"};
    CHECK(docs_are("crlf", "a\r\n<|endoftext|>\r\nb\r\n<|endoftext|>\r\n", CORPUS_STORIES, crlf, 2));
    /* the separator counts only alone on its line; elsewhere it is text */
    const char *inl[] = {"x <|endoftext|>\ny"};
    CHECK(docs_are("inline", "x <|endoftext|>\ny\n<|endoftext|>\n", CORPUS_STORIES, inl, 1));
    /* whitespace-only stories are dropped; blank lines inside a story stay */
    const char *ws[] = {"p\n\nThe End.", "q"};
    CHECK(docs_are("blank", "p\n\nThe End.\n<|endoftext|>\n \n<|endoftext|>\nq\n<|endoftext|>\n", CORPUS_STORIES, ws,
                   2));
    /* a leading space of a story is its text */
    const char *lead[] = {" Spot.", "Once"};
    CHECK(docs_are("leading space", " Spot.\n<|endoftext|>\nOnce\n<|endoftext|>\n", CORPUS_STORIES, lead, 2));
}

TEST(corpus_text_jsonl_raw_and_auto) {
    const char *paras[] = {"l1\nl2", "p2"};
    CHECK(docs_are("text", "\nl1\nl2\n\n \n\np2\n", CORPUS_TEXT, paras, 2));
    const char *js[] = {"a\nb", "c"};
    CHECK(docs_are("jsonl", "{\"text\": \"a\\nb\"}\n\n{\"text\": \"c\", \"id\": 2}\n", CORPUS_JSONL, js, 2));
    CHECK(docs_are("jsonl auto", "{\"text\": \"a\\nb\"}\n{\"text\": \"c\"}\n", CORPUS_AUTO, js, 2));
    CHECK(docs_are("x.jsonl", " {\"text\": \"a\\nb\"}\n{\"text\": \"c\"}", CORPUS_AUTO, js, 2));
    /* raw: the whole text, every byte, separators and all */
    const char *raw[] = {"a\n<|endoftext|>\nb\n"};
    CHECK(docs_are("raw", "a\n<|endoftext|>\nb\n", CORPUS_RAW, raw, 1));
    /* auto without separators or JSON: the caller's fallback (raw here) */
    const char *plain[] = {"one\n\ntwo\n"};
    CHECK(docs_are("auto plain", "one\n\ntwo\n", CORPUS_AUTO, plain, 1));
    CHECK(docs_are("empty", "", CORPUS_RAW, NULL, 0));
    /* the format auto chose is reported */
    static const struct { const char *name, *text; corpus_format want; } chose[] = {
        {"s.txt", "a\n<|endoftext|>\n", CORPUS_STORIES}, {"j.txt", "{\"text\": \"a\"}\n", CORPUS_JSONL},
        {"p.txt", "a\n\nb\n", CORPUS_RAW}};
    for (size_t i = 0; i < sizeof chose / sizeof chose[0]; i++) {
        corpus c = {0};
        k3_err err = {0};
        corpus_format used = CORPUS_AUTO;
        CHECK(corpus_read_text(&c, chose[i].name, chose[i].text, strlen(chose[i].text), CORPUS_AUTO, CORPUS_RAW, &used,
                               &err) == 0);
        CHECKF(used == chose[i].want, "%s: read as %s", chose[i].name, corpus_format_name(used));
        corpus_free(&c);
    }
    CHECK(corpus_detect("f.txt", "one\n\ntwo", 8, CORPUS_TEXT) == CORPUS_TEXT);
    CHECK(corpus_detect("f.txt", "x\n<|endoftext|>\n", 16, CORPUS_RAW) == CORPUS_STORIES);
    corpus_format f;
    CHECK(corpus_parse_format("jsonl", &f) && f == CORPUS_JSONL);
    CHECK(corpus_parse_format("raw", &f) && f == CORPUS_RAW);
    CHECK(!corpus_parse_format("csv", &f) && !corpus_parse_format("", &f));
}

static bool refused(const char *name, const char *text, corpus_format f, const char *needle) {
    corpus c = {0};
    k3_err err = {0};
    int rc = corpus_read_text(&c, name, text, strlen(text), f, CORPUS_RAW, NULL, &err);
    corpus_free(&c);
    if (rc != K3_EXIT_USAGE || !strstr(err.msg, needle)) {
        fprintf(stderr, "%s: rc %d, message '%s', wanted exit 2 with '%s'\n", name, rc, err.msg, needle);
        return false;
    }
    return true;
}

TEST(corpus_refuses_bad_input_with_its_line) {
    CHECK(refused("utf8.txt", "ok\nbad \xff here\n<|endoftext|>\n", CORPUS_AUTO, "utf8.txt:2: invalid UTF-8"));
    CHECK(refused("raw.txt", "\xc0\x80", CORPUS_RAW, "raw.txt:1: invalid UTF-8"));
    CHECK(refused("a.jsonl", "{\"text\": \"x\"}\n{\"text\": 1}\n", CORPUS_JSONL, "a.jsonl:2: no string field"));
    CHECK(refused("b.jsonl", "{\"text\": \"x\"}\n[1, 2\n", CORPUS_JSONL, "b.jsonl:2:"));
}

typedef struct {
    int32_t *v;
    size_t n, cap;
    uint64_t bytes;
} ids;

static int collect(void *ctx, const int32_t *p, size_t n, size_t bytes, k3_err *err) {
    (void)err;
    ids *b = ctx;
    if (b->n + n > b->cap) {
        b->cap = 2 * (b->n + n);
        b->v = xrealloc_array(b->v, b->cap, sizeof *b->v);
    }
    memcpy(b->v + b->n, p, n * sizeof *p);
    b->n += n;
    b->bytes += bytes;
    return K3_OK;
}

/* More documents than one encoding batch (4096), so batch order shows. */
TEST(corpus_encode_is_each_document_then_the_separator) {
    k3_tokenizer *tk;
    k3_err err = {0};
    CHECKF(tok_load(t_fixture("trained-5m"), &tk, &err) == 0, "%s", err.msg);
    const int32_t eot = tok_special_id(tk, CORPUS_EOT_TEXT);
    CHECK(eot >= 0);
    enum { N = 5000 };
    char **text = xcalloc(N, sizeof *text);
    const char **doc = xcalloc(N, sizeof *doc);
    size_t *len = xcalloc(N, sizeof *len);
    for (int i = 0; i < N; i++) {
        text[i] = xmalloc(64);
        len[i] = (size_t)snprintf(text[i], 64, "Story %d: the cat sat %s.", i, i % 3 ? "down" : "<|endoftext|>");
        doc[i] = text[i];
    }
    ids want = {0};
    for (int i = 0; i < N; i++) {
        int32_t *p;
        size_t n;
        CHECK(tok_encode(tk, doc[i], len[i], true, &p, &n, &err) == 0);
        collect(&want, p, n, len[i], &err);
        collect(&want, &eot, 1, 0, &err);
        free(p);
    }
    const int threads = omp_get_max_threads();
    for (int th = 1; th <= 2; th++) {
        omp_set_num_threads(th);
        ids got = {0};
        CHECK(corpus_encode(tk, doc, len, N, eot, collect, &got, NULL, &err) == 0);
        CHECKF(got.n == want.n && !memcmp(got.v, want.v, want.n * sizeof *want.v) && got.bytes == want.bytes,
               "%d thread(s): %zu ids, wanted %zu", th, got.n, want.n);
        free(got.v);
    }
    omp_set_num_threads(threads);
    for (int i = 0; i < N; i++) free(text[i]);
    free(text);
    free(doc);
    free(len);
    free(want.v);
    tok_free(tk);
}
