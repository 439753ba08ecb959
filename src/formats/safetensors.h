/* safetensors.h: a directory of safetensors shards as one name -> tensor index.
 *
 * Opens every *.safetensors file in a directory (with or without
 * model.safetensors.index.json, which is then cross-checked as a name -> shard
 * map), parses each header with jansson, validates it completely (header length
 * vs file size, offsets in bounds and equal to dtype x shape, no overlaps, no
 * duplicate names across shards, UTF-8 names) and keeps, per tensor, its dtype,
 * shape, shard and absolute byte range. Data is reached through mmap (st_data)
 * or pread (st_read*: util/dio.h's reader, O_DIRECT with a buffered fallback). */
#ifndef K3_FORMATS_SAFETENSORS_H
#define K3_FORMATS_SAFETENSORS_H

#include "util/common.h"

typedef enum {
    ST_F64 = 0, ST_F32, ST_F16, ST_BF16, ST_I64, ST_I32, ST_I16, ST_I8, ST_U8, ST_BOOL,
    ST_NDTYPES
} st_dtype;

#define ST_MAX_RANK 8

typedef struct {
    const char *name;          /* owned by the index */
    st_dtype dtype;
    int rank;
    int64_t shape[ST_MAX_RANK];
    int64_t numel;
    int shard;                 /* index into the shard table */
    uint64_t offset;           /* ABSOLUTE byte offset in the shard file */
    uint64_t nbytes;
} st_tensor;

typedef struct {
    char *path;                /* full path */
    uint64_t file_size;
    uint64_t data_start;       /* 8 + header length */
    int ntensors;
} st_shard;

typedef struct st_index st_index;

const char *st_dtype_name(st_dtype d);       /* "BF16", ... */
size_t st_dtype_size(st_dtype d);            /* bytes per element */

/* Open a directory of shards (or a single .safetensors file). Errors: K3_EXIT_USAGE
 * when the path is missing or holds no shards, K3_EXIT_DATA for any malformed
 * header/index, K3_EXIT_RUNTIME for I/O. */
int st_open(const char *path, st_index **out, k3_err *err);
/* One more owner of ix (the engine hands one index to the memory plan, the
 * streaming source and the model); returns ix. Every owner calls st_close:
 * the last one frees it. The index is shared, not copied: its lazily opened
 * descriptors and mappings serve every owner. */
st_index *st_retain(st_index *ix);
void st_close(st_index *ix);

/* Bytes of memory the open index holds (tensor records, names, hashes, the
 * name table, shard tables), rounded up as the pages that hold them are
 * touched. The release's 497,220 tensors come to about 100 MB, so a memory
 * plan counts this rather than calling it fixed overhead. */
uint64_t st_footprint(const st_index *ix);

size_t st_count(const st_index *ix);
const st_tensor *st_at(const st_index *ix, size_t i);     /* in shard, then offset order */
const st_tensor *st_find(const st_index *ix, const char *name); /* NULL if absent */
int st_nshards(const st_index *ix);
const st_shard *st_shard_at(const st_index *ix, int i);
/* The tensor's metadata string value for key in its shard's __metadata__, or NULL. */
const char *st_metadata(const st_index *ix, int shard, const char *key);

/* Read-only mmap of the tensor's bytes (the shard is mapped lazily, once). */
const void *st_data(st_index *ix, const st_tensor *t, k3_err *err);
/* pread the tensor's raw bytes into dst (nbytes). */
int st_read(st_index *ix, const st_tensor *t, void *dst, k3_err *err);
/* Read and widen any float dtype (F32/F16/BF16/F64) to f32: dst has numel floats. */
int st_read_f32(st_index *ix, const st_tensor *t, float *dst, k3_err *err);
/* pread [off, off+len) of shard i (any offset, length and dst) through
 * util/dio.h: O_DIRECT via an aligned bounce buffer where allowed, buffered
 * where the filesystem refuses it; the same bytes either way. */
int st_pread(st_index *ix, int shard, uint64_t off, void *dst, uint64_t len, k3_err *err);

/* Added by the formats work (additive): */
/* O_DIRECT on (default) or off for st_pread/st_read*. Environment K3_DIRECT_IO=0
 * turns it off for every index. Buffered reads are used anyway where the
 * filesystem refuses O_DIRECT. */
void st_set_direct(st_index *ix, bool on);
/* Validate one whole safetensors file image held in memory (8-byte length,
 * header, data) exactly as st_open validates a shard; name is used in
 * messages. Headers are read by a fast strict scanner that declines anything
 * unusual (escaped or non-ASCII names, ...), which jansson then parses;
 * use_jansson skips the scanner (so does K3_ST_JANSSON=1 for st_open). info
 * (may be NULL) gets the tensor count, a digest of names, dtypes, shapes,
 * offsets and metadata, and which parser answered. For the fuzzer and tests. */
typedef struct {
    size_t ntensors, nmeta;
    uint64_t digest;
    bool fast;
} st_buffer_info;
int st_check_buffer(const void *file, size_t len, const char *name, bool use_jansson, st_buffer_info *info,
                    k3_err *err);

/* ---- writing ------------------------------------------------------------ */
typedef struct {
    const char *name;
    st_dtype dtype;
    int rank;
    int64_t shape[ST_MAX_RANK];
    const void *data;
    uint64_t nbytes;           /* must equal dtype size x product(shape) */
} st_out_tensor;

/* Writes one safetensors file atomically (temp file, fsync, rename): the
 * header (metadata as n_md key/value string pairs md[2i], md[2i+1], then the
 * tensors in the given order, padded with spaces to a multiple of 8 bytes),
 * then the data in the same order. */
int st_write(const char *path, const char *const *md, size_t n_md, const st_out_tensor *ts, size_t n,
             k3_err *err);

#endif
