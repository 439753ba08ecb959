/* trunk.h: the packed dense trunk.
 *
 * `k3 pack-trunk` rewrites everything but the routed experts (and the vision
 * tower/projector) into TRUNK_DIR/trunk.bin, one contiguous run per layer
 * plus one run for the model-level tensors (embeddings, head, final norms),
 * each run starting on a 4 KiB boundary and each tensor inside a run on a
 * 64-byte boundary, so that one aligned O_DIRECT read brings a whole layer and
 * its tensors can be used in place. TRUNK_DIR/trunk.json indexes the runs
 * (offset, bytes, CRC-32C), the tensors inside them (name, dtype, shape,
 * offset within the run, and a CRC-32C of every K3_TRUNK_CRC_ROWS rows of
 * the tensor's first dimension, so a reader that reads only some rows of a
 * matrix, a rank of a job that splits the trunk by rows, checks what it
 * read) and the source checkpoint's identity (a hash over
 * every shard's name, size and header bytes and a sample of every trunk
 * tensor's data), so a trunk packed from a different checkpoint is refused. The
 * index carries table_crc32c, a CRC-32C of itself in canonical form, and at
 * open every indexed tensor is checked against the checkpoint (name, dtype,
 * shape, layer, no overlap, none missing or twice): an edited index is
 * refused, never read as wrong weights. trunk.json is written last: a directory
 * without it is an interrupted pack, and packing again starts clean. */
#ifndef K3_MEMORY_TRUNK_H
#define K3_MEMORY_TRUNK_H

#include "formats/safetensors.h"
#include "util/common.h"

#define K3_TRUNK_RUN_ALIGN 4096u
#define K3_TRUNK_TENSOR_ALIGN 64u
#define K3_TRUNK_MODEL_RUN (-1)
/* Format version: 2 added the per-rows checksums; version 1 indexes are
 * refused with a line saying to pack again. */
#define K3_TRUNK_VERSION 2
/* Rows of a matrix (its first dimension) under one checksum: the kernels'
 * row run, so a share of rows that k_row_share deals out is whole granules. */
#define K3_TRUNK_CRC_ROWS 16

typedef struct {
    char *name;        /* full released name */
    st_dtype dtype;
    int rank;
    int64_t shape[ST_MAX_RANK];
    uint64_t offset;   /* within the run */
    uint64_t nbytes;
    int64_t ngran;     /* checksummed granules (k3_trunk_granule) */
    uint32_t *gcrc;    /* [ngran] CRC-32C of each granule's bytes */
} k3_trunk_tensor;

typedef struct {
    int layer;         /* K3_TRUNK_MODEL_RUN for model-level tensors */
    uint64_t offset, bytes;
    uint32_t crc;
    k3_trunk_tensor *tensors;
    int ntensors;
} k3_trunk_run;

typedef struct {
    char *dir, *bin_path;
    char identity[17];        /* hex hash of the source shards */
    int identity_scheme;      /* 1 (FNV-1a, older packs) or 2 */
    uint64_t file_size;
    k3_trunk_run *runs;       /* runs[0] is the model-level run, then layers 0..L-1 */
    int nruns;
} k3_trunk;

/* True for tensors that belong in the trunk (not routed experts, not vision). */
bool k3_trunk_wants(const char *name);
/* Layer index of a released name ("...layers.12....") or -1. */
int k3_trunk_layer_of(const char *name);
/* Identity of a checkpoint: a 64-bit hash (hex) over shard names, sizes and
 * headers, and the first and last 64 bytes of every trunk tensor (so another
 * checkpoint with the same shapes, e.g. a fine-tune, has another identity).
 * Scheme 1 hashes with FNV-1a (trunks packed before scheme 2), scheme 2 with
 * a faster multi-lane hash over the same bytes; new packs use
 * K3_IDENTITY_SCHEME. The samples are merged into few reads that go out
 * together; the value does not depend on how they are read. */
#define K3_IDENTITY_SCHEME 2
int k3_checkpoint_identity(st_index *ix, char out[17], k3_err *err);
typedef struct { uint64_t reads, bytes; } k3_identity_stats;  /* what it read */
int k3_checkpoint_identity_ex(st_index *ix, int scheme, char out[17], k3_identity_stats *stats, k3_err *err);

/* Granules of a tensor: K3_TRUNK_CRC_ROWS rows of its first dimension each
 * (the last may be shorter) for rank >= 2, else the whole tensor; returns
 * their count and sets *bytes to a full granule's bytes. */
int64_t k3_trunk_granule(const k3_trunk_tensor *t, uint64_t *bytes);

/* Packs model_dir's trunk into trunk_dir (created if needed). Progress on
 * stderr. Atomic: trunk.bin and trunk.json appear only when complete. */
int k3_trunk_pack(const char *model_dir, const char *trunk_dir, k3_err *err);
/* Re-reads every run: CRC, and byte-equality with the source tensors. */
int k3_trunk_verify(const char *trunk_dir, const char *model_dir, k3_err *err);
/* Reads trunk.json (checks the file size and, when ix is given, that the
 * trunk was packed from that checkpoint). */
int k3_trunk_open(const char *trunk_dir, st_index *ix, k3_trunk **out, k3_err *err);
void k3_trunk_free(k3_trunk *t);
/* The identity check alone (k3_trunk_open does it when given ix); split out so
 * a run can check its memory plan before it reads any weight bytes. */
int k3_trunk_check_source(const k3_trunk *t, st_index *ix, k3_err *err);
/* The run for a layer (or K3_TRUNK_MODEL_RUN), NULL if absent. */
const k3_trunk_run *k3_trunk_run_for(const k3_trunk *t, int layer);

#endif
