/* stream_source.h (src/memory only): the state of the streaming weight
 * source, shared by its two files: stream.c (binding, the trunk's ring and I/O
 * thread, open/free) and stream_experts.c (routed-expert batches). The fields
 * below mu are under it; the I/O thread touches a slot's read only while the
 * slot is READING. */
#ifndef K3_MEMORY_STREAM_SOURCE_H
#define K3_MEMORY_STREAM_SOURCE_H

#include "memory/stream_internal.h"

#include <pthread.h>

enum { SLOT_EMPTY = 0, SLOT_READING, SLOT_READY, SLOT_FAILED };
enum { PIECE_UNSENT = 0, PIECE_SENT, PIECE_DONE };

typedef struct {
    int layer;                 /* layer held or being read, -1 none */
    int state;
    bool in_use;               /* between layer_get and layer_put */
    uint8_t *buf;
    k3_layer_w w;              /* bound when READY */
    k3_owned owned;
    bool bound;
    k3_err err;                /* when FAILED */
    /* the read in progress (touched by the I/O thread only while READING) */
    const k3_trunk_run *run;
    const k3s_share *sh;       /* what of the run this process reads */
    uint64_t base;             /* where the share starts in buf (shared ring: 0 or the far end) */
    k3_io_req *piece;          /* [maxpiece] */
    uint8_t *piece_st;         /* PIECE_UNSENT, PIECE_SENT or PIECE_DONE */
    int npiece, nsent, ndone;
    bool failed;
} ring_slot;

struct k3_stream {
    k3_config cfg;
    k3_mem_plan *plan;
    k3_stream_opts o;
    st_index *ix;
    k3_trunk *trunk;
    const char *prefix;
    k3_weight_source src;
    /* run 0 of a packed trunk: the model-level tensors */
    const k3_trunk_run *run0;
    uint8_t *head_buf;         /* every run-0 tensor but the embeddings (of a matrix the products
                                  split over the ranks, this rank's rows only), at head_pos[i] */
    int64_t *head_pos;         /* [run0->ntensors] where tensor i's byte 0 is in head_buf (before
                                  its rows when only a share is kept); HEAD_MAPPED for the
                                  embedding table */
    void *emb_map;             /* trunk.bin mapped around the embedding table */
    size_t emb_map_len;
    const uint8_t *emb;        /* the embedding table inside emb_map */
    char top_name[512];
    k3s_share *share;          /* [num_layers] with a packed trunk: what of each run is read */
    /* resident or pinned layers */
    k3_layer_w *lw;
    bool *have;
    uint8_t **pin_buf;
    k3_owned owned;
    /* ring and its I/O thread (the fields below mu are under it) */
    ring_slot slot[2];
    int nslots, maxpiece;
    bool shared;               /* one buffer, two slot records (a one-slot plan) */
    uint64_t piece_bytes;      /* trunk reads are cut into pieces of this size */
    int tdepth;                /* trunk pieces in flight */
    k3_io *tio;
    int tfd;
    pthread_t thr;
    bool thr_started, quit;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int want;                  /* the next streamed layer the model will ask for */
    int xpending;              /* an expert batch is being read: send no trunk piece (atomic) */
    int xprio;                 /* 1: expert batches pause the trunk reads (K3_EXPERT_PRIORITY=0: 0) */
    int active;                /* disk users now: trunk pieces in flight (1) + an expert batch (1) */
    double active_t0, disk_busy, trunk_busy, trunk_t0;
    uint64_t trunk_read;
    double trunk_stall;
    /* experts */
    k3_io *xio;
    int *sfd;                  /* per shard, -1 until opened */
    bool xdirect;
    xcache *xc;
    uint8_t *pool;
    int64_t npool;
    int64_t *free_list;
    int64_t nfree;
    int64_t *buf_of;           /* [layer * N_e + e] -> buffer or -1 */
    /* [layer] -> N_e layouts (NULL until the layer's first batch; n 0: not
     * yet found): an expert's tensors are looked up by name once, not at
     * every step (at most 240 B an expert, 20 MB at the release's shape) */
    xlayout **lay;
    uint8_t *inuse;
    int64_t *bb;               /* buffers of the current batch */
    k3_io_req *reqs;
    size_t reqcap;
    /* the batch in flight (experts_start .. its last experts_next) */
    k3_io_req **xq;            /* [reqcap] the requests in submission order */
    int *req_x;                /* [reqcap] batch index of each request */
    size_t nreq, nsent, nrecv;
    int xn, xgiven, xlayer, xid0;
    int *xleft;                /* [N_e] reads still to arrive per batch index */
    int *xready;               /* [N_e] batch indices whose bytes are in, in arrival order */
    int nready;
    bool xbusy;                /* reads in flight: xpending set, counted in disk_use */
    int xorder;                /* 0: arrival order; 1 reverse, 2 shuffled (K3_EXPERT_ORDER, tests) */
    uint64_t xseed, xreordered;
    double expert_stall;
    xc_trace_writer trace;
    bool tracing;
    int32_t step;
    uint64_t steps;
    bool poisoned;
    k3_err poison;
};

/* Disk-busy accounting (under mu): the union of trunk reads and expert batches. */
void k3s_disk_use(k3_stream *s, int d);
/* Marks the source failed with err (the first error stays); returns its code. */
int k3s_poison(k3_stream *s, const k3_err *err);
/* Returns expert buffer b to the pool. */
void k3s_free_push(k3_stream *s, int64_t b);
/* The source's expert calls (k3_weight_source's experts_*). */
int k3s_experts_start(void *ctx, int L, const int *ids, int n, k3_expert_w *ex, k3_err *err);
int k3s_experts_next(void *ctx, int L, int *out, k3_err *err);
int k3s_experts_get(void *ctx, int L, const int *ids, int n, k3_expert_w *ex, k3_err *err);
void k3s_experts_put(void *ctx, int L, const int *ids, int n);

#endif
