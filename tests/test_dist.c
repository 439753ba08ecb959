/* Expert placements, the model identity and the one-process form of the job
 * API (dist.h). The multi-rank behaviour is tested under mpirun by
 * tests/cli/test_mpi.sh. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dist/dist.h"
#include "dist/expert_par.h"
#include "formats/identity.h"
#include "harness.h"
#include "session/session.h"

TEST(dist_placement_contiguous_balanced) {
    k3_placement p;
    k3_placement_contiguous(3, 2, 8, &p);
    static const int want[8] = {0, 0, 1, 1, 1, 2, 2, 2}; /* [r*8/3, (r+1)*8/3) */
    for (int L = 0; L < 2; L++)
        for (int e = 0; e < 8; e++) CHECKF(p.owner[L * 8 + e] == want[e], "layer %d expert %d: rank %d", L, e, p.owner[L * 8 + e]);
    k3_placement_free(&p);
    k3_placement_contiguous(8, 1, 8, &p); /* one expert per rank */
    for (int e = 0; e < 8; e++) CHECK(p.owner[e] == e);
    k3_placement_free(&p);
}

static void add(xc_request **r, size_t *n, size_t *cap, int layer, int expert, int times) {
    for (int i = 0; i < times; i++) {
        if (*n == *cap) *r = xrealloc_array(*r, *cap = *cap ? 2 * *cap : 64, sizeof **r);
        (*r)[(*n)++] = (xc_request){.step = (int32_t)*n, .layer = layer, .expert = expert};
    }
}

TEST(dist_placement_from_trace_spreads_hot_experts) {
    /* layer 0: experts 0, 1, 2 hot (100, 90, 80 requests), 3 warm (10), 4-7 cold (1) */
    xc_request *r = NULL;
    size_t n = 0, cap = 0;
    static const int cnt[8] = {100, 90, 80, 10, 1, 1, 1, 1};
    for (int e = 0; e < 8; e++) add(&r, &n, &cap, 0, e, cnt[e]);
    k3_placement p, q;
    k3_placement_from_trace(2, 1, 8, r, n, &p);
    /* by hand: 0 -> r0 (100); 1 -> r1 (90); 2 -> r1 (least, 170); 3 -> r0 (110);
     * 4, 5 -> r0 (111, 112; now full at 4); 6, 7 -> r1 */
    static const int want[8] = {0, 1, 1, 0, 0, 0, 1, 1};
    for (int e = 0; e < 8; e++) CHECKF(p.owner[e] == want[e], "expert %d: rank %d", e, p.owner[e]);
    /* busiest over mean: 172 / 142 here, 280 / 142 for the contiguous split */
    k3_placement_contiguous(2, 1, 8, &q);
    CHECKF(fabs(k3_placement_imbalance(&p, r, n) - 172.0 / 142.0) < 1e-12, "%g", k3_placement_imbalance(&p, r, n));
    CHECKF(fabs(k3_placement_imbalance(&q, r, n) - 280.0 / 142.0) < 1e-12, "%g", k3_placement_imbalance(&q, r, n));
    k3_placement_free(&p);
    k3_placement_free(&q);
    /* never more than ceil(N / R) experts on a rank, whatever the trace */
    k3_placement_from_trace(3, 1, 8, r, n, &p);
    int held[3] = {0};
    for (int e = 0; e < 8; e++) held[p.owner[e]]++;
    for (int k = 0; k < 3; k++) CHECKF(held[k] <= 3 && held[k] >= 2, "rank %d holds %d", k, held[k]);
    k3_placement_free(&p);
    free(r);
}

TEST(dist_placement_step_load_by_hand) {
    /* step 0 selects experts 0-3 of layer 0, step 1 selects 0, 1, 4, 5 */
    xc_request r[8] = {{0, 0, 0}, {0, 0, 1}, {0, 0, 2}, {0, 0, 3}, {1, 0, 0}, {1, 0, 1}, {1, 0, 4}, {1, 0, 5}};
    k3_placement p;
    k3_placement_contiguous(2, 1, 8, &p); /* rank 0: 0-3, rank 1: 4-7: max 4, then 2 */
    CHECKF(k3_placement_step_load(&p, r, 8) == 3.0, "%g", k3_placement_step_load(&p, r, 8));
    for (int e = 0; e < 8; e++) p.owner[e] = e & 1; /* even / odd: 2 and 2 */
    CHECKF(k3_placement_step_load(&p, r, 8) == 2.0, "%g", k3_placement_step_load(&p, r, 8));
    k3_placement_free(&p);
}

static void write_text(const char *path, const char *s) {
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(s, f);
        fclose(f);
    }
}

TEST(dist_placement_file_roundtrip_and_refusals) {
    k3_config c = {.num_layers = 2, .num_experts = 4};
    k3_placement p, q;
    k3_placement_contiguous(2, 2, 4, &p);
    p.owner[1] = 1; /* not contiguous any more */
    char path[512];
    snprintf(path, sizeof path, "%s/p.json", t_outdir());
    k3_err err = {0};
    CHECK(k3_placement_save(&p, path, &err) == K3_OK);
    CHECK(k3_placement_load(path, 2, &c, &q, &err) == K3_OK);
    CHECK(memcmp(p.owner, q.owner, 8 * sizeof *p.owner) == 0);
    CHECK(k3_placement_hash(&p) == k3_placement_hash(&q));
    k3_placement_free(&q);
    /* a run of fewer layers may use a placement made for more */
    c.num_layers = 1;
    CHECK(k3_placement_load(path, 2, &c, &q, &err) == K3_OK && q.layers == 1);
    k3_placement_free(&q);
    c.num_layers = 2;
    CHECK(k3_placement_load(path, 3, &c, &q, &err) == K3_EXIT_USAGE && strstr(err.msg, "made for 2 ranks"));
    c.num_experts = 5;
    CHECK(k3_placement_load(path, 2, &c, &q, &err) == K3_EXIT_USAGE && strstr(err.msg, "experts per layer"));
    c.num_experts = 4;
    c.num_layers = 3;
    CHECK(k3_placement_load(path, 2, &c, &q, &err) == K3_EXIT_USAGE && strstr(err.msg, "covers 2 layers"));
    c.num_layers = 2;
    write_text(path, "{\"format\":\"k3-expert-placement\",\"version\":1,\"ranks\":2,\"num_layers\":2,"
                     "\"num_experts\":4,\"owner\":[[0,0,1,1],[0,2,1,1]]}");
    CHECK(k3_placement_load(path, 2, &c, &q, &err) == K3_EXIT_USAGE && strstr(err.msg, "owner[1][1]"));
    write_text(path, "{\"format\":\"k3-expert-placement\",\"version\":1,\"ranks\":2,\"num_layers\":2,"
                     "\"num_experts\":4,\"owner\":[[0,0,1,1]]}");
    CHECK(k3_placement_load(path, 2, &c, &q, &err) == K3_EXIT_USAGE);
    write_text(path, "{\"ranks\":2}");
    CHECK(k3_placement_load(path, 2, &c, &q, &err) == K3_EXIT_USAGE && strstr(err.msg, "not a k3 expert placement"));
    write_text(path, "not json");
    CHECK(k3_placement_load(path, 2, &c, &q, &err) == K3_EXIT_USAGE);
    k3_placement_free(&p);
}

/* what the ranks compare at start (formats/identity.h) */
TEST(dist_model_identity_sees_config_and_tensor_table) {
    const char *src = t_repo("tests/fixtures/gen/k3_like");
    char a[512], b[512], cmd[4096];
    snprintf(a, sizeof a, "%s/a", t_outdir());
    snprintf(b, sizeof b, "%s/b", t_outdir());
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s' && cp -r '%s' '%s' && cp -r '%s' '%s'", a, b, src, a, src, b);
    CHECK(system(cmd) == 0);
    uint64_t h0, ha, hb;
    k3_err err = {0};
    CHECK(k3_model_identity(src, NULL, 0, &h0, &err) == K3_OK);
    CHECK(k3_model_identity(a, NULL, 0, &ha, &err) == K3_OK);
    CHECK(h0 == ha); /* a copy is the same checkpoint */
    snprintf(cmd, sizeof cmd, "sed -i 's/\"rms_norm_eps\": 1e-05/\"rms_norm_eps\": 2e-05/' '%s/config.json'", b);
    CHECK(system(cmd) == 0);
    CHECK(k3_model_identity(b, NULL, 0, &hb, &err) == K3_OK);
    CHECK(hb != h0);
    /* another checkpoint (other tensor table) */
    CHECK(k3_model_identity(t_repo("tests/fixtures/gen/s2_two_dense"), NULL, 0, &hb, &err) == K3_OK && hb != h0);
    CHECK(k3_model_identity("/nonexistent-k3-dir", NULL, 0, &hb, &err) != K3_OK);
    /* the value itself is pinned: saved sessions of earlier builds must still
     * load. Computed outside k3 (FNV-1a 64 in Python over the bytes that
     * identity.h lists), and equal to the id in a session file that the
     * build before the identity moved into formats/ wrote */
    CHECK(h0 == 0xd4d9bc8b515810caULL);
    CHECK(k3_model_identity(t_repo("tests/fixtures/gen/s2_two_dense"), NULL, 0, &hb, &err) == K3_OK &&
          hb == 0xf3853593b46dae05ULL);
}

TEST(dist_one_process_job) {
    /* not under mpirun: rank 0 of 1, every collective local */
    CHECK(!k3_dist_active());
    CHECK(k3_dist_rank() == 0 && k3_dist_size() == 1);
    k3_err err = {0};
    CHECK(k3_dist_agree(0, &err, "t") == 0);
    snprintf(err.msg, sizeof err.msg, "x: bad");
    CHECK(k3_dist_agree(K3_EXIT_DATA, &err, "t") == K3_EXIT_DATA && !strcmp(err.msg, "x: bad"));
    int mine = 42, all = 0;
    k3_dist_allgather(&mine, sizeof mine, &all, "t");
    CHECK(all == 42);
    CHECK(!k3_dist_defer_error(1, "not deferred outside mpirun"));
    CHECK(k3_dist_finish(3) == 3);
}

/* The one-process form of the data-parallel fold is the left fold in vector
 * order, element by element ((a + b) + c, never a + (b + c)): the values are
 * chosen so the two associations give other floats. counts[0] vectors, the
 * output in place of the first (as the trainer calls it). */
#include "dist/data_par.h"
TEST(dist_fold_is_the_left_fold_in_unit_order) {
    enum { N = 70001, V = 3 }; /* past k3_dp_add's parallel threshold, not a multiple of its blocks */
    float *u[V];
    for (int j = 0; j < V; j++) u[j] = xmalloc_array(N, sizeof(float));
    for (int i = 0; i < N; i++) {
        u[0][i] = i & 1 ? 1.0f : 0.5f;
        u[1][i] = 16777216.0f; /* 2^24: 1 + 2^24 and 0.5 + 2^24 round to 2^24 */
        u[2][i] = -16777216.0f;
    }
    float *want = xmalloc_array(N, sizeof(float));
    for (int i = 0; i < N; i++) {
        volatile float a = u[0][i] + u[1][i]; /* by hand: 2^24, then 0 */
        want[i] = a + u[2][i];
    }
    CHECK(want[0] == 0.0f && want[1] == 0.0f); /* a + (b + c) would be a */
    const float *mine[V] = {u[0], u[1], u[2]};
    int counts[1] = {V};
    k3_dp_fold(u[0], mine, counts, N, "test");
    int bad = 0;
    for (int i = 0; i < N; i++) bad += memcmp(&u[0][i], &want[i], sizeof(float)) != 0;
    CHECKF(bad == 0, "%d of %d elements differ from the left fold", bad, N);
    /* one vector: the output is that vector */
    float one[3] = {1.5f, -2.0f, 0.25f}, out[3] = {0};
    const float *m1[1] = {one};
    int c1[1] = {1};
    k3_dp_fold(out, m1, c1, 3, "test");
    CHECK(!memcmp(out, one, sizeof one));
    /* the gather of one rank is its block */
    char all[5] = {0};
    k3_dp_allgather("abcd", 5, all, "test");
    CHECK(!strcmp(all, "abcd"));
    for (int j = 0; j < V; j++) free(u[j]);
    free(want);
}

/* k3_dist_exchange's rounds, every rank of R = 1..5 simulated in one process
 * with uneven blocks (empty ones included): after the rounds each rank holds
 * every rank's block, compared with a plain copy of the blocks themselves. */
TEST(dist_gather_rounds_deliver_every_block) {
    for (int R = 1; R <= 5; R++) {
        size_t sz[5], off[5][6], tot = 0;
        unsigned char blk[5][40], stage[5][200];
        for (int r = 0; r < R; r++) {
            sz[r] = (size_t)((r * 7 + R * 3) % 11) * (r != 1 || R < 3); /* rank 1 empty from R = 3 */
            for (size_t i = 0; i < sz[r]; i++) blk[r][i] = (unsigned char)(1 + 37 * r + i);
            tot += sz[r];
        }
        for (int me = 0; me < R; me++) { /* relative order, as each rank keeps it */
            off[me][0] = 0;
            for (int i = 0; i < R; i++) off[me][i + 1] = off[me][i] + sz[(me + i) % R];
            CHECK(off[me][R] == tot);
            memset(stage[me], 0, sizeof stage[me]);
            memcpy(stage[me], blk[me], sz[me]);
        }
        int rounds = k3_gather_rounds(R);
        CHECKF((1 << rounds) >= R && (rounds == 0 || (1 << (rounds - 1)) < R), "R %d: %d rounds", R, rounds);
        for (int s = 0; s < rounds; s++) {
            unsigned char next[5][200];
            memcpy(next, stage, sizeof next);
            for (int me = 0; me < R; me++) { /* me receives from `from`, which sends to me */
                int to, from, at, n, to2, from2, at2, n2;
                k3_gather_round(R, me, s, &to, &from, &at, &n);
                k3_gather_round(R, from, s, &to2, &from2, &at2, &n2);
                CHECKF(to2 == me && n2 == n && n >= 1, "R %d round %d rank %d", R, s, me);
                size_t want = off[me][at + n] - off[me][at];
                CHECKF(off[from][n] == want, "R %d round %d rank %d: %zu bytes sent, %zu expected", R, s, me,
                       off[from][n], want);
                memcpy(next[me] + off[me][at], stage[from], want);
            }
            memcpy(stage, next, sizeof next);
        }
        for (int me = 0; me < R; me++)
            for (int i = 0; i < R; i++) {
                int r = (me + i) % R;
                CHECKF(!memcmp(stage[me] + off[me][i], blk[r], sz[r]), "R %d: rank %d lacks rank %d's block", R, me, r);
            }
    }
}
