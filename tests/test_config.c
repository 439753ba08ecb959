/* Tests for formats/config: the released nested config against the values of
 * the spec's key table (k3-checkpoint-format.md 2.2/2.3), the flat fixture
 * shape, the peer's three refused configs, and variations built here. */
#include "harness.h"
#include "tjson.h"
#include "formats/config.h"
#include "formats/safetensors.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define RELEASE "k3-release/config.json"

TEST(config_released_matches_spec_table) {
    k3_config c;
    k3_err err = {0};
    int rc = k3_config_load(t_fixture(RELEASE), &c, &err);
    CHECKF(rc == 0, "%s", err.msg);
    CHECK(c.hidden_size == 7168 && c.num_layers == 93 && c.vocab_size == 163840);
    CHECK(c.rms_eps == 1e-5f && c.mla_latent_eps == 1e-6f);
    CHECK(c.kda_heads == 96 && c.kda_head_dim == 128 && c.conv_kernel == 4);
    CHECK(c.gate_lower_bound == -5.0f);
    CHECK(c.mla_heads == 96 && c.q_lora_rank == 1536 && c.kv_lora_rank == 512);
    CHECK(c.qk_nope_dim == 128 && c.qk_rope_dim == 64 && c.v_head_dim == 128);
    CHECK(c.mla_output_gate);
    CHECK(c.num_experts == 896 && c.experts_per_token == 16 && c.num_shared_experts == 2);
    CHECK(c.latent_dim == 3584 && c.moe_inter == 3072 && c.dense_inter == 33792);
    CHECK(c.routed_scaling_factor == 1.0f && c.moe_renormalize && c.latent_moe_use_norm);
    CHECK(c.first_k_dense_replace == 1 && c.moe_layer_freq == 1);
    CHECK(c.attn_res_block_size == 12 && c.situ_beta == 4.0f && c.situ_linear_beta == 25.0f);
    CHECK(c.experts_mxfp4_declared && c.mxfp4_group == 32);
    CHECK(c.bos_token_id == 163584 && c.eos_token_id == 163586 && c.pad_token_id == 163839);
    CHECK(c.n_kda_layers == 69 && c.n_mla_layers == 24);
    /* MLA at zero-based 3, 7, ..., 87, 91 and 92 (spec 2.3) */
    for (int l = 0; l < 93; l++) {
        bool mla = (l % 4 == 3) || l == 92;
        CHECKF(c.layer_kind[l] == (mla ? 'M' : 'K'), "layer %d is %c", l, c.layer_kind[l]);
        CHECKF(c.layer_dense[l] == (l == 0), "layer %d dense %d", l, c.layer_dense[l]);
    }
    char map[128];
    k3_config_layer_map(&c, map, sizeof map);
    CHECK(strlen(map) == 93 && strncmp(map, "KKKMKKKM", 8) == 0 && strcmp(map + 88, "KKKMM") == 0);
    CHECKF(c.defaults_used[0] == 0, "defaults used: %s", c.defaults_used);
    /* a model directory works too */
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", t_fixture("k3-release"));
    CHECK(k3_config_load(dir, &c, &err) == 0 && c.num_layers == 93);
}

static void check_tiny(const k3_config *c, int moe_inter) {
    char map[64];
    k3_config_layer_map(c, map, sizeof map);
    CHECKF(strcmp(map, "KKKMKKKMKKKMM") == 0, "map %s", map);
    CHECK(c->hidden_size == 128 && c->num_layers == 13 && c->vocab_size == 256);
    CHECK(c->kda_heads == 4 && c->kda_head_dim == 16 && c->moe_inter == moe_inter);
    CHECK(c->situ_beta == 4.0f && c->situ_linear_beta == 25.0f && c->attn_res_block_size == 3);
    CHECK(!c->experts_mxfp4_declared);
    CHECKF(strstr(c->defaults_used, "moe_layer_freq=1"), "%s", c->defaults_used);
}

TEST(config_flat_fixtures_parse) {
    k3_config c;
    k3_err err = {0};
    CHECKF(k3_config_load(t_fixture("peer/tiny-checkpoint/config.json"), &c, &err) == 0, "%s", err.msg);
    check_tiny(&c, 64);
    json_t *ref = tj_load(t_fixture("peer/ref_k3.json"));
    CHECK(ref);
    char *text = json_dumps(json_object_get(ref, "config"), 0);
    json_decref(ref);
    CHECK(text);
    int rc = k3_config_parse(text, "ref_k3.json:config", &c, &err);
    free(text);
    CHECKF(rc == 0, "%s", err.msg);
    check_tiny(&c, 48);
}

TEST(config_peer_bad_configs_refused) {
    struct { const char *file, *m1, *m2; } cases[] = {
        {"peer/cfg/bad_layer_index.json", "full_attn_layers", "999"},
        {"peer/cfg/bad_topk.json", "num_experts_per_token 128", "num_experts 8"},
        {"peer/cfg/no_layermap.json", "missing required keys", "full_attn_layers"},
    };
    for (int i = 0; i < 3; i++) {
        k3_config c;
        k3_err err = {0};
        int rc = k3_config_load(t_fixture(cases[i].file), &c, &err);
        CHECKF(rc == K3_EXIT_USAGE, "%s: rc %d", cases[i].file, rc);
        CHECKF(strstr(err.msg, cases[i].file) && strstr(err.msg, cases[i].m1) && strstr(err.msg, cases[i].m2),
               "%s: '%s'", cases[i].file, err.msg);
    }
}

/* Loads the released config, lets edit() change it, parses the result. */
static int parse_edited(void (*edit)(json_t *root, json_t *tc, json_t *lac), k3_config *c, k3_err *err) {
    json_t *root = tj_load(t_fixture(RELEASE));
    if (!root) return -1;
    json_t *tc = json_object_get(root, "text_config");
    edit(root, tc, json_object_get(tc, "linear_attn_config"));
    char *text = json_dumps(root, 0);
    json_decref(root);
    int rc = k3_config_parse(text, "edited.json", c, err);
    free(text);
    return rc;
}

static void e_many_missing(json_t *root, json_t *tc, json_t *lac) {
    (void)root;
    json_object_del(tc, "hidden_size");
    json_object_del(tc, "vocab_size");
    json_object_set_new(tc, "num_experts", json_string("896"));
    json_object_del(lac, "head_dim");
    json_object_set_new(tc, "rms_norm_eps", json_true());
}
TEST(config_lists_every_missing_key) {
    k3_config c;
    k3_err err = {0};
    CHECK(parse_edited(e_many_missing, &c, &err) == K3_EXIT_USAGE);
    const char *want[] = {"missing required keys", "hidden_size", "vocab_size", "kda_head_dim",
                          "wrong type", "num_experts (want integer)", "rms_norm_eps (want number)"};
    for (int i = 0; i < 7; i++) CHECKF(strstr(err.msg, want[i]), "'%s' lacks '%s'", err.msg, want[i]);
}

/* text_config.head_dim = 74 is the HF config class's synthesised value: the
 * KDA head dim must still come from linear_attn_config. */
static void e_head_dim_trap(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)lac;
    json_object_set_new(tc, "head_dim", json_integer(74));
    json_object_set_new(tc, "num_heads", json_integer(7));
}
TEST(config_kda_dims_only_from_linear_attn_config) {
    k3_config c;
    k3_err err = {0};
    CHECKF(parse_edited(e_head_dim_trap, &c, &err) == 0, "%s", err.msg);
    CHECK(c.kda_head_dim == 128 && c.kda_heads == 96);
}

static void e_not_complement(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)tc;
    json_array_remove(json_object_get(lac, "kda_layers"), 0); /* layer 1 in neither */
}
static void e_unsorted(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)tc;
    json_t *a = json_object_get(lac, "full_attn_layers");
    json_array_set_new(a, 0, json_integer(8)); /* 8, 8, ... */
}
static void e_zero_based(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)tc;
    json_array_set_new(json_object_get(lac, "full_attn_layers"), 0, json_integer(0));
}
static void e_latent_not_mxfp4(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)lac;
    json_object_set_new(tc, "routed_expert_hidden_size", json_integer(3580));
}
static void e_conflicting_spellings(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)lac;
    json_object_set_new(tc, "situ_beta", json_real(3.0));
}
static void e_same_spellings(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)lac;
    json_object_set_new(tc, "situ_beta", json_real(4.0));
}
static void e_nope_false(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)lac;
    json_object_set_new(tc, "mla_use_nope", json_false());
}
static void e_negative(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)lac;
    json_object_set_new(tc, "kv_lora_rank", json_integer(0));
}
static void e_defaults(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)lac;
    json_object_del(tc, "moe_layer_freq");
    json_object_del(tc, "mla_use_output_gate");
}
static void e_layer_freq(json_t *root, json_t *tc, json_t *lac) {
    (void)root; (void)lac;
    json_object_set_new(tc, "moe_layer_freq", json_integer(2));
}

TEST(config_validation_refusals) {
    struct { void (*edit)(json_t *, json_t *, json_t *); const char *msg; } cases[] = {
        {e_not_complement, "layer 1 is in neither"},
        {e_unsorted, "not sorted and unique"},
        {e_zero_based, "one-based"},
        {e_latent_not_mxfp4, "multiples of the MXFP4 group 32"},
        {e_conflicting_spellings, "'activation_situ_beta' and 'situ_beta'"},
        {e_nope_false, "mla_use_nope"},
        {e_negative, "kv_lora_rank must be positive"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        k3_config c;
        k3_err err = {0};
        int rc = parse_edited(cases[i].edit, &c, &err);
        CHECKF(rc == K3_EXIT_USAGE, "case %zu: rc %d (%s)", i, rc, err.msg);
        CHECKF(strstr(err.msg, "edited.json") && strstr(err.msg, cases[i].msg), "case %zu: '%s'", i, err.msg);
    }
}

TEST(config_defaults_recorded_and_dense_rule) {
    k3_config c;
    k3_err err = {0};
    CHECKF(parse_edited(e_same_spellings, &c, &err) == 0, "%s", err.msg);
    CHECKF(parse_edited(e_defaults, &c, &err) == 0, "%s", err.msg);
    CHECKF(strstr(c.defaults_used, "moe_layer_freq=1") && strstr(c.defaults_used, "mla_use_output_gate=false"),
           "%s", c.defaults_used);
    CHECK(!c.mla_output_gate);
    CHECKF(parse_edited(e_layer_freq, &c, &err) == 0, "%s", err.msg);
    /* dense iff L < first_k_dense_replace or L % moe_layer_freq != 0 */
    for (int l = 0; l < 93; l++) CHECKF(c.layer_dense[l] == (l < 1 || l % 2 != 0), "layer %d", l);
}

TEST(config_garbage_refused) {
    k3_config c;
    k3_err err = {0};
    CHECK(k3_config_parse("", "e.json", &c, &err) == K3_EXIT_USAGE);
    CHECK(k3_config_parse("[1]", "e.json", &c, &err) == K3_EXIT_USAGE);
    CHECK(k3_config_parse("{\"a\":1,\"a\":2}", "e.json", &c, &err) == K3_EXIT_USAGE);
    CHECK(k3_config_parse("{\"text_config\":5}", "e.json", &c, &err) == K3_EXIT_USAGE);
    CHECK(k3_config_load("no/such/config.json", &c, &err) == K3_EXIT_USAGE);
}

TEST(config_meets_checkpoint) {
    k3_config c;
    k3_err err = {0};
    CHECKF(k3_config_load(t_fixture("peer/tiny-checkpoint/config.json"), &c, &err) == 0, "%s", err.msg);
    st_index *ix = NULL;
    CHECKF(st_open(t_fixture("peer/tiny-checkpoint"), &ix, &err) == 0, "%s", err.msg);
    CHECKF(k3_config_check_index(&c, ix, &err) == 0, "%s", err.msg);
    c.vocab_size = 300;
    CHECK(k3_config_check_index(&c, ix, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "vocab_size 300") && strstr(err.msg, "embed_tokens"), "%s", err.msg);
    c.vocab_size = 256;
    c.latent_dim = 48; /* not a multiple of 32, and the checkpoint has packed experts */
    CHECK(k3_config_check_index(&c, ix, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "MXFP4"), "%s", err.msg);
    st_close(ix);
}
