/* bench_bpe: times BPE tokenizer training on TinyStories text and checks the
 * result at scale.
 *
 *   bin/bench_bpe [--vocab N] [--pattern kimi|gpt2] [FILE...]
 *
 * Default: vocabulary 8192 (7936 BPE tokens + 256 special ids, as k3 prepare
 * lays it out), Kimi pattern, ../shared/data/tinystories/train.txt and
 * train-extra.txt. Prints the pre-token counting rate, the merge time, and an
 * extrapolation to the 2 GB TinyStories train file. Then writes the tokenizer
 * to a temporary directory, loads it with tok_load, encodes the first 2 MB of
 * the text and checks that the ids equal the learned merges replayed in
 * creation order (tiktoken's lowest-rank-first must agree with training). */
#include "tokenizer/bpe_train.h"
#include "tokenizer/tokenizer.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int die(const k3_err *e) {
    fprintf(stderr, "bench_bpe: %s\n", e->msg);
    return 1;
}

int main(int argc, char **argv) {
    int vocab = 8192;
    const char *pattern = "kimi";
    const char *files[64];
    int nf = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--vocab") && i + 1 < argc) vocab = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--pattern") && i + 1 < argc) pattern = argv[++i];
        else if (nf < 64) files[nf++] = argv[i];
    }
    if (!nf) {
        files[nf++] = "../shared/data/tinystories/train.txt";
        files[nf++] = "../shared/data/tinystories/train-extra.txt";
    }
    k3_err err = {0};
    size_t total = 0;
    char *text = NULL;
    for (int i = 0; i < nf; i++) {
        char *d;
        size_t n;
        if (k3_read_file(files[i], &d, &n, &err)) return die(&err);
        text = xrealloc(text, total + n + 1);
        memcpy(text + total, d, n);
        total += n;
        free(d);
    }
    static const char *const eot[1] = {"<|endoftext|>"};
    tok_splitter *sp;
    if (tok_splitter_new(strcmp(pattern, "gpt2") ? TOK_PATTERN_KIMI : TOK_PATTERN_GPT2, &sp, &err)) return die(&err);
    printf("corpus: %d file(s), %.2f MB; vocabulary %d (%d BPE tokens), pattern %s, %d threads\n", nf,
           (double)total / 1e6, vocab, vocab - 256, pattern, omp_get_max_threads());

    double t0 = k3_now();
    bpe_counts *c = bpe_counts_new();
    if (bpe_count_text(c, sp, text, total, eot, 1, NULL, &err)) return die(&err);
    double t_count = k3_now() - t0;
    t0 = k3_now();
    bpe_train_opts o = {.target_tokens = vocab - 256, .unique_tokens = true};
    bpe_model m;
    if (bpe_train(c, &o, &m, &err)) return die(&err);
    double t_merge = k3_now() - t0;
    printf("count pre-tokens: %.2f s (%.1f MB/s), %llu pieces, %zu distinct\n", t_count,
           (double)total / 1e6 / t_count, (unsigned long long)bpe_counts_total(c), bpe_counts_unique(c));
    printf("merges: %d in %.2f s (%.2f ms/merge)\n", m.n_merges, t_merge, 1e3 * t_merge / m.n_merges);
    /* Counting is linear in bytes. The merge phase works on distinct
     * pre-tokens, which grow much slower than the text (Heaps' law); scaling
     * it linearly too gives an upper bound. */
    double scale = 2.1e9 / (double)total;
    printf("extrapolated to 2.1 GB: counting %.0f s, merges <= %.0f s (linear bound), total <= %.1f min\n",
           t_count * scale, t_merge * scale, (t_count + t_merge) * scale / 60.0);

    char dir[] = "/tmp/k3-bench-bpe-XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    if (bpe_write_tiktoken(&m, dir, eot, 1, 256, "<|endoftext|>", pattern, &err)) return die(&err);
    k3_tokenizer *tk;
    if (tok_load(dir, &tk, &err)) return die(&err);
    size_t n_check = total < 2000000 ? total : 2000000;
    while (n_check < total && (text[n_check] & 0xc0) == 0x80) n_check++; /* whole characters */
    int32_t *ids;
    size_t n;
    t0 = k3_now();
    if (tok_encode(tk, text, n_check, true, &ids, &n, &err)) return die(&err);
    double t_enc = k3_now() - t0;
    int32_t eot_id = tok_special_id(tk, "<|endoftext|>");
    struct { int32_t *ids; size_t n, cap; } a = {0};
    if (bpe_encode_reference(&m, sp, text, n_check, "<|endoftext|>", eot_id, &a.ids, &a.n, &a.cap, &err))
        return die(&err);
    size_t diff = a.n == n ? 0 : 1;
    for (size_t i = 0; i < n && i < a.n; i++) diff += ids[i] != a.ids[i];
    printf("check: tok_load + tok_encode of the first %.1f MB: %zu ids, %.3f bytes/token, %.1f MB/s; "
           "replayed merges %s\n",
           (double)n_check / 1e6, n, (double)n_check / (double)n, (double)n_check / 1e6 / t_enc,
           diff ? "DIFFER" : "agree");
    char path[256];
    snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    unlink(path);
    rmdir(dir);
    free(ids);
    free(a.ids);
    tok_free(tk);
    bpe_model_free(&m);
    bpe_counts_free(c);
    tok_splitter_free(sp);
    free(text);
    return diff ? 1 : 0;
}
