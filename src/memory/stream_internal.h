/* stream_internal.h (src/memory only): what the plan (stream_plan.c) and the
 * streaming weight source (stream.c, stream_experts.c) share: where a routed expert's bytes are
 * in the shards, and the helpers both sides use. */
#ifndef K3_MEMORY_STREAM_INTERNAL_H
#define K3_MEMORY_STREAM_INTERNAL_H

#include "memory/io.h"
#include "memory/stream.h"

/* Per matrix (w1 gate, w3 up, w2 down): MXFP4 (weight_packed + weight_scale)
 * or an unquantised weight. When all of an expert's tensors form one
 * contiguous run in one shard (the release does this: spec section 1) it is
 * one read; otherwise one read per tensor, each into its own aligned part of
 * the buffer. */
enum { XW1 = 0, XW3, XW2 };
typedef struct {
    int n;                      /* tensors */
    const st_tensor *t[6];
    int data[3], scale[3];      /* per matrix: index into t (scale -1 when unquantised) */
    bool one_run;
    uint64_t pos[6];            /* byte offset of tensor i's data in the buffer */
    uint64_t need;              /* buffer bytes */
} xlayout;

/* Fills x for expert e of layer L (prefix: k3_names_prefix), checking every
 * tensor's shape and dtype against the config as the binder would. */
int k3s_expert_layout(const k3_config *c, st_index *ix, const char *prefix, int L, int e, xlayout *x, k3_err *err);
/* The model.h dtype of a shard dtype; -1 for one K3 does not use. */
int k3s_tdtype(st_dtype d, k3_tdtype *out);
/* x rounded up to the O_DIRECT alignment. */
uint64_t k3s_align4k(uint64_t x);

#endif
