/* chat.h: the Kimi K3 chat template (XTML) and the streaming output parser.
 *
 * Input side. k3_chat_encode turns an OpenAI-shaped chat request into the
 * prompt ids the K3 release's own encoder (encoding_k3.py) gives for it. The
 * encoder works in segments: markup ([open] [close] [sep] [end_of_msg] and
 * expanded image prompts) and text. Every text segment (tag and attribute
 * names, attribute values, message text, JSON bodies) is encoded on its own
 * with specials disabled, so text a user or a tool types can never become a
 * control token, and adjacent segments are never merged (` role` + `="` +
 * `user` is three encodes). The grammar as implemented is in docs/chat.md.
 *
 * Output side. k3_chat_parser splits generated ids into reasoning, response
 * and tool calls by token id: only the XTML ids open and close elements and
 * only <|end_of_msg|> / [EOS] stop. Text is never searched for markup, so a
 * model that spells "<|close|>" as ordinary tokens writes that text. The
 * parser starts inside the channel the generation prefix opened (think when
 * thinking is on), so output cut off before the think channel closes is
 * reasoning, never content. Deltas hold whole UTF-8 characters only.
 *
 * Invariants: the module never exits or prints; every failure is a k3_err
 * (K3_EXIT_USAGE for a bad request or a tokenizer without XTML ids). It holds
 * no global state; a k3_chat may be shared by threads (read-only), a parser
 * belongs to one thread. */
#ifndef K3_CHAT_H
#define K3_CHAT_H

#include <jansson.h>

#include "tokenizer/tokenizer.h"
#include "util/common.h"

typedef struct k3_chat k3_chat; /* the XTML ids resolved from a tokenizer + the tokenizer */

/* Resolves the markup ids by name: the K3 release spells them <|open|>
 * <|close|> <|sep|> <|end_of_msg|>; the Kimi tokenizer_config gives the same
 * ids the names <|im_user|> <|im_assistant|> <|reserved_token_163589|>
 * <|im_end|>. One complete set must be present, else K3_EXIT_USAGE with
 * "tokenizer has no XTML ids (<|open|> <|close|> <|sep|> <|end_of_msg|>): not
 * a chat model" (callers put the tokenizer directory in front). [EOS] and the
 * media ids are optional. tok must outlive the k3_chat. */
int k3_chat_new(const k3_tokenizer *tok, k3_chat **out, k3_err *err);
void k3_chat_free(k3_chat *c);

/* The markup ids (eos is -1 when the tokenizer has no [EOS]). */
typedef struct {
    int32_t open, close, sep, end_of_msg, eos;
} k3_chat_ids;
k3_chat_ids k3_chat_markup(const k3_chat *c);

/* request: a JSON object with the fields of the fixtures' "request":
 *   messages (required): [{role: system|user|assistant|tool, content: string |
 *     [{type: "text", text} | {type: "image"|"image_url", ...}] | null, name,
 *     reasoning_content (or reasoning), tool_calls: [{id, type, function:
 *     {name, arguments: JSON string or object}}], tool_call_id, tool; a system
 *     message with a non-empty "tools" array is a dynamic tool declaration}]
 *   tools: [...]                      declared before all messages
 *   tool_choice: "auto"|"none"|"required"|{...}   (none and required render)
 *   response_format: {type: "text"|"json_object"|"json_schema", json_schema}
 *   thinking: bool (default true)     think channel in history and prefix
 *   thinking_effort: "low"|"high"|"max" | null (default: no effort message;
 *     the release's apply_chat_template passes "max"; ignored when thinking
 *     is off; "medium" is refused, as the release encoder refuses it)
 *   add_generation_prompt: bool (default true)
 *   image_prompts: [string]           expanded media markup, one per image
 * Other top-level fields are ignored here (k3_chat_check_fields rejects
 * them). A bad shape is K3_EXIT_USAGE with a message that names the field,
 * e.g. "messages[2].role: want one of system, user, assistant, tool".
 * *ids is malloc'd. */
int k3_chat_encode(const k3_chat *c, const json_t *request, int32_t **ids, size_t *n, k3_err *err);
/* k3_chat_encode that also reports where each rendered message ends: *ends
 * (malloc'd, *nends entries, increasing) holds the offset just past every
 * <|end_of_msg|> the template wrote (tool declarations, the effort and
 * tool-choice messages, and each of the request's messages), so ids[0..end)
 * is the conversation up to that message: the boundaries a state cache
 * snapshots (k3_session_prefill_marked). */
int k3_chat_encode_marked(const k3_chat *c, const json_t *request, int32_t **ids, size_t *n, size_t **ends,
                          size_t *nends, k3_err *err);
/* K3_EXIT_USAGE "request.FIELD: unknown field" for a top-level field that
 * k3_chat_encode does not read (for strict callers such as the CLI). */
int k3_chat_check_fields(const json_t *request, k3_err *err);

bool k3_chat_is_stop(const k3_chat *c, int32_t id); /* <|end_of_msg|> or [EOS] */

/* ---- output side ------------------------------------------------------ */
typedef struct k3_chat_parser k3_chat_parser;
/* thinking: the prompt's generation prefix opened the think channel (else it
 * opened the response channel). */
k3_chat_parser *k3_chat_parser_new(const k3_chat *c, bool thinking);

typedef struct {
    const char *reasoning; size_t reasoning_len; /* new reasoning text (valid until next feed) */
    const char *content; size_t content_len;     /* new response text */
    json_t *tool_call; /* a completed call {"id","type":"function","function":{"name","arguments"}}
                          (owned by the parser, valid until the next feed) or NULL; ids are
                          call_1, call_2, ... within the message (a server may rename them);
                          arguments is a JSON string (docs/chat.md) */
    bool stop;         /* <|end_of_msg|> or [EOS] seen: the message ended */
} k3_chat_delta;

/* Feeds one generated id. Ids after the stop are ignored (d->stop stays
 * true). Fails (K3_EXIT_USAGE) only for an id outside the vocabulary. */
int k3_chat_parser_feed(k3_chat_parser *p, int32_t id, k3_chat_delta *d, k3_err *err);

/* Streaming callers call this once at the end: the text held back for an
 * incomplete UTF-8 character, as a last delta (an incomplete character
 * becomes U+FFFD). k3_chat_parser_message does it too. */
void k3_chat_parser_flush(k3_chat_parser *p, k3_chat_delta *d);

/* At the end (stopped, or cut off by a length limit): the whole message as a
 * new JSON object {"role":"assistant", "content": string or null (null when
 * empty and there are tool calls), "reasoning_content" (thinking only),
 * "tool_calls" (only when there are any)}. Flushes first; a tool call still
 * open is dropped. *finish_reason: "length" when cut_off and no stop was seen, else
 * "tool_calls" when there are calls, else "stop". The caller owns the result. */
json_t *k3_chat_parser_message(k3_chat_parser *p, bool cut_off, const char **finish_reason);
void k3_chat_parser_free(k3_chat_parser *p);

#endif
