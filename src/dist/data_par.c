/* data_par.c: the fold of the units' gradients and a large all-gather
 * (data_par.h). */
#include "dist/data_par.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"

/* Floats of one vector per piece of the fold (bounds the buffers and keeps
 * every message far below MPI's int count) and bytes per message of
 * k3_dp_allgather. The test hook K3_DIST_PIECE=F,G sets them to F and G, so
 * that a small model crosses piece boundaries too. */
static size_t piece_env(int which) {
    static long long v[2] = {-1, -1};
    if (v[0] < 0) {
        const char *e = getenv("K3_DIST_PIECE");
        v[0] = v[1] = 0;
        if (e && sscanf(e, "%lld,%lld", &v[0], &v[1]) != 2) v[0] = v[1] = 0;
        if (v[0] < 0 || v[1] < 0) v[0] = v[1] = 0;
    }
    return (size_t)v[which];
}
#define FOLD_PIECE (piece_env(0) ? piece_env(0) : (size_t)1 << 22)
#define GATHER_PIECE (piece_env(1) ? piece_env(1) : (size_t)1 << 26)

void k3_dp_add(float *acc, const float *v, size_t n) {
    const size_t blk = 1 << 14;
    const long nb = (long)((n + blk - 1) / blk);
#pragma omp parallel for schedule(static) if (n > 65536)
    for (long b = 0; b < nb; b++) {
        size_t lo = (size_t)b * blk, hi = lo + blk < n ? lo + blk : n;
        for (size_t i = lo; i < hi; i++) acc[i] = acc[i] + v[i];
    }
}

void k3_dp_fold(float *out, const float *const *mine, const int *counts, size_t n, const char *what) {
    const int R = k3_dist_size(), me = k3_dist_rank();
    if (R == 1) {
        if (out != mine[0]) memcpy(out, mine[0], n * sizeof(float));
        for (int j = 1; j < counts[0]; j++) k3_dp_add(out, mine[j], n);
        return;
    }
    const int nv = counts[me];
    size_t total = 0;
    size_t *first = xmalloc_array((size_t)R, sizeof *first); /* index of rank r's first vector in the fold */
    for (int r = 0; r < R; r++) {
        first[r] = total;
        total += (size_t)counts[r];
    }
    const size_t slice_max = FOLD_PIECE / (size_t)R + 1;
    float *send = xmalloc_array((size_t)nv * FOLD_PIECE, sizeof(float));
    float *recv = xmalloc_array(total * slice_max, sizeof(float));
    const void **to = xmalloc_array((size_t)R, sizeof *to);
    void **theirs = xmalloc_array((size_t)R, sizeof *theirs);
    size_t *to_bytes = xmalloc_array((size_t)R, sizeof *to_bytes), *their_bytes = xmalloc_array((size_t)R, sizeof *their_bytes);
    size_t *s0 = xmalloc_array((size_t)R + 1, sizeof *s0);
    for (size_t off = 0; off < n; off += FOLD_PIECE) {
        const size_t len = n - off < FOLD_PIECE ? n - off : FOLD_PIECE;
        for (int r = 0; r <= R; r++) s0[r] = len * (size_t)r / (size_t)R; /* rank r folds [s0[r], s0[r+1]) */
        const size_t mylen = s0[me + 1] - s0[me];
        /* reduce-scatter: rank d gets every vector's slice d; this rank's own
         * slice goes straight to its place in recv */
        for (int d = 0; d < R; d++) {
            const size_t dl = s0[d + 1] - s0[d];
            float *blk = d == me ? recv + first[me] * mylen : send + (size_t)nv * s0[d];
            for (int j = 0; j < nv; j++) memcpy(blk + (size_t)j * dl, mine[j] + off + s0[d], dl * sizeof(float));
            to[d] = blk;
            to_bytes[d] = (size_t)nv * dl * sizeof(float);
            theirs[d] = recv + first[d] * mylen;
            their_bytes[d] = (size_t)counts[d] * mylen * sizeof(float);
        }
        k3_dist_alltoall(to, to_bytes, theirs, their_bytes, what);
        /* the fold of this rank's slice, in unit order */
        for (size_t v = 1; v < total; v++) k3_dp_add(recv, recv + v * mylen, mylen);
        /* all-gather the folded slices (mine[*] of this piece are read by now,
         * so out may be mine[0]) */
        for (int r = 0; r < R; r++) {
            theirs[r] = out + off + s0[r];
            their_bytes[r] = (s0[r + 1] - s0[r]) * sizeof(float);
        }
        memcpy(out + off + s0[me], recv, mylen * sizeof(float));
        k3_dist_exchange(recv, mylen * sizeof(float), theirs, their_bytes, what);
    }
    free(first);
    free(send);
    free(recv);
    free(to);
    free(theirs);
    free(to_bytes);
    free(their_bytes);
    free(s0);
}

void k3_dp_allgather(const void *mine, size_t n, void *all, const char *what) {
    const int R = k3_dist_size(), me = k3_dist_rank();
    memcpy((char *)all + (size_t)me * n, mine, n);
    if (R == 1) return;
    void **theirs = xmalloc_array((size_t)R, sizeof *theirs);
    size_t *bytes = xmalloc_array((size_t)R, sizeof *bytes);
    for (size_t off = 0; off < n; off += GATHER_PIECE) {
        const size_t len = n - off < GATHER_PIECE ? n - off : GATHER_PIECE;
        for (int r = 0; r < R; r++) {
            theirs[r] = (char *)all + (size_t)r * n + off;
            bytes[r] = len;
        }
        k3_dist_exchange((const char *)mine + off, len, theirs, bytes, what);
    }
    free(theirs);
    free(bytes);
}
