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

#define K3_JHASH_INIT 0xcbf29ce484222325ULL
static inline uint64_t k3_jhash_byte(uint64_t h, uint8_t b) { return (h ^ b) * 0x100000001b3ULL; }

#endif
