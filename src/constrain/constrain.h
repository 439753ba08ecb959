/* constrain.h: structured output. At each generation step only the tokens
 * that keep the output a valid prefix of the wanted shape may be sampled.
 *
 * Three layers:
 *  - k3_jschema: a JSON Schema compiled to a small node table (the subset
 *    clients send: type object/array/string/number/integer/boolean/null, or a
 *    list of them; properties, required, enum, const, items,
 *    additionalProperties false/true/schema; annotations such as title and
 *    description). Any other keyword is refused, naming it (path and
 *    keyword), never ignored. NULL schema text = json_object: any object.
 *  - k3_jstate: a pushdown machine over output bytes. feed() accepts exactly
 *    the byte strings that are a prefix of some JSON text (RFC 8259, UTF-8)
 *    valid against the schema, within the bounds below; done() says the text
 *    is a complete value. Every state it accepts can still be completed (no
 *    dead ends), so a mask built from it never leaves the sampler nothing.
 *  - k3_constraint: one chat reply. It allows free reasoning (thinking on)
 *    until the model closes its think channel, then forces the XTML that
 *    opens the response channel, masks the response with the machine, and
 *    after a complete value forces the close of the response and the end of
 *    the message. The mask is built from each token's bytes (k3_tokbytes,
 *    precomputed once per tokenizer: the base ids sorted by bytes, so tokens
 *    that share a prefix share its work and a rejected prefix rejects them
 *    all at once).
 *  - k3_callspec: the tools a reply calls. Under tool_choice "required" or
 *    a named function the reply is the template's assistant tool call
 *    (docs/chat.md): an empty response channel, then
 *      [open]tools[sep] CALL+ [close]tools[sep] [close]message[sep] [end_of_msg]
 *    with each CALL
 *      [open]call tool="NAME" index="I"[sep]
 *      ([open]argument key="K" type="T"[sep] VALUE [close]argument[sep])*
 *      [close]call[sep]
 *    where I counts the calls from 1, NAME is one of the tools (masked among
 *    their names), each K a declared parameter at most once, every required
 *    one present, T one of the parameter's types (string number boolean
 *    null array object), and VALUE the value as the parser reads it back: a
 *    string's raw text for type="string" (valid UTF-8 without NUL; fed to
 *    the machine as its JSON escapes), else JSON, masked by the machine on
 *    the parameter's schema. Names are spelled as the template spells
 *    attributes (& and " as &amp; &quot;). "required" with parallel calls:
 *    one or more calls; without, and a named function (OpenAI: "exactly one
 *    specific function"): one.
 *    Under "auto" the reply is free (any id) except where it opens a call:
 *    an [open] header that would read as a call (its first word "call") may
 *    only spell `call tool="`, then NAME is chosen among all the tools; a
 *    strict tool's call goes on as above up to its [close]call[sep], after
 *    which the reply is free again; a loose (not strict) tool's call is free
 *    text from its name on. Without parallel calls a second call header is
 *    refused. With no strict tool, only that count is enforced (no name is
 *    chosen), and with parallel calls there is nothing to enforce.
 *
 * Bounds (everything a client controls is bounded): schema nesting
 * K3_JSCHEMA_MAX_DEPTH, nodes K3_JSCHEMA_MAX_NODES, properties per object and
 * enum values K3_JSCHEMA_MAX_SET, an enum value's text K3_JSCHEMA_MAX_LIT
 * bytes; output nesting K3_JSON_MAX_DEPTH; whitespace runs K3_JSON_MAX_WS
 * bytes (none after the value ends, so the output cannot run on in
 * whitespace); integers at most 18 digits before the point (they fit a
 * 64-bit integer), 16 after it, exponents 2 digits (finite doubles).
 * Strings: valid UTF-8, escapes as RFC 8259 (surrogates paired; no \u0000).
 * Enum and const values must be written as compact JSON (jansson's
 * json_dumps form); property names declared with additionalProperties false
 * likewise.
 *
 * Invariants: deterministic (the mask is a function of the state and the
 * token bytes only); the module holds no global state; compiled schemas and
 * k3_tokbytes are read-only after creation and may be shared by threads; a
 * state or constraint belongs to one thread. */
#ifndef K3_CONSTRAIN_H
#define K3_CONSTRAIN_H

#include "chat/chat.h"
#include "tokenizer/tokenizer.h"
#include "util/common.h"

#include <jansson.h>

#define K3_JSCHEMA_MAX_DEPTH 16
#define K3_JSCHEMA_MAX_NODES 1024
#define K3_JSCHEMA_MAX_SET 64
#define K3_JSCHEMA_MAX_LIT 4096
#define K3_JSON_MAX_DEPTH 32
#define K3_JSON_MAX_WS 16

typedef struct k3_jschema k3_jschema;

/* Compiles schema (NULL: json_object, any object). On a refusal returns
 * K3_EXIT_USAGE with err naming the keyword; where[nwhere] receives the
 * keyword's path below the schema ("properties.age.minimum", "" for the
 * root's own). */
int k3_jschema_compile(const json_t *schema, k3_jschema **out, char *where, size_t nwhere, k3_err *err);
void k3_jschema_free(k3_jschema *s);
/* Whether v is valid against the schema (what the machine generates, as a
 * parsed value; used for enum/const and by tests). */
bool k3_jschema_valid(const k3_jschema *s, const json_t *v);

/* One output frame (an open object or array). */
typedef struct {
    uint64_t used;   /* object: declared properties written */
    uint16_t node;   /* schema node of the container */
    uint16_t vnode;  /* object: the node of the current key's value */
    uint8_t kind;    /* object or array */
    uint8_t phase;
} k3_jframe;

typedef struct {
    const k3_jschema *s;
    /* the scalar being written (a string, number or literal) */
    uint64_t cand;   /* literal: candidates still matching */
    uint64_t hash;   /* string: hash of its decoded bytes (keys) */
    uint16_t snode;  /* its node (key: the object's node) */
    uint16_t pos;    /* literal: bytes matched */
    uint8_t sk;      /* scalar kind (none, string, number, literal) */
    uint8_t sp;      /* its phase */
    uint8_t list;    /* literal: which list (enum, keys, true/false/null) */
    uint8_t key;     /* the string is an object key */
    uint8_t u8need, u8lo, u8hi; /* UTF-8: continuation bytes due, bounds of the next */
    uint8_t hexn, ndig, nfrac, nexp;
    uint8_t ws;      /* whitespace bytes in a row */
    uint8_t done;    /* the top value is complete */
    uint16_t hexv;
    uint32_t hi;     /* string: the high surrogate awaiting its low half */
    uint16_t root;   /* node of the top value */
    uint8_t rtypes;  /* the top value's types are held to these (0: as the schema says) */
    uint8_t raw;     /* the top value is a string written raw: bytes are its text, not JSON */
    int16_t depth;
    k3_jframe f[K3_JSON_MAX_DEPTH]; /* only f[0..depth) is meaningful (copies copy that much) */
} k3_jstate;

void k3_jstate_init(k3_jstate *st, const k3_jschema *s);
/* Feeds bytes; false: some byte makes the text invalid (st is then
 * unspecified: feed a copy to test). */
bool k3_jstate_feed(k3_jstate *st, const uint8_t *b, size_t n);
/* The text so far is a complete value (it may still go on: a number). */
bool k3_jstate_done(const k3_jstate *st);
/* Copies only the meaningful part. */
void k3_jstate_copy(k3_jstate *dst, const k3_jstate *src);

/* The base ids' bytes of a tokenizer, sorted for masking. */
typedef struct k3_tokbytes k3_tokbytes;
k3_tokbytes *k3_tokbytes_new(const k3_tokenizer *t);
void k3_tokbytes_free(k3_tokbytes *tb);
/* allow[id] = 1 for each base id (< tok_n_base) whose bytes st accepts, else
 * 0; returns how many. An id with no bytes is never allowed. */
size_t k3_jstate_mask(const k3_jstate *st, const k3_tokbytes *tb, uint8_t *allow);

/* ---- the tools a reply calls ---- */
#define K3_CALL_MAX_TOOLS 128  /* tools one reply may choose among */
#define K3_CALL_MAX_NAME 1024  /* bytes of a tool or parameter name as an attribute */
enum { K3_CALLS_REQUIRED, K3_CALLS_NAMED, K3_CALLS_AUTO };
typedef struct k3_callspec k3_callspec;
/* tools: the request's array ({type: "function", function: {name,
 * parameters, strict}}); how: tool_choice "required", a named function
 * (name: the one to call) or "auto"; parallel: parallel_tool_calls. Each
 * enforced tool's parameters (absent or null: none) must be an object
 * schema of the k3_jschema subset; a refusal is K3_EXIT_USAGE with where
 * naming the path ("tools[2].function.parameters.properties.age.minimum"),
 * as is a name declared twice, too long, or more than K3_CALL_MAX_TOOLS
 * tools to choose among. Enforced: every tool a "required" or named reply
 * may call; under "auto" the strict ones (function.strict true), the others
 * only by name. Parameters are written only from properties
 * (additionalProperties admits no extra argument). *out is NULL, with
 * K3_OK, where "auto" leaves nothing to enforce. */
int k3_callspec_compile(const json_t *tools, int how, const char *name, bool parallel, k3_callspec **out,
                        char *where, size_t nwhere, k3_err *err);
void k3_callspec_free(k3_callspec *cs);
/* What a compiled cs enforces: K3_CALLS_* (*how), whether a reply may make
 * more than one call (*multi) and how many tools a call may name. */
void k3_callspec_shape(const k3_callspec *cs, int *how, bool *multi, size_t *ntools);

/* ---- one chat reply ---- */
typedef struct k3_constraint k3_constraint;
/* schema: the compiled response_format (json_object or json_schema);
 * thinking: the generation prefix opened the think channel. */
k3_constraint *k3_constraint_new(const k3_jschema *schema, const k3_tokbytes *tb, const k3_chat *chat, int vocab,
                                 bool thinking);
/* A reply that calls cs's tools (the shapes above; thinking matters to
 * "required" and named replies). */
k3_constraint *k3_constraint_new_call(const k3_callspec *cs, const k3_tokbytes *tb, const k3_chat *chat, int vocab,
                                      bool thinking);
void k3_constraint_free(k3_constraint *c);
/* The row to sample from: row with every id that cannot continue the reply
 * at -INFINITY (a copy; row is not changed), or row itself where every id
 * can. NULL when no id can (the tokenizer lacks a byte the output needs):
 * the caller fails the request. */
const float *k3_constraint_apply(k3_constraint *c, const float *row);
/* A sampled id joins the reply; K3_EXIT_RUNTIME if it was not allowed. */
int k3_constraint_accept(k3_constraint *c, int32_t id, k3_err *err);

#endif
