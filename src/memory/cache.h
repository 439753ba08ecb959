/* cache.h: the routed-expert cache and its trace tools.
 *
 * A routed expert is identified by (layer, expert). The cache holds up to
 * `capacity` experts (each one expert's packed bytes, a fixed size per model)
 * and decides what to evict under a policy:
 *   LRU    least recently used;
 *   LFU    least frequently used so far, ties evicting the MOST recently
 *          inserted — a decode step visits every layer in order, a cyclic
 *          scan larger than the cache on which LRU keeps nothing; this keeps
 *          an established set resident (a pinned set that adapts to
 *          popularity). k3's policy, chosen with `k3 cache-sim`;
 *   BELADY the offline optimum (evict the expert needed farthest in the
 *          future); only the simulator can use it, as the bound to compare to.
 * Requests come in steps (one decode step or one prefill chunk). A hit is
 * "resident" when the expert was already in memory when its step began; a hit
 * on an expert read earlier in the same step is a raw hit only. The engine
 * reports both; the resident rate is the one that saves reads. A step reads
 * the union of its selections once, so a repeated request within one step is
 * a raw hit served from that batch and does not touch the policy's state.
 *
 * Traces: `--dump-cache-trace` writes the K3 trace format (magic "K3XTRACE",
 * u32 version 1, u32 reserved, then int32 records (step, layer, expert)); the
 * peer engine's expert_trace.bin (int32 pairs (layer, expert) with no header,
 * a new step whenever the layer index goes down) is read too. */
#ifndef K3_MEMORY_CACHE_H
#define K3_MEMORY_CACHE_H

#include "util/common.h"

typedef enum { XC_LRU = 0, XC_LFU, XC_BELADY } xc_policy;

typedef struct {
    int32_t step, layer, expert;
} xc_request;

typedef struct xcache xcache;

/* capacity in experts (0 allowed: every request misses). */
xcache *xc_new(xc_policy policy, size_t capacity);
void xc_free(xcache *c);
/* For BELADY: the whole future, once, before the first request. */
void xc_set_future(xcache *c, const xc_request *reqs, size_t n);
/* Marks the start of a new step (resident-hit accounting). */
void xc_begin_step(xcache *c);
/* One request. Returns true on a hit; on a miss the expert is inserted (after
 * evicting if full), and *evicted (may be NULL) gets the evicted key or -1.
 * *resident (may be NULL) tells whether a hit was resident at step start. */
bool xc_request_one(xcache *c, int32_t layer, int32_t expert, bool *resident, int64_t *evicted);

typedef struct {
    uint64_t requests, hits, resident_hits, misses, evictions;
} xc_stats;
xc_stats xc_get_stats(const xcache *c);
const char *xc_policy_name(xc_policy p);

/* Trace I/O. xc_trace_read detects the format; *reqs is malloc'd. */
int xc_trace_read(const char *path, xc_request **reqs, size_t *n, k3_err *err);
typedef struct {
    FILE *f;
    char *path;
} xc_trace_writer;
int xc_trace_open(xc_trace_writer *w, const char *path, k3_err *err);
int xc_trace_write(xc_trace_writer *w, int32_t step, int32_t layer, int32_t expert, k3_err *err);
int xc_trace_close(xc_trace_writer *w, k3_err *err);

/* Replays a trace through a fresh cache of the given policy and capacity. */
xc_stats xc_simulate(const xc_request *reqs, size_t n, xc_policy policy, size_t capacity);

#endif
