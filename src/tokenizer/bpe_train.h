/* bpe_train.h: exact byte-level BPE training (what `k3 prepare` runs).
 *
 * Two steps. (1) Count pre-tokens: the text is first cut at every special
 * token (which is dropped, so no merge ever crosses one), each segment is then
 * split by the pre-tokenizer pattern (tokenizer.h tok_split), and each piece's
 * bytes are counted. (2) Train: start from the 256 single bytes, repeatedly
 * merge the most frequent adjacent pair of tokens inside the pieces; a tie in
 * frequency goes to the lexicographically greater pair, comparing (left,
 * right) as byte strings (Python's max over (bytes, bytes) tuples, the CS336
 * rule). Pair counts are updated incrementally, only in the pieces that hold
 * the merged pair, so the cost per merge is proportional to where the pair
 * occurs, not to the corpus.
 *
 * Token ids of the result: 0..255 are the single bytes (id = byte value), then
 * one id per new token in creation order. Written as tiktoken.model these ids
 * are the ranks, and because ranks follow creation order, tiktoken's
 * "merge the lowest-rank pair first" replays the training merges. */
#ifndef K3_BPE_TRAIN_H
#define K3_BPE_TRAIN_H

#include "tokenizer/tokenizer.h"
#include "util/common.h"

/* ---- pre-token counts ---------------------------------------------------- */
typedef struct bpe_counts bpe_counts;
bpe_counts *bpe_counts_new(void);
void bpe_counts_free(bpe_counts *c);
/* n must be below 4 GiB (a longer piece exits like an allocation failure). */
void bpe_counts_add(bpe_counts *c, const uint8_t *bytes, size_t n, uint64_t count);
void bpe_counts_merge(bpe_counts *dst, const bpe_counts *src); /* dst += src */
size_t bpe_counts_unique(const bpe_counts *c);                 /* distinct pieces */
uint64_t bpe_counts_total(const bpe_counts *c);                /* pieces counted */
/* Count of one piece (0 if never seen); for tests. */
uint64_t bpe_counts_get(const bpe_counts *c, const uint8_t *bytes, size_t n);

/* Counts the pre-tokens of n_docs documents (OpenMP over documents, one map
 * per thread, summed at the end: the counts do not depend on the thread
 * count). Each document is cut at the specials first, then split with sp.
 * progress (may be NULL) advances by document bytes. Returns nonzero with err
 * set on invalid UTF-8 or a regex failure (the first failing document). */
int bpe_count_docs(bpe_counts *c, const tok_splitter *sp, const char *const *docs,
                   const size_t *lens, size_t n_docs, const char *const *specials,
                   int n_specials, k3_progress *progress, k3_err *err);
/* One text (e.g. a whole file): cut at the specials into documents, then as
 * bpe_count_docs. */
int bpe_count_text(bpe_counts *c, const tok_splitter *sp, const char *text, size_t len,
                   const char *const *specials, int n_specials, k3_progress *progress,
                   k3_err *err);

/* ---- training ------------------------------------------------------------ */
typedef struct {
    /* Stop when this many tokens exist (256 bytes + one per new token), or
     * earlier when no pair is left. */
    int target_tokens;
    /* A merge whose bytes equal an existing token (e.g. (a, bc) after (ab, c))
     * reuses that token's id instead of adding a second token with the same
     * bytes. tiktoken maps bytes to ranks, so a tokenizer that is written as
     * tiktoken.model needs this; the CS336 reference does not (it keeps the
     * duplicate), so the exactness test turns it off. */
    bool unique_tokens;
    /* Show a progress bar over merges (common.h k3_progress rules). */
    bool progress;
} bpe_train_opts;

typedef struct {
    int32_t left, right, result; /* token ids */
} bpe_merge;

typedef struct {
    int n_tokens;      /* 256 + new tokens */
    uint8_t **bytes;   /* [n_tokens] token bytes */
    uint32_t *lens;    /* [n_tokens] */
    int n_merges;      /* merges in creation order (> n_tokens-256 only when reused) */
    bpe_merge *merges; /* [n_merges] */
    struct bpe_pair_index *index; /* pair -> merge lookup for bpe_apply_merges */
} bpe_model;

int bpe_train(const bpe_counts *c, const bpe_train_opts *opts, bpe_model *out, k3_err *err);
void bpe_model_free(bpe_model *m);

/* Applies the merges to bytes in creation order, each merge over the whole
 * sequence left to right (the training-time semantics), appending ids to
 * *ids (capacity *cap, grown with xrealloc) from position *n. For tests and
 * for checking that a tiktoken-style encoder agrees. */
void bpe_apply_merges(const bpe_model *m, const uint8_t *bytes, size_t len, int32_t **ids,
                      size_t *n, size_t *cap);

/* The reference encoder built on it: text split by sp (the pre-tokenizer),
 * each piece's merges replayed, and every occurrence of the string special
 * emitted as special_id (the document separator). Appends to *ids as
 * bpe_apply_merges does. Slow on purpose: it is what a fast tiktoken-style
 * encoder of the trained vocabulary must agree with. */
int bpe_encode_reference(const bpe_model *m, const tok_splitter *sp, const char *text, size_t len,
                         const char *special, int32_t special_id, int32_t **ids, size_t *n, size_t *cap,
                         k3_err *err);

/* ---- output -------------------------------------------------------------- */
/* Writes dir/tiktoken.model (base64 of each token's bytes, then its id as
 * the rank) and dir/tokenizer_config.json: the specials as ids n_tokens,
 * n_tokens+1, ... in added_tokens_decoder, inside a block of n_reserved ids
 * after the ranks (the Kimi layout that tok_load reads has 256);
 * num_reserved_special_tokens; eos_token and bos_token set to eos, which must
 * be one of the specials; "pretokenizer": pattern_name. Both files are written
 * atomically. Requires unique token bytes. dir must exist. */
int bpe_write_tiktoken(const bpe_model *m, const char *dir, const char *const *specials,
                       int n_specials, int n_reserved, const char *eos,
                       const char *pattern_name, k3_err *err);

#endif
