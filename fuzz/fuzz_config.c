/* libFuzzer harness for the strict config reader.
 *
 * Input: JSON text. k3_config_parse must either refuse it (exit code 2, one
 * line naming the input) or accept it with a self-consistent result: a layer
 * map of K and M only, counts that add up, k <= N_e, positive sizes. Anything
 * else aborts, which libFuzzer reports. */
#include "formats/config.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    k3_config c;
    k3_err err = {0};
    int rc = k3_config_parse(text, "fuzz.json", &c, &err);
    free(text);
    if (rc) {
        if (rc != K3_EXIT_USAGE || strchr(err.msg, '\n') || strncmp(err.msg, "fuzz.json: ", 11)) abort();
        return 0;
    }
    if (c.num_layers < 1 || c.num_layers > K3_MAX_LAYERS) abort();
    int k = 0, m = 0;
    for (int l = 0; l < c.num_layers; l++) {
        if (c.layer_kind[l] == 'K') k++;
        else if (c.layer_kind[l] == 'M') m++;
        else abort();
        if (c.layer_dense[l] && c.dense_inter <= 0) abort();
    }
    if (k != c.n_kda_layers || m != c.n_mla_layers || k == 0 || m == 0) abort();
    if (c.experts_per_token < 1 || c.experts_per_token > c.num_experts) abort();
    if (c.hidden_size < 1 || c.vocab_size < 1 || c.kda_heads < 1 || c.attn_res_block_size < 1) abort();
    if (!(c.rms_eps > 0) || c.mla_latent_eps != 1e-6f) abort();
    char map[K3_MAX_LAYERS + 1];
    k3_config_layer_map(&c, map, sizeof map);
    if (strlen(map) != (size_t)c.num_layers) abort();
    return 0;
}
