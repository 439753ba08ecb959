/* tensor_par.c: the trunk's products split over the ranks by output rows (tensor_par.h). */
#include "dist/tensor_par.h"

#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"

/* Buffers of the gathers, grown as needed and kept: one forward call makes
 * hundreds of these calls. One thread at a time runs the model (dist.h). */
static struct {
    int cap_jobs;
    int *r0, *r1;
    char *send;
    size_t send_cap;
    int nrecv;
    char **recv;
    size_t *recv_cap, *sizes;
} B;

static void *grow(void *p, size_t *cap, size_t need) {
    if (need <= *cap) return p;
    *cap = need > 2 * *cap ? need : 2 * *cap;
    free(p);
    return xmalloc(*cap);
}

static void local_products(const k_prod *jobs, int njobs) {
    if (njobs == 1) k_matmul(jobs[0].W, jobs[0].X, jobs[0].n, jobs[0].Y);
    else k_products(jobs, njobs);
}

/* Bytes of the rows of each job that `rank` computes, every job's rows in
 * job order, each [n][share] floats. */
static size_t block_bytes(const k_prod *jobs, int njobs, int rank, int R) {
    size_t b = 0;
    for (int j = 0; j < njobs; j++) {
        int a, z;
        if (jobs[j].n <= 0) continue;
        k_row_share(jobs[j].W->rows, rank, R, &a, &z);
        b += (size_t)jobs[j].n * (size_t)(z - a) * sizeof(float);
    }
    return b;
}

/* Rank `rank`'s rows of every job between Y (strided, [n][rows]) and a block. */
static void pack(const k_prod *jobs, int njobs, int rank, int R, char *blk, bool out) {
    size_t at = 0;
    for (int j = 0; j < njobs; j++) {
        int a, z;
        if (jobs[j].n <= 0) continue;
        k_row_share(jobs[j].W->rows, rank, R, &a, &z);
        size_t w = (size_t)(z - a) * sizeof(float), rows = (size_t)jobs[j].W->rows;
        if (!w) continue;
        for (int t = 0; t < jobs[j].n; t++, at += w) {
            float *y = jobs[j].Y + (size_t)t * rows + (size_t)a;
            if (out) memcpy(blk + at, y, w);
            else memcpy(y, blk + at, w);
        }
    }
}

static void tp_products(const k_prod *jobs, int njobs) {
    int R = k3_dist_size(), me = k3_dist_rank();
    if (R <= 1 || njobs <= 0) {
        local_products(jobs, njobs);
        return;
    }
    if (njobs > B.cap_jobs) {
        B.cap_jobs = njobs > 2 * B.cap_jobs ? njobs : 2 * B.cap_jobs;
        free(B.r0);
        free(B.r1);
        B.r0 = xmalloc_array((size_t)B.cap_jobs, sizeof *B.r0);
        B.r1 = xmalloc_array((size_t)B.cap_jobs, sizeof *B.r1);
    }
    if (B.nrecv != R) {
        for (int r = 0; r < B.nrecv; r++) free(B.recv[r]);
        free(B.recv);
        free(B.recv_cap);
        free(B.sizes);
        B.recv = xcalloc((size_t)R, sizeof *B.recv);
        B.recv_cap = xcalloc((size_t)R, sizeof *B.recv_cap);
        B.sizes = xcalloc((size_t)R, sizeof *B.sizes);
        B.nrecv = R;
    }
    k3_dist_stats note = {.split_gathers = 1};
    for (int j = 0; j < njobs; j++) {
        k_row_share(jobs[j].W->rows, me, R, &B.r0[j], &B.r1[j]);
        if (jobs[j].n <= 0) continue;
        note.split_read += k_mat_bytes(jobs[j].W, B.r1[j] - B.r0[j]);
        note.split_whole += k_mat_bytes(jobs[j].W, jobs[j].W->rows);
    }
    k_products_rows(jobs, njobs, B.r0, B.r1);
    size_t mine = block_bytes(jobs, njobs, me, R);
    B.send = grow(B.send, &B.send_cap, mine ? mine : 1);
    pack(jobs, njobs, me, R, B.send, true);
    for (int r = 0; r < R; r++) {
        B.sizes[r] = r == me ? 0 : block_bytes(jobs, njobs, r, R);
        if (r != me) B.recv[r] = grow(B.recv[r], &B.recv_cap[r], B.sizes[r] ? B.sizes[r] : 1);
    }
    k3_dist_stats s0 = k3_dist_get_stats();
    k3_dist_exchange(B.send, mine, (void *const *)B.recv, B.sizes, "the trunk's split products (tensor parallel)");
    k3_dist_stats s1 = k3_dist_get_stats();
    for (int r = 0; r < R; r++)
        if (r != me) pack(jobs, njobs, r, R, B.recv[r], false);
    note.split_bytes_sent = s1.bytes_sent - s0.bytes_sent;
    note.split_wait_s = s1.wait_s - s0.wait_s;
    k3_dist_note_split(&note);
}

static const k3_fwd_ops tp_ops = {.products = tp_products, .expert_products = local_products, .collective = true,
                                  .whole_products = local_products};
static const k3_fwd_ops tp_all_ops = {.products = tp_products, .expert_products = tp_products, .collective = true,
                                      .experts_split = true, .whole_products = local_products};

const k3_fwd_ops *k3_tp_ops(bool experts_too) { return experts_too ? &tp_all_ops : &tp_ops; }

void k3_tp_release(void) {
    for (int r = 0; r < B.nrecv; r++) free(B.recv[r]);
    free(B.recv);
    free(B.recv_cap);
    free(B.sizes);
    free(B.send);
    free(B.r0);
    free(B.r1);
    memset(&B, 0, sizeof B);
}
