/* bench/tokenizer.c: encode throughput of the Kimi tokenizer, in MB of UTF-8
 * input per second, on TinyStories (English) and on a multilingual text built
 * from the test corpus, single-threaded. tools/tiktoken-check/bench.js
 * measures npm tiktoken on the same two texts.
 *
 *   make bin/bench_tokenizer && bin/bench_tokenizer [TOK_DIR] */
#include "tokenizer/tokenizer.h"

#include <jansson.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* CPU time of this thread: the machines these figures come from are shared,
 * and wall time there measures the neighbours as much as the code. */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Texts of the corpus cases without specials and without the synthetic long
 * runs ("long_*"), concatenated and repeated to at least 1 MB (bench.js
 * builds the same text). */
static bool in_text(json_t *e) {
    return !json_is_true(json_object_get(e, "allow_special")) &&
           strncmp(json_string_value(json_object_get(e, "name")), "long_", 5) != 0;
}

static char *multilingual(size_t *len) {
    json_error_t je;
    json_t *c = json_load_file("tests/fixtures/tokenizer/corpus.json", JSON_ALLOW_NUL, &je);
    if (!c) {
        fprintf(stderr, "k3: tests/fixtures/tokenizer/corpus.json:%d: %s\n", je.line, je.text);
        exit(K3_EXIT_USAGE);
    }
    size_t one = 0;
    for (size_t i = 0; i < json_array_size(c); i++) {
        json_t *e = json_array_get(c, i);
        if (in_text(e)) one += json_string_length(json_object_get(e, "text"));
    }
    size_t reps = (1u << 20) / one + 1, w = 0;
    char *s = xmalloc(one * reps + 1);
    for (size_t r = 0; r < reps; r++)
        for (size_t i = 0; i < json_array_size(c); i++) {
            json_t *e = json_array_get(c, i);
            if (!in_text(e)) continue;
            json_t *t = json_object_get(e, "text");
            memcpy(s + w, json_string_value(t), json_string_length(t));
            w += json_string_length(t);
        }
    json_decref(c);
    *len = w;
    return s;
}

static void bench(const k3_tokenizer *t, const char *name, const char *text, size_t len) {
    k3_err err = {0};
    int32_t *ids;
    size_t n = 0;
    double best = 1e30, total = 0;
    int iters = 0;
    while (total < 2.0 || iters < 3) {
        double t0 = cpu_now();
        if (tok_encode(t, text, len, false, &ids, &n, &err)) {
            fprintf(stderr, "k3: %s\n", err.msg);
            exit(err.code);
        }
        double dt = cpu_now() - t0;
        free(ids);
        if (dt < best) best = dt;
        total += dt;
        iters++;
    }
    printf("%-14s %9zu bytes %8zu ids  encode %7.2f MB/s (CPU time, best of %d)\n", name, len, n,
           len / best / 1e6, iters);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "../shared/tokenizers/kimi";
    /* one thread, like tiktoken (tok_encode would otherwise cut inputs over
     * 1 MiB into chunks and encode them in parallel) */
    omp_set_num_threads(1);
    k3_err err = {0};
    k3_tokenizer *t;
    double t0 = k3_now();
    if (tok_load(dir, &t, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    printf("load %s: %.3f s\n", dir, k3_now() - t0);
    char *text;
    size_t len;
    if (k3_read_file("../shared/data/tinystories/train.txt", &text, &len, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    bench(t, "tinystories", text, len);
    free(text);
    text = multilingual(&len);
    bench(t, "multilingual", text, len);
    free(text);
    tok_free(t);
    return 0;
}
