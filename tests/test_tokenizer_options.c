/* tokenizer_config.json options that shape loading: the reserved-special
 * count and the pre-tokenization pattern. */
#include "harness.h"
#include "tokenizer/tokenizer.h"

#include <stdlib.h>
#include <string.h>

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* A tokenizer dir with the 256 byte tokens plus "b'" (rank 256) and the given config. */
static const char *make_dir(const char *name, const char *config) {
    static char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", t_outdir(), name);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", dir);
    if (system(cmd) != 0) return NULL;
    char path[1200];
    snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    FILE *f = fopen(path, "w");
    for (int b = 0; b < 256; b++) {
        unsigned v = (unsigned)b << 16;
        fprintf(f, "%c%c== %d\n", B64[(v >> 18) & 63], B64[(v >> 12) & 63], b);
    }
    fprintf(f, "Yic= 256\n"); /* "b'" */
    fclose(f);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    f = fopen(path, "w");
    fputs(config, f);
    fclose(f);
    return dir;
}

TEST(tokenizer_honours_reserved_count_and_pattern) {
    const char *dir = make_dir("opt1", "{\"num_reserved_special_tokens\": 1, \"pretokenizer\": \"gpt2\","
                                       " \"added_tokens_decoder\": {\"257\": {\"content\": \"<|endoftext|>\"}},"
                                       " \"eos_token\": \"<|endoftext|>\"}");
    CHECK(dir);
    k3_tokenizer *t;
    k3_err err = {0};
    CHECKF(tok_load(dir, &t, &err) == 0, "%s", err.msg);
    CHECK(tok_vocab_size(t) == 258 && tok_n_base(t) == 257);
    CHECK(tok_eos_id(t) == 257);
    /* GPT-2 cuts "ab'll" into "ab" + "'ll", so the merge "b'" never applies;
     * the Kimi pattern keeps "ab'll" whole and merges it. */
    int32_t *ids; size_t n;
    CHECK(tok_encode(t, "ab'll<|endoftext|>", 18, true, &ids, &n, &err) == 0);
    CHECKF(n == 6 && ids[1] == 'b' && ids[2] == '\'' && ids[5] == 257, "n=%zu", n);
    free(ids);
    tok_free(t);
    dir = make_dir("opt1k", "{\"num_reserved_special_tokens\": 1}");
    CHECKF(tok_load(dir, &t, &err) == 0, "%s", err.msg);
    CHECK(tok_encode(t, "ab'll", 5, false, &ids, &n, &err) == 0);
    CHECKF(n == 4 && ids[1] == 256, "n=%zu", n);
    free(ids);
    tok_free(t);
}

TEST(tokenizer_default_reserves_256) {
    const char *dir = make_dir("opt2", "{}");
    k3_tokenizer *t;
    k3_err err = {0};
    CHECKF(tok_load(dir, &t, &err) == 0, "%s", err.msg);
    CHECK(tok_vocab_size(t) == 257 + 256);
    CHECK(tok_special_id(t, "<|reserved_token_257|>") == 257);
    tok_free(t);
}

TEST(tokenizer_rejects_bad_options) {
    k3_tokenizer *t;
    k3_err err = {0};
    const char *dir = make_dir("opt3", "{\"num_reserved_special_tokens\": 0}");
    CHECK(tok_load(dir, &t, &err) == K3_EXIT_USAGE);
    CHECK(strstr(err.msg, "num_reserved_special_tokens") != NULL);
    dir = make_dir("opt4", "{\"pretokenizer\": \"bert\"}");
    CHECK(tok_load(dir, &t, &err) == K3_EXIT_USAGE);
    CHECK(strstr(err.msg, "pretokenizer") != NULL);
}
