/* corpus.h: a text corpus as documents, and documents as the token stream
 * the model is trained and evaluated on.
 *
 * One reader for `k3 prepare` (which writes the stream into shards) and
 * `k3 eval` (which scores it), so a file means the same tokens to both: the
 * trainer's validation split and `k3 eval --text` of the file it came from
 * score the same ids.
 *
 * Formats:
 *   stories  documents separated by a line that is exactly <|endoftext|>;
 *            the newline that ends a story's last line belongs to the
 *            separator (TinyStories' own layout)
 *   text     documents separated by one or more blank lines
 *   jsonl    one JSON object per line, its "text" field
 *   raw      the whole file is one document, byte for byte (only for
 *            callers that ask for it: `k3 eval --format raw`)
 * Documents that are only whitespace are dropped. Text must be strict UTF-8.
 *
 * The stream: each document's ids (specials written as text, such as
 * "<|endoftext|>", become their ids), then the separator id after it. The
 * ids do not depend on the thread count. */
#ifndef K3_TRAIN_CORPUS_H
#define K3_TRAIN_CORPUS_H

#include "tokenizer/tokenizer.h"
#include "util/common.h"

#define CORPUS_EOT_TEXT "<|endoftext|>"

typedef enum { CORPUS_AUTO, CORPUS_STORIES, CORPUS_TEXT, CORPUS_JSONL, CORPUS_RAW } corpus_format;

/* Documents pointing into mapped files or into text the corpus owns. */
typedef struct {
    const char **doc;
    size_t *len;
    size_t n, cap;
    uint64_t bytes;
    void **maps;
    size_t *map_lens;
    char **owned;
    size_t n_maps, n_owned;
} corpus;

/* "auto", "stories", "text", "jsonl", "raw"; false for anything else. */
bool corpus_parse_format(const char *s, corpus_format *out);
const char *corpus_format_name(corpus_format f);
/* What `auto` means for this file: jsonl for *.jsonl or a first '{',
 * stories when a separator line occurs, else `fallback`. */
corpus_format corpus_detect(const char *path, const char *text, size_t len, corpus_format fallback);
/* Adds the documents of a file (mapped, not copied). `fallback` is what
 * CORPUS_AUTO becomes when the file is neither jsonl nor stories; `used`
 * (may be NULL) receives the format read. Errors (unreadable, not a regular
 * file, invalid UTF-8 with its line) exit 2. */
int corpus_read_file(corpus *c, const char *path, corpus_format fmt, corpus_format fallback, corpus_format *used,
                     k3_err *err);
/* The same for text already in memory, which must outlive the corpus. */
int corpus_read_text(corpus *c, const char *name, const char *text, size_t len, corpus_format fmt,
                     corpus_format fallback, corpus_format *used, k3_err *err);
void corpus_free(corpus *c);

/* The id that follows each document: <|endoftext|>, else the tokenizer's
 * eos token; -1 if it has neither. */
int32_t corpus_separator_id(const k3_tokenizer *tk);

/* Encodes documents [0, n) and hands each one's ids, then {eot}, to `sink`
 * in document order (documents are encoded in parallel batches). `bytes` is
 * the document's length; `prog` (may be NULL) advances by it. */
typedef int (*corpus_sink)(void *ctx, const int32_t *ids, size_t n, size_t bytes, k3_err *err);
int corpus_encode(const k3_tokenizer *tk, const char *const *doc, const size_t *len, size_t n, int32_t eot,
                  corpus_sink sink, void *ctx, k3_progress *prog, k3_err *err);

#endif
