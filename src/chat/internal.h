/* internal.h: helpers shared by the chat template and the output parser. */
#ifndef K3_CHAT_INTERNAL_H
#define K3_CHAT_INTERNAL_H

#include "chat/chat.h"

struct k3_chat {
    const k3_tokenizer *tok;
    k3_chat_ids ids;
};

/* json.dumps(v, ensure_ascii=False) as CPython writes it: separators (",",
 * ":") when compact, else (", ", ": "); sort_keys sorts every object's keys
 * (encoding_k3's deep_sort_dict, by code point = by UTF-8 bytes); reals as
 * repr(float). */
void chat_pyjson(k3_sbuf *b, const json_t *v, bool compact, bool sort_keys);
void chat_pyjson_string(k3_sbuf *b, const char *s, size_t n);

/* Moves the longest prefix of in[0..n) made of complete UTF-8 characters to
 * out; a byte that cannot start or continue a valid character becomes U+FFFD.
 * Returns how many bytes were consumed; the rest is an incomplete character
 * (at most 3 bytes) unless final, in which case it becomes U+FFFD too. */
size_t chat_utf8_take(const uint8_t *in, size_t n, bool final, k3_sbuf *out);

#endif
