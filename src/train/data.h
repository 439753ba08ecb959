/* data.h: binary token shards, written by `k3 prepare` and read by `k3 train`.
 *
 * A shard is one file: a 64-byte header, then n_tokens token ids, little
 * endian, uint16 when the vocabulary has at most 65,536 ids, else uint32.
 *
 *   offset size  field
 *        0    8  magic "K3TOKENS"
 *        8    4  version (1)
 *       12    4  vocab_size       every id is < vocab_size
 *       16    4  token_bytes      2 or 4 (must match vocab_size as above)
 *       20    4  eot_id           the document separator id, or 0xFFFFFFFF
 *       24    8  n_tokens
 *       32    8  n_docs           documents in the shard
 *       40    8  tokenizer_hash   data_tokenizer_hash() of the tokenizer used
 *       48   16  zero
 *
 * The file size must be exactly 64 + n_tokens * token_bytes. Shards are
 * written atomically (temp file, fsync, rename), so a shard that exists is
 * complete. */
#ifndef K3_TRAIN_DATA_H
#define K3_TRAIN_DATA_H

#include "util/common.h"

#define K3_SHARD_MAGIC "K3TOKENS"
#define K3_SHARD_VERSION 1u
#define K3_SHARD_HEADER_BYTES 64u
#define K3_SHARD_NO_EOT 0xFFFFFFFFu

typedef struct {
    uint32_t version, vocab_size, token_bytes, eot_id;
    uint64_t n_tokens, n_docs, tokenizer_hash;
} k3_shard_info;

/* 64-bit FNV-1a over dir/tiktoken.model followed by dir/tokenizer_config.json
 * (absent config = empty): two shards with the same hash were made by the same
 * tokenizer files. */
int data_tokenizer_hash(const char *dir, uint64_t *hash, k3_err *err);

/* ---- writing ------------------------------------------------------------- */
typedef struct k3_shard_writer k3_shard_writer;
int shard_writer_open(const char *path, uint32_t vocab_size, uint32_t eot_id,
                      uint64_t tokenizer_hash, k3_shard_writer **out, k3_err *err);
/* Appends ids (each must be < vocab_size, else K3_EXIT_RUNTIME: a bug). */
int shard_writer_append(k3_shard_writer *w, const int32_t *ids, size_t n, k3_err *err);
void shard_writer_add_docs(k3_shard_writer *w, uint64_t n_docs);
/* Writes the final header and renames the temp file into place; frees w. */
int shard_writer_commit(k3_shard_writer *w, k3_shard_info *info, k3_err *err);
void shard_writer_abort(k3_shard_writer *w); /* removes the temp file; frees w */

/* ---- reading ------------------------------------------------------------- */
typedef struct {
    k3_shard_info info;
    const void *tokens; /* uint16_t or uint32_t array, per info.token_bytes */
    void *map;          /* the whole file, mmap'd read-only */
    size_t map_len;
} k3_shard;

/* Opens and validates a shard: magic, version, token width, exact file size
 * (a short file is "truncated": K3_EXIT_DATA), and every id < vocab_size
 * (K3_EXIT_DATA). expect_vocab / expect_hash (0 = do not check) must match the
 * header, else K3_EXIT_USAGE "shard was made with a different vocabulary /
 * tokenizer". */
int shard_open(const char *path, uint32_t expect_vocab, uint64_t expect_hash, k3_shard *s,
               k3_err *err);
void shard_close(k3_shard *s);

/* Opens DIR/<split>.bin (split "train" or "val") as written by k3 prepare,
 * checking it against the tokenizer in DIR (data_tokenizer_hash) and, if
 * expect_vocab is not 0, the vocabulary size. A directory without the shard
 * is K3_EXIT_USAGE "DIR: no train.bin (make it with k3 prepare)". */
int data_open_split(const char *dir, const char *split, uint32_t expect_vocab, k3_shard *s,
                    k3_err *err);

static inline int32_t shard_token(const k3_shard *s, uint64_t i) {
    return s->info.token_bytes == 2 ? (int32_t)((const uint16_t *)s->tokens)[i]
                                    : (int32_t)((const uint32_t *)s->tokens)[i];
}
/* Copies ids [start, start+n) (must lie inside the shard) into out. */
void shard_read(const k3_shard *s, uint64_t start, size_t n, int32_t *out);

#endif
