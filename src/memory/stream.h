/* stream.h: running a model inside a memory budget, however large the model.
 *
 * A k3_stream is a k3_weight_source (model/source.h) that serves
 *  - the dense trunk: resident from the shards (mapped), or, with a packed
 *    trunk (k3 pack-trunk), pinned layers (spread through the stack) held in memory and the
 *    rest streamed through ring slots: layer L+1 is read (O_DIRECT, CRC-32C
 *    checked per 16 rows) on an I/O thread while layer L computes, and bound
 *    in place (under a trunk split by rows, only this rank's share of it);
 *  - the routed experts: never mapped; the union a forward call selects in a
 *    layer is fetched as one batch of reads sorted by file offset (io_uring),
 *    straight from the shards (one read per expert when its tensors form one
 *    contiguous run, as in the release, else one read per tensor), through an
 *    expert cache of a fixed number of buffers (policy: cache.h).
 * Output bits do not depend on any of this: the same bytes reach the same
 * kernels whatever the budget.
 *
 * Memory plan. Before anything is read, k3_plan_make sizes every part from the
 * config and the shard headers: the trunk part (model-level tensors as used,
 * resident or pinned layers, ring slots, per-layer widened copies) is what
 * --trunk-gb limits; the expert part (cache plus the buffers of one batch) is
 * what --cache-gb limits; decode state and scratch come from k3_state_size_cfg.
 * A plan that cannot fit is refused with K3_EXIT_BUDGET and a one-line reason.
 * Peak RSS stays within plan.total + K3_PLAN_OVERHEAD (tested). */
#ifndef K3_MEMORY_STREAM_H
#define K3_MEMORY_STREAM_H

#include "formats/config.h"
#include "formats/safetensors.h"
#include "memory/cache.h"
#include "memory/trunk.h"
#include "model/model.h"
#include "util/common.h"

/* What the process uses beyond the plan: code, libraries, thread stacks,
 * allocator slack, the tokenizer. Stated, and tested. (The checkpoint
 * index is not in it: at the release's 497,220 tensors it alone is about
 * 100 MB, so the plan counts it.) */
#define K3_PLAN_OVERHEAD (96ull << 20)

typedef struct {
    const char *trunk_dir;   /* --trunk; NULL: trunk resident from the shards */
    double trunk_gb;         /* < 0: unlimited */
    double cache_gb;         /* < 0: unlimited */
    const char *preset;      /* name of the preset applied last, or NULL */
    int chunk;               /* prefill chunk; 0: default (K3_PREFILL_CHUNK, reduced to fit) */
    xc_policy policy;        /* expert cache policy (LFU) */
    int io_depth;            /* expert reads in flight (32) */
    int trunk_depth;         /* trunk pieces in flight (4; K3_TRUNK_DEPTH) */
    uint64_t trunk_piece;    /* bytes per trunk read (2 MiB; K3_TRUNK_PIECE_KB) */
    bool expert_priority;    /* expert batches pause trunk reads (K3_EXPERT_PRIORITY=0: no) */
    bool pin_spread;         /* pinned layers spread through the stack (K3_PIN_SPREAD=0: a prefix) */
    bool expert_overlap;     /* decode computes each routed expert as it arrives (experts_start/next)
                                while the rest are read (K3_EXPERT_OVERLAP=0: wait for the batch) */
    bool direct;             /* O_DIRECT (default; K3_DIRECT_IO=0 turns it off) */
    const char *trace_dir;   /* --dump-cache-trace DIR, or NULL */
    uint64_t mem_limit;      /* refuse plans above this (0: MemAvailable) */
    int pass_tokens;         /* speculation: ids of one verifying pass (0: none). The chunk
                                never drops below it (each streamed layer and each distinct
                                expert then read once per pass) and the pass's rollback
                                record (k3_state_pass_bytes) is counted in the plan */
    const uint8_t *owned;    /* [num_layers][num_experts], nonzero for the routed experts this
                                process holds (its share of an expert-parallel job, dist/);
                                NULL: all. Only these are planned for and ever requested. */
    int tp_rank, tp_ranks;   /* tp_ranks > 1: this process is rank tp_rank of a job whose trunk
                                matrices are split by output rows (dist/tensor_par.h): the
                                plan counts its share of their rows (k_row_share), and with a
                                packed trunk only that share of each layer is read and held */
    bool tp_experts;         /* with tp_ranks > 1, the routed experts' matrices are split by
                                output rows too (--parallel-layout tp): every expert is
                                planned, cached and read as this rank's rows of its three
                                matrices only */
    bool experts_only;       /* serve the routed experts alone (bench/layers.c times one MoE
                                layer reading its experts): no trunk is planned, bound or
                                read (trunk_dir must be NULL), layer_get refuses; the model
                                calls the expert path as in a run (k3_moe_source) */
} k3_stream_opts;

void k3_stream_opts_init(k3_stream_opts *o);

typedef struct {
    int num_layers, n_moe, num_experts, top_k;
    int64_t max_pos;
    bool streamed;               /* --trunk */
    /* trunk part */
    uint64_t head_bytes;         /* embedding rows used, head, final norms */
    uint64_t layer_bytes[K3_MAX_LAYERS];  /* each layer's trunk tensors */
    uint64_t bind_bytes[K3_MAX_LAYERS];   /* widened copies + expert table of a bound layer */
    uint64_t layers_all;         /* sum of layer_bytes */
    int pinned;                  /* how many layers are pinned (resident) */
    bool pin[K3_MAX_LAYERS];     /* which: spread evenly through the stack, so the
                                    compute of each pinned layer overlaps the read of a
                                    streamed one; a prefix with pin_spread off */
    uint64_t pinned_bytes;       /* their runs and copies */
    int ring_slots;              /* 0 (all pinned), 1 (no overlap) or 2 */
    uint64_t slot_bytes;         /* one slot: the largest streamed run */
    uint64_t ring_bytes;         /* slots + copies of the layers bound in them */
    uint64_t trunk_bytes;        /* head + pinned + ring: what --trunk-gb limits */
    /* expert part */
    uint64_t expert_buf;         /* one expert's read buffer */
    int64_t total_experts;       /* routed experts in the model */
    int64_t cache_experts;       /* cache capacity */
    int batch_experts;           /* buffers for one batch (a chunk's union) */
    int chunk;                   /* prefill chunk the plan holds */
    uint64_t expert_bytes;       /* (cache + batch) buffers: what --cache-gb limits */
    uint64_t table_bytes;        /* the cache's key -> buffer table */
    k3_state_plan state;         /* KDA state, MLA latent cache, scratch */
    uint64_t pass_bytes;         /* the rollback record of a verifying pass (pass_tokens) */
    uint64_t index_bytes;        /* the open checkpoint index's tables (st_footprint) */
    uint64_t total;
} k3_mem_plan;

/* Sizes the plan for cfg (num_layers already cut to --layers) at max_pos
 * positions. trunk: the packed trunk when streaming (opened WITHOUT its
 * identity check, which reads data), else NULL. Returns K3_EXIT_BUDGET with
 * a one-line reason when it cannot fit; K3_EXIT_USAGE / K3_EXIT_DATA for a
 * checkpoint the streamer cannot serve. Reads no weight bytes. */
int k3_plan_make(const k3_config *cfg, st_index *ix, const k3_trunk *trunk, const k3_stream_opts *o,
                 int64_t max_pos, k3_mem_plan *p, k3_err *err);
void k3_plan_print(const k3_mem_plan *p, const k3_stream_opts *o, FILE *f);

/* ---- the source ---------------------------------------------------------- */
typedef struct k3_stream k3_stream;

/* Opens the source for a model opened with k3_model_opts.top_only (the model
 * keeps the model-level tensors; the stream serves layers and experts). Takes
 * ownership of ix and trunk (freed on failure too). Checks the trunk's identity against ix, loads
 * the resident or pinned layers (progress on stderr), starts the I/O thread. */
int k3_stream_open(const k3_config *cfg, st_index *ix, k3_trunk *trunk, const k3_mem_plan *plan,
                   const k3_stream_opts *o, k3_stream **out, k3_err *err);
const k3_weight_source *k3_stream_source(k3_stream *s);
/* Makes m (opened top_only) take its layers and experts from s and, with a
 * packed trunk, its model-level tensors from run 0 of trunk.bin (read and
 * CRC-checked at open; the model must be freed before s). */
int k3_stream_attach(k3_stream *s, k3_model *m, k3_err *err);
void k3_stream_free(k3_stream *s);

typedef struct {
    uint64_t steps;              /* forward passes over the layers */
    uint64_t trunk_read;         /* bytes read for streamed layers */
    uint64_t expert_read;        /* bytes read for experts */
    double trunk_busy_s;         /* time with trunk reads in flight */
    double disk_busy_s;          /* time with any read in flight (trunk or experts) */
    double trunk_stall_s;        /* compute waiting for a layer */
    double expert_stall_s;       /* compute waiting for expert reads */
    uint64_t requests, hits, resident_hits, misses, evictions;
    const char *backend;         /* "io_uring" or "pread" */
    bool direct;                 /* expert shards opened with O_DIRECT */
    uint64_t experts_reordered;  /* experts handed to the model out of id order (arrival order) */
} k3_stream_stats;
k3_stream_stats k3_stream_get_stats(const k3_stream *s);

#endif
