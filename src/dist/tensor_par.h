/* tensor_par.h: the trunk split over the ranks of a job (tensor parallelism)
 * by output rows.
 *
 * The model takes every trunk matrix product through a table of operations
 * (k3_fwd_ops, model/source.h): Y = X W^T for a batch of jobs. k3_tp_ops() is that
 * table for a job of several ranks: each rank computes only its share of
 * every job's output rows (rows [r0, r1) of W, k_row_share: whole 16-row
 * runs dealt out evenly, uneven shares included) and one gather per call
 * (k3_dist_exchange: each rank's rows of all the call's jobs in one block)
 * hands every rank the whole Y. Every output element is one dot computed
 * whole by one rank with the kernels' canonical arithmetic (k_products_rows:
 * the bits k_products gives it), and the gather only concatenates, so the
 * outputs, hence the logits, are bit-identical to one process at every rank
 * count. A rank reads only its rows of each matrix: the trunk's bytes read
 * per token fall as 1/R (the split_* figures of k3_dist_stats count them).
 *
 * What stays whole on every rank: the routed experts in the default layout
 * (expert-parallel, expert_par.h: they reach expert_products, which runs
 * locally; split like the trunk with experts_too below), MLA's
 * kv_b (the absorbed attention core reads its rows per head directly), KDA's
 * f_b (whole_products: 3 MB at the release's size, D = 128 inputs, whose
 * read costs less than a gather's round of messages; every rank computes it
 * whole with one process's kernels, so its bits are one process's), the
 * embedding rows, norms and the elementwise work and recurrences (cheap
 * beside the matrices at decode).
 *
 * Invariants: every rank makes the same calls with the same jobs (shapes and
 * inputs), as for the expert exchange; every wait is bounded (dist.h), a
 * rank that dies or hangs ends the job. The ranks' count and order come from
 * dist.h. */
#ifndef K3_DIST_TENSOR_PAR_H
#define K3_DIST_TENSOR_PAR_H

#include "model/source.h"

/* The split products for this job's ranks (one process: the canonical ones).
 * experts_too (--parallel-layout tp): the routed experts' products are split
 * the same way (every rank computes its rows of every selected expert's three
 * matrices, one gather for the gates and ups, one for the downs), so no rank
 * waits for the one that holds the most selected experts; each rank then
 * needs its rows of every expert (k3_stream_opts.tp_experts). */
const k3_fwd_ops *k3_tp_ops(bool experts_too);
/* Frees the gather buffers (at the end of a run; the ops stay usable). */
void k3_tp_release(void);

#endif
