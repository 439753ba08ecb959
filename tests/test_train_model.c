/* test_train_model.c: the smol configs' parameter budget and layer rhythm, and
 * the causal invariance of the training forward. */
#include <math.h>
#include <string.h>

#include "harness.h"
#include "train/tinternal.h"

static bool build(const char *cfg, tmodel *m) {
    k3_config c;
    k3_err err = {0};
    if (k3_config_load(t_repo(cfg), &c, &err) || tm_build(m, &c, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return false;
    }
    return true;
}

/* The strict released layout of the 49M miniature counts
 * 49,018,061 parameters (the router biases are buffers, not parameters; A_log
 * has one value per head). tools/train_ref.py inventory counts the same. */
TEST(train_smol_parameter_budget) {
    tmodel m;
    CHECK(build("configs/smol-50m.json", &m));
    CHECKF(m.nw == 49018061, "smol-50m: %zu parameters", m.nw);
    char map[64];
    k3_config_layer_map(&m.cfg, map, sizeof map);
    CHECKF(strcmp(map, "KKKMKKKMKKKMM") == 0, "layer map %s", map);
    CHECK(m.n_moe == 13 && m.cfg.num_experts == 32 && m.cfg.experts_per_token == 4);
    tm_free(&m);
    CHECK(build("configs/smol-5m.json", &m));
    CHECKF(m.nw == 5102290, "smol-5m: %zu parameters", m.nw);
    tm_free(&m);
}

/* Logits at position t do not depend on tokens after t (KDA, MLA, AttnRes,
 * MoE and the head are all causal or per position). */
TEST(train_forward_is_causal) {
    tmodel m;
    CHECK(build("tests/fixtures/train/grad-config.json", &m));
    tm_init(&m, 3);
    for (size_t i = 0; i < m.nw; i++) m.w[i] += 0.01f * (float)((i * 2654435761u) % 1000) / 1000.0f;
    enum { T = 20, CUT = 11 };
    int32_t a[T + 1], b[T + 1];
    for (int i = 0; i <= T; i++) a[i] = b[i] = (int32_t)((i * 5 + 2) % m.cfg.vocab_size);
    for (int i = CUT + 1; i <= T; i++) b[i] = (int32_t)((i * 11 + 7) % m.cfg.vocab_size);
    const int V = m.cfg.vocab_size;
    float *la = xmalloc_array((size_t)T * V, sizeof(float));
    tm_forward(&m, a, 1, T);
    memcpy(la, m.logits, sizeof(float) * (size_t)T * V);
    tm_forward(&m, b, 1, T);
    CHECK(memcmp(la, m.logits, sizeof(float) * (size_t)(CUT + 1) * V) == 0);
    CHECK(memcmp(la + (size_t)(CUT + 1) * V, m.logits + (size_t)(CUT + 1) * V, sizeof(float) * V) != 0);
    free(la);
    tm_free(&m);
}
