/* Tests for src/kernels against the independent references:
 *  - tests/fixtures/peer/ops/ (each op) and mxfp4.json (the peer's PyTorch);
 *  - tests/fixtures/kernels/ (ours) (our own PyTorch, tools/kernels_ref.py);
 * plus the determinism contract: scalar == every SIMD path the CPU has (AVX2,
 * AVX-512) bit for bit, thread count
 * does not change bits, k_matmul == k_matvec per input; and the chunked KDA
 * against the recurrent KDA. Tolerances are the MANIFEST's, judged normwise
 * per row (tj_close_rows). */
#include "harness.h"
#include "tjson.h"
#include "kernels/internal.h"
#include "kernels/kernels.h"
#include "util/common.h"

#include <malloc.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ATOL 1e-5
#define RTOL 1e-4

/* ---- helpers ---------------------------------------------------------------- */

/* Every array handed out by the helpers is kept here and freed by pool_free. */
static void *pool[256];
static int npool;
static void *keep(void *p) {
    if (npool < 256) pool[npool++] = p;
    return p;
}
static void pool_free(void) {
    while (npool) free(pool[--npool]);
}

/* obj[key] as floats: either {"shape":..., "data": [...]} or a bare array. */
static float *fx(const json_t *obj, const char *key, size_t *n) {
    const json_t *v = json_object_get(obj, key);
    if (json_is_object(v)) v = json_object_get(v, "data");
    size_t m = 0;
    float *f = tj_floats(v, &m);
    if (n) *n = m;
    return f ? keep(f) : NULL;
}

static float *fzero(size_t n) { return keep(xcalloc(n ? n : 1, sizeof(float))); }
static float *fcopy(const float *x, size_t n) {
    float *y = keep(xmalloc_array(n ? n : 1, sizeof(float)));
    memcpy(y, x, n * sizeof(float));
    return y;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}
static float urand(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() & 0xffffff) / 16777216.0f; }
static float *frand(size_t n, float lo, float hi) {
    float *x = keep(xmalloc_array(n ? n : 1, sizeof(float)));
    for (size_t i = 0; i < n; i++) x[i] = urand(lo, hi);
    return x;
}

static bool same_bits(const float *a, const float *b, size_t n, size_t *where) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) { if (where) *where = i; return false; }
    return true;
}

/* normwise compare with a readable failure */
#define CLOSE(got, want, n, row)                                                        \
    do {                                                                                \
        double worst_;                                                                  \
        long bad_ = tj_close_rows((got), (want), (n), (row), ATOL, RTOL, &worst_);      \
        CHECKF(bad_ < 0, "%s: element %ld got %.9g want %.9g (worst/bound %.3g)", #got, \
               bad_, bad_ < 0 ? 0.0 : (double)(got)[bad_], bad_ < 0 ? 0.0 : (double)(want)[bad_], worst_); \
    } while (0)

/* ---- the math helpers (exp, tanh, sigmoid) against double -------------------------- */

static double ulp_err(float got, double want) {
    if (want == 0) return got == 0 ? 0 : INFINITY;
    double u = ldexp(1.0, ilogb(want) - 23);
    if (fabs(want) < 0x1p-126) u = 0x1p-149;
    return fabs((double)got - want) / u;
}

TEST(kmath_exp_tanh_sigmoid_accuracy) {
    double we = 0, wt = 0, ws = 0;
    for (int i = 0; i <= 400000; i++) {
        float x = -87.0f + 175.0f * (float)i / 400000.0f;
        double e = ulp_err(km_exp(x), exp((double)x));
        if (e > we) we = e;
        float y = -12.0f + 24.0f * (float)i / 400000.0f;
        double t = ulp_err(km_tanh(y), tanh((double)y));
        if (t > wt) wt = t;
        double s = ulp_err(km_sigmoid(y), 1.0 / (1.0 + exp(-(double)y)));
        if (s > ws) ws = s;
    }
    CHECKF(we <= 2.0, "exp max error %.2f ulp", we);
    CHECKF(wt <= 3.0, "tanh max error %.2f ulp", wt);
    CHECKF(ws <= 3.0, "sigmoid max error %.2f ulp", ws);
    CHECK(isinf(km_exp(89.0f)) && km_exp(-104.0f) == 0.0f && km_exp(0.0f) == 1.0f);
    CHECK(isnan(km_exp(NAN)) && isnan(km_tanh(NAN)));
    CHECK(km_exp(-INFINITY) == 0.0f && isinf(km_exp(INFINITY)));
    CHECK(km_tanh(INFINITY) == 1.0f && km_tanh(-INFINITY) == -1.0f && km_tanh(0.0f) == 0.0f);
    CHECK(km_sigmoid(-200.0f) == 0.0f && km_sigmoid(200.0f) == 1.0f);
    /* subnormal results: one rounding, like exp in double then to float */
    for (float x = -103.5f; x < -87.0f; x += 0.37f) {
        float want = (float)exp((double)x);
        CHECKF(fabsf(km_exp(x) - want) <= 0x1p-149f, "exp(%g) = %a want %a", x, km_exp(x), want);
    }
}

/* ---- peer fixtures ---------------------------------------------------------------- */

TEST(peer_rmsnorm) {
    json_t *j = tj_load(t_fixture("peer/ops/rmsnorm.json"));
    CHECK(j);
    size_t nw, nin, nout;
    float *w = fx(j, "weight", &nw), *in = fx(j, "in", &nin), *want = fx(j, "out", &nout);
    CHECK(w && in && want && nin == nout && nin % nw == 0);
    float eps = (float)tj_num(j, "eps");
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *got = fzero(nin);
        for (size_t r = 0; r < nin / nw; r++) k_rmsnorm(got + r * nw, in + r * nw, w, (int)nw, eps);
        CLOSE(got, want, nin, nw);
        /* in place */
        float *y = fcopy(in, nin);
        for (size_t r = 0; r < nin / nw; r++) k_rmsnorm(y + r * nw, y + r * nw, w, (int)nw, eps);
        CHECK(same_bits(y, got, nin, NULL));
    }
    json_decref(j);
    pool_free();
}

TEST(peer_situ_glu) {
    json_t *j = tj_load(t_fixture("peer/ops/situ_glu.json"));
    CHECK(j);
    size_t nin, nout;
    float *in = fx(j, "in", &nin), *want = fx(j, "out", &nout);
    CHECK(in && want && nin == 2 * nout);
    float b1 = (float)tj_num(j, "beta"), b2 = (float)tj_num(j, "linear_beta");
    float bound = (float)tj_num(j, "max_abs");
    size_t rows = json_integer_value(json_array_get(json_object_get(json_object_get(j, "out"), "shape"), 0));
    CHECK(rows > 0 && nout % rows == 0);
    size_t w = nout / rows;
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *got = fzero(nout);
        for (size_t r = 0; r < rows; r++) /* gate half first, then the up half */
            k_situ_glu(got + r * w, in + r * 2 * w, in + r * 2 * w + w, (int)w, b1, b2);
        CLOSE(got, want, nout, w);
        for (size_t i = 0; i < nout; i++) CHECKF(fabsf(got[i]) <= bound, "|%g| > %g", got[i], bound);
    }
    json_decref(j);
    pool_free();
}

TEST(peer_shortconv_with_state) {
    json_t *j = tj_load(t_fixture("peer/ops/shortconv.json"));
    CHECK(j);
    int K = (int)tj_num(j, "kernel"), C = (int)tj_num(j, "channels");
    size_t nw, nin, nout, nst, nnx, nonx;
    float *w = fx(j, "weight", &nw), *in = fx(j, "in", &nin), *want = fx(j, "out", &nout);
    float *st_want = fx(j, "state_after", &nst), *inx = fx(j, "in_next", &nnx), *outx = fx(j, "out_next", &nonx);
    CHECK(w && in && want && st_want && inx && outx);
    CHECK(nw == (size_t)(C * K) && nin == nout && nin % (size_t)C == 0 && nst == (size_t)(C * (K - 1)));
    int T = (int)(nin / (size_t)C);
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *state = fzero(nst), *y = fzero(nin);
        k_shortconv_silu(y, in, T, C, w, K, state);
        CLOSE(y, want, nin, (size_t)C);
        CLOSE(state, st_want, nst, nst);
        float *y2 = fzero(nonx);
        k_shortconv_silu(y2, inx, 1, C, w, K, state);
        CLOSE(y2, outx, nonx, nonx);
        /* one step at a time gives the same bits as the whole sequence */
        float *s1 = fzero(nst), *y1 = fzero(nin);
        for (int t = 0; t < T; t++) k_shortconv_silu(y1 + t * C, in + t * C, 1, C, w, K, s1);
        CHECK(same_bits(y1, y, nin, NULL));
    }
    json_decref(j);
    pool_free();
}

TEST(peer_kda_decay_gate) {
    json_t *j = tj_load(t_fixture("peer/ops/kda_decay.json"));
    CHECK(j);
    size_t nz, na, nd, ng, nal;
    float *z = fx(j, "z", &nz), *A = fx(j, "A_log", &na), *dtb = fx(j, "dt_bias", &nd);
    float *want = fx(j, "g", &ng), *alpha = fx(j, "alpha", &nal);
    CHECK(z && A && dtb && want && alpha && ng == nz && nal == ng);
    int H = (int)na, D = (int)(nd / na);
    int T = (int)(nz / nd);
    float lower = (float)tj_num(j, "lower_bound");
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *g = fzero(ng), *a = fzero(ng);
        for (int t = 0; t < T; t++) k_kda_gate(g + t * H * D, NULL, z + t * H * D, A, dtb, H, D, lower);
        CLOSE(g, want, ng, (size_t)D);
        for (size_t i = 0; i < ng; i++) {
            a[i] = km_exp(g[i]);
            CHECKF(g[i] >= lower && g[i] <= 0, "g %g outside [%g, 0]", g[i], lower);
        }
        CLOSE(a, alpha, ng, (size_t)D);
    }
    json_decref(j);
    pool_free();
}

/* The bound a chunkwise call is promised: the smallest log-decay given. */
static float min_of(const float *x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = x[i] < m ? x[i] : m;
    return m;
}

static void kda_recur_fixture(const char *name) {
    json_t *j = tj_load(t_fixture(name));
    CHECK(j);
    int T = (int)tj_num(j, "T"), H = (int)tj_num(j, "H"), D = (int)tj_num(j, "d_k");
    CHECK((int)tj_num(j, "d_v") == D);
    CHECK(fabs(tj_num(j, "q_scale") - 1.0 / sqrt(D)) < 1e-7);
    size_t n, nb, no, ns;
    float *q = fx(j, "q", &n), *k = fx(j, "k", NULL), *v = fx(j, "v", NULL), *al = fx(j, "alpha", NULL);
    float *beta = fx(j, "beta", &nb), *want = fx(j, "out", &no), *swant = fx(j, "state_out", &ns);
    CHECK(q && k && v && al && beta && want && swant);
    CHECK(n == (size_t)T * H * D && nb == (size_t)T * H && no == n && ns == (size_t)H * D * D);
    float *g = fzero(n);
    for (size_t i = 0; i < n; i++) g[i] = logf(al[i]);
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *o = fzero(n), *S = fzero(ns);
        k_kda_recurrent(o, S, q, k, v, g, beta, T, H, D);
        CLOSE(o, want, n, (size_t)D);
        CLOSE(S, swant, ns, (size_t)D);
        for (int C = 1; C <= T + 1; C *= 2) {
            float *o2 = fzero(n), *S2 = fzero(ns);
            k_kda_chunked(o2, S2, q, k, v, g, beta, T, H, D, C, min_of(g, n));
            CLOSE(o2, want, n, (size_t)D);
            CLOSE(S2, swant, ns, (size_t)D);
        }
    }
    json_decref(j);
    pool_free();
}
TEST(peer_kda_recur1) { kda_recur_fixture("peer/ops/kda_recur1.json"); }
TEST(peer_kda_recur8) { kda_recur_fixture("peer/ops/kda_recur8.json"); }

TEST(peer_router_topk) {
    json_t *j = tj_load(t_fixture("peer/ops/router.json"));
    CHECK(j);
    int K = (int)tj_num(j, "top_k"), N = (int)tj_num(j, "n_experts");
    size_t nw, nb, nin, ni, nwt;
    float *W = fx(j, "gate_weight", &nw), *bias = fx(j, "bias", &nb), *in = fx(j, "in", &nin);
    float *widx = fx(j, "topk_idx", &ni), *wwt = fx(j, "topk_weight", &nwt);
    CHECK(W && bias && in && widx && wwt && nb == (size_t)N && nw % (size_t)N == 0);
    int E = (int)(nw / (size_t)N), rows = (int)(nin / (size_t)E);
    CHECK(ni == (size_t)rows * K && nwt == ni);
    k3_mat M = {.type = KW_F32, .rows = N, .cols = E, .data = W};
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *logits = fzero((size_t)N), *w = fzero((size_t)K);
        int idx[64];
        CHECK(K <= 64);
        for (int r = 0; r < rows; r++) {
            k_matvec(&M, in + (size_t)r * E, logits);
            k_router_topk(logits, bias, N, K, true, 1.0f, idx, w);
            for (int i = 0; i < K; i++)
                CHECKF(idx[i] == (int)widx[r * K + i], "row %d slot %d: expert %d want %d", r, i, idx[i],
                       (int)widx[r * K + i]);
            CLOSE(w, wwt + (size_t)r * K, (size_t)K, (size_t)K);
        }
    }
    json_decref(j);
    pool_free();
}

TEST(router_ties_go_to_lower_index) {
    float logits[6] = {0.5f, 1.0f, 1.0f, 0.2f, 1.0f, -3.0f};
    int idx[4];
    float w[4];
    k_router_topk(logits, NULL, 6, 3, true, 2.0f, idx, w);
    CHECK(idx[0] == 1 && idx[1] == 2 && idx[2] == 4);
    CHECK(fabsf(w[0] + w[1] + w[2] - 2.0f) < 1e-6f);
    /* bias selects but does not weight */
    float bias[6] = {0, 0, 0, 5.0f, 0, 0};
    k_router_topk(logits, bias, 6, 2, false, 1.0f, idx, w);
    CHECK(idx[0] == 3 && idx[1] == 1);
    CHECK(w[0] == k_sigmoid(0.2f) && w[1] == k_sigmoid(1.0f));
    /* k = 1: no renormalisation, scale still applies */
    k_router_topk(logits, NULL, 6, 1, true, 3.0f, idx, w);
    CHECK(idx[0] == 1 && w[0] == k_sigmoid(1.0f) * 3.0f);
    /* NaN logit never preferred */
    float ln[3] = {NAN, -1.0f, -2.0f};
    k_router_topk(ln, NULL, 3, 1, false, 1.0f, idx, w);
    CHECK(idx[0] == 1);
}

/* ---- MXFP4 -------------------------------------------------------------------------- */

TEST(peer_mxfp4_bit_exact_and_decoy_detected) {
    json_t *j = tj_load(t_fixture("peer/mxfp4.json"));
    CHECK(j);
    int rows = (int)tj_num(j, "rows"), cols = (int)tj_num(j, "logical_width");
    int G = (int)tj_num(j, "group_size");
    size_t np, ns, ne, nl;
    float *pf = fx(j, "packed", &np), *sf = fx(j, "scales", &ns), *exp_ = fx(j, "expected", &ne);
    float *lut = fx(j, "e2m1_lut", &nl);
    CHECK(pf && sf && exp_ && lut && nl == 16);
    for (int i = 0; i < 16; i++) CHECK(memcmp(&lut[i], &k_e2m1[i], 4) == 0);
    CHECK(np == (size_t)rows * cols / 2 && ns == (size_t)rows * cols / G && ne == (size_t)rows * cols);
    uint8_t *packed = keep(xmalloc(np)), *scales = keep(xmalloc(ns));
    for (size_t i = 0; i < np; i++) packed[i] = (uint8_t)pf[i];
    for (size_t i = 0; i < ns; i++) scales[i] = (uint8_t)sf[i];
    k3_mat M = {.type = KW_MXFP4, .rows = rows, .cols = cols, .data = packed, .scales = scales, .group = G};
    float *row = fzero((size_t)cols);
    for (int r = 0; r < rows; r++) {
        k_mat_row(&M, r, row);
        size_t at = 0;
        CHECKF(same_bits(row, exp_ + (size_t)r * cols, (size_t)cols, &at), "row %d col %zu: %a want %a", r,
               at, row[at], exp_[(size_t)r * cols + at]);
    }
    /* the decoy: decoding with the nibbles swapped reproduces the fixture's
     * wrong values, and those differ from ours, so this test can tell. */
    json_t *sw = json_object_get(json_object_get(j, "expected_swapped_nibbles"), "first64");
    size_t nsw;
    float *swapped = keep(tj_floats(sw, &nsw));
    CHECK(swapped && nsw == 64);
    float mine[64];
    for (int c = 0; c < 64; c++) {
        uint8_t b = packed[c / 2];
        int code = (c & 1) ? (b & 15) : (b >> 4);
        mine[c] = k_e2m1[code] * k_e8m0(scales[c / G]);
    }
    CHECK(same_bits(mine, swapped, 64, NULL));
    k_mat_row(&M, 0, row);
    CHECK(!same_bits(row, swapped, 64, NULL));
    /* the MXFP4 product equals, bit for bit, the F32 product of its
     * dequantised matrix, on both paths (kernels.h contract) */
    float *x = frand((size_t)cols, -1, 1);
    k3_mat F = {.type = KW_F32, .rows = rows, .cols = cols, .data = exp_};
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *y1 = fzero((size_t)rows), *y2 = fzero((size_t)rows);
        k_matvec(&M, x, y1);
        k_matvec(&F, x, y2);
        CHECK(same_bits(y1, y2, (size_t)rows, NULL));
    }
    json_decref(j);
    pool_free();
}

TEST(mxfp4_e8m0_scales) {
    CHECK(k_e8m0(127) == 1.0f && k_e8m0(128) == 2.0f && k_e8m0(120) == 0x1p-7f);
    CHECK(k_e8m0(0) == 0x1p-127f && k_e8m0(254) == 0x1p127f && k_e8m0(255) == 0.0f);
    /* a 255 scale zeroes its whole group and only it */
    uint8_t packed[32], scales[2] = {255, 127};
    memset(packed, 0x77, sizeof packed); /* every code 7 = 6.0 */
    k3_mat M = {.type = KW_MXFP4, .rows = 1, .cols = 64, .data = packed, .scales = scales, .group = 32};
    float row[64];
    k_mat_row(&M, 0, row);
    for (int i = 0; i < 64; i++) CHECK(row[i] == (i < 32 ? 0.0f : 6.0f));
}

/* ---- chunked KDA against recurrent KDA --------------------------------------------- */

/* Model-like inputs: q, k L2-normalised per head, beta in (0, 1), log-decays
 * in [lower, 0] with a share exactly 0 (alpha == 1) and a share at the bound. */
static void kda_inputs(int T, int H, int D, float lower, float **q, float **k, float **v, float **g,
                       float **beta) {
    size_t n = (size_t)T * H * D;
    *q = frand(n, -1, 1);
    *k = frand(n, -1, 1);
    *v = frand(n, -2, 2);
    *g = frand(n, lower, 0);
    *beta = frand((size_t)T * H, 0.01f, 0.99f);
    for (size_t i = 0; i < n; i++) {
        uint32_t r = rnd() % 8;
        if (r == 0) (*g)[i] = 0.0f;
        if (r == 1) (*g)[i] = lower * 0.9999f;
    }
    for (size_t h = 0; h < n / (size_t)D; h++) {
        k_l2norm(*q + h * D, D, 1e-6f);
        k_l2norm(*k + h * D, D, 1e-6f);
    }
}

static void chunk_vs_recur(int T, int H, int D, int C, float lower) {
    float *q, *k, *v, *g, *beta;
    kda_inputs(T, H, D, lower, &q, &k, &v, &g, &beta);
    size_t n = (size_t)T * H * D, ns = (size_t)H * D * D;
    float *S0 = frand(ns, -0.5f, 0.5f); /* a carried state, as after a prefix */
    float *o1 = fzero(n), *o2 = fzero(n), *S1 = fcopy(S0, ns), *S2 = fcopy(S0, ns);
    k_kda_recurrent(o1, S1, q, k, v, g, beta, T, H, D);
    k_kda_chunked(o2, S2, q, k, v, g, beta, T, H, D, C, lower);
    for (size_t i = 0; i < n; i++) CHECKF(isfinite(o2[i]), "T %d C %d: o[%zu] = %g", T, C, i, o2[i]);
    for (size_t i = 0; i < ns; i++) CHECKF(isfinite(S2[i]), "T %d C %d: S[%zu] = %g", T, C, i, S2[i]);
    double w1, w2;
    long b1 = tj_close_rows(o2, o1, n, (size_t)D, ATOL, RTOL, &w1);
    long b2 = tj_close_rows(S2, S1, ns, (size_t)D, ATOL, RTOL, &w2);
    CHECKF(b1 < 0 && b2 < 0, "T %d H %d D %d C %d lower %g: out worst %.3g, state worst %.3g", T, H, D, C,
           lower, w1, w2);
}

TEST(kda_chunked_matches_recurrent) {
    static const int cases[][4] = {
        /* T, H, D, C */
        {1, 2, 16, 16}, {7, 2, 16, 4}, {16, 2, 16, 16}, {37, 2, 16, 16}, {64, 1, 32, 16},
        {50, 3, 8, 64}, {33, 2, 24, 8}, {100, 1, 16, 32}, {20, 2, 16, 1},
    };
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            chunk_vs_recur(cases[c][0], cases[c][1], cases[c][2], cases[c][3], -5.0f);
            chunk_vs_recur(cases[c][0], cases[c][1], cases[c][2], cases[c][3], -0.05f);
        }
    }
    pool_free();
}

/* Training's call: several sequences at once, the states saved at every
 * block. The outputs have the bits of one call per sequence, and each saved
 * state is the state a call over the positions before it ends in. */
TEST(kda_forward_sequences_and_saved_states) {
    const int T = 37, H = 2, D = 16, nseq = 2;
    const size_t P = (size_t)H * D, n = (size_t)T * P, ns = (size_t)H * D * D;
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        for (int C = 0; C <= 64; C += 16) { /* 0: recurrent; 64: clamped to 16 by the bound */
            float *q[2], *k[2], *v[2], *g[2], *beta[2];
            for (int s = 0; s < nseq; s++) kda_inputs(T, H, D, -5.0f, &q[s], &k[s], &v[s], &g[s], &beta[s]);
            float *Q = fzero(2 * n), *K = fzero(2 * n), *V = fzero(2 * n), *G = fzero(2 * n), *B = fzero(2 * (size_t)T * H);
            for (int s = 0; s < nseq; s++) {
                memcpy(Q + s * n, q[s], n * 4);
                memcpy(K + s * n, k[s], n * 4);
                memcpy(V + s * n, v[s], n * 4);
                memcpy(G + s * n, g[s], n * 4);
                memcpy(B + (size_t)s * T * H, beta[s], (size_t)T * H * 4);
            }
            const int L = k_kda_block_len(C, -5.0f), nb = (T + L - 1) / L;
            CHECK(L == (C ? 16 : K_KDA_RECUR_BLOCK));
            float *O = fzero(2 * n), *S = fzero(2 * ns), *save = fzero(2 * nb * ns);
            k_kda_forward(O, S, Q, K, V, G, B, nseq, T, H, D, C, -5.0f, save);
            for (int s = 0; s < nseq; s++) {
                float *o1 = fzero(n), *S1 = fzero(ns);
                k_kda_forward(o1, S1, q[s], k[s], v[s], g[s], beta[s], 1, T, H, D, C, -5.0f, NULL);
                CHECKF(!memcmp(o1, O + s * n, n * 4) && !memcmp(S1, S + s * ns, ns * 4), "C %d seq %d", C, s);
                for (int b = 0; b < nb; b++) {
                    float *o2 = fzero(n), *S2 = fzero(ns);
                    if (b > 0) k_kda_forward(o2, S2, q[s], k[s], v[s], g[s], beta[s], 1, b * L, H, D, C, -5.0f, NULL);
                    for (int h = 0; h < H; h++)
                        CHECKF(!memcmp(S2 + (size_t)h * D * D, save + (((size_t)s * H + h) * nb + b) * D * D,
                                       (size_t)D * D * 4),
                               "C %d seq %d head %d block %d: saved state", C, s, h, b);
                }
            }
        }
    }
    pool_free();
}

/* A batch of decode states: sequences of different lengths and forms, each
 * state apart and not zero, in one call. Each sequence's outputs and state
 * have the bits of k_kda_forward on it alone, at every thread count. */
TEST(kda_forward_seqs_apart_match_each_alone) {
    const int H = 2, D = 16, nseq = 4;
    const int lens[4] = {5, 1, 37, 0}, forms[4] = {0, 0, 16, 16};
    const size_t P = (size_t)H * D, ns = (size_t)H * D * D;
    int rows = 0;
    for (int s = 0; s < nseq; s++) rows += lens[s];
    float *Q, *K, *V, *G, *B;
    kda_inputs(rows, H, D, -5.0f, &Q, &K, &V, &G, &B);
    float *S0 = fzero((size_t)nseq * ns);
    for (size_t i = 0; i < (size_t)nseq * ns; i++) S0[i] = 0.01f * (float)((i * 7919) % 201) - 1.0f;
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        for (int th = 1; th <= 3; th++) {
            omp_set_num_threads(th);
            float *O = fzero((size_t)rows * P), *Sb[4];
            k_kda_seq seq[4];
            size_t row = 0;
            for (int s = 0; s < nseq; s++) { /* each state its own allocation */
                Sb[s] = fzero(ns);
                memcpy(Sb[s], S0 + s * ns, ns * 4);
            }
            for (int s = 0; s < nseq; s++) {
                seq[s] = (k_kda_seq){.S = Sb[s], .row = row, .T = lens[s], .C = forms[s]};
                row += (size_t)lens[s];
            }
            k_kda_forward_seqs(O, Q, K, V, G, B, seq, nseq, H, D, -5.0f);
            row = 0;
            for (int s = 0; s < nseq; s++) {
                float *o1 = fzero((size_t)(lens[s] ? lens[s] : 1) * P), *S1 = fzero(ns);
                memcpy(S1, S0 + s * ns, ns * 4);
                if (lens[s])
                    k_kda_forward(o1, S1, Q + row * P, K + row * P, V + row * P, G + row * P, B + row * H, 1, lens[s],
                                  H, D, forms[s], -5.0f, NULL);
                CHECKF(!memcmp(o1, O + row * P, (size_t)lens[s] * P * 4) && !memcmp(S1, Sb[s], ns * 4),
                       "isa %d threads %d seq %d", pass, th, s);
                row += (size_t)lens[s];
            }
        }
    }
    omp_set_num_threads(2);
    pool_free();
}

TEST(kda_chunked_extreme_decay_no_nan) {
    /* every decay at the bound with a requested chunk of 64: e^{G} e^{-G}
     * over 64 positions would span e^{+-320} and overflow; the chunk is
     * clamped to 80/5 = 16 positions, and everything stays finite. */
    int T = 130, H = 1, D = 16, C = 64;
    float *q, *k, *v, *g, *beta;
    kda_inputs(T, H, D, -5.0f, &q, &k, &v, &g, &beta);
    for (size_t i = 0; i < (size_t)T * D; i++) g[i] = -5.0f;
    float *o1 = fzero((size_t)T * D), *o2 = fzero((size_t)T * D), *S1 = fzero((size_t)D * D),
          *S2 = fzero((size_t)D * D);
    k_kda_recurrent(o1, S1, q, k, v, g, beta, T, H, D);
    k_kda_chunked(o2, S2, q, k, v, g, beta, T, H, D, C, -5.0f);
    for (size_t i = 0; i < (size_t)T * D; i++) CHECK(isfinite(o2[i]));
    CLOSE(o2, o1, (size_t)T * D, (size_t)D);
    CLOSE(S2, S1, (size_t)D * D, (size_t)D);
    pool_free();
}

TEST(kda_out_norm_gate_definition) {
    int H = 3, D = 20;
    float *o = frand((size_t)H * D, -2, 2), *gate = frand((size_t)H * D, -4, 4), *gain = frand((size_t)D, 0.5f, 1.5f);
    float *out = fzero((size_t)H * D);
    k_kda_out_norm_gate(out, o, gain, gate, H, D, 1e-5f);
    for (int h = 0; h < H; h++) {
        double ss = 0;
        for (int d = 0; d < D; d++) ss += (double)o[h * D + d] * o[h * D + d];
        double r = sqrt(ss / D + 1e-5);
        for (int d = 0; d < D; d++) {
            double want = o[h * D + d] / r * gain[d] / (1 + exp(-(double)gate[h * D + d]));
            CHECKF(fabs(out[h * D + d] - want) <= 1e-6 * (1 + fabs(want)), "h %d d %d: %g want %g", h, d,
                   out[h * D + d], want);
        }
    }
    pool_free();
}

/* ---- determinism: scalar vs SIMD, threads, matmul vs matvec ---------------------------- */

typedef struct {
    k3_mat m;
    void *buf;
    uint8_t *sc;
} tmat;

static tmat make_mat(kw_type type, int rows, int cols, int group) {
    tmat t = {.m = {.type = type, .rows = rows, .cols = cols, .group = group}};
    size_t n = (size_t)rows * cols;
    if (type == KW_F32) {
        t.buf = frand(n, -1, 1);
    } else if (type == KW_BF16) {
        uint16_t *p = keep(xmalloc_array(n, 2));
        for (size_t i = 0; i < n; i++) p[i] = k3_f32_to_bf16(urand(-1, 1));
        t.buf = p;
    } else {
        uint8_t *p = keep(xmalloc(n / 2));
        for (size_t i = 0; i < n / 2; i++) p[i] = (uint8_t)rnd();
        size_t ng = (size_t)rows * ((size_t)(cols + group - 1) / group);
        t.sc = keep(xmalloc(ng));
        for (size_t i = 0; i < ng; i++) t.sc[i] = (uint8_t)(115 + rnd() % 16);
        if (ng > 2) t.sc[1] = 255; /* zeroed group */
        if (ng > 3) t.sc[3] = 0;   /* the subnormal scale 2^-127 */
        t.m.scales = t.sc;
        t.buf = p;
    }
    t.m.data = t.buf;
    return t;
}

static const char *tname[] = {"f32", "bf16", "mxfp4"};

/* Runs every product on both paths and both thread counts; returns via CHECK. */
static void products_agree(kw_type type, int rows, int cols, int group, int ntok) {
    tmat t = make_mat(type, rows, cols, group);
    float *X = frand((size_t)ntok * cols, -1, 1);
    size_t ny = (size_t)ntok * rows;
    float *ref = fzero(ny);
    k_set_scalar(true);
    omp_set_num_threads(1);
    for (int i = 0; i < ntok; i++) k_matvec(&t.m, X + (size_t)i * cols, ref + (size_t)i * rows);
    /* the scalar matvec is the canonical order, written out here once more */
    float *row = fzero((size_t)cols);
    for (int r = 0; r < rows; r++) {
        k_mat_row(&t.m, r, row);
        float acc[16] = {0};
        for (int j = 0; j < cols; j++) acc[j & 15] = fmaf(row[j], X[j], acc[j & 15]);
        for (int s = 8; s >= 1; s >>= 1)
            for (int l = 0; l < s; l++) acc[l] += acc[l + s];
        CHECKF(memcmp(&acc[0], &ref[r], 4) == 0, "%s %dx%d row %d: not the canonical order", tname[type], rows,
               cols, r);
    }
    for (int path = 0; path < K_ISA_COUNT; path++) {
        if (!k_set_isa((k_isa)path)) continue;
        for (int th = 1; th <= 2; th++) {
            omp_set_num_threads(th);
            float *y = fzero(ny), *y2 = fzero(ny);
            k_matmul(&t.m, X, ntok, y);
            for (int i = 0; i < ntok; i++) k_matvec(&t.m, X + (size_t)i * cols, y2 + (size_t)i * rows);
            size_t at = 0;
            CHECKF(same_bits(y, ref, ny, &at), "%s %dx%d n %d %s threads %d: matmul differs at %zu", tname[type],
                   rows, cols, ntok, k_path_name(), th, at);
            CHECKF(same_bits(y2, ref, ny, &at), "%s %dx%d %s threads %d: matvec differs at %zu", tname[type], rows,
                   cols, k_path_name(), th, at);
            if (rows > 3) { /* a row range writes only its rows */
                float *y3 = fzero((size_t)rows);
                k_matvec_rows(&t.m, X, y3, 1, rows - 1);
                CHECK(y3[0] == 0.0f && y3[rows - 1] == 0.0f);
                CHECK(same_bits(y3 + 1, ref + 1, (size_t)rows - 2, NULL));
            }
        }
    }
    omp_set_num_threads(2);
    pool_free();
}

TEST(products_scalar_simd_threads_matmul_agree) {
    static const int shapes[][2] = {{1, 1}, {3, 5}, {17, 15}, {5, 16}, {33, 17}, {16, 100},
                                    {40, 257}, {7, 64}, {300, 512}, {129, 96}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int ntok = 1; ntok <= 9; ntok += 4) {
            products_agree(KW_F32, shapes[s][0], shapes[s][1], 0, ntok);
            products_agree(KW_BF16, shapes[s][0], shapes[s][1], 0, ntok);
        }
    static const int mx[][3] = {{1, 32, 32}, {5, 64, 32}, {17, 96, 32}, {300, 512, 32},
                                {9, 48, 16}, {6, 40, 8}, {3, 128, 64}, {4, 30, 10}};
    for (size_t s = 0; s < sizeof mx / sizeof mx[0]; s++)
        for (int ntok = 1; ntok <= 13; ntok += 3) products_agree(KW_MXFP4, mx[s][0], mx[s][1], mx[s][2], ntok);
    pool_free();
}

/* Every tile shape of the SIMD products (4 rows x 1..6 inputs, edges, the
 * 8-row matvec tile with its prefetch) against the scalar matvec per input,
 * and a batch of products (one thread team, dynamic row items) against the
 * same products one by one; shapes big enough to run in parallel. */
TEST(products_tiles_and_batches_agree) {
    static const int shapes[][4] = {{KW_BF16, 203, 160, 0}, {KW_F32, 37, 96, 0}, {KW_MXFP4, 130, 512, 32},
                                    {KW_MXFP4, 21, 64, 16}, {KW_BF16, 9, 1280, 0}};
    static const int ntoks[] = {1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 19, 64};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        kw_type type = (kw_type)shapes[si][0];
        int rows = shapes[si][1], cols = shapes[si][2];
        tmat t = make_mat(type, rows, cols, shapes[si][3]);
        int nmax = 64;
        float *X = frand((size_t)nmax * cols, -1, 1);
        float *ref = fzero((size_t)nmax * rows);
        k_set_scalar(true);
        omp_set_num_threads(1);
        for (int i = 0; i < nmax; i++) k_matvec(&t.m, X + (size_t)i * cols, ref + (size_t)i * rows);
        for (int path = 0; path < K_ISA_COUNT; path++) {
            if (!k_set_isa((k_isa)path)) continue;
            for (int th = 1; th <= 2; th++) {
                omp_set_num_threads(th);
                for (size_t ni = 0; ni < sizeof ntoks / sizeof ntoks[0]; ni++) {
                    int n = ntoks[ni];
                    float *y = fzero((size_t)n * rows);
                    k_matmul(&t.m, X, n, y);
                    size_t at = 0;
                    CHECKF(same_bits(y, ref, (size_t)n * rows, &at), "%s %dx%d n %d %s threads %d: differs at %zu",
                           tname[type], rows, cols, n, k_path_name(), th, at);
                }
                /* a batch: three slices of the inputs and an empty job */
                float *y = fzero((size_t)nmax * rows);
                k_prod jobs[4] = {{&t.m, X, 5, y},
                                  {&t.m, X + (size_t)5 * cols, 0, NULL},
                                  {&t.m, X + (size_t)5 * cols, 1, y + (size_t)5 * rows},
                                  {&t.m, X + (size_t)6 * cols, nmax - 6, y + (size_t)6 * rows}};
                k_products(jobs, 4);
                size_t at = 0;
                CHECKF(same_bits(y, ref, (size_t)nmax * rows, &at), "%s %dx%d batch %s threads %d: differs at %zu",
                       tname[type], rows, cols, k_path_name(), th, at);
            }
        }
    }
    k_set_scalar(false);
    omp_set_num_threads(2);
    pool_free();
}

/* The trunk split over ranks (dist/tensor_par.h): k_row_share's parts tile
 * a matrix's rows in order, in whole 16-row runs, as evenly as the runs go;
 * each part's products (k_products_rows) give exactly the scalar matvec's
 * bits for its rows on every path and thread count and write nothing
 * else, so the parts of any split put together are one process's output. */
TEST(products_row_shares_agree) {
    static const int shapes[][4] = {{KW_BF16, 203, 160, 0}, {KW_F32, 37, 96, 0}, {KW_MXFP4, 130, 512, 32},
                                    {KW_BF16, 9, 64, 0}, {KW_BF16, 48, 1280, 0}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        kw_type type = (kw_type)shapes[si][0];
        int rows = shapes[si][1], cols = shapes[si][2], n = 5;
        tmat t = make_mat(type, rows, cols, shapes[si][3]);
        float *X = frand((size_t)n * cols, -1, 1);
        float *ref = fzero((size_t)n * rows);
        k_set_scalar(true);
        omp_set_num_threads(1);
        for (int i = 0; i < n; i++) k_matvec(&t.m, X + (size_t)i * cols, ref + (size_t)i * rows);
        for (int R = 1; R <= 5; R++) {
            int prev = 0, units = (rows + 15) / 16, most = 0;
            for (int part = 0; part < R; part++) {
                int r0, r1;
                k_row_share(rows, part, R, &r0, &r1);
                CHECKF(r0 == prev && r1 >= r0 && (r0 % 16 == 0 || r0 == rows) && (r1 % 16 == 0 || r1 == rows),
                       "%d rows, part %d of %d: [%d, %d) after %d", rows, part, R, r0, r1, prev);
                if ((r1 - r0 + 15) / 16 > most) most = (r1 - r0 + 15) / 16;
                prev = r1;
            }
            CHECKF(prev == rows && most <= (units + R - 1) / R, "%d rows in %d parts: end %d, at most %d runs a part",
                   rows, R, prev, most);
        }
        for (int path = 0; path < K_ISA_COUNT; path++) {
            if (!k_set_isa((k_isa)path)) continue;
            for (int th = 1; th <= 2; th++) {
                omp_set_num_threads(th);
                for (int R = 2; R <= 4; R++)
                    for (int part = 0; part < R; part++) {
                        int r0, r1;
                        k_row_share(rows, part, R, &r0, &r1);
                        float *y = fzero((size_t)n * rows);
                        for (size_t i = 0; i < (size_t)n * rows; i++) y[i] = 7.0f;
                        k_prod job = {&t.m, X, n, y};
                        k_products_rows(&job, 1, &r0, &r1);
                        for (int q = 0; q < n; q++)
                            for (int r = 0; r < rows; r++) {
                                float got = y[(size_t)q * rows + r], want = r >= r0 && r < r1 ? ref[(size_t)q * rows + r] : 7.0f;
                                CHECKF(!memcmp(&got, &want, sizeof got), "%s %dx%d part %d of %d %s threads %d: "
                                       "row %d input %d differs", tname[type], rows, cols, part, R, k_path_name(), th, r, q);
                                if (memcmp(&got, &want, sizeof got)) { q = n; break; }
                            }
                    }
            }
        }
    }
    k_set_scalar(false);
    omp_set_num_threads(2);
    pool_free();
}

/* Products over many inputs (the SIMD path decodes each row once into an f32
 * panel and sweeps wide rows in column blocks of 1024, keeping the lane
 * accumulators between blocks): every input against the scalar matvec, for
 * rows wider than one and several blocks, a ragged last vector, row counts
 * that leave edge tiles and panel remainders, MXFP4 layouts the fast decode
 * takes and one it does not, -0 weights (sign-symmetric E2M1 codes), and
 * input counts on both sides of the panel threshold; 1 and 2 threads. */
TEST(products_panel_column_blocks_agree) {
    static const int shapes[][4] = {{KW_BF16, 37, 2070, 0}, {KW_BF16, 20, 1024, 0}, {KW_F32, 19, 1041, 0},
                                    {KW_MXFP4, 21, 2112, 32}, {KW_MXFP4, 18, 1040, 16}, {KW_MXFP4, 5, 1030, 10},
                                    {KW_BF16, 33, 40, 0}};
    /* both sides of each type's panel threshold (the SIMD paths': 8, 16, 24, 64) */
    static const int ntoks[] = {7, 8, 9, 13, 15, 16, 17, 23, 24, 40, 63, 64, 65};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        kw_type type = (kw_type)shapes[si][0];
        int rows = shapes[si][1], cols = shapes[si][2];
        tmat t = make_mat(type, rows, cols, shapes[si][3]);
        if (type == KW_BF16) ((uint16_t *)t.buf)[3] = 0x8000; /* a -0 weight */
        int nmax = 65;
        float *X = frand((size_t)nmax * cols, -1, 1);
        X[5] = -0.0f;
        float *ref = fzero((size_t)nmax * rows);
        k_set_scalar(true);
        omp_set_num_threads(1);
        for (int i = 0; i < nmax; i++) k_matvec(&t.m, X + (size_t)i * cols, ref + (size_t)i * rows);
        k_set_scalar(false);
        for (int th = 1; th <= 2; th++) {
            omp_set_num_threads(th);
            for (size_t ni = 0; ni < sizeof ntoks / sizeof ntoks[0]; ni++) {
                int n = ntoks[ni];
                float *y = fzero((size_t)n * rows);
                k_matmul(&t.m, X, n, y);
                size_t at = 0;
                CHECKF(same_bits(y, ref, (size_t)n * rows, &at), "%s %dx%d n %d %s threads %d: differs at %zu",
                       tname[type], rows, cols, n, k_path_name(), th, at);
            }
        }
        pool_free();
    }
    omp_set_num_threads(2);
}

/* k_dots and k_gemm_acc: scalar == SIMD, and the definitions written out. */
TEST(dots_and_gemm_acc_agree) {
    int rows = 37, len = 83, ldb = 100;
    float *B = frand((size_t)rows * ldb, -1, 1), *x = frand((size_t)len, -1, 1);
    float *o0 = fzero((size_t)rows), *o1 = fzero((size_t)rows);
    k_set_scalar(true);
    k_dots(o0, x, B, (size_t)ldb, rows, len);
    for (int path = 1; path < K_ISA_COUNT; path++) {
        if (!k_set_isa((k_isa)path)) continue;
        for (int r = 0; r <= rows; r += rows / 3) { /* row counts off the 4/8-row blocks */
            memset(o1, 0, (size_t)rows * sizeof *o1);
            k_dots(o1, x, B, (size_t)ldb, rows - r, len);
            CHECKF(same_bits(o0, o1, (size_t)(rows - r), NULL), "k_dots %s rows %d", k_path_name(), rows - r);
        }
        for (int l = 0; l <= 33; l++) { /* every tail length */
            float a0[8], a1[8];
            k_set_scalar(true);
            k_dots(a0, x, B, (size_t)ldb, 5, l);
            k_set_isa((k_isa)path);
            k_dots(a1, x, B, (size_t)ldb, 5, l);
            CHECKF(same_bits(a0, a1, 5, NULL), "k_dots %s len %d", k_path_name(), l);
        }
    }
    k_set_scalar(true);
    for (int p = 0; p < rows; p++) {
        float want = k_dot(x, B + (size_t)p * ldb, len);
        CHECK(memcmp(&want, &o0[p], 4) == 0);
    }
    /* C += A B with B a BF16 weight (rows b0..b0+K), M 7, N 45 of 50 columns */
    int M = 7, N = 45, K = 19, lda = 23, ldc = 48;
    tmat Bw = make_mat(KW_BF16, 30, 50, 0);
    float *A = frand((size_t)M * lda, -1, 1), *C0 = frand((size_t)M * ldc, -1, 1);
    float *C1 = fcopy(C0, (size_t)M * ldc), *C2 = fcopy(C0, (size_t)M * ldc), *row = fzero(50);
    k_set_scalar(true);
    k_gemm_acc(C1, ldc, M, N, A, lda, K, &Bw.m, 4);
    for (int path = 1; path < K_ISA_COUNT; path++) {
        if (!k_set_isa((k_isa)path)) continue;
        memcpy(C2, C0, (size_t)M * ldc * sizeof *C2);
        k_gemm_acc(C2, ldc, M, N, A, lda, K, &Bw.m, 4);
        CHECKF(same_bits(C1, C2, (size_t)M * ldc, NULL), "k_gemm_acc %s", k_path_name());
    }
    k_set_scalar(false);
    for (int k = 0; k < K; k++) {
        k_mat_row(&Bw.m, 4 + k, row);
        for (int m = 0; m < M; m++)
            for (int j = 0; j < N; j++) C0[(size_t)m * ldc + j] = fmaf(A[(size_t)m * lda + k], row[j], C0[(size_t)m * ldc + j]);
    }
    CHECK(same_bits(C0, C1, (size_t)M * ldc, NULL));
    pool_free();
}

static bool g_simd_skip;
#define NEED_SIMD()                                                   \
    do {                                                              \
        if (!k_isa_available(K_ISA_AVX2) && !k_isa_available(K_ISA_AVX512) && \
            !k_isa_available(K_ISA_NEON))                             \
            SKIP("no SIMD path on this CPU");                         \
    } while (0)

/* Runs fn with the scalar path, then SIMD, and compares the bytes written. */
TEST(elementwise_scalar_equals_simd) {
    NEED_SIMD();
    (void)g_simd_skip;
    static const int sizes[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 33, 40, 64, 100, 257};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        int n = sizes[si];
        float *x = frand((size_t)n, -30, 30), *x2 = frand((size_t)n, -3, 3), *gn = frand((size_t)n, 0.5f, 2);
        x[0] = -100.0f; /* saturations */
        if (n > 1) x[1] = 95.0f;
        float *r[K_ISA_COUNT][10];
        for (int p = 0; p < K_ISA_COUNT; p++) {
            if (!k_set_isa((k_isa)p)) { r[p][0] = NULL; continue; }
            float sums[3] = {k_sum(x, n), k_sumsq(x2, n), k_dot(x, x2, n)};
            r[p][0] = fcopy(sums, 3);
            r[p][1] = fzero((size_t)n);
            k_rmsnorm(r[p][1], x2, gn, n, 1e-5f);
            r[p][2] = fcopy(x2, (size_t)n);
            k_l2norm(r[p][2], n, 1e-6f);
            r[p][3] = fcopy(x, (size_t)n);
            k_silu(r[p][3], n);
            r[p][4] = fzero((size_t)n);
            k_situ_glu(r[p][4], x, x2, n, 4.0f, 25.0f);
            r[p][5] = fcopy(x, (size_t)n);
            k_softmax(r[p][5], n);
            r[p][6] = fzero((size_t)n);
            k_rmsnorm(r[p][6], x2, NULL, n, 1e-5f);
        }
        static const int len[] = {3, 1, 1, 1, 1, 1, 1};
        static const char *what[] = {"sum/sumsq/dot", "rmsnorm", "l2norm", "silu", "situ", "softmax", "rmsnorm-nogain"};
        for (int p = 1; p < K_ISA_COUNT; p++)
            for (int kf = 0; kf < 7 && r[p][0]; kf++) {
                size_t at = 0, m = len[kf] == 3 ? 3 : (size_t)n;
                CHECKF(same_bits(r[0][kf], r[p][kf], m, &at), "%s n %d: scalar %a %s %a at %zu", what[kf], n,
                       r[0][kf][at], k_isa_name((k_isa)p), r[p][kf][at], at);
            }
    }
    pool_free();
}

/* The recurrent form over T positions (which fuses the write sweep of one
 * step with the decay sweep of the next) == T calls of one position each
 * (the two sweeps one after the other): o and S bit for bit, both paths,
 * register sweeps (D 16..128) and the generic loop (D 8, 17). */
TEST(kda_recurrent_fused_steps_same_bits) {
    static const int cases[][3] = {{7, 2, 8}, {5, 3, 17}, {9, 2, 16}, {6, 1, 32}, {5, 2, 64}, {4, 1, 128}};
    for (int path = 0; path < 2; path++) {
        k_set_scalar(path == 0);
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            int T = cases[c][0], H = cases[c][1], D = cases[c][2];
            size_t HD = (size_t)H * D, n = (size_t)T * HD, ns = HD * D;
            float *q, *k, *v, *g, *beta;
            kda_inputs(T, H, D, -5.0f, &q, &k, &v, &g, &beta);
            float *S0 = frand(ns, -0.5f, 0.5f);
            float *o1 = fzero(n), *S1 = fcopy(S0, ns), *o2 = fzero(n), *S2 = fcopy(S0, ns);
            k_kda_recurrent(o1, S1, q, k, v, g, beta, T, H, D);
            for (int t = 0; t < T; t++)
                k_kda_recurrent(o2 + t * HD, S2, q + t * HD, k + t * HD, v + t * HD, g + t * HD, beta + (size_t)t * H,
                                1, H, D);
            size_t at = 0;
            CHECKF(same_bits(o1, o2, n, &at), "%s T %d H %d D %d: o differs at %zu", k_path_name(), T, H, D, at);
            CHECKF(same_bits(S1, S2, ns, &at), "%s T %d H %d D %d: S differs at %zu", k_path_name(), T, H, D, at);
        }
        pool_free();
    }
    k_set_scalar(false);
}

TEST(kda_scalar_equals_simd_and_threads) {
    NEED_SIMD();
    static const int cases[][5] = {{1, 3, 16, 16, 4}, {9, 2, 17, 4, 3}, {40, 4, 32, 16, 4}, {23, 2, 8, 64, 2},
                                   {6, 2, 64, 4, 4},  {4, 1, 128, 3, 4}, {5, 2, 24, 2, 3}}; /* D 16 32 64 128: register sweeps */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int T = cases[c][0], H = cases[c][1], D = cases[c][2], C = cases[c][3], K = cases[c][4];
        size_t n = (size_t)T * H * D, ns = (size_t)H * D * D;
        float *q, *k, *v, *g, *beta;
        kda_inputs(T, H, D, -5.0f, &q, &k, &v, &g, &beta);
        float *S0 = frand(ns, -0.5f, 0.5f), *z = frand(n, -3, 3), *A = frand((size_t)H, -1, 1.5f),
              *dtb = frand((size_t)H * D, -1, 1), *cw = frand((size_t)H * D * K, -0.5f, 0.5f),
              *cs0 = frand((size_t)H * D * (K - 1), -1, 1), *gain = frand((size_t)D, 0.5f, 1.5f);
        /* run 0: scalar, 1 thread; then each SIMD path at 1 and at 2 threads */
        enum { NRUN = 1 + 2 * (K_ISA_COUNT - 1) };
        float *res[NRUN][6];
        bool ran[NRUN] = {false};
        for (int run = 0; run < NRUN; run++) {
            k_isa isa = (k_isa)((run + 1) / 2);
            if (!k_set_isa(isa)) continue;
            ran[run] = true;
            omp_set_num_threads(run > 0 && run % 2 == 0 ? 2 : 1);
            res[run][0] = fzero(n);
            res[run][1] = fcopy(S0, ns);
            k_kda_recurrent(res[run][0], res[run][1], q, k, v, g, beta, T, H, D);
            res[run][2] = fzero(n);
            res[run][3] = fcopy(S0, ns);
            k_kda_chunked(res[run][2], res[run][3], q, k, v, g, beta, T, H, D, C, -5.0f);
            res[run][4] = fzero(n);
            for (int t = 0; t < T; t++) k_kda_gate(res[run][4] + (size_t)t * H * D, NULL, z + (size_t)t * H * D, A, dtb, H, D, -5.0f);
            res[run][5] = fzero(n + (size_t)H * D * (K - 1) + n);
            float *st = fcopy(cs0, (size_t)H * D * (K - 1));
            k_shortconv_silu(res[run][5], v, T, H * D, cw, K, st);
            memcpy(res[run][5] + n, st, (size_t)H * D * (K - 1) * sizeof(float));
            k_kda_out_norm_gate(res[run][5] + n + (size_t)H * D * (K - 1), res[run][0], gain, z, H, D, 1e-5f);
            for (int t = 1; t < T; t++)
                k_kda_out_norm_gate(res[run][5] + n + (size_t)H * D * (K - 1) + (size_t)t * H * D,
                                    res[run][0] + (size_t)t * H * D, gain, z + (size_t)t * H * D, H, D, 1e-5f);
        }
        size_t lens[6] = {n, ns, n, ns, n, n + (size_t)H * D * (K - 1) + n};
        static const char *what[] = {"recurrent o", "recurrent S", "chunked o", "chunked S", "gate", "conv+outnorm"};
        for (int run = 1; run < NRUN; run++)
            for (int kf = 0; kf < 6 && ran[run]; kf++) {
                size_t at = 0;
                CHECKF(same_bits(res[0][kf], res[run][kf], lens[kf], &at), "case %zu %s %s threads %d differs at %zu",
                       c, what[kf], k_isa_name((k_isa)((run + 1) / 2)), run % 2 == 0 ? 2 : 1, at);
            }
    }
    k_set_scalar(false);
    omp_set_num_threads(2);
    pool_free();
}

/* K3_ISA values and path selection: unknown names and paths the CPU lacks
 * are refused with a reason; k_set_isa never selects a missing path. */
TEST(isa_parse_and_select) {
    char msg[160];
    k_isa isa = K_ISA_COUNT;
    unsigned all = (1u << K_ISA_COUNT) - 1, old = (1u << K_ISA_SCALAR) | (1u << K_ISA_AVX2);
    CHECK(k_isa_parse("avx2", all, &isa, msg, sizeof msg) == 0 && isa == K_ISA_AVX2);
    CHECK(k_isa_parse("scalar", 1u, &isa, msg, sizeof msg) == 0 && isa == K_ISA_SCALAR);
    CHECK(k_isa_parse("avx512", all, &isa, msg, sizeof msg) == 0 && isa == K_ISA_AVX512);
    CHECK(k_isa_parse("avx512", old, &isa, msg, sizeof msg) != 0 && isa == K_ISA_AVX512);
    CHECKF(strstr(msg, "lacks the avx512") && strstr(msg, "available: scalar avx2") && !strchr(msg, '\n'), "%s", msg);
    CHECK(k_isa_parse("AVX2", all, &isa, msg, sizeof msg) != 0 && strstr(msg, "unknown"));
    CHECK(k_isa_parse("", all, &isa, msg, sizeof msg) != 0);
    CHECK(k_isa_available(K_ISA_SCALAR) && !k_isa_available(K_ISA_COUNT));
    for (int i = 0; i < K_ISA_COUNT; i++) {
        k_set_scalar(true);
        bool ok = k_set_isa((k_isa)i);
        CHECK(ok == k_isa_available((k_isa)i));
        CHECK(k_isa_active() == (ok ? (k_isa)i : K_ISA_SCALAR));
        CHECK(strcmp(k_path_name(), k_isa_name(k_isa_active())) == 0);
    }
    CHECK(k_simd_available() == k_isa_available(K_ISA_AVX512));
    k_set_scalar(false);
}

/* ---- our own PyTorch fixtures (tools/kernels_ref.py) ------------------------------------ */

static void own_kda(const char *file) {
    json_t *j = tj_load(t_repo(file));
    CHECK(j);
    int T = (int)tj_num(j, "T"), H = (int)tj_num(j, "H"), D = (int)tj_num(j, "D");
    size_t n, ns;
    float *q = fx(j, "q", &n), *k = fx(j, "k", NULL), *v = fx(j, "v", NULL), *g = fx(j, "g", NULL);
    float *beta = fx(j, "beta", NULL), *S0 = fx(j, "S0", &ns), *want = fx(j, "out", NULL);
    float *swant = fx(j, "state_out", NULL);
    CHECK(q && k && v && g && beta && S0 && want && swant);
    CHECK(n == (size_t)T * H * D && ns == (size_t)H * D * D);
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *o = fzero(n), *S = fcopy(S0, ns);
        k_kda_recurrent(o, S, q, k, v, g, beta, T, H, D);
        CLOSE(o, want, n, (size_t)D);
        CLOSE(S, swant, ns, (size_t)D);
        static const int Cs[] = {1, 3, 8, 16, 64};
        for (size_t c = 0; c < sizeof Cs / sizeof Cs[0]; c++) {
            float *o2 = fzero(n), *S2 = fcopy(S0, ns);
            k_kda_chunked(o2, S2, q, k, v, g, beta, T, H, D, Cs[c], min_of(g, n));
            CLOSE(o2, want, n, (size_t)D);
            CLOSE(S2, swant, ns, (size_t)D);
        }
        /* decode one step at a time from the carried state */
        float *o3 = fzero(n), *S3 = fcopy(S0, ns);
        size_t P = (size_t)H * D;
        for (int t = 0; t < T; t++)
            k_kda_recurrent(o3 + t * P, S3, q + t * P, k + t * P, v + t * P, g + t * P, beta + (size_t)t * H, 1, H, D);
        CLOSE(o3, want, n, (size_t)D);
    }
    json_decref(j);
    pool_free();
}
TEST(own_kda_h3_d32_carried_state) { own_kda("tests/fixtures/kernels/kda_h3_d32.json"); }
TEST(own_kda_h2_d8_lower_minus2) { own_kda("tests/fixtures/kernels/kda_h2_d8.json"); }
TEST(own_kda_h1_d64_long) { own_kda("tests/fixtures/kernels/kda_h1_d64.json"); }

TEST(own_kda_gate_other_shape_and_bound) {
    json_t *j = tj_load(t_repo("tests/fixtures/kernels/gate_h3_d12.json"));
    CHECK(j);
    int T = (int)tj_num(j, "T"), H = (int)tj_num(j, "H"), D = (int)tj_num(j, "D");
    float lower = (float)tj_num(j, "lower");
    size_t n;
    float *z = fx(j, "z", &n), *A = fx(j, "A_log", NULL), *dtb = fx(j, "dt_bias", NULL), *want = fx(j, "g", NULL);
    CHECK(z && A && dtb && want && n == (size_t)T * H * D);
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *g = fzero(n);
        for (int t = 0; t < T; t++) k_kda_gate(g + (size_t)t * H * D, NULL, z + (size_t)t * H * D, A, dtb, H, D, lower);
        CLOSE(g, want, n, (size_t)D);
    }
    json_decref(j);
    pool_free();
}

static void own_conv(const char *file) {
    json_t *j = tj_load(t_repo(file));
    CHECK(j);
    int T = (int)tj_num(j, "T"), C = (int)tj_num(j, "C"), K = (int)tj_num(j, "K");
    size_t nx, ns, nx2;
    float *x = fx(j, "x", &nx), *w = fx(j, "w", NULL), *st0 = fx(j, "state", &ns), *x2 = fx(j, "x2", &nx2);
    float *want = fx(j, "out", NULL), *swant = fx(j, "state_after", NULL), *want2 = fx(j, "out2", NULL);
    CHECK(x && w && st0 && x2 && want && swant && want2);
    CHECK(nx == (size_t)T * C && ns == (size_t)C * (K - 1));
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *st = fcopy(st0, ns), *y = fzero(nx), *y2 = fzero(nx2);
        k_shortconv_silu(y, x, T, C, w, K, st);
        CLOSE(y, want, nx, (size_t)C);
        CLOSE(st, swant, ns, ns);
        k_shortconv_silu(y2, x2, (int)(nx2 / (size_t)C), C, w, K, st);
        CLOSE(y2, want2, nx2, (size_t)C);
    }
    json_decref(j);
    pool_free();
}
TEST(own_shortconv_k3) { own_conv("tests/fixtures/kernels/conv_k3.json"); }
TEST(own_shortconv_k5) { own_conv("tests/fixtures/kernels/conv_k5.json"); }
TEST(own_shortconv_k2) { own_conv("tests/fixtures/kernels/conv_k2.json"); }

TEST(own_situ_other_betas) {
    json_t *j = tj_load(t_repo("tests/fixtures/kernels/situ_betas.json"));
    CHECK(j);
    json_t *cases = json_object_get(j, "cases");
    CHECK(json_array_size(cases) >= 2);
    for (size_t c = 0; c < json_array_size(cases); c++) {
        json_t *cs = json_array_get(cases, c);
        size_t n;
        float *a = fx(cs, "gate", &n), *u = fx(cs, "up", NULL), *want = fx(cs, "out", NULL);
        float b1 = (float)tj_num(cs, "b1"), b2 = (float)tj_num(cs, "b2");
        CHECK(a && u && want);
        for (int pass = 0; pass < K_ISA_COUNT; pass++) {
            if (!k_set_isa((k_isa)pass)) continue;
            float *got = fzero(n);
            k_situ_glu(got, a, u, (int)n, b1, b2);
            CLOSE(got, want, n, n);
            for (size_t i = 0; i < n; i++) CHECK(fabsf(got[i]) <= b1 * b2);
        }
    }
    json_decref(j);
    pool_free();
}

TEST(own_router_cases) {
    json_t *j = tj_load(t_repo("tests/fixtures/kernels/router_cases.json"));
    CHECK(j);
    json_t *cases = json_object_get(j, "cases");
    CHECK(json_array_size(cases) == 3);
    for (size_t c = 0; c < json_array_size(cases); c++) {
        json_t *cs = json_object_get(json_array_get(cases, c), "rows");
        json_t *hd = json_array_get(cases, c);
        int n = (int)tj_num(hd, "n"), k = (int)tj_num(hd, "k");
        bool renorm = json_is_true(json_object_get(hd, "renorm"));
        float scale = (float)tj_num(hd, "scale");
        for (size_t r = 0; r < json_array_size(cs); r++) {
            json_t *row = json_array_get(cs, r);
            size_t nl, ni;
            float *lg = fx(row, "logits", &nl), *bias = fx(row, "bias", NULL), *want = fx(row, "w", NULL);
            int64_t *widx = keep(tj_ints(json_object_get(row, "idx"), &ni));
            CHECK(lg && bias && want && widx && nl == (size_t)n && ni == (size_t)k);
            int idx[64];
            float w[64];
            k_router_topk(lg, bias, n, k, renorm, scale, idx, w);
            for (int i = 0; i < k; i++) CHECKF(idx[i] == widx[i], "case %zu row %zu slot %d", c, r, i);
            CLOSE(w, want, (size_t)k, (size_t)k);
        }
    }
    json_decref(j);
    pool_free();
}

TEST(own_norms_softmax) {
    json_t *j = tj_load(t_repo("tests/fixtures/kernels/norms.json"));
    CHECK(j);
    size_t n, ng;
    float *x = fx(j, "x", &n), *gain = fx(j, "gain", &ng);
    float *w1 = fx(j, "rms_gain", NULL), *w2 = fx(j, "rms_nogain", NULL), *w3 = fx(j, "l2", NULL);
    float *w4 = fx(j, "softmax_of_4x", NULL);
    float eps = (float)tj_num(j, "eps");
    CHECK(x && gain && w1 && w2 && w3 && w4 && n % ng == 0);
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *a = fzero(n), *b = fzero(n), *c = fcopy(x, n), *d = fzero(n);
        for (size_t r = 0; r < n / ng; r++) {
            k_rmsnorm(a + r * ng, x + r * ng, gain, (int)ng, eps);
            k_rmsnorm(b + r * ng, x + r * ng, NULL, (int)ng, eps);
            k_l2norm(c + r * ng, (int)ng, 1e-6f);
            for (size_t i = 0; i < ng; i++) d[r * ng + i] = 4.0f * x[r * ng + i];
            k_softmax(d + r * ng, (int)ng);
        }
        CLOSE(a, w1, n, ng);
        CLOSE(b, w2, n, ng);
        CLOSE(c, w3, n, ng);
        CLOSE(d, w4, n, ng);
    }
    json_decref(j);
    pool_free();
}

static void own_mxfp4(const char *file) {
    json_t *j = tj_load(t_repo(file));
    CHECK(j);
    int rows = (int)tj_num(j, "rows"), cols = (int)tj_num(j, "cols"), G = (int)tj_num(j, "group");
    size_t np, ns, nx, ny;
    float *pf = fx(j, "packed", &np), *sf = fx(j, "scales", &ns), *x = fx(j, "x", &nx), *want = fx(j, "y", &ny);
    CHECK(pf && sf && x && want && np == (size_t)rows * cols / 2 && ns == (size_t)rows * (cols / G));
    uint8_t *packed = keep(xmalloc(np)), *scales = keep(xmalloc(ns));
    for (size_t i = 0; i < np; i++) packed[i] = (uint8_t)pf[i];
    for (size_t i = 0; i < ns; i++) scales[i] = (uint8_t)sf[i];
    k3_mat M = {.type = KW_MXFP4, .rows = rows, .cols = cols, .data = packed, .scales = scales, .group = G};
    int ntok = (int)(nx / (size_t)cols);
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *y = fzero(ny);
        k_matmul(&M, x, ntok, y);
        CLOSE(y, want, ny, (size_t)rows);
    }
    json_decref(j);
    pool_free();
}
TEST(own_mxfp4_matvec_vs_torch_dequant) { own_mxfp4("tests/fixtures/kernels/mxfp4_matvec.json"); }
TEST(own_mxfp4_group16) { own_mxfp4("tests/fixtures/kernels/mxfp4_group16.json"); }

TEST(own_bf16_matvec) {
    json_t *j = tj_load(t_repo("tests/fixtures/kernels/bf16_matvec.json"));
    CHECK(j);
    int rows = (int)tj_num(j, "rows"), cols = (int)tj_num(j, "cols");
    size_t nb, nx, ny;
    float *bf = fx(j, "bits", &nb), *x = fx(j, "x", &nx), *want = fx(j, "y", &ny);
    CHECK(bf && x && want && nb == (size_t)rows * cols);
    uint16_t *bits = keep(xmalloc_array(nb, 2));
    for (size_t i = 0; i < nb; i++) bits[i] = (uint16_t)bf[i];
    k3_mat M = {.type = KW_BF16, .rows = rows, .cols = cols, .data = bits};
    for (int pass = 0; pass < K_ISA_COUNT; pass++) {
        if (!k_set_isa((k_isa)pass)) continue;
        float *y = fzero(ny);
        for (size_t t = 0; t < nx / (size_t)cols; t++) k_matvec(&M, x + t * cols, y + t * rows);
        CLOSE(y, want, ny, (size_t)rows);
    }
    json_decref(j);
    pool_free();
}

/* ---- per-thread scratch ---------------------------------------------------------------- */
#define SCRATCH_BIG ((size_t)48 << 20) /* above malloc's mmap threshold: counted in hblkhd */

static void *scratch_thread(void *arg) {
    uint8_t *a = k_scratch(K_SCRATCH_PANEL, SCRATCH_BIG);
    memset(a, 1, SCRATCH_BIG); /* all of it is usable */
    uint8_t *b = k_scratch(K_SCRATCH_PANEL, 4096);
    uint8_t *c = k_scratch(K_SCRATCH_AMX, 4096);
    bool ok = a == b && c != a && ((uintptr_t)a & 63) == 0 && ((uintptr_t)c & 63) == 0;
    *(void **)arg = ok ? a : NULL;
    return NULL;
}

/* Each thread gets its own buffer, kept while it lives (a smaller request
 * returns the same one; another slot is another buffer), and a thread's
 * buffers are freed when it exits: a server's and an OpenMP team's threads
 * come and go. */
TEST(scratch_per_thread_freed_at_exit) {
    NEEDS_THREADS();
    void *mine = k_scratch(K_SCRATCH_PANEL, 256);
    CHECK(mine != NULL && ((uintptr_t)mine & 63) == 0);
#ifndef __SANITIZE_ADDRESS__ /* ASan keeps its own heap: mallinfo2 does not see it */
    size_t before = mallinfo2().hblkhd;
#endif
    void *got[4] = {0};
    pthread_t th[4];
    for (int i = 0; i < 4; i++) CHECK(pthread_create(&th[i], NULL, scratch_thread, &got[i]) == 0);
    for (int i = 0; i < 4; i++) CHECK(pthread_join(th[i], NULL) == 0);
    for (int i = 0; i < 4; i++) CHECK(got[i] != NULL && got[i] != mine);
#ifndef __SANITIZE_ADDRESS__
    size_t after = mallinfo2().hblkhd;
    CHECK(after <= before + SCRATCH_BIG / 2); /* 4 x 48 MB were mapped and are gone again */
#endif
    CHECK(k_scratch(K_SCRATCH_PANEL, 128) == mine); /* the calling thread's own stays */
}
