/* expert_par.h: expert-parallel inference over the ranks of a job (dist.h).
 *
 * The routed experts of every MoE layer are partitioned over the ranks by a
 * placement: contiguous and balanced by default (rank r holds experts
 * [r N / R, (r+1) N / R) of every layer), or read from a file made from a
 * cache trace (`k3 cache-sim TRACE --placement R ...`) that spreads each
 * layer's hottest experts evenly. The trunk runs on every rank.
 *
 * The expert-parallel source wraps the engine's weight source (model/source.h): it
 * answers expert_owned from the placement and experts_combine with one
 * exchange per MoE layer and forward call: each rank sends the output rows
 * of the selected experts it owns, every rank receives the others' rows, and
 * the model then sums every token's slots in the router's order as one
 * process does, so the logits are bit-identical at every rank count. Each
 * block carries the layer and a hash of the routing; a rank whose routing
 * differs (ranks that compute other bits) is refused with a line naming it.
 *
 * Invariants: every rank must make the same forward calls in the same
 * chunks (the engine agrees on the chunk at open); the placement and the
 * model's identity (formats/identity.h: config, tensor tables,
 * tokenizer) are checked equal on all ranks. */
#ifndef K3_DIST_EXPERT_PAR_H
#define K3_DIST_EXPERT_PAR_H

#include "formats/config.h"
#include "memory/cache.h"
#include "model/source.h"

typedef struct {
    int ranks, layers, experts;
    int32_t *owner;              /* [layers][experts]: the rank that computes expert e of layer L */
} k3_placement;

/* rank r holds experts [r N / R, (r+1) N / R) of every layer */
void k3_placement_contiguous(int ranks, int layers, int experts, k3_placement *p);
/* From a cache trace: per layer, experts in decreasing request count each go
 * to the least-loaded rank that holds fewer than ceil(N / R), so the load
 * (requests) and the memory (experts) are both balanced. Ties: lower ids and
 * lower ranks first (the same placement for the same trace). */
void k3_placement_from_trace(int ranks, int layers, int experts, const xc_request *reqs, size_t n, k3_placement *p);
/* The most requests one rank serves in a layer over the mean, summed over
 * layers (1.0: perfectly even); for reports. */
double k3_placement_imbalance(const k3_placement *p, const xc_request *reqs, size_t n);
/* Per (step, layer) of the trace, the most experts one rank computes, averaged
 * over the trace's (step, layer) pairs: what a decode step waits for (the
 * mean is k / R). */
double k3_placement_step_load(const k3_placement *p, const xc_request *reqs, size_t n);
/* JSON: {"format": "k3-expert-placement", "version": 1, "ranks": R,
 * "num_layers": L, "num_experts": N, "owner": [[rank of expert 0, ...], ...]} */
int k3_placement_save(const k3_placement *p, const char *path, k3_err *err);
/* Loads and checks a placement for this job (ranks) and model (c: the layers
 * run, experts per layer): K3_EXIT_USAGE with one line when it does not fit. */
int k3_placement_load(const char *path, int ranks, const k3_config *c, k3_placement *p, k3_err *err);
uint64_t k3_placement_hash(const k3_placement *p);
void k3_placement_free(k3_placement *p);

/* The wrapping source. inner stays owned by the caller and must outlive it. */
typedef struct k3_ep k3_ep;
k3_ep *k3_ep_new(const k3_weight_source *inner, const k3_placement *p, int rank, int size);
const k3_weight_source *k3_ep_source(k3_ep *ep);
void k3_ep_free(k3_ep *ep);

#endif
