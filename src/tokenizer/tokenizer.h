/* tokenizer.h: the Kimi tiktoken-style byte-level BPE tokenizer.
 *
 * Loads tiktoken.model (base64 token, rank per line) + tokenizer_config.json
 * (named specials in added_tokens_decoder; 256 reserved ids after the base
 * ranks, or "num_reserved_special_tokens" of them, unnamed ones are
 * <|reserved_token_N|>; "pretokenizer": "kimi" (default) or "gpt2"). Pre-tokenizes with the exact
 * Kimi pattern (PCRE2, UTF + Unicode properties, JIT), then merges byte pairs
 * by lowest rank. Byte-for-byte identical to tiktoken. */
#ifndef K3_TOKENIZER_H
#define K3_TOKENIZER_H

#include "util/common.h"

typedef struct k3_tokenizer k3_tokenizer;

/* dir holds tiktoken.model and (optionally) tokenizer_config.json. */
int tok_load(const char *dir, k3_tokenizer **out, k3_err *err);
void tok_free(k3_tokenizer *t);

int tok_vocab_size(const k3_tokenizer *t);    /* base ranks + specials */
int tok_n_base(const k3_tokenizer *t);        /* number of BPE ranks */
int tok_eos_id(const k3_tokenizer *t);        /* from config eos_token, -1 if none */
int tok_bos_id(const k3_tokenizer *t);
int tok_special_id(const k3_tokenizer *t, const char *name); /* -1 if not a special */
size_t tok_max_token_bytes(const k3_tokenizer *t); /* longest token or special name */

/* Encode UTF-8 text. allow_special: special names in the text (the named ones
 * and <|reserved_token_N|>) become their ids (tiktoken encode(text, "all"));
 * otherwise they are plain text (encode_ordinary). *ids is malloc'd. Invalid UTF-8 is
 * an error (K3_EXIT_USAGE). Safe to call concurrently on one tokenizer; inputs
 * of 1 MiB and more are encoded in parallel (OpenMP) with the same ids. */
int tok_encode(const k3_tokenizer *t, const char *text, size_t len, bool allow_special,
               int32_t **ids, size_t *n, k3_err *err);

/* A position >= at (or len) where text can be cut and both sides encoded
 * separately with exactly the ids of encoding it whole (a '\n' followed by
 * printable ASCII). For streaming long inputs; tok_encode already uses it to
 * encode inputs of 1 MiB and more in parallel. */
size_t tok_safe_cut(const k3_tokenizer *t, const char *text, size_t len, size_t at);

/* The bytes of one id (NULL for an id outside the vocabulary). */
const uint8_t *tok_token_bytes(const k3_tokenizer *t, int32_t id, size_t *len);
/* All ids to bytes; *out is malloc'd (not NUL-terminated, *len set). */
int tok_decode(const k3_tokenizer *t, const int32_t *ids, size_t n, uint8_t **out, size_t *len,
               k3_err *err);

/* Incremental decoder: feed ids one at a time; emits only complete UTF-8
 * sequences (a partial multi-byte character is held back until completed;
 * bytes that can never form valid UTF-8 are emitted as they are at flush). */
typedef struct {
    const k3_tokenizer *tok;
    uint8_t pending[8];
    int npending;
} tok_stream;
void tok_stream_init(tok_stream *s, const k3_tokenizer *t);
/* Appends printable bytes to out (capacity cap); returns bytes written.
 * cap must be at least tok_max_token_bytes(t) + 3 (a token plus a held-back
 * partial character); the concatenated output of feed + flush is always
 * exactly the concatenated token bytes. */
size_t tok_stream_feed(tok_stream *s, int32_t id, uint8_t *out, size_t cap);
size_t tok_stream_flush(tok_stream *s, uint8_t *out, size_t cap);

/* ---- pre-tokenization (also used by the BPE trainer) ------------------- */
/* The Kimi pattern rewritten for PCRE2 (class intersections expanded) and the
 * GPT-2 pattern. */
extern const char *const TOK_PATTERN_KIMI;
extern const char *const TOK_PATTERN_GPT2;
typedef struct tok_splitter tok_splitter;
int tok_splitter_new(const char *pattern, tok_splitter **out, k3_err *err);
void tok_splitter_free(tok_splitter *s);
/* Calls cb for every piece of text (consecutive, covering all of it, in order).
 * Thread-safe for concurrent calls on one splitter. Returns nonzero (and fills
 * err) on a regex or UTF-8 error; a nonzero return from cb stops early. */
int tok_split(const tok_splitter *s, const char *text, size_t len,
              int (*cb)(const char *piece, size_t n, void *ctx), void *ctx, k3_err *err);
/* Strict UTF-8 check (no overlongs, surrogates or code points past U+10FFFF):
 * the offset of the first invalid byte, or len when all of it is valid. */
size_t tok_utf8_check(const uint8_t *p, size_t len);

#endif
