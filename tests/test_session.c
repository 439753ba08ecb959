/* test_session.c: sessions and the state cache (src/session/session.h).
 *
 * The reuse contract, bit for bit: whatever a session resumes from (its own
 * state, a turn-end snapshot, a grid snapshot after a partial match, a saved
 * file), the logits it returns equal those of a cold prefill of the whole
 * sequence on a fresh state, computed by k3_forward alone, at 1 and 2
 * threads. The model is a small random K3-architecture model (KDA and MLA
 * layers, LatentMoE with MXFP4 experts) with the full 163,840-entry Kimi
 * vocabulary, built here by the trainer's initialiser and exported in the
 * released layout with the Kimi tokenizer (tests/fixtures/tokenizer/kimi). */
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "harness.h"
#include "tengine.h"
#include "model/model.h"
#include "engine/engine.h"
#include "formats/identity.h"
#include "session/session.h"
#include "train/export.h"
#include "train/train.h"

static const char *const CFG =
    "{\"model_type\":\"kimi_k3\",\"tie_word_embeddings\":false,\"text_config\":{"
    "\"hidden_size\":64,\"num_hidden_layers\":6,\"vocab_size\":163840,\"rms_norm_eps\":1e-5,"
    "\"hidden_act\":\"situ\",\"activation_situ_beta\":4.0,\"activation_situ_linear_beta\":25.0,"
    "\"attn_res_block_size\":2,"
    "\"linear_attn_config\":{\"full_attn_layers\":[3,6],\"kda_layers\":[1,2,4,5],\"gate_lower_bound\":-5.0,"
    "\"head_dim\":16,\"num_heads\":2,\"short_conv_kernel_size\":4,\"use_full_rank_gate\":true},"
    "\"mla_use_nope\":true,\"mla_use_output_gate\":true,\"num_attention_heads\":2,\"num_key_value_heads\":2,"
    "\"q_lora_rank\":32,\"kv_lora_rank\":32,\"qk_nope_head_dim\":16,\"qk_rope_head_dim\":8,\"v_head_dim\":16,"
    "\"num_experts\":4,\"num_experts_per_token\":2,\"num_shared_experts\":1,\"routed_expert_hidden_size\":32,"
    "\"moe_intermediate_size\":32,\"intermediate_size\":64,\"moe_router_activation_func\":\"sigmoid\","
    "\"moe_renormalize\":true,\"routed_scaling_factor\":1.0,\"latent_moe_use_norm\":true,"
    "\"first_k_dense_replace\":1,\"moe_layer_freq\":1,\"num_expert_group\":1,\"topk_group\":1,"
    "\"num_nextn_predict_layers\":0,\"initializer_range\":0.02}}";

#define MODEL_DIR "tests/out/session_model_v1"
#define G 8 /* grid of the tests' caches */

/* The model directory, exported once per suite run (config.json is written
 * last, so its presence means the directory is complete). */
static const char *model_dir(void) {
    struct stat sb;
    if (stat(MODEL_DIR "/config.json", &sb) == 0) return MODEL_DIR;
    mkdir("tests/out", 0755);
    k3_config c;
    k3_err err = {0};
    tmodel tm;
    if (k3_config_parse(CFG, "session test config", &c, &err) || tm_build(&tm, &c, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return NULL;
    }
    tm_init(&tm, 11);
    /* off the init (zero pseudo-queries, unit gains) so every tensor matters */
    uint64_t r = 0x5E55;
    for (size_t i = 0; i < tm.nw; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        tm.w[i] += 0.05f * ((float)(r >> 40) / 16777216.0f - 0.5f);
    }
    texport_opts o = {.dtype = TEX_BF16, .experts = TEX_MXFP4, .tok_dir = t_repo("tests/fixtures/tokenizer/kimi"),
                      .step = -1};
    int rc = texport_write(&tm, CFG, MODEL_DIR, &o, &err);
    tm_free(&tm);
    if (rc) {
        fprintf(stderr, "%s\n", err.msg);
        return NULL;
    }
    return MODEL_DIR;
}

static k3_model *open_model(void) {
    const char *d = model_dir();
    k3_model *m = NULL;
    k3_err err = {0};
    if (!d || k3_model_open(d, NULL, &m, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return NULL;
    }
    return m;
}

/* A conversation-like id sequence: spread over the whole vocabulary. */
static void fill_ids(int32_t *v, int n, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        v[i] = (int32_t)((seed >> 8) % 163840u);
    }
}

/* Logits of ids[n-1] after one cold prefill of ids[0..n) on a fresh state. */
static float *cold(k3_model *m, const int32_t *ids, int n) {
    int V = k3_model_config(m)->vocab_size;
    k3_state *st;
    k3_err err = {0};
    float *lg = xmalloc_array((size_t)V, sizeof *lg);
    if (k3_state_new(m, 512, &st, &err) || k3_forward(m, st, ids, n, lg, false, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        free(lg);
        return NULL;
    }
    k3_state_free(st);
    return lg;
}

static bool same(const float *a, const float *b, int V) { return a && b && memcmp(a, b, (size_t)V * sizeof *a) == 0; }

/* The release's snapshot cost from its config, worked by hand: 69 KDA layers
 * x (96 heads x 128 x 128 state + 3 x 12288 channels x 3 conv history) floats,
 * 24 MLA layers x (512 + 64) floats per position. */
TEST(session_snapshot_cost_of_release) {
    k3_config c;
    k3_err err = {0};
    CHECKF(k3_config_load(t_repo("tests/fixtures/k3-release/config.json"), &c, &err) == 0, "%s", err.msg);
    CHECK(k3_state_kda_floats(&c) == 69ull * (96 * 128 * 128 + 3 * 12288 * 3));
    CHECK(k3_state_row_floats(&c) == 24ull * 576);
    CHECK(k3_state_snapshot_bytes(&c, 0) == 464633856ull);
    CHECK(k3_state_snapshot_bytes(&c, 1000) == 464633856ull + 1000ull * 55296);
}

/* Save, perturb, load: the state continues as if never touched. Truncating
 * the MLA cache and restoring the KDA part from a copy also gives it back. */
TEST(session_state_save_load_roundtrip) {
    k3_model *m = open_model();
    CHECK(m);
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    int32_t ids[40];
    fill_ids(ids, 40, 1);
    k3_state *st;
    k3_err err = {0};
    CHECK(k3_state_new(m, 64, &st, &err) == 0);
    CHECK(k3_forward(m, st, ids, 25, NULL, false, &err) == 0);
    uint64_t nb = k3_state_snapshot_bytes(c, 25);
    float *snap = xmalloc(nb);
    k3_state_save(st, snap);
    float *kda = xmalloc_array(k3_state_kda_floats(c) + 1, sizeof(float));
    k3_state_kda_get(st, kda);
    float *lg = xmalloc_array((size_t)V, sizeof *lg);
    CHECK(k3_forward(m, st, ids + 25, 15, lg, false, &err) == 0);
    float *want = cold(m, ids, 40);
    CHECK(same(lg, want, V));
    /* whole-snapshot load onto a state that has moved on */
    CHECK(k3_state_load(st, snap, 25, &err) == 0 && k3_state_pos(st) == 25);
    CHECK(k3_forward(m, st, ids + 25, 15, lg, false, &err) == 0);
    CHECK(same(lg, want, V));
    /* truncate the cache to 25 (rows 0..25 are still the right ones), put the
     * KDA part back */
    CHECK(k3_state_set_pos(st, 25, &err) == 0);
    k3_state_kda_set(st, kda);
    CHECK(k3_forward(m, st, ids + 25, 15, lg, false, &err) == 0);
    CHECK(same(lg, want, V));
    /* truncation alone leaves the KDA part at 40 tokens: not the same state */
    CHECK(k3_state_set_pos(st, 25, &err) == 0);
    CHECK(k3_forward(m, st, ids + 25, 15, lg, false, &err) == 0);
    CHECK(!same(lg, want, V));
    CHECK(k3_state_set_pos(st, 65, &err) == K3_EXIT_USAGE);
    CHECK(k3_state_rows_get(st, 30, 20, kda, &err) == K3_EXIT_USAGE);
    free(want);
    free(lg);
    free(kda);
    free(snap);
    k3_state_free(st);
    k3_model_free(m);
}

/* Three turns: each prompt extends the last (prompt + generated reply + new
 * message); the session feeds only the new tokens and every turn's logits
 * equal a cold prefill. Run at 1 and 2 threads, each against a cold prefill
 * at 1 thread. */
TEST(session_turns_feed_only_new_tokens) {
    k3_model *m = open_model();
    CHECK(m);
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    int32_t conv[120];
    fill_ids(conv, 120, 7);
    omp_set_num_threads(1);
    static const int ends[3] = {30, 70, 117}; /* prompt ends; a "reply" of 10 ids follows each */
    float *want[3];
    for (int t = 0; t < 3; t++) want[t] = cold(m, conv, ends[t]);
    for (int th = 1; th <= 2; th++) {
        omp_set_num_threads(th);
        k3_state_cache *sc = k3_state_cache_new(c, 64 << 20, G);
        k3_state *st;
        k3_err err = {0};
        CHECK(k3_state_new(m, 200, &st, &err) == 0);
        k3_session *s = k3_session_new(m, st, sc);
        float *lg = xmalloc_array((size_t)V, sizeof *lg);
        size_t reused = 99;
        for (int t = 0; t < 3; t++) {
            CHECK(k3_session_prefill(s, conv, (size_t)ends[t], lg, &reused, &err) == 0);
            CHECKF(same(lg, want[t], V), "turn %d, %d threads: logits differ from a cold prefill", t + 1, th);
            /* turn 1 is cold; later turns resume from the previous reply's end */
            size_t expect = t == 0 ? 0 : (size_t)ends[t - 1] + 10;
            CHECKF(reused == expect, "turn %d: reused %zu, want %zu", t + 1, reused, expect);
            CHECK(k3_session_last_source(s) == (t == 0 ? 0 : 1));
            if (t < 2) { /* decode the reply token by token (teacher forced) */
                for (int i = 0; i < 10; i++) CHECK(k3_session_feed(s, conv + ends[t] + i, 1, lg, &err) == 0);
                k3_session_snapshot(s);
            }
        }
        /* the same prompt again: nothing to feed, the held logits come back */
        CHECK(k3_session_prefill(s, conv, 117, lg, &reused, &err) == 0 && reused == 117);
        CHECK(same(lg, want[2], V));
        free(lg);
        k3_session_free(s);
        k3_state_free(st);
        k3_state_cache_free(sc);
    }
    for (int t = 0; t < 3; t++) free(want[t]);
    k3_model_free(m);
}

/* A prompt that matches the session only partly (the reply was re-rendered
 * differently from what was generated, at position 37): the session's state
 * holds 37 + 13 tokens and must not be cut back; the deepest snapshot at or
 * before 37 is the grid one at 32, so 32 tokens are reused. Without a cache
 * the prefill is cold. Both equal a cold prefill. */
TEST(session_partial_match_falls_back_to_grid) {
    k3_model *m = open_model();
    CHECK(m);
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    int32_t a[60], b[60];
    fill_ids(a, 60, 3);
    memcpy(b, a, sizeof a);
    for (int i = 37; i < 60; i++) b[i] = (a[i] + 1 + i) % V;
    float *want = cold(m, b, 55);
    k3_err err = {0};
    for (int with_cache = 0; with_cache < 2; with_cache++) {
        k3_state_cache *sc = with_cache ? k3_state_cache_new(c, 64 << 20, G) : NULL;
        k3_state *st;
        CHECK(k3_state_new(m, 128, &st, &err) == 0);
        k3_session *s = k3_session_new(m, st, sc);
        float *lg = xmalloc_array((size_t)V, sizeof *lg);
        size_t reused = 99;
        CHECK(k3_session_prefill(s, a, 50, lg, &reused, &err) == 0 && reused == 0);
        CHECK(k3_session_prefill(s, b, 55, lg, &reused, &err) == 0);
        CHECKF(reused == (with_cache ? 32u : 0u), "cache %d: reused %zu", with_cache, reused);
        CHECK(k3_session_last_source(s) == (with_cache ? 2 : 0));
        CHECK(same(lg, want, V));
        /* and back to the first conversation: its prompt-end snapshot at 50
         * is a prefix of a[0..58) */
        if (with_cache) {
            float *want_a = cold(m, a, 58);
            CHECK(k3_session_prefill(s, a, 58, lg, &reused, &err) == 0 && reused == 50);
            CHECK(same(lg, want_a, V));
            free(want_a);
        }
        free(lg);
        k3_session_free(s);
        k3_state_free(st);
        k3_state_cache_free(sc);
    }
    free(want);
    k3_model_free(m);
}

/* Two sessions share one cache: the second resumes from the first's
 * snapshots (a client resending its history to a new request). */
TEST(session_cache_shared_between_sessions) {
    k3_model *m = open_model();
    CHECK(m);
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    int32_t a[80];
    fill_ids(a, 80, 5);
    k3_err err = {0};
    k3_state_cache *sc = k3_state_cache_new(c, 64 << 20, G);
    k3_state *s1, *s2;
    CHECK(k3_state_new(m, 128, &s1, &err) == 0 && k3_state_new(m, 128, &s2, &err) == 0);
    k3_session *x = k3_session_new(m, s1, sc), *y = k3_session_new(m, s2, sc);
    float *lg = xmalloc_array((size_t)V, sizeof *lg), *want = cold(m, a, 80);
    size_t reused;
    CHECK(k3_session_prefill(x, a, 45, lg, &reused, &err) == 0);
    CHECK(k3_session_prefill(y, a, 80, lg, &reused, &err) == 0 && reused == 45);
    CHECK(same(lg, want, V));
    k3_state_cache_stats st = k3_state_cache_get_stats(sc);
    CHECK(st.hits == 1 && st.bytes <= st.budget);
    k3_session_free(x);
    k3_session_free(y);
    k3_state_cache_free(sc);
    k3_state_free(s1);
    k3_state_free(s2);
    free(lg);
    free(want);
    k3_model_free(m);
}

/* A snapshot keeps the logits of its last id, so a prompt another
 * conversation already ended at (an exact repeat, a regenerate) resumes at its
 * very end and feeds nothing; the logits are a cold prefill's, bit for bit.
 * Failed before snapshots kept logits: the lookup skipped a snapshot at the
 * prompt's end and the repeat fed from the grid. */
TEST(session_exact_repeat_feeds_nothing) {
    k3_model *m = open_model();
    CHECK(m);
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    int32_t a[70], b[70];
    fill_ids(a, 70, 11);
    fill_ids(b, 70, 12);
    k3_err err = {0};
    k3_state_cache *sc = k3_state_cache_new(c, 64 << 20, G);
    k3_state *st;
    CHECK(k3_state_new(m, 128, &st, &err) == 0);
    k3_session *s = k3_session_new(m, st, sc);
    float *lg = xmalloc_array((size_t)V, sizeof *lg), *want = cold(m, a, 61);
    size_t reused;
    CHECK(k3_session_prefill(s, a, 61, lg, &reused, &err) == 0 && reused == 0);
    CHECK(k3_session_prefill(s, b, 70, lg, &reused, &err) == 0 && reused == 0); /* another conversation */
    for (int i = 0; i < V; i++) lg[i] = -1.0f;
    uint64_t hits = k3_state_cache_get_stats(sc).hits;
    CHECK(k3_session_prefill(s, a, 61, lg, &reused, &err) == 0);
    CHECKF(reused == 61, "reused %zu of 61", reused);
    CHECK(same(lg, want, V));
    CHECK(k3_state_cache_get_stats(sc).hits == hits + 1);
    /* it goes on as a cold state of a[0..61) would: feed one more id */
    float *want2 = cold(m, a, 62);
    CHECK(k3_session_feed(s, a + 61, 1, lg, &err) == 0 && same(lg, want2, V));
    free(want2);
    free(want);
    free(lg);
    k3_session_free(s);
    k3_state_free(st);
    k3_state_cache_free(sc);
    k3_model_free(m);
}

/* A marked prefill snapshots the message boundaries it feeds past, so a new
 * conversation sharing only the system prompt (ids[0..37)) resumes at its
 * end, off the grid; without the marks it starts cold (the control: the same
 * prompts, the same cache). The logits, of the split feed and of the resumed
 * one, are a cold prefill's, bit for bit. */
TEST(session_marked_boundary_resumes_new_conversation) {
    k3_model *m = open_model();
    CHECK(m);
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    int32_t a[60], b[60];
    fill_ids(a, 60, 21);
    fill_ids(b, 60, 22);
    memcpy(b, a, 37 * sizeof *a); /* the shared system prompt */
    const size_t marks[] = {37, 50, 60};
    float *want_a = cold(m, a, 60), *want_b = cold(m, b, 55);
    k3_err err = {0};
    for (int marked = 0; marked < 2; marked++) {
        k3_state_cache *sc = k3_state_cache_new(c, 64 << 20, 1000); /* no grid point inside */
        k3_state *st;
        CHECK(k3_state_new(m, 128, &st, &err) == 0);
        k3_session *s = k3_session_new(m, st, sc);
        float *lg = xmalloc_array((size_t)V, sizeof *lg);
        size_t reused = 99;
        CHECK(k3_session_prefill_marked(s, a, 60, marks, marked ? 3 : 0, lg, &reused, &err) == 0 && reused == 0);
        CHECK(same(lg, want_a, V));
        /* 37 and 50 (60 is the prompt end, taken either way) */
        CHECKF(k3_state_cache_get_stats(sc).taken == (marked ? 3u : 1u), "marked %d: %llu taken", marked,
               (unsigned long long)k3_state_cache_get_stats(sc).taken);
        CHECK(k3_session_prefill(s, b, 55, lg, &reused, &err) == 0);
        CHECKF(reused == (marked ? 37u : 0u), "marked %d: reused %zu", marked, reused);
        CHECK(k3_session_last_source(s) == (marked ? 2 : 0));
        CHECK(same(lg, want_b, V));
        free(lg);
        k3_session_free(s);
        k3_state_free(st);
        k3_state_cache_free(sc);
    }
    /* marks must be increasing offsets inside the prompt */
    k3_state *st;
    CHECK(k3_state_new(m, 128, &st, &err) == 0);
    k3_session *s = k3_session_new(m, st, NULL);
    const size_t bad[][2] = {{0, 5}, {5, 5}, {9, 7}, {5, 61}};
    for (int i = 0; i < 4; i++) {
        CHECK(k3_session_prefill_marked(s, a, 60, bad[i], 2, NULL, NULL, &err) == K3_EXIT_USAGE);
        CHECKF(strstr(err.msg, "increasing offsets"), "%s", err.msg);
    }
    CHECK(k3_session_len(s) == 0);
    k3_session_free(s);
    k3_state_free(st);
    free(want_a);
    free(want_b);
    k3_model_free(m);
}

/* Under a budget of about three unshared snapshots the cache evicts the least recently
 * used ones and stays within it; a budget of 0 keeps nothing. Reuse stays
 * exact whatever survived. */
TEST(session_cache_budget_evicts) {
    k3_model *m = open_model();
    CHECK(m);
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    int32_t a[100];
    fill_ids(a, 100, 9);
    uint64_t one = k3_state_snapshot_bytes(c, 0);
    k3_err err = {0};
    for (int b = 0; b < 2; b++) {
        /* the prompt end keeps its logits too */
        uint64_t budget = b == 0 ? 0 : 3 * one + (uint64_t)V * 4 + 64 * (k3_state_row_floats(c) * 4 + 4) + 1024;
        k3_state_cache *sc = k3_state_cache_new(c, budget, G);
        k3_state *st;
        CHECK(k3_state_new(m, 128, &st, &err) == 0);
        k3_session *s = k3_session_new(m, st, sc);
        float *lg = xmalloc_array((size_t)V, sizeof *lg);
        size_t reused;
        CHECK(k3_session_prefill(s, a, 90, lg, &reused, &err) == 0);
        k3_state_cache_stats cs = k3_state_cache_get_stats(sc);
        CHECKF(cs.bytes <= budget, "budget %llu: holds %llu", (unsigned long long)budget,
               (unsigned long long)cs.bytes);
        if (b == 0) CHECK(cs.snapshots == 0 && cs.taken == 0);
        else CHECKF(cs.snapshots >= 1 && cs.snapshots <= 3 && cs.evicted > 0, "%d snapshots, %llu evicted, one %llu, V %d", cs.snapshots, (unsigned long long)cs.evicted, (unsigned long long)one, V);
        /* diverge at 50: the grid snapshot at 48 is gone (the conversation's
         * rows are shared, the KDA parts are not, so only the newest
         * snapshots fit), so the prefill is cold */
        int32_t d[100];
        memcpy(d, a, sizeof d);
        d[50] = (d[50] + 1) % V;
        float *want = cold(m, d, 95);
        CHECK(k3_session_prefill(s, d, 95, lg, &reused, &err) == 0 && reused == 0);
        CHECK(same(lg, want, V));
        free(want);
        free(lg);
        k3_session_free(s);
        k3_state_free(st);
        cs = k3_state_cache_get_stats(sc);
        CHECK(cs.bytes <= budget);
        k3_state_cache_free(sc);
    }
    k3_model_free(m);
}

/* A saved session, loaded into a new session (and a new state), continues
 * bit-identically; a corrupt, truncated or other model's file is refused with
 * K3_EXIT_DATA and leaves the session as it was. */
TEST(session_file_roundtrip_and_refusals) {
    k3_model *m = open_model();
    CHECK(m);
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    int32_t a[70];
    fill_ids(a, 70, 13);
    k3_err err = {0};
    uint64_t id = 0, id2 = 0;
    CHECKF(k3_model_identity(model_dir(), NULL, 6, &id, &err) == 0, "%s", err.msg);
    CHECK(k3_model_identity(model_dir(), NULL, 5, &id2, &err) == 0 && id2 != id);
    char path[1024], bad[1100];
    snprintf(path, sizeof path, "%s/s.k3session", t_outdir());
    k3_state *st;
    CHECK(k3_state_new(m, 128, &st, &err) == 0);
    k3_session *s = k3_session_new(m, st, NULL);
    float *lg = xmalloc_array((size_t)V, sizeof *lg);
    size_t reused;
    CHECK(k3_session_prefill(s, a, 41, lg, &reused, &err) == 0);
    CHECKF(k3_session_save(s, path, id, "{\"x\":1}", 7, &err) == 0, "%s", err.msg);
    k3_session_free(s);
    k3_state_free(st);

    CHECK(k3_state_new(m, 128, &st, &err) == 0);
    s = k3_session_new(m, st, NULL);
    char *extra = NULL;
    size_t xl = 0;
    CHECKF(k3_session_load(s, path, id, &extra, &xl, &err) == 0, "%s", err.msg);
    CHECK(xl == 7 && strcmp(extra, "{\"x\":1}") == 0 && k3_session_len(s) == 41);
    free(extra);
    float *want = cold(m, a, 70);
    CHECK(k3_session_prefill(s, a, 70, lg, &reused, &err) == 0 && reused == 41);
    CHECK(same(lg, want, V));

    /* refusals */
    CHECK(k3_session_load(s, path, id2, NULL, NULL, &err) == K3_EXIT_DATA && strstr(err.msg, "another model"));
    char *data;
    size_t len;
    CHECK(k3_read_file(path, &data, &len, &err) == 0);
    snprintf(bad, sizeof bad, "%s/bad.k3session", t_outdir());
    static const size_t flips[3] = {20, 64, 0};
    for (int i = 0; i < 3; i++) {
        size_t at = flips[i] ? flips[i] : len - 1;
        data[at] ^= 0x10;
        CHECK(k3_write_file_atomic(bad, data, len, &err) == 0);
        data[at] ^= 0x10;
        err.code = 0;
        CHECKF(k3_session_load(s, bad, id, NULL, NULL, &err) == K3_EXIT_DATA, "flip at %zu accepted", at);
        CHECK(strstr(err.msg, "corrupt") || strstr(err.msg, "another model"));
    }
    CHECK(k3_write_file_atomic(bad, data, len - 100, &err) == 0);
    CHECK(k3_session_load(s, bad, id, NULL, NULL, &err) == K3_EXIT_DATA && strstr(err.msg, "truncated"));
    CHECK(k3_write_file_atomic(bad, "hello", 5, &err) == 0);
    CHECK(k3_session_load(s, bad, id, NULL, NULL, &err) == K3_EXIT_DATA);
    free(data);
    /* the refused loads left the session at 70 tokens; so does a prompt
     * longer than the state */
    CHECK(k3_session_len(s) == 70 && memcmp(k3_session_ids(s), a, sizeof a) == 0);
    int32_t *big = xcalloc(129, sizeof *big);
    memcpy(big, a, sizeof a);
    CHECK(k3_session_prefill(s, big, 129, lg, &reused, &err) == K3_EXIT_USAGE);
    CHECK(k3_session_len(s) == 70 && memcmp(k3_session_ids(s), a, sizeof a) == 0);
    free(big);
    free(want);
    free(lg);
    k3_session_free(s);
    k3_state_free(st);
    k3_model_free(m);
}

/* Through the engine under a streamed budget (routed experts read through a
 * tiny cache, 3-token prefill chunks): turns and a partial match give the
 * logits of a cold prefill on the resident model. */
TEST(session_engine_streamed_budget_matches_cold) {
    k3_model *m = open_model();
    CHECK(m);
    int V = k3_model_config(m)->vocab_size;
    k3_err err = {0};
    k3_engine *e;
    CHECKF(t_engine_open(model_dir(), (const char *const[]){"--cache-gb", "0.0002", "--chunk", "3", NULL}, 128, 0, &e,
                         &err) == 0,
           "%s", err.msg);
    k3_state *st;
    CHECKF(k3_engine_state_new(e, 128, 0, &st, &err) == 0, "%s", err.msg);
    k3_state_cache *sc = k3_state_cache_new(k3_engine_config(e), 64 << 20, G);
    k3_session *s = k3_session_open(e, st, sc);
    int32_t a[70], b[70];
    fill_ids(a, 70, 21);
    memcpy(b, a, sizeof a);
    for (int i = 29; i < 70; i++) b[i] = (a[i] * 3 + 1) % V;
    float *lg = xmalloc_array((size_t)V, sizeof *lg);
    size_t reused;
    CHECK(k3_session_prefill(s, a, 20, lg, &reused, &err) == 0);
    float *w = cold(m, a, 20);
    CHECK(same(lg, w, V));
    free(w);
    for (int i = 20; i < 35; i++) CHECK(k3_session_feed(s, a + i, 1, lg, &err) == 0);
    k3_session_snapshot(s);
    CHECK(k3_session_prefill(s, a, 60, lg, &reused, &err) == 0 && reused == 35);
    w = cold(m, a, 60);
    CHECK(same(lg, w, V));
    free(w);
    /* b departs at 29: the grid snapshot at 24 */
    CHECK(k3_session_prefill(s, b, 50, lg, &reused, &err) == 0 && reused == 24);
    w = cold(m, b, 50);
    CHECK(same(lg, w, V));
    free(w);
    free(lg);
    k3_session_free(s);
    k3_state_cache_free(sc);
    k3_engine_state_free(e, st);
    k3_engine_free(e);
    k3_model_free(m);
}

/* A hook that cancels at its n-th question. */
typedef struct { int asked, at; } cancel_at;
static bool cancel_now(const void *ctx) {
    cancel_at *c = (cancel_at *)ctx;
    return ++c->asked >= c->at;
}

/* A prefill cancelled between its chunks (--chunk 3, grid 8): from the
 * session's 20 tokens it feeds 20..23, 23..24 (the grid), 24..27 and stops at
 * the fourth question. The session then holds exactly a[0..27), the grid
 * snapshot at 24 is kept, the same prompt again continues from 27 with the
 * logits of a cold prefill, and no snapshot stands at 27 as if a prompt had
 * ended there. */
TEST(session_prefill_cancel_keeps_a_true_state) {
    k3_model *m = open_model();
    CHECK(m);
    int V = k3_model_config(m)->vocab_size;
    k3_err err = {0};
    k3_engine *e;
    CHECKF(t_engine_open(model_dir(), (const char *const[]){"--chunk", "3", NULL}, 128, 0, &e, &err) == 0, "%s",
           err.msg);
    k3_state *st, *st2;
    CHECKF(k3_engine_state_new(e, 128, 0, &st, &err) == 0, "%s", err.msg);
    CHECKF(k3_engine_state_new(e, 128, 0, &st2, &err) == 0, "%s", err.msg);
    k3_state_cache *sc = k3_state_cache_new(k3_engine_config(e), 64 << 20, G);
    k3_session *s = k3_session_open(e, st, sc);
    int32_t a[60];
    fill_ids(a, 60, 33);
    float *lg = xmalloc_array((size_t)V, sizeof *lg);
    size_t reused = 99;
    CHECK(k3_session_prefill(s, a, 20, lg, &reused, &err) == 0);
    cancel_at ca = {.at = 4};
    k3_session_set_cancel(s, cancel_now, &ca);
    int rc = k3_session_prefill(s, a, 60, lg, &reused, &err);
    CHECKF(rc == K3_EXIT_RUNTIME && strstr(err.msg, "cancelled after 27 of 60 prompt tokens (20 reused)"), "rc %d: %s",
           rc, err.msg);
    CHECK(ca.asked == 4);
    CHECKF(k3_session_len(s) == 27, "len %zu", k3_session_len(s));
    CHECK(memcmp(k3_session_ids(s), a, 27 * sizeof *a) == 0);
    /* the hook gone, the same prompt continues from the cancelled session's 27 */
    k3_session_set_cancel(s, NULL, NULL);
    CHECK(k3_session_prefill(s, a, 60, lg, &reused, &err) == 0);
    CHECKF(reused == 27 && k3_session_last_source(s) == 1, "reused %zu", reused);
    float *w = cold(m, a, 60);
    CHECK(same(lg, w, V));
    free(w);
    /* another session on the cache: the deepest snapshot a[0..28) can resume from is
     * the grid one at 24 (none at 27; the continued prefill's are deeper) */
    k3_session *s2 = k3_session_open(e, st2, sc);
    CHECK(k3_session_prefill(s2, a, 28, lg, &reused, &err) == 0);
    CHECKF(reused == 24, "reused %zu, want the grid's 24", reused);
    w = cold(m, a, 28);
    CHECK(same(lg, w, V));
    free(w);
    k3_session_free(s2);
    /* a hook that cancels at once: the session resumes from the grid snapshot
     * at 56 (a[0..59) departs from its 60 ids) and feeds nothing */
    cancel_at now = {.at = 1};
    k3_session_set_cancel(s, cancel_now, &now);
    rc = k3_session_prefill(s, a, 59, lg, &reused, &err);
    CHECKF(rc == K3_EXIT_RUNTIME && strstr(err.msg, "cancelled after 56 of 59 prompt tokens (56 reused)"), "%s",
           err.msg);
    CHECK(k3_session_len(s) == 56 && reused == 56);
    free(lg);
    k3_session_free(s);
    k3_state_cache_free(sc);
    k3_engine_state_free(e, st);
    k3_engine_state_free(e, st2);
    k3_engine_free(e);
    k3_model_free(m);
}

/* Batched decoding through sessions (k3_session_feed_batch), streamed weights
 * (--cache-gb 0.0002): three sessions at different positions step together
 * while the batch changes every step (a session joins, leaves, asks for no
 * logits), and each gives the logits bits of the same ids fed alone to a
 * twin session (k3_session_feed), holds the same ids, and ends where a cold
 * k3_forward of its whole sequence ends. A full session in the batch is
 * refused before anything is fed. */
TEST(session_feed_batch_same_as_alone) {
    k3_model *m = open_model();
    CHECK(m);
    int V = k3_model_config(m)->vocab_size;
    k3_err err = {0};
    k3_engine *e;
    CHECKF(t_engine_open(model_dir(), (const char *const[]){"--cache-gb", "0.0002", "--chunk", "3", NULL}, 64, 0, &e,
                         &err) == 0,
           "%s", err.msg);
    enum { NS = 3, STEPS = 9 };
    k3_state_cache *sc = k3_state_cache_new(k3_engine_config(e), 64 << 20, G);
    k3_state *bst[NS], *ast[NS];
    k3_session *bs[NS], *as[NS];
    int32_t seq[NS][40];
    const int pre[NS] = {5, 1, 12};
    float *lb = xmalloc_array((size_t)NS * V, sizeof *lb), *la = xmalloc_array((size_t)V, sizeof *la);
    for (int q = 0; q < NS; q++) {
        fill_ids(seq[q], 40, 31 + (uint32_t)q);
        CHECKF(k3_engine_state_new(e, 64, 0, &bst[q], &err) == 0 && k3_engine_state_new(e, 64, 0, &ast[q], &err) == 0,
               "%s", err.msg);
        bs[q] = k3_session_open(e, bst[q], sc);
        as[q] = k3_session_open(e, ast[q], NULL);
        CHECK(k3_session_prefill(bs[q], seq[q], (size_t)pre[q], NULL, NULL, &err) == 0);
        CHECK(k3_session_prefill(as[q], seq[q], (size_t)pre[q], NULL, NULL, &err) == 0);
    }
    bool ok = true;
    for (int t = 0; ok && t < STEPS; t++) {
        k3_session *in[NS];
        int32_t ids[NS];
        float *rows[NS];
        int n = 0, who[NS];
        for (int q = 0; q < NS; q++) {
            if ((t + q) % 4 == 3) continue; /* this one sits the step out */
            in[n] = bs[q];
            ids[n] = seq[q][k3_session_len(bs[q])];
            rows[n] = (t * 7 + q) % 5 == 2 ? NULL : lb + (size_t)n * V; /* no logits wanted */
            who[n++] = q;
        }
        ok = k3_session_feed_batch(in, n, ids, rows, &err) == 0;
        for (int i = 0; ok && i < n; i++) {
            k3_session *a = as[who[i]];
            ok = k3_session_feed(a, &ids[i], 1, rows[i] ? la : NULL, &err) == 0 &&
                 (!rows[i] || !memcmp(la, rows[i], (size_t)V * sizeof *la)) &&
                 k3_session_len(a) == k3_session_len(in[i]) &&
                 !memcmp(k3_session_ids(a), k3_session_ids(in[i]), k3_session_len(a) * sizeof(int32_t));
            if (!ok) fprintf(stderr, "step %d session %d differs (%s)\n", t, who[i], err.msg);
        }
    }
    CHECK(ok);
    /* the last step's state: one more id each, alone vs batched, against a cold forward */
    int32_t last[NS];
    float *rows[NS];
    for (int q = 0; q < NS; q++) {
        last[q] = seq[q][k3_session_len(bs[q])];
        rows[q] = lb + (size_t)q * V;
    }
    CHECK(k3_session_feed_batch(bs, NS, last, rows, &err) == 0);
    for (int q = 0; q < NS; q++) {
        float *w = cold(m, seq[q], (int)k3_session_len(bs[q]));
        CHECK(same(rows[q], w, V));
        free(w);
    }
    /* refused whole: a session given twice, a full session */
    k3_session *twice[2] = {bs[0], bs[0]};
    size_t len0 = k3_session_len(bs[0]), len1 = k3_session_len(bs[1]);
    CHECK(k3_session_feed_batch(twice, 2, last, NULL, &err) == K3_EXIT_USAGE);
    k3_state *tiny;
    CHECKF(k3_engine_state_new(e, 2, 0, &tiny, &err) == 0, "%s", err.msg);
    k3_session *full = k3_session_open(e, tiny, NULL);
    CHECK(k3_state_max_pos(tiny) <= 40);
    CHECK(k3_session_prefill(full, seq[0], (size_t)k3_state_max_pos(tiny), NULL, NULL, &err) == 0);
    k3_session *pair[2] = {bs[1], full};
    CHECK(k3_session_feed_batch(pair, 2, last, NULL, &err) == K3_EXIT_USAGE);
    CHECKF(k3_session_len(bs[0]) == len0 && k3_session_len(bs[1]) == len1, "%zu %zu, %zu %zu", k3_session_len(bs[0]),
           len0, k3_session_len(bs[1]), len1);
    k3_session_free(full);
    k3_engine_state_free(e, tiny);
    for (int q = 0; q < NS; q++) {
        k3_session_free(bs[q]);
        k3_session_free(as[q]);
        k3_engine_state_free(e, bst[q]);
        k3_engine_state_free(e, ast[q]);
    }
    free(lb);
    free(la);
    k3_state_cache_free(sc);
    k3_engine_free(e);
    k3_model_free(m);
}
