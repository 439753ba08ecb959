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
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "tengine.h"

#include "draft/draft.h"
#include "engine/engine.h"
#include "formats/safetensors.h"
#include "memory/stream.h"
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

/* ---- drafters ------------------------------------------------------------------------- */

TEST(spec_ngram_drafts_continue_the_latest_match) {
    k3_drafter *d = k3_drafter_ngram(100, 2, 4, 0.0);
    int32_t out[8];
    int got;
    k3_err err = {0};
    /* "1 2 3 4 5 | 9 2 3 4 7 | 8 2 3 4": the suffix 2 3 4 last continued with 7 8 2 3 4 */
    const int32_t h[] = {1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4};
    CHECK(k3_drafter_propose(d, h, 14, 4, out, &got, &err) == 0);
    CHECKF(got == 4 && out[0] == 7 && out[1] == 8 && out[2] == 2 && out[3] == 3, "got %d: %d %d", got, out[0], out[1]);
    /* no repeated suffix: nothing */
    const int32_t u[] = {1, 2, 3, 4, 5, 6};
    CHECK(k3_drafter_propose(d, u, 6, 4, out, &got, &err) == 0 && got == 0);
    /* a loop continues past the history's end */
    const int32_t l[] = {5, 6, 5, 6, 5};
    CHECK(k3_drafter_propose(d, l, 5, 5, out, &got, &err) == 0);
    CHECKF(got == 5 && out[0] == 6 && out[1] == 5 && out[2] == 6 && out[4] == 6, "loop: got %d", got);
    /* an extension of the last history is indexed on, the same as a fresh
     * drafter: "5 6" last ended at 4, followed by 5 9 5 */
    k3_drafter *f = k3_drafter_ngram(100, 2, 4, 0.0);
    const int32_t l2[] = {5, 6, 5, 6, 5, 9, 5, 6};
    int32_t o2[8];
    int g2;
    CHECK(k3_drafter_propose(d, l2, 8, 3, out, &got, &err) == 0 && k3_drafter_propose(f, l2, 8, 3, o2, &g2, &err) == 0);
    CHECK(got == g2 && got == 3 && !memcmp(out, o2, 3 * sizeof *out) && out[0] == 5 && out[1] == 9 && out[2] == 5);
    /* ids outside the target's vocabulary are never drafted */
    k3_drafter *v = k3_drafter_ngram(7, 1, 2, 0.0);
    const int32_t w[] = {3, 9, 3};
    CHECK(k3_drafter_propose(v, w, 3, 2, out, &got, &err) == 0 && got == 0);
    k3_drafter_free(d);
    k3_drafter_free(f);
    k3_drafter_free(v);
}

TEST(spec_controller_shrinks_backs_off_and_probes) {
    k3_spec_ctl c;
    k3_spec_ctl_init(&c, 4, false);
    CHECK(k3_spec_ctl_want(&c) == 4);
    k3_spec_ctl_update(&c, 4, 4);
    CHECK(k3_spec_ctl_want(&c) == 4);
    k3_spec_ctl_update(&c, 4, 1);
    CHECK(k3_spec_ctl_want(&c) == 2);
    k3_spec_ctl_update(&c, 2, 0);
    CHECK(k3_spec_ctl_want(&c) == 1);
    k3_spec_ctl_update(&c, 1, 0); /* k 0: one plain pass, then a probe */
    CHECK(k3_spec_ctl_want(&c) == 0);
    CHECK(k3_spec_ctl_want(&c) == 1);
    k3_spec_ctl_update(&c, 1, 0); /* back-off doubles */
    CHECK(k3_spec_ctl_want(&c) == 0 && k3_spec_ctl_want(&c) == 0 && k3_spec_ctl_want(&c) == 1);
    k3_spec_ctl_update(&c, 0, 0); /* nothing proposed: nothing learnt */
    CHECK(k3_spec_ctl_want(&c) == 1);
    k3_spec_ctl_update(&c, 1, 1);
    CHECK(k3_spec_ctl_want(&c) == 2);
    k3_spec_ctl_init(&c, 0, false);
    CHECK(k3_spec_ctl_want(&c) == 0);
    /* a drafter that stops its own drafts is asked for K every pass, whatever
     * the last ones did */
    k3_spec_ctl_init(&c, 4, true);
    k3_spec_ctl_update(&c, 4, 0);
    CHECK(k3_spec_ctl_want(&c) == 4);
    k3_spec_ctl_update(&c, 4, 1);
    CHECK(k3_spec_ctl_want(&c) == 4);
}

static k3_engine *open_engine(const char *dir, int64_t max_pos) {
    k3_engine *e = NULL;
    k3_err err = {0};
    if (t_engine_open(dir, (const char *const[]){NULL}, max_pos, 0, &e, &err)) fprintf(stderr, "  %s\n", err.msg);
    return e;
}

/* models/default drafting for itself: its drafts are its own greedy
 * continuation, and after a history that rejects some of them (taken back by
 * a cut-back pass) they equal a fresh drafter's. */
TEST(spec_draft_model_follows_the_history) {
    k3_engine *e = open_engine(t_repo("models/default"), 128);
    CHECK(e);
    k3_err err = {0};
    k3_drafter *d = NULL, *f = NULL;
    CHECKF(k3_drafter_for(e, t_repo("models/default"), 0.0f, 4, 128, &d, &err) == 0, "%s", err.msg);
    CHECK(k3_drafter_for(e, t_repo("models/default"), 0.0f, 4, 128, &f, &err) == 0);
    int32_t h[40];
    memcpy(h, seq, sizeof seq);
    int32_t a[4], b[4];
    int ga, gb;
    CHECK(k3_drafter_propose(d, h, 10, 4, a, &ga, &err) == 0 && ga == 4);
    /* greedy: feeding the drafts to a plain state gives them back */
    k3_state *s;
    float *lg = xmalloc_array((size_t)k3_engine_vocab(e), sizeof *lg);
    CHECK(k3_state_new(k3_engine_model(e), 64, &s, &err) == 0);
    CHECK(k3_forward(k3_engine_model(e), s, h, 10, lg, false, &err) == 0);
    for (int i = 0; i < 4; i++) {
        CHECKF(k3_argmax(lg, k3_engine_vocab(e)) == a[i], "draft %d is not the greedy id", i);
        CHECK(k3_forward(k3_engine_model(e), s, &a[i], 1, lg, false, &err) == 0);
    }
    /* the target kept the first draft and then sampled something else */
    h[10] = a[0];
    h[11] = (a[1] + 1) % k3_engine_vocab(e);
    CHECK(k3_drafter_propose(d, h, 12, 3, a, &ga, &err) == 0);
    CHECK(k3_drafter_propose(f, h, 12, 3, b, &gb, &err) == 0);
    CHECK(ga == 3 && gb == 3 && !memcmp(a, b, sizeof(int32_t) * 3));
    /* and none of them: a history that shares nothing past the old one */
    h[9] = (h[9] + 1) % k3_engine_vocab(e);
    CHECK(k3_drafter_propose(d, h, 10, 2, a, &ga, &err) == 0);
    CHECK(k3_drafter_propose(f, h, 10, 2, b, &gb, &err) == 0);
    CHECK(ga == 2 && gb == 2 && !memcmp(a, b, sizeof(int32_t) * 2));
    free(lg);
    k3_state_free(s);
    k3_drafter_free(d);
    k3_drafter_free(f);
    k3_engine_free(e);
}

/* The gate's counts: an untried tenth of probability starts at 1, then
 * (kept + 1) / (verified + 1). */
TEST(spec_draft_gate_learns_per_tenth) {
    k3_draft_gate g = {0};
#define B k3_draft_gate_bucket
    CHECK(B(0.0) == 0 && B(0.31) == 3 && B(0.39) == 3 && B(0.9) == 9 && B(1.0) == 9 && B(-1) == 0);
    CHECK(k3_draft_gate_chance(&g, B(0.35)) == 1.0 && k3_draft_gate_chance(&g, B(0.0)) == 1.0);
    for (int i = 0; i < 3; i++) k3_draft_gate_record(&g, B(0.35), false);
    CHECK(k3_draft_gate_chance(&g, B(0.31)) == 0.25 && k3_draft_gate_chance(&g, B(0.39)) == 0.25);
    CHECK(k3_draft_gate_chance(&g, B(0.45)) == 1.0 && k3_draft_gate_chance(&g, B(0.29)) == 1.0);
    for (int i = 0; i < 9; i++) k3_draft_gate_record(&g, B(0.97), true);
    k3_draft_gate_record(&g, B(1.0), false); /* 1 falls in the top tenth */
    CHECK(k3_draft_gate_chance(&g, B(0.9)) == 10.0 / 11.0);
#undef B
}

/* An n-gram drafter's gate learns per length of match, from the histories
 * that follow its drafts; every length starts at even odds (as if one draft
 * had been rejected), and at p_min 0.5 a draft goes while its chance
 * (kept + 1) / (verified + 1) is at least 1/2. */
static int ngram_ask(k3_drafter *d, int32_t *h, int *n, const int32_t *add, int m, int k, int32_t *out) {
    for (int i = 0; i < m; i++) h[(*n)++] = add[i];
    int got = -1;
    k3_err err = {0};
    if (k3_drafter_propose(d, h, (size_t)*n, k, out, &got, &err)) return -1;
    return got;
}

TEST(spec_ngram_gate_learns_per_match_length) {
    k3_drafter *d = k3_drafter_ngram(100, 2, 4, 0.5);
    int32_t h[64], out[8];
    int n = 0, got;
    /* "1 2 3 4" matches, 4 ids: even odds, one draft (two: 1/4) */
    got = ngram_ask(d, h, &n, (const int32_t[]){1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4}, 12, 2, out);
    CHECKF(got == 1 && out[0] == 5, "got %d", got);
    /* kept (the target went on 5, 9): a 4-id match's chance is 2/3 */
    CHECK(ngram_ask(d, h, &n, (const int32_t[]){5, 9}, 2, 2, out) == 0); /* "5 9": no match */
    got = ngram_ask(d, h, &n, (const int32_t[]){1, 2, 3, 4}, 4, 2, out);
    CHECKF(got == 1 && out[0] == 5, "2/3, then 4/9: got %d", got);
    /* rejected (7): 2/4, still a draft */
    CHECK(ngram_ask(d, h, &n, (const int32_t[]){7}, 1, 2, out) == 0);
    got = ngram_ask(d, h, &n, (const int32_t[]){1, 2, 3, 4}, 4, 2, out);
    CHECKF(got == 1 && out[0] == 7, "2/4: got %d", got);
    /* rejected (8): 2/5. Then "6 7" matches 2 ids: that length is untried */
    CHECK(ngram_ask(d, h, &n, (const int32_t[]){8}, 1, 1, out) == 0); /* "4 8": no match */
    got = ngram_ask(d, h, &n, (const int32_t[]){6, 7}, 2, 1, out);
    CHECKF(got == 1 && out[0] == 8, "a 2-id match: got %d", got);
    /* so a 4-id match drafts nothing now */
    got = ngram_ask(d, h, &n, (const int32_t[]){1, 2, 3, 4}, 4, 2, out);
    CHECKF(got == 0, "2/5: got %d", got);
    /* 64 asks that matched and drafted nothing: the next drafts one anyway */
    for (int i = 1; i < 64; i++) CHECK(ngram_ask(d, h, &n, NULL, 0, 2, out) == 0);
    got = ngram_ask(d, h, &n, NULL, 0, 2, out);
    CHECKF(got == 1 && out[0] == 8, "the probe: got %d", got);
    CHECK(ngram_ask(d, h, &n, NULL, 0, 2, out) == 0);
    /* without the gate, it does */
    k3_drafter *f = k3_drafter_ngram(100, 2, 4, 0.0);
    int nf = 0;
    CHECK(ngram_ask(f, h + 32, &nf, h, n, 2, out) == 2);
    k3_drafter_free(d);
    k3_drafter_free(f);
}

/* --draft-p-min: the drafter learns from the histories that follow its
 * drafts. The same history asked again and again, its first draft rejected
 * each time: after r rejections that draft's chance is 1 / (r + 1), so at
 * p_min 0.2 the fifth rejection stops it; 64 asks later one draft goes
 * anyway (a probe: the second's chance would multiply the first's). */
TEST(spec_draft_model_gate_stops_rejected_drafts) {
    k3_engine *e = open_engine(t_repo("models/default"), 128);
    CHECK(e);
    const int V = k3_engine_vocab(e);
    k3_err err = {0};
    k3_drafter *d = NULL;
    CHECKF(k3_drafter_for(e, t_fixture("trained-5m"), 0.2, 4, 128, &d, &err) == 0, "%s", err.msg);
    int32_t h[16], out[4];
    memcpy(h, seq, 10 * sizeof *h);
    int got, first = -1;
    for (int r = 0; r <= 5; r++) {
        CHECK(k3_drafter_propose(d, h, 10, 4, out, &got, &err) == 0);
        CHECKF(r < 5 ? got >= 1 : got == 0, "after %d rejections: %d drafts", r, got);
        if (r == 5) break;
        CHECK(first < 0 || out[0] == first); /* the same history, the same draft */
        first = out[0];
        h[10] = (first + 1) % V; /* the target sampled something else */
        CHECK(k3_drafter_propose(d, h, 11, 4, out, &got, &err) == 0);
    }
    for (int i = 0; i < 63; i++) {
        CHECK(k3_drafter_propose(d, h, 10, 4, out, &got, &err) == 0);
        CHECKF(got == 0, "ask %d after the stop: %d drafts", i + 2, got);
    }
    CHECK(k3_drafter_propose(d, h, 10, 4, out, &got, &err) == 0);
    CHECKF(got == 1 && out[0] == first, "the probe: %d drafts", got);
    k3_drafter_free(d);
    /* out of [0, 1]: refused */
    CHECK(k3_drafter_for(e, t_fixture("trained-5m"), 1.5, 4, 128, &d, &err) == K3_EXIT_USAGE && !d);
    k3_engine_free(e);
}

/* A catch-up bound: a drafter behind a 100-id prompt feeds 16 a ask,
 * drafting nothing until it holds the prompt, then drafts what a drafter
 * without the bound drafts; a sibling takes the bound. */
TEST(spec_draft_model_catches_up_a_chunk_an_ask) {
    k3_engine *e = open_engine(t_repo("models/default"), 256);
    CHECK(e);
    k3_err err = {0};
    k3_drafter *d = NULL, *f = NULL, *sib = NULL;
    CHECKF(k3_drafter_for(e, t_repo("models/default"), 0.0, 4, 256, &d, &err) == 0, "%s", err.msg);
    CHECK(k3_drafter_for(e, t_repo("models/default"), 0.0, 4, 256, &f, &err) == 0);
    k3_drafter_set_catchup(d, 16);
    CHECK(k3_drafter_sibling(d, 256, &sib, &err) == 0);
    int32_t h[100], a[4], b[4];
    for (int i = 0; i < 100; i++) h[i] = seq[i % 24];
    int got, gb, asks = 0;
    k3_drafter *both[2] = {d, sib};
    for (int t = 0; t < 2; t++) {
        k3_drafter *x = both[t];
        asks = 0;
        do {
            CHECK(k3_drafter_propose(x, h, 100, 4, a, &got, &err) == 0);
            asks++;
        } while (got == 0 && asks < 20);
        CHECKF(asks == 7, "%d asks to catch up with 100 ids, 16 an ask", asks); /* 6 x 16 = 96, then the rest */
        CHECK(k3_drafter_propose(f, h, 100, 4, b, &gb, &err) == 0);
        CHECK(got == 4 && gb == 4 && !memcmp(a, b, sizeof a));
    }
    k3_drafter_free(sib);
    k3_drafter_free(d);
    k3_drafter_free(f);
    k3_engine_free(e);
}

TEST(spec_draft_model_with_another_tokenizer_refused) {
    k3_engine *e = open_engine(t_repo("models/default"), 64);
    CHECK(e);
    k3_err err = {0};
    k3_drafter *d = NULL;
    /* the session tests' model carries the Kimi tokenizer, not the default's */
    int rc = k3_drafter_for(e, t_fixture("tokenizer/kimi"), K3_DRAFT_P_MIN, 4, 64, &d, &err);
    CHECKF(rc == K3_EXIT_USAGE && !d && strstr(err.msg, "tokenizer"), "rc %d: %s", rc, err.msg);
    rc = k3_drafter_for(e, t_fixture("peer/tiny-checkpoint"), K3_DRAFT_P_MIN, 4, 64, &d, &err); /* none at all */
    CHECKF(rc == K3_EXIT_USAGE && !d, "rc %d: %s", rc, err.msg);
    k3_engine_free(e);
}

/* ---- the verifying feed: speculative ids == plain ids ------------------------------------ */

/* The generation loop's shape: sample, then feed (plainly, or through the
 * verifying feed). ids[ngen]; *state (malloc'd): the session's state bytes
 * after the loop; stats of the speculative feed into *st. */
static int32_t *generate(k3_engine *e, const char *draft_dir, double p_min, int kmax, float temp,
                         const int32_t *prompt, int np, int ngen, void **state, size_t *sbytes, k3_spec_stats *st) {
    k3_err err = {0};
    k3_state *ks = NULL;
    if (k3_engine_state_new(e, 256, 0, &ks, &err)) return NULL;
    k3_session *s = k3_session_open(e, ks, NULL);
    k3_drafter *d = NULL;
    k3_spec *sp = NULL;
    if (kmax > 0) {
        if (k3_drafter_for(e, draft_dir, p_min, kmax, 256, &d, &err)) {
            fprintf(stderr, "  %s\n", err.msg);
            return NULL;
        }
        sp = k3_spec_new(d, kmax, k3_engine_vocab(e));
    }
    k3_sampler smp;
    k3_sampler_init(&smp, k3_engine_vocab(e), temp, 0, 1.0f, 0, 7);
    float *lg = xmalloc_array((size_t)k3_engine_vocab(e), sizeof *lg);
    int32_t *ids = xmalloc_array((size_t)ngen, sizeof *ids);
    int rc = k3_session_prefill(s, prompt, (size_t)np, lg, NULL, &err);
    for (int g = 0; !rc && g < ngen; g++) {
        ids[g] = k3_sample(&smp, lg);
        if (g + 1 == ngen) break;
        rc = sp ? k3_spec_feed(sp, s, ids[g], lg, ngen - g - 2, &err) : k3_session_feed(s, &ids[g], 1, lg, &err);
    }
    if (!rc && sp) rc = k3_spec_finish(sp, s, &err);
    if (rc) {
        fprintf(stderr, "  %s\n", err.msg);
        free(ids);
        ids = NULL;
    } else {
        *sbytes = (size_t)k3_state_snapshot_bytes(k3_engine_config(e), k3_state_pos(ks));
        *state = xmalloc(*sbytes);
        k3_state_save(ks, *state);
    }
    if (sp) *st = k3_spec_get_stats(sp);
    k3_spec_free(sp);
    k3_drafter_free(d);
    free(lg);
    k3_sampler_free(&smp);
    k3_session_free(s);
    k3_engine_state_free(e, ks);
    return ids;
}

static void spec_equals_plain(const char *draft, double p_min, int threads) {
    omp_set_num_threads(threads);
    k3_engine *e = open_engine(t_repo("models/default"), 256);
    CHECK(e);
    int32_t prompt[64];
    size_t np = 0;
    k3_err err = {0};
    int32_t *pi = NULL;
    const char *text = "Once upon a time, there was a little girl named Lily. She loved to play. Lily";
    CHECKF(tok_encode(k3_engine_tokenizer(e), text, strlen(text), false, &pi, &np, &err) == 0, "%s", err.msg);
    CHECK(np > 0 && np < 64);
    memcpy(prompt, pi, np * sizeof *pi);
    free(pi);
    static const float temps[] = {0.0f, 0.8f};
    for (int t = 0; t < 2; t++) {
        void *sa = NULL, *sb = NULL;
        size_t na = 0, nb = 0;
        k3_spec_stats st = {0}, none;
        int32_t *a = generate(e, NULL, 0.0f, 0, temps[t], prompt, (int)np, 60, &sa, &na, &none);
        int32_t *b = generate(e, draft, p_min, 4, temps[t], prompt, (int)np, 60, &sb, &nb, &st);
        CHECK(a && b);
        CHECKF(!memcmp(a, b, 60 * sizeof *a), "temperature %g: speculative ids differ from plain", (double)temps[t]);
        CHECKF(na == nb && !memcmp(sa, sb, na), "temperature %g: the state after the loop differs", (double)temps[t]);
        CHECKF(st.proposed > 0 && st.passes < 59, "temperature %g: %llu drafts, %llu passes for 59 fed ids",
               (double)temps[t], (unsigned long long)st.proposed, (unsigned long long)st.passes);
        CHECK(st.accepted <= st.proposed && st.fed == st.passes + st.proposed);
        free(a);
        free(b);
        free(sa);
        free(sb);
    }
    k3_engine_free(e);
    omp_set_num_threads(2);
}

TEST(spec_ngram_ids_equal_plain_1_thread) { spec_equals_plain(NULL, 0.0f, 1); }
TEST(spec_ngram_ids_equal_plain_2_threads) { spec_equals_plain(NULL, 0.0f, 2); }
TEST(spec_draft_model_ids_equal_plain) { spec_equals_plain(t_repo("models/default"), K3_DRAFT_P_MIN, 2); }
/* another model drafting (the 5M fixture, the same tokenizer: some drafts
 * rejected), its drafts stopped by the gate (the acceptance controller with
 * it: tests/cli/test_speculate.sh, --draft-p-min 0) */
TEST(spec_small_draft_model_ids_equal_plain) { spec_equals_plain(t_fixture("trained-5m"), K3_DRAFT_P_MIN, 1); }

/* The memory plan holds a verifying pass in one chunk (each streamed layer
 * and each distinct expert read once per pass), counts its rollback record,
 * and refuses up front what cannot hold it. */
TEST(spec_memory_plan_holds_the_pass) {
    const char *dir = t_repo("tests/fixtures/gen/k3_like");
    k3_config cfg;
    st_index *ix;
    k3_err err = {0};
    CHECK(k3_config_load(dir, &cfg, &err) == 0);
    CHECK(st_open(dir, &ix, &err) == 0);
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.mem_limit = 1ull << 40;
    static k3_mem_plan p, q;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_OK);
    CHECK(p.pass_bytes == 0);
    o.cache_gb = (double)p.expert_buf / 1e9 * 3 * cfg.experts_per_token;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_OK);
    CHECKF(p.chunk == 2, "chunk %d", p.chunk); /* without speculation the chunk shrinks to what fits */
    o.pass_tokens = 3;
    CHECKF(k3_plan_make(&cfg, ix, NULL, &o, 16, &q, &err) == K3_OK, "%s", err.msg);
    CHECKF(q.chunk == 3, "chunk %d", q.chunk);
    CHECK(q.pass_bytes == k3_state_pass_bytes(&cfg, 3) && q.pass_bytes > 0);
    CHECK(q.total > p.total);
    o.pass_tokens = 4; /* 4 ids' experts do not fit 3 ids' buffers */
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &q, &err) == K3_EXIT_BUDGET);
    CHECKF(strstr(err.msg, "--speculate 3") != NULL, "%s", err.msg);
    /* the record counts against the memory limit */
    o.cache_gb = -1;
    o.pass_tokens = 0;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_OK);
    o.mem_limit = p.total + K3_PLAN_OVERHEAD;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &p, &err) == K3_OK);
    o.pass_tokens = 9;
    CHECK(k3_plan_make(&cfg, ix, NULL, &o, 16, &q, &err) == K3_EXIT_BUDGET);
    CHECKF(strstr(err.msg, "speculation record") != NULL, "%s", err.msg);
    st_close(ix);
}

/* Several sequences in one pass with several ids each (k3_forward_batch_rows):
 * three states at different positions feed 1..5 ids per step, some inside a
 * recorded pass that is then cut back, others plainly; every row has the
 * bits of the same ids fed alone (k3_forward, every row), and at the end each
 * state's bytes equal plain token-by-token decoding of the ids it kept. With
 * --kda-chunk the plain multi-id rows run chunkwise, as alone (whose last
 * bits differ from token by token: the state is compared with alone's). */
static void batch_rows_equal_alone(int kda_chunk) {
    k3_model *m = open_model(t_fixture("peer/tiny-checkpoint"), kda_chunk);
    CHECK(m);
    const int V = k3_model_config(m)->vocab_size;
    enum { NS = 3, STEPS = 4 };
    static const int pre[NS] = {5, 1, 9};
    static const int counts[STEPS][NS] = {{3, 1, 4}, {1, 5, 2}, {2, 2, 1}, {4, 1, 3}};
    static const int pass_of[STEPS][NS] = {{1, 0, 1}, {0, 1, 1}, {1, 1, 0}, {0, 0, 1}}; /* a recorded pass */
    static const int keep[STEPS][NS] = {{1, 0, 4}, {0, 2, 0}, {2, 1, 0}, {0, 0, 2}};  /* ids it keeps */
    k3_state *bs[NS], *as[NS];
    int32_t hist[NS][64]; /* the ids each state holds */
    int len[NS];
    k3_err err = {0};
    for (int q = 0; q < NS; q++) {
        bs[q] = plain(m, pre[q], NULL);
        as[q] = plain(m, pre[q], NULL);
        CHECK(bs[q] && as[q]);
        CHECK(k3_state_pass_reserve(bs[q], 8, &err) == 0 && k3_state_pass_reserve(as[q], 8, &err) == 0);
        memcpy(hist[q], seq, (size_t)pre[q] * sizeof *seq);
        len[q] = pre[q];
    }
    float *rows = xmalloc_array((size_t)16 * V, sizeof(float)), *one = xmalloc_array((size_t)8 * V, sizeof(float));
    for (int t = 0; t < STEPS; t++) {
        int32_t ids[16];
        int at = 0;
        for (int q = 0; q < NS; q++) {
            for (int i = 0; i < counts[t][q]; i++) ids[at + i] = seq[(len[q] + 3 * q + 5 * t + i) % 24];
            if (pass_of[t][q]) CHECK(k3_state_pass_begin(bs[q], &err) == 0 && k3_state_pass_begin(as[q], &err) == 0);
            at += counts[t][q];
        }
        CHECKF(k3_forward_batch_rows(m, bs, NS, counts[t], ids, rows, &err) == 0, "%s", err.msg);
        at = 0;
        for (int q = 0; q < NS; q++) {
            int c = counts[t][q];
            CHECK(k3_forward(m, as[q], ids + at, c, one, true, &err) == 0);
            CHECKF(!memcmp(one, rows + (size_t)at * V, (size_t)c * V * sizeof(float)),
                   "kda_chunk %d step %d sequence %d: batched rows differ from alone", kda_chunk, t, q);
            CHECK(k3_state_pos(as[q]) == k3_state_pos(bs[q]));
            int kept = c;
            if (pass_of[t][q]) {
                kept = keep[t][q];
                CHECK(k3_state_pass_end(bs[q], kept, &err) == 0 && k3_state_pass_end(as[q], kept, &err) == 0);
            }
            memcpy(hist[q] + len[q], ids + at, (size_t)kept * sizeof *ids);
            len[q] += kept;
            at += c;
        }
    }
    for (int q = 0; q < NS; q++) {
        k3_state *p = NULL;
        CHECK(k3_state_new(m, 64, &p, &err) == 0);
        for (int i = 0; i < len[q]; i++) CHECK(k3_forward(m, p, &hist[q][i], 1, NULL, false, &err) == 0);
        size_t nx, ny;
        void *x = save(m, bs[q], &nx), *y = save(m, kda_chunk ? as[q] : p, &ny);
        CHECKF(nx == ny && !memcmp(x, y, nx), "kda_chunk %d sequence %d: state differs from plain decoding", kda_chunk,
               q);
        free(x);
        free(y);
        k3_state_free(p);
        k3_state_free(bs[q]);
        k3_state_free(as[q]);
    }
    /* refused before anything is fed: a count of 0, a pass past its record */
    k3_state *s1 = plain(m, 2, NULL), *s2 = plain(m, 2, NULL);
    CHECK(s1 && s2);
    k3_state *two[2] = {s1, s2};
    int bad[2] = {1, 0}, big[2] = {1, 3};
    CHECK(k3_forward_batch_rows(m, two, 2, bad, seq, rows, &err) == K3_EXIT_USAGE);
    CHECK(k3_state_pass_reserve(s2, 2, &err) == 0 && k3_state_pass_begin(s2, &err) == 0);
    CHECK(k3_forward_batch_rows(m, two, 2, big, seq, rows, &err) == K3_EXIT_USAGE);
    CHECK(k3_state_pos(s1) == 2 && k3_state_pos(s2) == 2);
    k3_state_free(s1);
    k3_state_free(s2);
    free(rows);
    free(one);
    k3_model_free(m);
}

TEST(spec_batch_rows_equal_alone) { batch_rows_equal_alone(0); }
TEST(spec_batch_rows_equal_alone_kda_chunk) { batch_rows_equal_alone(16); }

/* Speculating sessions decoded together (k3_spec_begin, one
 * k3_session_feed_batch_rows for every session's pass, k3_spec_fed), on
 * streamed weights: each session's ids and final state equal plain decoding
 * of its prompt alone (one id per pass, no drafts), greedy and sampled, and
 * some drafts were accepted (rows taken from a batched pass). */
TEST(spec_batched_sessions_equal_plain) {
    k3_err err = {0};
    k3_engine *e = NULL;
    CHECKF(t_engine_open(t_repo("models/default"), (const char *const[]){"--cache-gb", "0.001", "--chunk", "16", NULL},
                         256, 5, &e, &err) == 0,
           "%s", err.msg);
    const int V = k3_engine_vocab(e);
    enum { NS = 3, NGEN = 28, K = 4 };
    static const char *texts[NS] = {"Once upon a time, there was a little girl named Lily. She loved to play. Lily",
                                    "Tom had a red ball. Tom had a red ball. Tom",
                                    "The cat sat on the mat. The dog sat on the"};
    static const float temps[NS] = {0.0f, 0.8f, 0.0f};
    k3_state *ks[NS];
    k3_session *s[NS];
    k3_drafter *d[NS];
    k3_spec *sp[NS];
    k3_sampler smp[NS];
    int32_t *prompt[NS], got[NS][NGEN];
    size_t np[NS];
    float *lg[NS];
    for (int q = 0; q < NS; q++) {
        CHECKF(tok_encode(k3_engine_tokenizer(e), texts[q], strlen(texts[q]), false, &prompt[q], &np[q], &err) == 0,
               "%s", err.msg);
        CHECK(k3_engine_state_new(e, 256, 0, &ks[q], &err) == 0);
        s[q] = k3_session_open(e, ks[q], NULL);
        CHECK(k3_drafter_for(e, NULL, 0.0f, K, 256, &d[q], &err) == 0);
        sp[q] = k3_spec_new(d[q], K, V);
        k3_sampler_init(&smp[q], V, temps[q], 0, 1.0f, 0, 7);
        lg[q] = xmalloc_array((size_t)V, sizeof(float));
        CHECK(k3_session_prefill(s[q], prompt[q], np[q], lg[q], NULL, &err) == 0);
    }
    uint64_t passes = 0, accepted = 0;
    for (int g = 0; g < NGEN; g++) {
        k3_session *bs[NS];
        int counts[NS], nb = 0, who[NS];
        int32_t ids[NS * (K + 1)];
        float *rows[NS];
        size_t at = 0;
        for (int q = 0; q < NS; q++) {
            got[q][g] = k3_sample(&smp[q], lg[q]);
            if (g + 1 == NGEN) continue;
            k3_spec_pass p;
            CHECKF(k3_spec_begin(sp[q], s[q], got[q][g], lg[q], NGEN - g - 2, &p, &err) == 0, "%s", err.msg);
            if (p.n == 0) continue; /* an accepted draft: its row is there */
            memcpy(ids + at, p.ids, (size_t)p.n * sizeof *ids);
            at += (size_t)p.n;
            bs[nb] = s[q];
            counts[nb] = p.n;
            rows[nb] = p.rows;
            who[nb++] = q;
        }
        if (nb == 0) continue;
        CHECKF(k3_session_feed_batch_rows(bs, nb, counts, ids, rows, &err) == 0, "%s", err.msg);
        passes++;
        for (int i = 0; i < nb; i++) k3_spec_fed(sp[who[i]]);
    }
    for (int q = 0; q < NS; q++) {
        CHECK(k3_spec_finish(sp[q], s[q], &err) == 0);
        k3_spec_stats st = k3_spec_get_stats(sp[q]);
        void *sa = NULL;
        size_t na = 0;
        k3_spec_stats none;
        int32_t *want = generate(e, NULL, 0.0f, 0, temps[q], prompt[q], (int)np[q], NGEN, &sa, &na, &none);
        CHECK(want);
        CHECKF(!memcmp(want, got[q], sizeof got[q]), "session %d: batched speculative ids differ from plain", q);
        size_t nb = (size_t)k3_state_snapshot_bytes(k3_engine_config(e), k3_state_pos(ks[q]));
        void *sb = xmalloc(nb);
        k3_state_save(ks[q], sb);
        CHECKF(na == nb && !memcmp(sa, sb, na), "session %d: the state after the loop differs from plain", q);
        accepted += st.accepted;
        free(want);
        free(sa);
        free(sb);
        free(prompt[q]);
        free(lg[q]);
        k3_sampler_free(&smp[q]);
        k3_spec_free(sp[q]);
        k3_drafter_free(d[q]);
        k3_session_free(s[q]);
        k3_engine_state_free(e, ks[q]);
    }
    CHECKF(accepted > 0 && passes > 0, "%llu batched passes, no draft accepted", (unsigned long long)passes);
    k3_engine_free(e);
}

/* Draft-model drafting for several speculating sessions at once
 * (k3_spec_ask, one k3_drafter_propose_batch for every slot's drafter, each
 * a sibling on one draft model, k3_spec_answer): every ask's drafts equal,
 * id for id, what a drafter of its own (another engine of the draft model,
 * k3_drafter_propose alone) proposes for the same history and count; the
 * draft model's passes were shared (more drafters fed than passes); and the
 * ids equal plain decoding's. Target and draft: models/default; greedy and
 * sampled sessions, so their acceptance (and how many drafters ask at each
 * step) differs. */
TEST(spec_batched_drafting_equals_alone) {
    k3_engine *e = open_engine(t_repo("models/default"), 256);
    CHECK(e);
    k3_err err = {0};
    const int V = k3_engine_vocab(e);
    enum { NS = 4, NGEN = 40, K = 4 };
    static const char *texts[NS] = {"Once upon a time, there was a little girl named Lily. She loved to play. Lily",
                                    "Tom had a red ball. Tom had a red ball. Tom",
                                    "The cat sat on the mat. The dog sat on the",
                                    "One day, a big bird flew over the"};
    static const float temps[NS] = {0.0f, 0.8f, 0.0f, 1.0f};
    k3_state *ks[NS];
    k3_session *s[NS];
    k3_drafter *d[NS], *alone[NS];
    k3_spec *sp[NS];
    k3_sampler smp[NS];
    int32_t *prompt[NS], got[NS][NGEN];
    size_t np[NS];
    float *lg[NS];
    CHECKF(k3_drafter_for(e, t_repo("models/default"), K3_DRAFT_P_MIN, K, 256, &d[0], &err) == 0, "%s", err.msg);
    for (int q = 0; q < NS; q++) {
        CHECKF(tok_encode(k3_engine_tokenizer(e), texts[q], strlen(texts[q]), false, &prompt[q], &np[q], &err) == 0,
               "%s", err.msg);
        CHECK(k3_engine_state_new(e, 256, 0, &ks[q], &err) == 0);
        s[q] = k3_session_open(e, ks[q], NULL);
        if (q > 0) CHECKF(k3_drafter_sibling(d[0], 256, &d[q], &err) == 0, "%s", err.msg);
        CHECKF(k3_drafter_for(e, t_repo("models/default"), K3_DRAFT_P_MIN, K, 256, &alone[q], &err) == 0, "%s", err.msg);
        sp[q] = k3_spec_new(d[q], K, V);
        k3_sampler_init(&smp[q], V, temps[q], 0, 1.0f, 0, 7);
        lg[q] = xmalloc_array((size_t)V, sizeof(float));
        CHECK(k3_session_prefill(s[q], prompt[q], np[q], lg[q], NULL, &err) == 0);
    }
    int shared = 0; /* asks made together with another */
    for (int g = 0; g < NGEN; g++) {
        k3_session *bs[NS];
        int counts[NS], nb = 0, who[NS], na = 0;
        int32_t ids[NS * (K + 1)];
        float *rows[NS];
        k3_spec_pass p[NS];
        k3_draft_ask ask[NS], *asks[NS];
        bool open[NS] = {false};
        for (int q = 0; q < NS; q++) {
            got[q][g] = k3_sample(&smp[q], lg[q]);
            if (g + 1 == NGEN) continue;
            CHECKF(k3_spec_ask(sp[q], s[q], got[q][g], lg[q], NGEN - g - 2, &p[q], &ask[q], &err) == 0, "%s", err.msg);
            if (p[q].n == 0) continue; /* an accepted draft: its row is there */
            open[q] = true;
            if (ask[q].k > 0) asks[na++] = &ask[q];
        }
        CHECKF(k3_drafter_propose_batch(asks, na, &err) == 0, "%s", err.msg);
        if (na > 1) shared += na;
        for (int i = 0; i < na; i++) {
            int32_t want[K];
            int gw = -1;
            CHECK(k3_drafter_propose(alone[asks[i] - ask], asks[i]->hist, asks[i]->n, asks[i]->k, want, &gw, &err) == 0);
            CHECKF(gw == asks[i]->got && !memcmp(want, asks[i]->out, (size_t)gw * sizeof *want),
                   "step %d, session %d (of %d asking): %d drafts together, %d alone, or other ids", g,
                   (int)(asks[i] - ask), na, asks[i]->got, gw);
        }
        size_t at = 0;
        for (int q = 0; q < NS; q++) {
            if (!open[q]) continue;
            CHECK(k3_spec_answer(sp[q], s[q], ask[q].got, &p[q], &err) == 0);
            memcpy(ids + at, p[q].ids, (size_t)p[q].n * sizeof *ids);
            at += (size_t)p[q].n;
            bs[nb] = s[q];
            counts[nb] = p[q].n;
            rows[nb] = p[q].rows;
            who[nb++] = q;
        }
        if (nb == 0) continue;
        CHECKF(k3_session_feed_batch_rows(bs, nb, counts, ids, rows, &err) == 0, "%s", err.msg);
        for (int i = 0; i < nb; i++) k3_spec_fed(sp[who[i]]);
    }
    k3_draft_stats ds = k3_drafter_stats(d[1]); /* every sibling's, the root's alike */
    CHECKF(shared > 0 && ds.seqs > ds.passes, "%d asks shared a call; the draft model fed %llu drafters in %llu passes",
           shared, (unsigned long long)ds.seqs, (unsigned long long)ds.passes);
    for (int q = 0; q < NS; q++) {
        CHECK(k3_spec_finish(sp[q], s[q], &err) == 0);
        CHECK(k3_spec_get_stats(sp[q]).accepted > 0);
        void *sa = NULL;
        size_t na = 0;
        k3_spec_stats none;
        int32_t *want = generate(e, NULL, 0.0f, 0, temps[q], prompt[q], (int)np[q], NGEN, &sa, &na, &none);
        CHECK(want);
        CHECKF(!memcmp(want, got[q], sizeof got[q]), "session %d: ids with batched drafting differ from plain", q);
        free(want);
        free(sa);
        free(prompt[q]);
        free(lg[q]);
        k3_sampler_free(&smp[q]);
        k3_spec_free(sp[q]);
        k3_drafter_free(alone[q]);
        k3_session_free(s[q]);
        k3_engine_state_free(e, ks[q]);
    }
    for (int q = NS - 1; q >= 0; q--) k3_drafter_free(d[q]); /* the root last: the siblings share its model */
    k3_engine_free(e);
}
