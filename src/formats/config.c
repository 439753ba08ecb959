/* config.c: see config.h.
 *
 * Lookup. Nested (released) configs keep the language model under
 * text_config and the hybrid-attention block under
 * text_config.linear_attn_config; flat (fixture) configs keep everything at
 * the root. Every key is looked up in text_config, then the root; the KDA keys
 * in linear_attn_config first. Two spellings of one key must agree.
 *
 * The KDA dims under their released names (num_heads, head_dim) are taken from
 * linear_attn_config ONLY: the HF config class synthesises a text-level
 * head_dim = hidden_size / num_attention_heads (74 for K3) that means nothing
 * to KDA (spec 2.1). Their flat names (kda_num_heads, kda_head_dim) are
 * accepted anywhere.
 *
 * Required keys: missing or wrongly typed ones are collected and reported
 * together in one line. Optional keys and their defaults (the released
 * reference's defaults, spec 2.2), each recorded in defaults_used when taken:
 *   mla_use_output_gate   false
 *   latent_moe_use_norm   false
 *   moe_renormalize       true
 *   moe_layer_freq        1
 * Keys checked when present: kda_layers (must be the complement of
 * full_attn_layers, and then drives the layer map as in the reference),
 * mla_use_nope (must be true), hidden_act (must be situ),
 * moe_router_activation_func (must be sigmoid), num_key_value_heads (must
 * equal num_attention_heads), num_expert_group/topk_group (group-limited
 * routing unsupported), tie_word_embeddings (must be false),
 * use_full_rank_gate (must be true: the low-rank KDA gate is unsupported),
 * quantization_config (MXFP4 group size). */
#include "formats/config.h"
#include "formats/names.h"
#include "formats/safetensors.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    const char *name;
    json_t *lac, *tc, *root;   /* lookup scopes (lac/tc may be NULL) */
    char missing[512], badtype[512], defaults[512];
    bool overflow;             /* a list did not fit: say so */
    int code;
    k3_err *err;
} reader;

static void list_add(reader *r, char *list, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void list_add(reader *r, char *list, size_t cap, const char *fmt, ...) {
    char item[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(item, sizeof item, fmt, ap);
    va_end(ap);
    size_t n = strlen(list);
    int w = snprintf(list + n, cap - n, "%s%s", n ? ", " : "", item);
    if (w < 0 || (size_t)w >= cap - n) {
        list[n] = 0;
        r->overflow = true;
    }
}

/* Where to look for a key. */
enum { SC_TEXT, SC_KDA, SC_LAC_ONLY };

/* Finds key under any of its spellings (NULL-terminated) in the scope order.
 * Two different values under two spellings or scopes is an error. */
static json_t *find(reader *r, int scope, const char *const *names, const char **found_as) {
    json_t *scopes[3];
    int ns = 0;
    if (scope == SC_KDA || scope == SC_LAC_ONLY) {
        if (r->lac) scopes[ns++] = r->lac;
    }
    if (scope != SC_LAC_ONLY) {
        if (r->tc) scopes[ns++] = r->tc;
        scopes[ns++] = r->root;
    }
    json_t *hit = NULL;
    for (int i = 0; i < ns; i++)
        for (const char *const *n = names; *n; n++) {
            json_t *v = json_object_get(scopes[i], *n);
            if (!v) continue;
            if (!hit) {
                hit = v;
                *found_as = *n;
            } else if (!json_equal(hit, v) && r->code == K3_OK) {
                r->code = k3_fail(r->err, K3_EXIT_USAGE, "%s: '%s' and '%s' are both given, with different values",
                                  r->name, *found_as, *n);
            }
        }
    return hit;
}

/* Integer key. required: missing is an error; else *out keeps its default. */
static bool get_int(reader *r, int scope, const char *const *names, bool required, int *out) {
    const char *as = names[0];
    json_t *v = find(r, scope, names, &as);
    if (!v) {
        if (required) list_add(r, r->missing, sizeof r->missing, "%s", names[0]);
        return false;
    }
    if (!json_is_integer(v)) {
        list_add(r, r->badtype, sizeof r->badtype, "%s (want integer)", as);
        return false;
    }
    json_int_t x = json_integer_value(v);
    if (x > K3_MAX_DIM || x < -K3_MAX_DIM) {
        if (r->code == K3_OK)
            r->code = k3_fail(r->err, K3_EXIT_USAGE, "%s: %s %lld is too %s (k3 takes config integers up to %d)",
                              r->name, as, (long long)x, x > 0 ? "large" : "small", K3_MAX_DIM);
        return false;
    }
    *out = (int)json_integer_value(v);
    return true;
}

static bool get_num(reader *r, int scope, const char *const *names, bool required, float *out) {
    const char *as = names[0];
    json_t *v = find(r, scope, names, &as);
    if (!v) {
        if (required) list_add(r, r->missing, sizeof r->missing, "%s", names[0]);
        return false;
    }
    if (!json_is_number(v)) {
        list_add(r, r->badtype, sizeof r->badtype, "%s (want number)", as);
        return false;
    }
    *out = (float)json_number_value(v);
    return true;
}

static bool get_bool(reader *r, const char *key, bool required, bool *out) {
    const char *names[] = {key, NULL}, *as = key;
    json_t *v = find(r, SC_TEXT, names, &as);
    if (!v) {
        if (required) list_add(r, r->missing, sizeof r->missing, "%s", key);
        return false;
    }
    if (!json_is_boolean(v)) {
        list_add(r, r->badtype, sizeof r->badtype, "%s (want true/false)", as);
        return false;
    }
    *out = json_is_true(v);
    return true;
}

#define N1(a) ((const char *const[]){a, NULL})
#define N2(a, b) ((const char *const[]){a, b, NULL})

/* A one-based layer list: integers in 1..L, strictly increasing. */
static int read_layer_list(reader *r, json_t *a, const char *key, int L, bool *mark) {
    size_t n = json_array_size(a);
    int prev = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v))
            return k3_fail(r->err, K3_EXIT_USAGE, "%s: %s[%zu] is not an integer", r->name, key, i);
        json_int_t x = json_integer_value(v);
        if (x < 1 || x > L)
            return k3_fail(r->err, K3_EXIT_USAGE,
                           "%s: %s[%zu] = %lld is outside 1..%d (layer indices are one-based)", r->name,
                           key, i, (long long)x, L);
        if (x <= prev)
            return k3_fail(r->err, K3_EXIT_USAGE, "%s: %s is not sorted and unique (%lld after %d)",
                           r->name, key, (long long)x, prev);
        prev = (int)x;
        mark[x - 1] = true;
    }
    return K3_OK;
}

static int check_string(reader *r, const char *key, const char *want, const char *why) {
    const char *as = key;
    json_t *v = find(r, SC_TEXT, N1(key), &as);
    if (!v) return K3_OK;
    if (!json_is_string(v) || strcmp(json_string_value(v), want) != 0)
        return k3_fail(r->err, K3_EXIT_USAGE, "%s: %s must be \"%s\" (%s)", r->name, key, want, why);
    return K3_OK;
}

/* quantization_config: where it says MXFP4, take the group size. */
static int read_quant(reader *r, k3_config *c) {
    c->experts_mxfp4_declared = false;
    c->mxfp4_group = 32;
    json_t *q = r->tc ? json_object_get(r->tc, "quantization_config") : NULL;
    if (!q) q = json_object_get(r->root, "quantization_config");
    if (!q || json_is_null(q)) return K3_OK;
    if (!json_is_object(q))
        return k3_fail(r->err, K3_EXIT_USAGE, "%s: quantization_config is not an object", r->name);
    const char *fmt = json_string_value(json_object_get(q, "format"));
    if (!fmt || strcmp(fmt, "mxfp4-pack-quantized") != 0)
        return k3_fail(r->err, K3_EXIT_USAGE, "%s: quantization_config format '%s' is not supported (want mxfp4-pack-quantized)",
                       r->name, fmt ? fmt : "(none)");
    c->experts_mxfp4_declared = true;
    json_t *groups = json_object_get(q, "config_groups");
    const char *gk;
    json_t *g;
    json_object_foreach(groups, gk, g) {
        json_t *w = json_object_get(g, "weights");
        json_t *gs = json_object_get(w, "group_size");
        json_t *nb = json_object_get(w, "num_bits");
        if (nb && (!json_is_integer(nb) || json_integer_value(nb) != 4))
            return k3_fail(r->err, K3_EXIT_USAGE, "%s: quantization_config group %s: num_bits must be 4", r->name, gk);
        if (gs && (!json_is_integer(gs) || json_integer_value(gs) != 32))
            return k3_fail(r->err, K3_EXIT_USAGE,
                           "%s: quantization_config group %s: group_size must be 32 (MXFP4)", r->name, gk);
    }
    return K3_OK;
}

static int positive(reader *r, const char *key, long long v) {
    if (v <= 0) return k3_fail(r->err, K3_EXIT_USAGE, "%s: %s must be positive (got %lld)", r->name, key, v);
    return K3_OK;
}

/* The layer-kind counts, from layer_kind over the first num_layers: the one
 * place they are derived (for the whole config and for --layers). */
static void count_kinds(k3_config *c) {
    c->n_kda_layers = c->n_mla_layers = 0;
    for (int l = 0; l < c->num_layers; l++) {
        if (c->layer_kind[l] == 'K') c->n_kda_layers++;
        else c->n_mla_layers++;
    }
}

int k3_config_parse(const char *json_text, const char *name, k3_config *c, k3_err *err) {
    memset(c, 0, sizeof *c);
    json_error_t je;
    json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return k3_fail(err, K3_EXIT_USAGE, "%s: bad JSON: %s (line %d, column %d)", name, je.text, je.line,
                       je.column);
    if (!json_is_object(root)) {
        json_decref(root);
        return k3_fail(err, K3_EXIT_USAGE, "%s: not a JSON object", name);
    }
    reader r = {.name = name, .root = root, .err = err};
    int rc = K3_OK;
    json_t *tc = json_object_get(root, "text_config");
    if (tc && !json_is_object(tc)) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: text_config is not an object", name);
        goto out;
    }
    r.tc = tc;
    json_t *lac = tc ? json_object_get(tc, "linear_attn_config") : NULL;
    if (!lac) lac = json_object_get(root, "linear_attn_config");
    if (lac && !json_is_object(lac)) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: linear_attn_config is not an object", name);
        goto out;
    }
    r.lac = lac;

    /* required keys */
    get_int(&r, SC_TEXT, N1("hidden_size"), true, &c->hidden_size);
    get_int(&r, SC_TEXT, N1("num_hidden_layers"), true, &c->num_layers);
    get_int(&r, SC_TEXT, N1("vocab_size"), true, &c->vocab_size);
    get_num(&r, SC_TEXT, N1("rms_norm_eps"), true, &c->rms_eps);
    /* KDA dims: released names from linear_attn_config only, flat names anywhere */
    {
        const char *as;
        bool lac_h = r.lac && find(&r, SC_LAC_ONLY, N1("num_heads"), &as);
        bool lac_d = r.lac && find(&r, SC_LAC_ONLY, N1("head_dim"), &as);
        if (lac_h) get_int(&r, SC_LAC_ONLY, N1("num_heads"), true, &c->kda_heads);
        else get_int(&r, SC_KDA, N1("kda_num_heads"), true, &c->kda_heads);
        if (lac_d) get_int(&r, SC_LAC_ONLY, N1("head_dim"), true, &c->kda_head_dim);
        else get_int(&r, SC_KDA, N1("kda_head_dim"), true, &c->kda_head_dim);
        if (lac_h && find(&r, SC_KDA, N1("kda_num_heads"), &as)) {
            int alt = 0;
            if (get_int(&r, SC_KDA, N1("kda_num_heads"), false, &alt) && alt != c->kda_heads && !rc)
                rc = k3_fail(err, K3_EXIT_USAGE, "%s: num_heads and kda_num_heads disagree", name);
        }
        if (lac_d && find(&r, SC_KDA, N1("kda_head_dim"), &as)) {
            int alt = 0;
            if (get_int(&r, SC_KDA, N1("kda_head_dim"), false, &alt) && alt != c->kda_head_dim && !rc)
                rc = k3_fail(err, K3_EXIT_USAGE, "%s: head_dim and kda_head_dim disagree", name);
        }
    }
    get_int(&r, SC_KDA, N1("short_conv_kernel_size"), true, &c->conv_kernel);
    get_num(&r, SC_KDA, N1("gate_lower_bound"), true, &c->gate_lower_bound);
    get_int(&r, SC_TEXT, N1("num_attention_heads"), true, &c->mla_heads);
    get_int(&r, SC_TEXT, N1("q_lora_rank"), true, &c->q_lora_rank);
    get_int(&r, SC_TEXT, N1("kv_lora_rank"), true, &c->kv_lora_rank);
    get_int(&r, SC_TEXT, N1("qk_nope_head_dim"), true, &c->qk_nope_dim);
    get_int(&r, SC_TEXT, N1("qk_rope_head_dim"), true, &c->qk_rope_dim);
    get_int(&r, SC_TEXT, N1("v_head_dim"), true, &c->v_head_dim);
    get_int(&r, SC_TEXT, N1("num_experts"), true, &c->num_experts);
    get_int(&r, SC_TEXT, N1("num_experts_per_token"), true, &c->experts_per_token);
    get_int(&r, SC_TEXT, N1("num_shared_experts"), true, &c->num_shared_experts);
    get_int(&r, SC_TEXT, N1("routed_expert_hidden_size"), true, &c->latent_dim);
    get_int(&r, SC_TEXT, N1("moe_intermediate_size"), true, &c->moe_inter);
    get_int(&r, SC_TEXT, N1("intermediate_size"), true, &c->dense_inter);
    get_num(&r, SC_TEXT, N1("routed_scaling_factor"), true, &c->routed_scaling_factor);
    get_int(&r, SC_TEXT, N1("first_k_dense_replace"), true, &c->first_k_dense_replace);
    get_int(&r, SC_TEXT, N1("attn_res_block_size"), true, &c->attn_res_block_size);
    get_num(&r, SC_TEXT, N2("activation_situ_beta", "situ_beta"), true, &c->situ_beta);
    get_num(&r, SC_TEXT, N2("activation_situ_linear_beta", "situ_linear_beta"), true, &c->situ_linear_beta);
    const char *fal_as = "full_attn_layers";
    json_t *fal = find(&r, SC_KDA, N1("full_attn_layers"), &fal_as);
    if (!fal) list_add(&r, r.missing, sizeof r.missing, "full_attn_layers");
    else if (!json_is_array(fal)) list_add(&r, r.badtype, sizeof r.badtype, "full_attn_layers (want array)");
    const char *kl_as = "kda_layers";
    json_t *kdl = find(&r, SC_KDA, N1("kda_layers"), &kl_as);
    if (kdl && !json_is_array(kdl)) list_add(&r, r.badtype, sizeof r.badtype, "kda_layers (want array)");

    /* optional keys, each default recorded */
    c->mla_output_gate = false;
    if (!get_bool(&r, "mla_use_output_gate", false, &c->mla_output_gate))
        list_add(&r, r.defaults, sizeof r.defaults, "mla_use_output_gate=false");
    c->latent_moe_use_norm = false;
    if (!get_bool(&r, "latent_moe_use_norm", false, &c->latent_moe_use_norm))
        list_add(&r, r.defaults, sizeof r.defaults, "latent_moe_use_norm=false");
    c->moe_renormalize = true;
    if (!get_bool(&r, "moe_renormalize", false, &c->moe_renormalize))
        list_add(&r, r.defaults, sizeof r.defaults, "moe_renormalize=true");
    c->moe_layer_freq = 1;
    if (!get_int(&r, SC_TEXT, N1("moe_layer_freq"), false, &c->moe_layer_freq))
        list_add(&r, r.defaults, sizeof r.defaults, "moe_layer_freq=1");
    c->bos_token_id = c->eos_token_id = c->pad_token_id = -1;
    get_int(&r, SC_TEXT, N1("bos_token_id"), false, &c->bos_token_id);
    get_int(&r, SC_TEXT, N1("eos_token_id"), false, &c->eos_token_id);
    get_int(&r, SC_TEXT, N1("pad_token_id"), false, &c->pad_token_id);
    int kv_heads = -1, n_group = 1, topk_group = 1;
    get_int(&r, SC_TEXT, N1("num_key_value_heads"), false, &kv_heads);
    get_int(&r, SC_TEXT, N1("num_expert_group"), false, &n_group);
    get_int(&r, SC_TEXT, N1("topk_group"), false, &topk_group);
    bool nope = true, tie = false, full_rank = true;
    get_bool(&r, "mla_use_nope", false, &nope);
    get_bool(&r, "tie_word_embeddings", false, &tie);
    {
        const char *as;
        json_t *v = r.lac ? find(&r, SC_LAC_ONLY, N1("use_full_rank_gate"), &as) : NULL;
        if (v && !json_is_boolean(v)) list_add(&r, r.badtype, sizeof r.badtype, "use_full_rank_gate (want true/false)");
        else if (v) full_rank = json_is_true(v);
    }
    c->mla_latent_eps = 1e-6f; /* fixed in the reference (spec section 9) */

    if (rc) goto out;
    if (r.code) {
        rc = r.code;
        goto out;
    }
    if (r.missing[0] || r.badtype[0]) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: %s%s%s%s%s%s", name, r.missing[0] ? "missing required keys: " : "",
                     r.missing, r.missing[0] && r.badtype[0] ? "; " : "", r.badtype[0] ? "wrong type: " : "",
                     r.badtype, r.overflow ? " (and more)" : "");
        goto out;
    }

    /* validation */
    const struct { const char *k; long long v; } pos[] = {
        {"hidden_size", c->hidden_size}, {"num_hidden_layers", c->num_layers},
        {"vocab_size", c->vocab_size}, {"kda head count", c->kda_heads},
        {"kda head_dim", c->kda_head_dim}, {"short_conv_kernel_size", c->conv_kernel},
        {"num_attention_heads", c->mla_heads}, {"q_lora_rank", c->q_lora_rank},
        {"kv_lora_rank", c->kv_lora_rank}, {"qk_nope_head_dim", c->qk_nope_dim},
        {"v_head_dim", c->v_head_dim},
        {"num_experts", c->num_experts}, {"num_experts_per_token", c->experts_per_token},
        {"routed_expert_hidden_size", c->latent_dim}, {"moe_intermediate_size", c->moe_inter},
        {"attn_res_block_size", c->attn_res_block_size}, {"moe_layer_freq", c->moe_layer_freq},
    };
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if ((rc = positive(&r, pos[i].k, pos[i].v))) goto out;
    /* sizes derived from the dimensions: every one computed in 64 bits here,
     * so that the int arithmetic of the model and the trainer cannot wrap.
     * A derived dimension (a projection's row count) stays within
     * K3_MAX_DIM, one matrix within K3_MAX_MATRIX elements. */
    {
        const int64_t kp = (int64_t)c->kda_heads * c->kda_head_dim;
        const int64_t qk = (int64_t)c->qk_nope_dim + c->qk_rope_dim;
        const struct { const char *what; int64_t v; } dims[] = {
            {"num_heads x head_dim (KDA)", kp},
            {"num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)", (int64_t)c->mla_heads * qk},
            {"num_attention_heads x (qk_nope_head_dim + v_head_dim)",
             (int64_t)c->mla_heads * ((int64_t)c->qk_nope_dim + c->v_head_dim)},
            {"2 x num_attention_heads", 2 * (int64_t)c->mla_heads},
            {"kv_lora_rank + qk_rope_head_dim", (int64_t)c->kv_lora_rank + c->qk_rope_dim},
            {"num_shared_experts x moe_intermediate_size", (int64_t)c->num_shared_experts * c->moe_inter},
            {"num_experts x num_experts_per_token", (int64_t)c->num_experts * c->experts_per_token},
        };
        for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
            if (dims[i].v > K3_MAX_DIM) {
                rc = k3_fail(err, K3_EXIT_USAGE, "%s: %s = %lld is too large (at most %d)", name, dims[i].what,
                             (long long)dims[i].v, K3_MAX_DIM);
                goto out;
            }
        const int64_t E = c->hidden_size;
        const struct { const char *what; int64_t a, b; } mats[] = {
            {"vocab_size x hidden_size", c->vocab_size, E},
            {"intermediate_size x hidden_size", c->dense_inter, E},
            {"KDA projection", kp, E},
            {"KDA short conv", kp, c->conv_kernel},
            {"q_b_proj", (int64_t)c->mla_heads * qk, c->q_lora_rank},
            {"q_a_proj", c->q_lora_rank, E},
            {"kv_a_proj", (int64_t)c->kv_lora_rank + c->qk_rope_dim, E},
            {"kv_b_proj", (int64_t)c->mla_heads * ((int64_t)c->qk_nope_dim + c->v_head_dim), c->kv_lora_rank},
            {"MLA o_proj", (int64_t)c->mla_heads * c->v_head_dim, E},
            {"router", c->num_experts, E},
            {"latent projection", c->latent_dim, E},
            {"routed expert", c->moe_inter, c->latent_dim},
            {"shared experts", (int64_t)c->num_shared_experts * c->moe_inter, E},
        };
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
            uint64_t n;
            if (!k3_mul_ok((uint64_t)mats[i].a, (uint64_t)mats[i].b, &n) || n > K3_MAX_MATRIX) {
                rc = k3_fail(err, K3_EXIT_USAGE, "%s: the %s matrix (%lld x %lld) is too large (at most %lld elements)",
                             name, mats[i].what, (long long)mats[i].a, (long long)mats[i].b, (long long)K3_MAX_MATRIX);
                goto out;
            }
        }
    }
    if (c->num_layers > K3_MAX_LAYERS) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: num_hidden_layers %d exceeds %d", name, c->num_layers, K3_MAX_LAYERS);
        goto out;
    }
    if (c->experts_per_token > c->num_experts) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: num_experts_per_token %d exceeds num_experts %d", name,
                     c->experts_per_token, c->num_experts);
        goto out;
    }
    /* qk_rope_head_dim 0 is allowed: NoPE means the rope slots are never
     * rotated, so a model may simply have none (smol K3 does this) */
    if (c->num_shared_experts < 0 || c->first_k_dense_replace < 0 || c->dense_inter < 0 || c->qk_rope_dim < 0) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: num_shared_experts, first_k_dense_replace, intermediate_size and qk_rope_head_dim must not be negative",
                     name);
        goto out;
    }
    if (!(c->rms_eps > 0) || !isfinite(c->rms_eps)) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: rms_norm_eps must be a positive number", name);
        goto out;
    }
    if (!isfinite(c->gate_lower_bound) || !(c->routed_scaling_factor > 0) || !isfinite(c->routed_scaling_factor) ||
        !(c->situ_beta > 0) || !isfinite(c->situ_beta) || !(c->situ_linear_beta > 0) || !isfinite(c->situ_linear_beta)) {
        rc = k3_fail(err, K3_EXIT_USAGE,
                     "%s: gate_lower_bound must be finite; routed_scaling_factor and the SiTU betas positive and finite",
                     name);
        goto out;
    }
    int tok[3] = {c->bos_token_id, c->eos_token_id, c->pad_token_id};
    const char *tokn[3] = {"bos_token_id", "eos_token_id", "pad_token_id"};
    for (int i = 0; i < 3; i++)
        if (tok[i] < -1 || tok[i] >= c->vocab_size) {
            rc = k3_fail(err, K3_EXIT_USAGE, "%s: %s %d is outside the vocabulary (%d)", name, tokn[i], tok[i],
                         c->vocab_size);
            goto out;
        }
    if (!nope) { rc = k3_fail(err, K3_EXIT_USAGE, "%s: mla_use_nope must be true (K3 MLA has no RoPE)", name); goto out; }
    if (tie) { rc = k3_fail(err, K3_EXIT_USAGE, "%s: tie_word_embeddings true is not supported (K3 has a separate lm_head)", name); goto out; }
    if (!full_rank) { rc = k3_fail(err, K3_EXIT_USAGE, "%s: use_full_rank_gate false (low-rank KDA gate) is not supported", name); goto out; }
    if (kv_heads != -1 && kv_heads != c->mla_heads) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: num_key_value_heads %d differs from num_attention_heads %d (grouped MLA heads are not supported)",
                     name, kv_heads, c->mla_heads);
        goto out;
    }
    if (n_group > 1 && n_group > topk_group) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: group-limited routing (num_expert_group %d, topk_group %d) is not supported",
                     name, n_group, topk_group);
        goto out;
    }
    if ((rc = check_string(&r, "hidden_act", "situ", "only SiTU-GLU is supported"))) goto out;
    if ((rc = check_string(&r, "moe_router_activation_func", "sigmoid", "only the sigmoid router is supported"))) goto out;
    if ((rc = read_quant(&r, c))) goto out;
    if (c->experts_mxfp4_declared && (c->latent_dim % c->mxfp4_group || c->moe_inter % c->mxfp4_group)) {
        rc = k3_fail(err, K3_EXIT_USAGE,
                     "%s: routed_expert_hidden_size %d and moe_intermediate_size %d must be multiples of the MXFP4 group %d",
                     name, c->latent_dim, c->moe_inter, c->mxfp4_group);
        goto out;
    }

    /* layer map */
    int L = c->num_layers;
    bool mla[K3_MAX_LAYERS] = {0}, kda[K3_MAX_LAYERS] = {0};
    if ((rc = read_layer_list(&r, fal, "full_attn_layers", L, mla))) goto out;
    if (json_array_size(fal) == 0) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: full_attn_layers is empty (the layer map needs at least one MLA layer)", name);
        goto out;
    }
    if (json_array_size(fal) >= (size_t)L) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: full_attn_layers lists every layer (at least one KDA layer is required)", name);
        goto out;
    }
    if (kdl) {
        if ((rc = read_layer_list(&r, kdl, "kda_layers", L, kda))) goto out;
        for (int l = 0; l < L; l++)
            if (kda[l] == mla[l]) {
                rc = k3_fail(err, K3_EXIT_USAGE, "%s: kda_layers and full_attn_layers are not complements: layer %d is in %s",
                             name, l + 1, kda[l] ? "both" : "neither");
                goto out;
            }
    }
    for (int l = 0; l < L; l++) {
        /* the reference assigns from kda_layers; with the check above both agree */
        bool is_kda = kdl ? kda[l] : !mla[l];
        c->layer_kind[l] = is_kda ? 'K' : 'M';
        c->layer_dense[l] = l < c->first_k_dense_replace || l % c->moe_layer_freq != 0;
    }
    count_kinds(c);
    bool any_dense = false;
    for (int l = 0; l < L; l++) any_dense |= c->layer_dense[l];
    if (any_dense && c->dense_inter <= 0) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: intermediate_size must be positive (the model has dense layers)", name);
        goto out;
    }
    if (!any_dense) c->dense_inter = 0;
    if (r.overflow) list_add(&r, r.defaults, sizeof r.defaults, "...");
    snprintf(c->defaults_used, sizeof c->defaults_used, "%s", r.defaults);
out:
    json_decref(root);
    if (rc) memset(c, 0, sizeof *c);
    return rc;
}

int k3_config_first_layers(k3_config *cfg, int layers, const char *dir, k3_err *err) {
    if (layers > cfg->num_layers)
        return k3_fail(err, K3_EXIT_USAGE, "--layers %d: %s has only %d layers", layers, dir, cfg->num_layers);
    if (layers <= 0 || layers == cfg->num_layers) return K3_OK;
    cfg->num_layers = layers;
    count_kinds(cfg);
    return K3_OK;
}

int k3_config_load(const char *path, k3_config *cfg, k3_err *err) {
    struct stat st;
    char *p = NULL;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        size_t n = strlen(path) + 16;
        p = xmalloc(n);
        snprintf(p, n, "%s/config.json", path);
        path = p;
    }
    char *text;
    int rc = k3_read_file(path, &text, NULL, err);
    if (rc == K3_OK) {
        rc = k3_config_parse(text, path, cfg, err);
        free(text);
    }
    free(p);
    return rc;
}

void k3_config_layer_map(const k3_config *cfg, char *buf, size_t n) {
    if (!n) return;
    size_t L = (size_t)cfg->num_layers;
    if (L > n - 1) L = n - 1;
    memcpy(buf, cfg->layer_kind, L);
    buf[L] = 0;
}

/* Finds name under the released prefix or bare. */
static const st_tensor *find_any(const st_index *ix, const char *a, const char *b) {
    const st_tensor *t = st_find(ix, a);
    return t ? t : st_find(ix, b);
}

const char *k3_names_prefix(const st_index *ix) {
    if (!st_find(ix, K3N_PREFIX K3N_EMBED) && st_find(ix, K3N_PREFIX_PLAIN K3N_EMBED)) return K3N_PREFIX_PLAIN;
    return K3N_PREFIX;
}

const char *k3_names_head(const char *prefix) {
    return !strcmp(prefix, K3N_PREFIX_PLAIN) ? K3N_HEAD : K3N_HEAD_FULL;
}

int k3_config_check_index(const k3_config *c, const st_index *ix, k3_err *err) {
    struct { const char *a, *b, *what; } mats[] = {
        {K3N_PREFIX K3N_EMBED, K3N_PREFIX_PLAIN K3N_EMBED, "embedding"},
        {K3N_HEAD_FULL, K3N_HEAD, "lm_head"},
    };
    for (int i = 0; i < 2; i++) {
        const st_tensor *t = find_any(ix, mats[i].a, mats[i].b);
        if (!t) return k3_fail(err, K3_EXIT_DATA, "%s: checkpoint has no %s tensor (%s)",
                               st_shard_at(ix, 0)->path, mats[i].what, mats[i].a);
        if (t->rank != 2 || t->shape[0] != c->vocab_size || t->shape[1] != c->hidden_size)
            return k3_fail(err, K3_EXIT_DATA, "%s: %s '%s' is [%lld, %lld] but the config says vocab_size %d x hidden_size %d",
                           st_shard_at(ix, t->shard)->path, mats[i].what, t->name,
                           (long long)(t->rank > 0 ? t->shape[0] : -1), (long long)(t->rank > 1 ? t->shape[1] : -1),
                           c->vocab_size, c->hidden_size);
    }
    /* MXFP4 experts stored as packed U8 need both expert dims divisible by the group */
    size_t n = st_count(ix);
    for (size_t i = 0; i < n; i++) {
        const st_tensor *t = st_at(ix, i);
        const char *s = strstr(t->name, ".experts.");
        if (s && strstr(s, ".weight_packed") && t->dtype == ST_U8) {
            if (c->latent_dim % c->mxfp4_group || c->moe_inter % c->mxfp4_group)
                return k3_fail(err, K3_EXIT_DATA,
                               "%s: MXFP4 experts need routed_expert_hidden_size %d and moe_intermediate_size %d divisible by %d",
                               st_shard_at(ix, t->shard)->path, c->latent_dim, c->moe_inter, c->mxfp4_group);
            break;
        }
    }
    return K3_OK;
}
