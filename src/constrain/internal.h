/* internal.h: the constrain module's compiled schema, shared by its files.
 * Not a public header. */
#ifndef K3_CONSTRAIN_INTERNAL_H
#define K3_CONSTRAIN_INTERNAL_H

#include "constrain/constrain.h"

enum { T_OBJ = 1, T_ARR = 2, T_STR = 4, T_NUM = 8, T_INT = 16, T_BOOL = 32, T_NULL = 64, T_ANY = 127 };

typedef struct {
    char *s;       /* compact JSON text */
    uint32_t n;
} jlit;

typedef struct {
    uint8_t types;        /* T_* allowed */
    uint16_t nlit;        /* enum/const: the value is one of lit (0: no such keyword) */
    jlit *lit;
    json_t **litv;        /* the values themselves */
    /* object */
    uint16_t nprops;
    jlit *keys;           /* "name" as compact JSON */
    char **names;         /* the raw names */
    uint64_t *khash;      /* hash of each raw name (k3_jhash) */
    uint16_t *pnode;
    uint64_t required;    /* bits over the properties */
    int32_t addl;         /* additionalProperties: -1 none, else a node */
    /* array */
    int32_t items;
} jnode;

struct k3_jschema {
    jnode *nodes;         /* nodes[0]: any value */
    size_t n, cap;
    uint16_t root;
};

struct k3_tokbytes {
    const k3_tokenizer *tok;
    int nbase;
    size_t n;                 /* ids with bytes */
    int32_t *ord;             /* ids sorted by bytes */
    const uint8_t **p;        /* in that order */
    uint16_t *len, *lcp;      /* bytes; bytes shared with the previous one */
    uint8_t *plain;           /* string text that can neither end the string nor leave a character open */
    size_t maxlen;
};

/* The T_* bits of a JSON value's kind (a number is both). */
static inline uint8_t k3_jkind_bits(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return T_OBJ;
    case JSON_ARRAY: return T_ARR;
    case JSON_STRING: return T_STR;
    case JSON_INTEGER:
    case JSON_REAL: return T_NUM | T_INT;
    case JSON_TRUE:
    case JSON_FALSE: return T_BOOL;
    default: return T_NULL;
    }
}

/* The argument type names of the template (docs/chat.md) and their bits. */
#define K3_NCALL_TYPES 6
extern const struct k3_call_type {
    const char *attr; /* the type attribute's value and its closing quote: string" */
    uint8_t bits;
} k3_call_types[K3_NCALL_TYPES];

typedef struct {
    char *head;          /* NAME" index=" (the header after tool=", up to the
                            index's digits); loose: NAME" */
    bool loose;          /* not enforced: once named, the call is free text */
    uint32_t nhead;
    k3_jschema *params;  /* NULL: no parameters */
    uint16_t nargs;      /* the root's properties */
    char **khead;        /* per property: KEY" type=" */
    uint32_t *nkhead;
    uint8_t *ntypes;     /* per property: bit i set: k3_call_types[i] may be written */
    uint64_t required;
} k3_calltool;

struct k3_callspec {
    k3_calltool *t;      /* the tools a call may name (none: a call is not named by the mask) */
    size_t n;
    int how;             /* K3_CALLS_* */
    bool multi;          /* more than one call per reply */
};

/* Holds a fresh state's top value to types (T_* bits); raw: the value is a
 * string whose fed bytes are its text, unquoted and unescaped (a tool
 * call's string argument), so any UTF-8 without NUL is text. */
void k3_jstate_hold(k3_jstate *st, uint8_t types, bool raw);
/* done() for a held state: a raw string is complete where its closing quote
 * would complete the value. */
bool k3_jstate_raw_done(const k3_jstate *st);

/* Sets allow[id] for each base id below limit whose bytes are a non-empty
 * prefix of s[0..n) (the ids that may spell forced text); returns how many
 * it newly set. */
size_t k3_tokbytes_prefixes(const k3_tokbytes *tb, const uint8_t *s, size_t n, int32_t limit, uint8_t *allow);

/* Copies a reply's state into dst, made for the same spec, tokenizer and
 * vocabulary (a test feeds each id to a copy). */
void k3_constraint_copy(k3_constraint *dst, const k3_constraint *src);

#define K3_JHASH_INIT 0xcbf29ce484222325ULL
static inline uint64_t k3_jhash_byte(uint64_t h, uint8_t b) { return (h ^ b) * 0x100000001b3ULL; }

#endif
