/* stream_internal.h (src/memory only): what the plan (stream_plan.c) and the
 * streaming weight source (stream.c, stream_experts.c) share: where a routed expert's bytes are
 * in the shards, and the helpers both sides use. */
#ifndef K3_MEMORY_STREAM_INTERNAL_H
#define K3_MEMORY_STREAM_INTERNAL_H

#include "memory/io.h"
#include "memory/stream.h"
#include "model/source.h"

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
    int64_t pos[6];             /* where tensor i's byte 0 is in the buffer (before it for a
                                   tensor of which only a share of rows is read) */
    uint64_t off[6], len[6];    /* what of tensor i is read: shard offset and bytes */
    uint64_t need;              /* buffer bytes */
} xlayout;

/* Fills x for expert e of layer L (prefix: k3_names_prefix), checking every
 * tensor's shape and dtype against the config as the binder would. With o
 * asking for split experts (tp_experts, tp_ranks > 1), only this rank's rows
 * of each matrix (and of its scales) are read: k_row_share's, the split
 * products' own. o may be NULL (whole experts). */
int k3s_expert_layout(const k3_config *c, st_index *ix, const char *prefix, int L, int e, const k3_stream_opts *o,
                      xlayout *x, k3_err *err);
/* The model/source.h dtype of a shard dtype; -1 for one K3 does not use. */
int k3s_tdtype(st_dtype d, k3_tdtype *out);
/* x rounded up to the O_DIRECT alignment. */
uint64_t k3s_align4k(uint64_t x);

/* Under a trunk split by output rows (o->tp_ranks > 1): true when this
 * process reads only rows [*r0, *r1) of the tensor (its share by
 * k_row_share, the split products' own), false when it reads it whole
 * (vectors, MLA's kv_b read per head, KDA's f_b computed whole, conv taps, AttnRes queries, F16
 * matrices widened at bind, embeddings; everything with one process). */
bool k3s_tp_rows(const k3_stream_opts *o, const char *name, int rank, const int64_t *shape, st_dtype dt, int *r0,
                 int *r1);

/* What of a packed trunk run this process reads, and where it lies in its
 * buffer: the run's tensors, the split ones in their rows' share only, as
 * extents of the file (run-relative, starting on K3_DIO_ALIGN, merged where
 * they touch) laid out one after another in the buffer, each at an aligned
 * position. Tensor i's byte 0 is at buffer + tpos[i] (for a split tensor
 * the rows before its share lie before it, never read: only the rows of
 * the share are addressed), and granules [g0[i], g1[i]) of it
 * (k3_trunk_granule) are held and checked. With one process: one extent,
 * the whole run at position 0. */
typedef struct { uint64_t off, len, pos; } k3s_extent;
typedef struct {
    int n;
    k3s_extent *ext;
    int64_t *tpos, *g0, *g1;   /* [run->ntensors] */
    uint64_t bytes;            /* the extents' bytes: what one read of the share reads */
    uint64_t need;             /* buffer bytes: k3s_align4k(bytes) (only the last extent may end
                                  off the alignment, at the run's end) */
} k3s_share;
void k3s_share_make(const k3_trunk_run *run, const k3_stream_opts *o, k3s_share *sh);
void k3s_share_free(k3s_share *sh);
/* Reads of at most `piece` bytes (a K3_DIO_ALIGN multiple) the share takes. */
int k3s_share_pieces(const k3s_share *sh, uint64_t piece);
/* Piece k of the share (k < k3s_share_pieces): run-relative offset, length
 * and buffer position. */
void k3s_share_piece(const k3s_share *sh, uint64_t piece, int k, uint64_t *off, uint64_t *len, uint64_t *pos);
/* Checks the granules the share holds against the index's checksums (buf:
 * the share read as laid out); -1 when all match, else the failing tensor. */
int k3s_share_check(const k3_trunk_run *run, const k3s_share *sh, const uint8_t *buf);
/* Where tensor i's byte 0 is over a buffer holding the share (may lie before
 * buf for a split tensor; only its share's rows are ever addressed). */
const uint8_t *k3s_share_at(const k3s_share *sh, const uint8_t *buf, int i);

#endif
