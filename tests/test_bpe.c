/* Tests for the BPE trainer: exactness against the CS336 reference merges and
 * vocabulary, tie-breaking and overlap on hand-made corpora whose merges are
 * derived by hand below, special-token handling, and the written tokenizer
 * loaded back through tok_load. */
#include "harness.h"
#include "tokenizer/bpe_train.h"
#include "tokenizer/tokenizer.h"

#include <jansson.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* GPT-2's byte <-> printable-code-point map (the alphabet of the reference
 * files): bytes 33..126, 161..172, 174..255 stand for themselves; the other 68
 * bytes, in increasing order, become U+0100, U+0101, ... */
static int unicode_to_byte(uint32_t cp) {
    if ((cp >= 33 && cp <= 126) || (cp >= 161 && cp <= 172) || (cp >= 174 && cp <= 255)) return (int)cp;
    uint32_t n = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        if (printable) continue;
        if (256 + n == cp) return b;
        n++;
    }
    return -1;
}

/* Decodes a UTF-8 string in the GPT-2 alphabet into raw bytes; -1 on error. */
static long gpt2_decode(const char *s, size_t n, uint8_t *out) {
    long o = 0;
    for (size_t i = 0; i < n;) {
        uint8_t c = (uint8_t)s[i];
        uint32_t cp;
        if (c < 0x80) { cp = c; i += 1; }
        else if ((c & 0xe0) == 0xc0 && i + 1 < n) { cp = ((uint32_t)(c & 0x1f) << 6) | (s[i + 1] & 0x3f); i += 2; }
        else return -1;
        int b = unicode_to_byte(cp);
        if (b < 0) return -1;
        out[o++] = (uint8_t)b;
    }
    return o;
}

static bool tok_is(const bpe_model *m, int32_t id, const uint8_t *s, size_t n) {
    return id >= 0 && id < m->n_tokens && m->lens[id] == n && memcmp(m->bytes[id], s, n) == 0;
}

static bool tok_is_str(const bpe_model *m, int32_t id, const char *s) {
    return tok_is(m, id, (const uint8_t *)s, strlen(s));
}

static int cmp_bytes_ptr(const void *x, const void *y) {
    const uint8_t *const *a = x, *const *b = y;
    /* entries are [len byte][bytes...] */
    size_t la = (*a)[0], lb = (*b)[0];
    int c = memcmp(*a + 1, *b + 1, la < lb ? la : lb);
    return c ? c : (la < lb ? -1 : la > lb);
}

static const char *const EOT[] = {"<|endoftext|>"};

TEST(bpe_matches_cs336_reference) {
    char *text;
    size_t len;
    k3_err err = {0};
    CHECK(k3_read_file(t_fixture("cs336-bpe/corpus.en"), &text, &len, &err) == 0);
    tok_splitter *sp;
    CHECK(tok_splitter_new(TOK_PATTERN_GPT2, &sp, &err) == 0);
    bpe_counts *c = bpe_counts_new();
    CHECKF(bpe_count_text(c, sp, text, len, EOT, 1, NULL, &err) == 0, "%s", err.msg);
    /* vocab 500 = 1 special + 256 bytes + 243 merges; the CS336 reference
     * keeps duplicate byte strings, so no reuse here */
    bpe_train_opts o = {.target_tokens = 500 - 1, .unique_tokens = false};
    bpe_model m;
    CHECKF(bpe_train(c, &o, &m, &err) == 0, "%s", err.msg);
    CHECKF(m.n_merges == 243 && m.n_tokens == 499, "merges %d tokens %d", m.n_merges, m.n_tokens);

    char *ref;
    size_t rlen;
    CHECK(k3_read_file(t_fixture("cs336-bpe/train-bpe-reference-merges.txt"), &ref, &rlen, &err) == 0);
    int line = 0;
    uint8_t l[256], r[256];
    for (char *p = ref, *nl; p < ref + rlen; p = nl + 1, line++) {
        nl = memchr(p, '\n', (size_t)(ref + rlen - p));
        if (!nl) nl = ref + rlen;
        char *sp1 = memchr(p, ' ', (size_t)(nl - p));
        CHECKF(sp1, "merges line %d has no space", line + 1);
        long ln = gpt2_decode(p, (size_t)(sp1 - p), l), rn = gpt2_decode(sp1 + 1, (size_t)(nl - sp1 - 1), r);
        CHECKF(ln > 0 && rn > 0, "merges line %d: bad token", line + 1);
        CHECKF(line < m.n_merges, "reference has more merges than we made (%d)", m.n_merges);
        const bpe_merge *mg = &m.merges[line];
        CHECKF(tok_is(&m, mg->left, l, (size_t)ln) && tok_is(&m, mg->right, r, (size_t)rn),
               "merge %d differs: got (%.*s | %.*s), reference line '%.*s'", line + 1,
               (int)m.lens[mg->left], (const char *)m.bytes[mg->left], (int)m.lens[mg->right],
               (const char *)m.bytes[mg->right], (int)(nl - p), p);
        CHECKF(mg->result == 256 + line, "merge %d made id %d", line + 1, mg->result);
    }
    CHECKF(line == 243, "reference has %d merges", line);

    /* vocabulary: ids 0..499 with the special at 0; the set of byte strings
     * equals ours (special + 256 bytes + merged tokens); and reference ids
     * 257.. follow merge order, as our ids 256.. do */
    json_error_t je;
    json_t *v = json_load_file(t_fixture("cs336-bpe/train-bpe-reference-vocab.json"), 0, &je);
    CHECKF(v && json_object_size(v) == 500, "vocab json: %s", v ? "wrong size" : je.text);
    uint8_t **refs = xcalloc(500, sizeof *refs), **ours = xcalloc(500, sizeof *ours);
    bool seen[500] = {0};
    const char *key;
    json_t *val;
    int nref = 0;
    json_object_foreach(v, key, val) {
        json_int_t id = json_integer_value(val);
        CHECKF(json_is_integer(val) && id >= 0 && id < 500 && !seen[id], "vocab id %lld", (long long)id);
        seen[id] = true;
        uint8_t *e = xmalloc(257);
        long n = gpt2_decode(key, strlen(key), e + 1);
        CHECKF(n > 0 && n < 256, "vocab key '%s'", key);
        e[0] = (uint8_t)n;
        if (id == 0) CHECKF(strcmp(key, "<|endoftext|>") == 0, "id 0 is '%s'", key);
        if (id >= 257) CHECKF(tok_is(&m, (int32_t)id - 1, e + 1, (size_t)n), "vocab id %lld '%s' is not our token %lld", (long long)id, key, (long long)id - 1);
        refs[nref++] = e;
    }
    ours[0] = xmalloc(257);
    ours[0][0] = 13;
    memcpy(ours[0] + 1, "<|endoftext|>", 13);
    for (int i = 0; i < m.n_tokens; i++) {
        ours[i + 1] = xmalloc(257);
        ours[i + 1][0] = (uint8_t)m.lens[i];
        memcpy(ours[i + 1] + 1, m.bytes[i], m.lens[i]);
    }
    qsort(refs, 500, sizeof *refs, cmp_bytes_ptr);
    qsort(ours, 500, sizeof *ours, cmp_bytes_ptr);
    for (int i = 0; i < 500; i++)
        CHECKF(cmp_bytes_ptr(&refs[i], &ours[i]) == 0, "vocab byte strings differ at sorted index %d", i);
    for (int i = 0; i < 500; i++) free(refs[i]), free(ours[i]);
    free(refs);
    free(ours);
    json_decref(v);
    free(ref);
    bpe_model_free(&m);
    bpe_counts_free(c);
    tok_splitter_free(sp);
    free(text);
}

/* Hand-derived merges (pieces added directly, no pre-tokenizer):
 *   "ab" x10, "abx" x3, "zy" x3, "qr" x2, "qs" x2
 * Pair counts: (a,b)=13 (b,x)=3 (z,y)=3 (q,r)=2 (q,s)=2.
 *  1. (a,b) 13 -> "ab" (256). "abx" becomes [ab][x]: (b,x) 0, (ab,x) 3.
 *  2. (ab,x) 3 vs (z,y) 3: "z" > "ab" as byte strings (although id 256 > 'z'),
 *     so (z,y) -> "zy" (257).
 *  3. (ab,x) 3 -> "abx" (258).
 *  4. (q,r) 2 vs (q,s) 2: left equal, "s" > "r": (q,s) -> "qs" (259).
 *  5. (q,r) -> "qr" (260). No pairs left, so training stops at 261 tokens. */
TEST(bpe_ties_go_to_the_greater_pair) {
    bpe_counts *c = bpe_counts_new();
    bpe_counts_add(c, (const uint8_t *)"ab", 2, 10);
    bpe_counts_add(c, (const uint8_t *)"abx", 3, 3);
    bpe_counts_add(c, (const uint8_t *)"zy", 2, 3);
    bpe_counts_add(c, (const uint8_t *)"qr", 2, 2);
    bpe_counts_add(c, (const uint8_t *)"qs", 2, 2);
    bpe_train_opts o = {.target_tokens = 300, .unique_tokens = true};
    bpe_model m;
    k3_err err = {0};
    CHECKF(bpe_train(c, &o, &m, &err) == 0, "%s", err.msg);
    CHECKF(m.n_merges == 5 && m.n_tokens == 261, "merges %d tokens %d", m.n_merges, m.n_tokens);
    const char *want[5] = {"ab", "zy", "abx", "qs", "qr"};
    for (int i = 0; i < 5; i++) CHECKF(tok_is_str(&m, 256 + i, want[i]), "token %d", 256 + i);
    CHECK(m.merges[0].left == 'a' && m.merges[0].right == 'b');
    CHECK(m.merges[2].left == 256 && m.merges[2].right == 'x');
    bpe_model_free(&m);
    bpe_counts_free(c);
}

/* Overlapping pairs, hand-derived: "aaa" x1, "aaaa" x1.
 *  (a,a) = 2 + 3 = 5.
 *  1. (a,a) -> "aa" (256), left to right: "aaa" = [aa][a], "aaaa" = [aa][aa];
 *     (a,a) must fall to exactly 0, (aa,a) = 1, (aa,aa) = 1.
 *  2. tie at 1: left equal, "aa" > "a": (aa,aa) -> "aaaa" (257).
 *  3. (aa,a) -> "aaa" (258). */
TEST(bpe_overlapping_pairs_merge_left_to_right) {
    bpe_counts *c = bpe_counts_new();
    bpe_counts_add(c, (const uint8_t *)"aaa", 3, 1);
    bpe_counts_add(c, (const uint8_t *)"aaaa", 4, 1);
    bpe_train_opts o = {.target_tokens = 1000};
    bpe_model m;
    k3_err err = {0};
    CHECKF(bpe_train(c, &o, &m, &err) == 0, "%s", err.msg);
    CHECKF(m.n_tokens == 259, "tokens %d", m.n_tokens);
    CHECK(tok_is_str(&m, 256, "aa") && tok_is_str(&m, 257, "aaaa") && tok_is_str(&m, 258, "aaa"));
    CHECK(m.merges[1].left == 256 && m.merges[1].right == 256);
    CHECK(m.merges[2].left == 256 && m.merges[2].right == 'a');
    /* target smaller than what the corpus allows stops early */
    bpe_model m2;
    o.target_tokens = 257;
    CHECK(bpe_train(c, &o, &m2, &err) == 0);
    CHECK(m2.n_tokens == 257 && m2.n_merges == 1);
    bpe_model_free(&m2);
    bpe_model_free(&m);
    bpe_counts_free(c);
}

/* The special is cut out before the pattern runs, so no piece (and therefore
 * no merge) spans it, and the special's own bytes are never counted. */
TEST(bpe_special_token_is_never_merged) {
    tok_splitter *sp;
    k3_err err = {0};
    CHECK(tok_splitter_new(TOK_PATTERN_GPT2, &sp, &err) == 0);
    const char *text = "hello<|endoftext|>hello<|endoftext|><|endoftext|>!hello";
    bpe_counts *c = bpe_counts_new();
    CHECKF(bpe_count_text(c, sp, text, strlen(text), EOT, 1, NULL, &err) == 0, "%s", err.msg);
    /* pieces: "hello" x3, "!" x1; with the GPT-2 pattern "!hello" splits as
     * "!" + "hello" */
    CHECKF(bpe_counts_get(c, (const uint8_t *)"hello", 5) == 3, "hello %llu",
           (unsigned long long)bpe_counts_get(c, (const uint8_t *)"hello", 5));
    CHECK(bpe_counts_get(c, (const uint8_t *)"!", 1) == 1);
    CHECK(bpe_counts_total(c) == 4 && bpe_counts_unique(c) == 2);
    CHECK(bpe_counts_get(c, (const uint8_t *)"<|", 2) == 0);
    /* without the special, its bytes are text: "<|" is a piece of its own */
    bpe_counts *c2 = bpe_counts_new();
    CHECK(bpe_count_text(c2, sp, text, strlen(text), NULL, 0, NULL, &err) == 0);
    CHECK(bpe_counts_get(c2, (const uint8_t *)"<|", 2) > 0);
    /* documents: same counts whether counted as one text or as documents */
    const char *docs[3] = {"hello", "hello", "!hello"};
    size_t lens[3] = {5, 5, 6};
    bpe_counts *c3 = bpe_counts_new();
    CHECK(bpe_count_docs(c3, sp, docs, lens, 3, EOT, 1, NULL, &err) == 0);
    CHECK(bpe_counts_get(c3, (const uint8_t *)"hello", 5) == 3 && bpe_counts_total(c3) == 4);
    /* a special inside a document is cut out too */
    const char *d4[1] = {"ab<|endoftext|>ab"};
    size_t l4[1] = {17};
    bpe_counts *c4 = bpe_counts_new();
    CHECK(bpe_count_docs(c4, sp, d4, l4, 1, EOT, 1, NULL, &err) == 0);
    CHECK(bpe_counts_get(c4, (const uint8_t *)"ab", 2) == 2 && bpe_counts_total(c4) == 2);
    /* invalid UTF-8 is an error, not a silent skip */
    const char *bad[1] = {"ok \xff bad"};
    size_t lbad[1] = {8};
    bpe_counts *c5 = bpe_counts_new();
    CHECK(bpe_count_docs(c5, sp, bad, lbad, 1, EOT, 1, NULL, &err) != 0);
    bpe_counts_free(c5);
    bpe_counts_free(c4);
    bpe_counts_free(c3);
    bpe_counts_free(c2);
    bpe_counts_free(c);
    tok_splitter_free(sp);
}

/* Counting is the same whatever the thread count (the merged maps hold the
 * same counts), so training gives the same merges. */
TEST(bpe_counts_do_not_depend_on_threads) {
    char *text;
    size_t len;
    k3_err err = {0};
    CHECK(k3_read_file(t_fixture("cs336-bpe/tinystories_sample.txt"), &text, &len, &err) == 0);
    tok_splitter *sp;
    CHECK(tok_splitter_new(TOK_PATTERN_KIMI, &sp, &err) == 0);
    bpe_model m[2];
    for (int r = 0; r < 2; r++) {
        omp_set_num_threads(r == 0 ? 1 : 3);
        bpe_counts *c = bpe_counts_new();
        CHECK(bpe_count_text(c, sp, text, len, EOT, 1, NULL, &err) == 0);
        bpe_train_opts o = {.target_tokens = 400, .unique_tokens = true};
        CHECK(bpe_train(c, &o, &m[r], &err) == 0);
        bpe_counts_free(c);
    }
    CHECK(m[0].n_merges == m[1].n_merges && m[0].n_merges > 100);
    CHECK(memcmp(m[0].merges, m[1].merges, (size_t)m[0].n_merges * sizeof(bpe_merge)) == 0);
    bpe_model_free(&m[0]);
    bpe_model_free(&m[1]);
    tok_splitter_free(sp);
    free(text);
}

/* Train on TinyStories text with the Kimi pattern, write tiktoken.model +
 * tokenizer_config.json, load it with tok_load: encoding the training text
 * gives exactly the ids that replaying the learned merges gives (tiktoken's
 * lowest-rank-first equals creation order), <|endoftext|> is the special id
 * after the ranks, and decoding returns the text byte for byte. */
TEST(bpe_tokenizer_roundtrips_through_tok_load) {
    char *text;
    size_t len;
    k3_err err = {0};
    CHECK(k3_read_file(t_fixture("tinystories/valid.txt"), &text, &len, &err) == 0);
    len = 200000; /* about 250 stories; cut at a story end below */
    while (len > 0 && !(len >= 15 && memcmp(text + len - 15, "\n<|endoftext|>\n", 15) == 0)) len--;
    CHECK(len > 100000);
    tok_splitter *sp;
    CHECK(tok_splitter_new(TOK_PATTERN_KIMI, &sp, &err) == 0);
    bpe_counts *c = bpe_counts_new();
    CHECK(bpe_count_text(c, sp, text, len, EOT, 1, NULL, &err) == 0);
    bpe_train_opts o = {.target_tokens = 1023, .unique_tokens = true};
    bpe_model m;
    CHECK(bpe_train(c, &o, &m, &err) == 0);
    CHECK(m.n_tokens == 1023);
    CHECKF(bpe_write_tiktoken(&m, t_outdir(), EOT, 1, 256, "<|endoftext|>", "kimi", &err) == 0, "%s", err.msg);
    k3_tokenizer *tk;
    CHECKF(tok_load(t_outdir(), &tk, &err) == 0, "%s", err.msg);
    CHECK(tok_n_base(tk) == 1023);
    CHECK(tok_vocab_size(tk) == 1023 + 256); /* the reserved block of the Kimi layout */
    CHECKF(tok_special_id(tk, "<|endoftext|>") == 1023, "eot id %d", tok_special_id(tk, "<|endoftext|>"));
    CHECK(tok_eos_id(tk) == 1023);

    int32_t *ids;
    size_t n;
    CHECKF(tok_encode(tk, text, len, true, &ids, &n, &err) == 0, "%s", err.msg);
    /* expected: per story, the pieces' merges replayed; the separator line
     * "\n<|endoftext|>\n" is "\n", the special, "\n" */
    struct { int32_t *ids; size_t n, cap; } a = {0};
    CHECK(bpe_encode_reference(&m, sp, text, len, "<|endoftext|>", 1023, &a.ids, &a.n, &a.cap, &err) == 0);
    CHECKF(a.n == n, "tok_encode gave %zu ids, replayed merges %zu", n, a.n);
    for (size_t i = 0; i < n; i++) CHECKF(ids[i] == a.ids[i], "id %zu: %d vs %d", i, ids[i], a.ids[i]);
    uint8_t *back;
    size_t blen;
    CHECK(tok_decode(tk, ids, n, &back, &blen, &err) == 0);
    CHECK(blen == len && memcmp(back, text, len) == 0);
    /* compression sanity: a 1k vocabulary on its own training text */
    CHECKF((double)len / (double)n > 2.5, "bytes/token %.2f", (double)len / (double)n);
    free(back);
    free(ids);
    free(a.ids);
    tok_free(tk);
    bpe_model_free(&m);
    bpe_counts_free(c);
    tok_splitter_free(sp);
    free(text);
}
