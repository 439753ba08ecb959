/* test_speculate.c: passes of several tokens that can be cut back (model.h,
 * k3_state_pass_*), what exact speculative decoding stands on.
 *
 * The reference is plain token-by-token decoding with k3_forward (one token
 * per call, recurrent KDA): a recorded pass of T tokens must give the same
 * logits bits at every position, and a pass cut back to its first j tokens
 * must leave the state bytes (k3_state_save) and the next logits of plain
 * decoding of those j tokens. Models: the peer's tiny checkpoint (13 layers,
 * 9 KDA, dense and MoE) and the shipped models/default (9 layers, MXFP4
 * experts), at 1 and 2 threads. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "model/model.h"

static const int32_t seq[24] = {3,  7,   11, 5,  9,  92,  168, 13,  3,   49,  208, 214,
                                208, 84, 30, 84, 204, 133, 143, 175, 197, 116, 175, 188};
#define NPRE 9 /* prefix fed before the pass */
#define NT 8   /* tokens of the pass */

static k3_model *open_model(const char *dir, int kda_chunk) {
    k3_model_opts o = {.kda_chunk = kda_chunk};
    k3_model *m = NULL;
    k3_err err = {0};
    if (k3_model_open(dir, &o, &m, &err)) {
        fprintf(stderr, "  %s\n", err.msg);
        return NULL;
    }
    return m;
}

/* A state that consumed seq[0..n) fed one token at a time; the last token's
 * logits into lg (may be NULL). */
static k3_state *plain(k3_model *m, int n, float *lg) {
    k3_state *s = NULL;
    k3_err err = {0};
    if (k3_state_new(m, 64, &s, &err)) return NULL;
    for (int i = 0; i < n; i++)
        if (k3_forward(m, s, &seq[i], 1, lg, false, &err)) {
            fprintf(stderr, "  %s\n", err.msg);
            k3_state_free(s);
            return NULL;
        }
    return s;
}

static void *save(const k3_model *m, const k3_state *s, size_t *bytes) {
    *bytes = (size_t)k3_state_snapshot_bytes(k3_model_config(m), k3_state_pos(s));
    void *b = xmalloc(*bytes);
    k3_state_save(s, b);
    return b;
}

/* The pass's logits equal token-by-token decoding's, at every position; ending
 * it at every j leaves plain decoding's state bytes and next logits. */
static void pass_and_rollback(const char *dir, int kda_chunk, int threads, bool every_j) {
    omp_set_num_threads(threads);
    k3_model *m = open_model(dir, kda_chunk);
    CHECK(m);
    const int V = k3_model_config(m)->vocab_size;
    float *want = xmalloc_array((size_t)NT * V, sizeof(float)), *got = xmalloc_array((size_t)NT * V, sizeof(float));
    float *a = xmalloc_array((size_t)V, sizeof(float)), *b = xmalloc_array((size_t)V, sizeof(float));
    k3_err err = {0};
    /* plain: the logits after each of seq[NPRE .. NPRE + NT) */
    for (int t = 0; t < NT; t++) {
        k3_state *s = plain(m, NPRE + t + 1, want + (size_t)t * V);
        CHECK(s);
        k3_state_free(s);
    }
    for (int j = 0; j <= NT; j++) {
        if (!every_j && j != 0 && j != 3 && j != NT - 1 && j != NT) continue;
        k3_state *s = plain(m, NPRE, NULL);
        CHECK(s);
        CHECK(k3_state_pass_reserve(s, NT, &err) == 0);
        CHECK(k3_state_pass_begin(s, &err) == 0);
        /* in two calls, as a pass may be fed: the record continues */
        CHECK(k3_forward(m, s, seq + NPRE, 3, got, true, &err) == 0);
        CHECK(k3_state_pass_len(s) == 3);
        CHECK(k3_forward(m, s, seq + NPRE + 3, NT - 3, got + (size_t)3 * V, true, &err) == 0);
        CHECKF(!memcmp(got, want, (size_t)NT * V * sizeof(float)), "%s: the pass's logits differ from plain", dir);
        CHECK(k3_state_pass_end(s, j, &err) == 0);
        CHECK(k3_state_pos(s) == NPRE + j);
        k3_state *p = plain(m, NPRE + j, NULL);
        CHECK(p);
        size_t nx, ny;
        void *x = save(m, s, &nx), *y = save(m, p, &ny);
        CHECKF(nx == ny && !memcmp(x, y, nx), "%s: state after keeping %d of %d differs from plain", dir, j, NT);
        free(x);
        free(y);
        /* the next token: a different one from the pass's, then the logits */
        int32_t next = (seq[NPRE + j] * 5 + 1) % V;
        CHECK(k3_forward(m, s, &next, 1, a, false, &err) == 0);
        CHECK(k3_forward(m, p, &next, 1, b, false, &err) == 0);
        CHECKF(!memcmp(a, b, (size_t)V * sizeof(float)), "%s: next logits after keeping %d differ", dir, j);
        /* a second pass on the same record after a cut-back one */
        CHECK(k3_state_pass_begin(s, &err) == 0);
        CHECK(k3_forward(m, s, seq, 2, NULL, false, &err) == 0);
        CHECK(k3_state_pass_end(s, 1, &err) == 0);
        CHECK(k3_forward(m, p, seq, 1, NULL, false, &err) == 0);
        x = save(m, s, &nx);
        y = save(m, p, &ny);
        CHECKF(nx == ny && !memcmp(x, y, nx), "%s: second pass after keeping %d differs", dir, j);
        free(x);
        free(y);
        k3_state_free(p);
        k3_state_free(s);
    }
    free(want);
    free(got);
    free(a);
    free(b);
    k3_model_free(m);
    omp_set_num_threads(2);
}

TEST(spec_pass_rollback_tiny_1_thread) { pass_and_rollback(t_fixture("peer/tiny-checkpoint"), 0, 1, true); }
TEST(spec_pass_rollback_tiny_2_threads) { pass_and_rollback(t_fixture("peer/tiny-checkpoint"), 0, 2, true); }
/* --kda-chunk makes prefill chunkwise; a recorded pass stays recurrent */
TEST(spec_pass_rollback_tiny_kda_chunk) { pass_and_rollback(t_fixture("peer/tiny-checkpoint"), 16, 2, true); }
/* (a few cut points: the shipped model is slower to decode) */
TEST(spec_pass_rollback_default_model) { pass_and_rollback(t_repo("models/default"), 0, 2, false); }

TEST(spec_pass_errors) {
    k3_model *m = open_model(t_fixture("peer/tiny-checkpoint"), 0);
    CHECK(m);
    k3_err err = {0};
    k3_state *s = plain(m, 4, NULL);
    CHECK(s);
    CHECK(k3_state_pass_begin(s, &err) == K3_EXIT_USAGE); /* nothing reserved */
    CHECK(k3_state_pass_reserve(s, 0, &err) == K3_EXIT_USAGE);
    CHECK(k3_state_pass_reserve(s, 3, &err) == 0);
    CHECK(k3_state_pass_end(s, 0, &err) == K3_EXIT_USAGE); /* no pass open */
    CHECK(k3_state_pass_begin(s, &err) == 0);
    CHECK(k3_state_pass_begin(s, &err) == K3_EXIT_USAGE);
    CHECK(k3_state_pass_reserve(s, 8, &err) == K3_EXIT_USAGE);
    CHECK(k3_forward(m, s, seq, 4, NULL, false, &err) == K3_EXIT_USAGE); /* past the record */
    CHECK(k3_state_pos(s) == 4);
    CHECK(k3_forward(m, s, seq, 2, NULL, false, &err) == 0);
    CHECK(k3_state_pass_end(s, 3, &err) == K3_EXIT_USAGE); /* only 2 fed */
    CHECK(k3_state_pass_end(s, -1, &err) == K3_EXIT_USAGE);
    CHECK(k3_state_pass_len(s) == 2);
    CHECK(k3_state_pass_end(s, 2, &err) == 0);
    CHECK(k3_state_pos(s) == 6);
    /* 9 KDA layers of P = 64, H = 4: 7P + H floats a layer per token, P of replay */
    const k3_config *c = k3_model_config(m);
    CHECK(k3_state_pass_bytes(c, 1) == 4 * (k3_state_kda_floats(c) + 9ull * (7 * 64 + 4) + 64));
    k3_state_free(s);
    k3_model_free(m);
}

/* What model.h and docs/speculation.md state for the release (69 KDA layers,
 * H 96, D 128): 464,633,856 bytes of KDA copy + 23,766,912 per token + 49,152
 * per token of replay output. */
TEST(spec_pass_bytes_release) {
    k3_config c;
    k3_err err = {0};
    CHECKF(k3_config_load(t_repo("tests/fixtures/k3-release/config.json"), &c, &err) == 0, "%s", err.msg);
    CHECK(k3_state_pass_bytes(&c, 1) == 464633856ull + 23766912ull + 49152ull);
    CHECK(k3_state_pass_bytes(&c, 8) == 464633856ull + 8 * (23766912ull + 49152ull));
}
