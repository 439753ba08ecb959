/* Expert cache policies against textbook page-replacement figures, and the
 * trace formats. */
#include "harness.h"
#include "memory/cache.h"

#include <stdlib.h>
#include <string.h>

/* The classic reference string from operating-systems textbooks; with 3 frames
 * LRU takes 12 faults and the optimal (Belady) policy 9. */
static const int32_t REF[] = {7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1};
#define NREF (sizeof REF / sizeof REF[0])

static xc_request *one_per_step(const int32_t *keys, size_t n) {
    xc_request *r = calloc(n, sizeof *r);
    for (size_t i = 0; i < n; i++) { r[i].step = (int32_t)i; r[i].layer = 0; r[i].expert = keys[i]; }
    return r;
}

TEST(cache_lru_textbook_faults) {
    xc_request *r = one_per_step(REF, NREF);
    xc_stats s = xc_simulate(r, NREF, XC_LRU, 3);
    CHECKF(s.misses == 12, "LRU misses %llu, want 12", (unsigned long long)s.misses);
    CHECK(s.hits == 8 && s.resident_hits == 8);
    free(r);
}

TEST(cache_belady_textbook_faults) {
    xc_request *r = one_per_step(REF, NREF);
    xc_stats s = xc_simulate(r, NREF, XC_BELADY, 3);
    CHECKF(s.misses == 9, "OPT misses %llu, want 9", (unsigned long long)s.misses);
    free(r);
}

TEST(cache_lfu_keeps_established_set) {
    /* A B C A B C, capacity 2, worked by hand:
     * A,B miss; C miss evicts B (tie at freq 1 -> newest); A hits (freq 2);
     * B misses (freq 2), evicts C (freq 1); C misses (freq 2), evicts B
     * (tie at 2 -> newest). 5 misses, 1 hit. LRU misses all 6. */
    const int32_t k[] = {0, 1, 2, 0, 1, 2};
    xc_request *r = one_per_step(k, 6);
    xc_stats s = xc_simulate(r, 6, XC_LFU, 2);
    CHECKF(s.misses == 5 && s.hits == 1, "lfu misses %llu hits %llu", (unsigned long long)s.misses,
           (unsigned long long)s.hits);
    s = xc_simulate(r, 6, XC_LRU, 2);
    CHECK(s.misses == 6);
    free(r);
}

TEST(cache_repeat_within_step_is_raw_hit_only) {
    /* step 0: e1, e1 (second is a raw hit from the batch); step 1: e1 resident */
    xc_request r[3] = {{0, 5, 1}, {0, 5, 1}, {1, 5, 1}};
    for (int p = 0; p < 3; p++) {
        xc_stats s = xc_simulate(r, 3, (xc_policy)p, 4);
        CHECK(s.misses == 1 && s.hits == 2 && s.resident_hits == 1);
    }
    /* capacity 0: nothing is ever resident, the in-step repeat is still served */
    xc_stats s = xc_simulate(r, 3, XC_LRU, 0);
    CHECK(s.misses == 2 && s.hits == 1 && s.resident_hits == 0);
}

TEST(cache_trace_roundtrip_and_peer_format) {
    char path[1024];
    snprintf(path, sizeof path, "%s/t.trace", t_outdir());
    k3_err err = {0};
    xc_trace_writer w;
    CHECK(xc_trace_open(&w, path, &err) == 0);
    CHECK(xc_trace_write(&w, 0, 1, 7, &err) == 0);
    CHECK(xc_trace_write(&w, 3, 2, 895, &err) == 0);
    CHECK(xc_trace_close(&w, &err) == 0);
    xc_request *r; size_t n;
    CHECK(xc_trace_read(path, &r, &n, &err) == 0);
    CHECK(n == 2 && r[1].step == 3 && r[1].layer == 2 && r[1].expert == 895);
    free(r);
    /* the peer's expert_trace.bin: 100,096 (layer, expert) requests over 8
     * full-recompute steps of 5..12 tokens x 16 experts x layers 1..92 */
    CHECK(xc_trace_read(t_fixture("peer/expert_trace.bin"), &r, &n, &err) == 0);
    CHECKF(n == 100096, "n=%zu", n);
    CHECK(r[0].step == 0 && r[n - 1].step == 7);
    size_t step0 = 0;
    for (size_t i = 0; i < n; i++) if (r[i].step == 0) step0++;
    CHECKF(step0 == 5u * 16u * 92u, "step 0 has %zu requests", step0);
    free(r);
}

TEST(cache_trace_rejects_garbage) {
    char path[1024];
    snprintf(path, sizeof path, "%s/bad.trace", t_outdir());
    k3_err err = {0};
    CHECK(k3_write_file_atomic(path, "abc", 3, &err) == 0);
    xc_request *r; size_t n;
    CHECK(xc_trace_read(path, &r, &n, &err) == K3_EXIT_USAGE);
    CHECK(strstr(err.msg, "bad.trace") != NULL);
}
