/* tvocab.h: token bytes of a prepared data directory (see tvocab.c). */
#ifndef K3_TRAIN_TVOCAB_H
#define K3_TRAIN_TVOCAB_H

#include "util/common.h"

typedef struct {
    int n;
    uint8_t **bytes;  /* [n] (NULL for an id the files do not name) */
    int *len;
    bool *special;    /* named specials: no text bytes */
    int eot;          /* <|endoftext|>, -1 if none */
} tvocab;

int tvocab_load(const char *dir, int vocab, tvocab *v, k3_err *err);
void tvocab_free(tvocab *v);
/* Bytes of text the id stands for (0 for specials and unknown ids). */
int tvocab_text_bytes(const tvocab *v, int id);

#endif
