/* data_par.h: the collectives of data-parallel training (k3 train under
 * mpirun), over dist.h.
 *
 * The global batch of a step is a sequence of units (micro-batches); rank r
 * computes a contiguous run of them, so rank order is unit order. A float
 * vector per unit (a gradient) is combined by ONE canonical sum, the left fold
 * in unit order: out = ((u_0 + u_1) + u_2) + ... (float additions, element by
 * element). It does not depend on the rank count: a single process that adds
 * each unit's gradient into a running sum as it goes computes the same bits.
 * A rank may hand in a prefix of its units already folded (rank 0 does: its
 * first units are the start of the fold), so `counts` says how many vectors
 * each rank contributes.
 *
 * K3_DIST_PIECE=F,G (a test hook): pieces of F floats (the fold) and G bytes
 * (the all-gather).
 *
 * Invariant: every rank gets the same bits, whatever the rank count, thread
 * count or arrival order. One process (not under mpirun) is a job of one rank:
 * no communication. */
#ifndef K3_DIST_DATA_PAR_H
#define K3_DIST_DATA_PAR_H

#include "util/common.h"

/* out[i] = the left fold, in rank order and then vector order, of every rank's
 * vectors mine[0..counts[rank]) (n floats each) at i. counts[r] >= 1 for every
 * rank, the same array on every rank. out may be mine[0]. Exchanged in pieces
 * (a reduce-scatter of each piece's slices, then an all-gather of the folded
 * slices): a rank sends and receives about (its vectors + 1) x n floats and
 * holds at most (sum of counts) x piece / R floats of others'. */
void k3_dp_fold(float *out, const float *const *mine, const int *counts, size_t n, const char *what);

/* all[r * n .. (r+1) * n) = rank r's mine[0..n) bytes, in pieces small enough
 * for one message each (k3_dist_allgather's, for blocks of any size). */
void k3_dp_allgather(const void *mine, size_t n, void *all, const char *what);

/* In place: the elementwise sum of n floats (the one-process form of the
 * fold's step: acc[i] = acc[i] + v[i]), parallel over elements. */
void k3_dp_add(float *acc, const float *v, size_t n);

#endif
