/* test_train_gemm.c: the training GEMM (src/kernels/gemm.c): the AVX-512 tiles
 * give the scalar reference's bits (F32 and the BF16 emulation of
 * vdpbf16ps), at 1 and 2 threads, over awkward shapes and all three stride
 * layouts the training products use; the F32 mode equals a written-out fma
 * chain and is close to a double-precision product. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kernels/kernels.h"
#include "util/common.h"

static uint64_t st = 0x9E3779B97F4A7C15ull;
static float rnd(void) {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return (float)((double)(st >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

typedef struct { int M, N, K; } shape;
static const shape shapes[] = {{1, 1, 1}, {3, 5, 7}, {12, 32, 256}, {13, 33, 257}, {97, 70, 300},
                               {200, 65, 513}, {5, 320, 64}, {40, 17, 1}};

/* layout 0: X W^T (B transposed view), 1: dY W, 2: dY^T X (A transposed view) */
static void views(int layout, const float *a, const float *b, int M, int N, int K, k_view *A, k_view *B) {
    if (layout == 0) { *A = (k_view){a, K, 1}; *B = (k_view){b, 1, K}; }
    else if (layout == 1) { *A = (k_view){a, K, 1}; *B = (k_view){b, N, 1}; }
    else { *A = (k_view){a, 1, M}; *B = (k_view){b, N, 1}; }
}

static bool run_case(k_gemm_mode mode, bool *all_same) {
    bool ok = true;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int layout = 0; layout < 3; layout++)
            for (int acc = 0; acc < 2; acc++) {
                int M = shapes[s].M, N = shapes[s].N, K = shapes[s].K;
                size_t na = (size_t)M * K, nb = (size_t)K * N, nc = (size_t)M * N;
                float *a = xmalloc_array(na, sizeof(float)), *b = xmalloc_array(nb, sizeof(float));
                float *c0 = xmalloc_array(nc, sizeof(float));
                float *ref = xmalloc_array(nc, sizeof(float)), *v1 = xmalloc_array(nc, sizeof(float));
                float *v2 = xmalloc_array(nc, sizeof(float));
                for (size_t i = 0; i < na; i++) a[i] = rnd();
                for (size_t i = 0; i < nb; i++) b[i] = rnd() * (i % 7 == 0 ? 1e-3f : 1.0f);
                for (size_t i = 0; i < nc; i++) c0[i] = rnd();
                if (na > 3) a[3] = 0.0f;
                if (na > 5) a[5] = 1e-40f;                /* denormals: BF16 reads them as zero */
                if (nb > 1) b[1] = -3e-39f;
                if (nb > 2) b[2] = 0x1.fffffcp-127f;      /* would round up to the least normal */
                k_view A, B;
                views(layout, a, b, M, N, K, &A, &B);
                memcpy(ref, c0, nc * sizeof(float));
                k_gemm_set_scalar(true);
                k_gemm(ref, N, M, N, K, A, B, acc, mode);
                k_gemm_set_scalar(false);
                memcpy(v1, c0, nc * sizeof(float));
                memcpy(v2, c0, nc * sizeof(float));
                omp_set_num_threads(1);
                k_gemm(v1, N, M, N, K, A, B, acc, mode);
                omp_set_num_threads(2);
                k_gemm(v2, N, M, N, K, A, B, acc, mode);
                if (memcmp(ref, v1, nc * sizeof(float)) || memcmp(ref, v2, nc * sizeof(float))) {
                    *all_same = false;
                    fprintf(stderr, "mode %d shape %dx%dx%d layout %d acc %d: SIMD/threads differ from scalar\n",
                            (int)mode, M, N, K, layout, acc);
                }
                /* against a written-out chain (F32) or double (both) */
                for (int m = 0; m < M && ok; m++)
                    for (int n = 0; n < N; n++) {
                        float cf = acc ? c0[(size_t)m * N + n] : 0.0f;
                        double cd = cf;
                        for (int k = 0; k < K; k++) {
                            float x = A.p[m * A.rs + k * A.cs], y = B.p[k * B.rs + n * B.cs];
                            cf = fmaf(x, y, cf);
                            cd += (double)x * y;
                        }
                        float got = ref[(size_t)m * N + n];
                        if (mode == K_GEMM_F32 && memcmp(&cf, &got, sizeof cf)) {
                            fprintf(stderr, "F32 chain differs at %d,%d\n", m, n);
                            ok = false;
                            break;
                        }
                        double tol = mode == K_GEMM_F32 ? 1e-5 * (1 + sqrt(K)) : 2e-2 * (1 + sqrt(K));
                        if (fabs(got - cd) > tol) {
                            fprintf(stderr, "mode %d: %g vs %g at %d,%d (K %d)\n", (int)mode, got, cd, m, n, K);
                            ok = false;
                            break;
                        }
                    }
                free(a); free(b); free(c0); free(ref); free(v1); free(v2);
            }
    omp_set_num_threads(2);
    return ok;
}

/* every SIMD path the CPU has (AVX2 and AVX-512 tiles) against the scalar chain */
TEST(tgemm_f32_scalar_simd_threads_agree) {
    const k_isa was = k_isa_active();
    int paths = 0;
    for (k_isa isa = K_ISA_AVX2; isa < K_ISA_COUNT; isa++) {
        if (!k_isa_available(isa)) continue;
        CHECK(k_set_isa(isa));
        bool same = true;
        CHECKF(run_case(K_GEMM_F32, &same), "path %s", k_isa_name(isa));
        CHECKF(same, "path %s differs from scalar", k_isa_name(isa));
        paths++;
    }
    k_set_isa(was);
    if (!paths) SKIP("no SIMD path on this CPU (the scalar reference is the only path)");
}

/* k_gemm_sym (the upper triangle, copied down) against the full scalar
 * chain, on every path and at 1 and 2 threads, for X X^T and for S S with S
 * symmetric: the same bits, every element (a skipped tile that was needed, or
 * a copy in the wrong direction, shows as a mismatch). */
static bool sym_case(int M, int K, bool *same) {
    float *x = xmalloc_array((size_t)M * K, sizeof(float)), *s = xmalloc_array((size_t)M * M, sizeof(float));
    float *ref = xmalloc_array((size_t)M * M, sizeof(float)), *got = xmalloc_array((size_t)M * M, sizeof(float));
    for (size_t i = 0; i < (size_t)M * K; i++) x[i] = rnd();
    for (int form = 0; form < 2; form++) {
        k_view A = {x, K, 1}, B = {x, 1, K};
        int k = K;
        if (form == 1) { /* S = X X^T from the scalar chain: symmetric exactly */
            k_gemm_set_scalar(true);
            k_gemm(s, M, M, M, K, A, B, false, K_GEMM_F32);
            k_gemm_set_scalar(false);
            A = (k_view){s, M, 1};
            B = (k_view){s, M, 1};
            k = M;
        }
        k_gemm_set_scalar(true);
        k_gemm(ref, M, M, M, k, A, B, false, K_GEMM_F32);
        k_gemm_set_scalar(false);
        for (int th = 1; th <= 2; th++) {
            omp_set_num_threads(th);
            for (size_t i = 0; i < (size_t)M * M; i++) got[i] = NAN;
            k_gemm_sym(got, M, M, k, A, B, K_GEMM_F32);
            if (memcmp(got, ref, (size_t)M * M * sizeof(float))) *same = false;
        }
    }
    free(x);
    free(s);
    free(ref);
    free(got);
    return true;
}

TEST(tgemm_sym_equals_full_product) {
    static const int ms[] = {1, 12, 13, 50, 130}, ks[] = {1, 7, 257};
    const k_isa was = k_isa_active();
    const int threads = omp_get_max_threads();
    for (k_isa isa = K_ISA_SCALAR; isa < K_ISA_COUNT; isa++) {
        if (!k_isa_available(isa)) continue;
        CHECK(k_set_isa(isa));
        for (size_t a = 0; a < sizeof ms / sizeof ms[0]; a++)
            for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++) {
                bool same = true;
                CHECK(sym_case(ms[a], ks[b], &same));
                CHECKF(same, "M %d K %d on %s", ms[a], ks[b], k_isa_name(isa));
            }
    }
    k_set_isa(was);
    omp_set_num_threads(threads);
}

TEST(tgemm_bf16_scalar_equals_simd) {
    if (!k_gemm_bf16_available()) SKIP("no AVX512_BF16 (the emulation is the only path)");
    bool same = true;
    k_gemm_set_amx(false); /* the vdpbf16ps tiles; AMX has its own test below */
    CHECK(run_case(K_GEMM_BF16, &same));
    k_gemm_set_amx(true);
    CHECK(same);
}

/* The AMX path against an exact reference: BF16 operands (the emulation's
 * rounding, checked separately below) multiplied and summed in double. The
 * hardware's accumulation inside one TDPBF16PS is not a sequence of IEEE
 * roundings we can reproduce (kernels.h, "the training GEMM"), so the bound is the F32
 * accumulation error: |got - exact| <= 2^-22 (|C0| + sum |a b|) per
 * instruction step, i.e. K/32 + 1 roundings of at most 2 ulp. The AMX bits
 * must not depend on the thread count. */
static bool amx_case(int M, int N, int K, int layout, bool acc) {
    size_t na = (size_t)M * K, nb = (size_t)K * N, nc = (size_t)M * N;
    float *a = xmalloc_array(na, sizeof(float)), *b = xmalloc_array(nb, sizeof(float));
    float *c0 = xmalloc_array(nc, sizeof(float)), *v1 = xmalloc_array(nc, sizeof(float));
    float *v2 = xmalloc_array(nc, sizeof(float));
    for (size_t i = 0; i < na; i++) a[i] = rnd();
    for (size_t i = 0; i < nb; i++) b[i] = rnd() * (i % 7 == 0 ? 1e-3f : 1.0f);
    for (size_t i = 0; i < nc; i++) c0[i] = rnd();
    if (na > 5) a[5] = 1e-40f; /* denormal input reads as zero */
    k_view A, B;
    views(layout, a, b, M, N, K, &A, &B);
    memcpy(v1, c0, nc * sizeof(float));
    memcpy(v2, c0, nc * sizeof(float));
    omp_set_num_threads(1);
    k_gemm(v1, N, M, N, K, A, B, acc, K_GEMM_BF16);
    omp_set_num_threads(2);
    k_gemm(v2, N, M, N, K, A, B, acc, K_GEMM_BF16);
    bool ok = memcmp(v1, v2, nc * sizeof(float)) == 0;
    if (!ok) fprintf(stderr, "AMX %dx%dx%d layout %d: 1 and 2 threads differ\n", M, N, K, layout);
    double worst = 0.0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double e = acc ? c0[(size_t)m * N + n] : 0.0, mag = fabs(e);
            for (int k = 0; k < K; k++) {
                double x = k3_bf16_to_f32(k3_f32_to_bf16(A.p[m * A.rs + k * A.cs]));
                double y = k3_bf16_to_f32(k3_f32_to_bf16(B.p[k * B.rs + n * B.cs]));
                if (fabs(x) < 0x1p-126) x = 0.0;
                e += x * y;
                mag += fabs(x * y);
            }
            double err = fabs(v1[(size_t)m * N + n] - e), bound = 0x1p-22 * mag * ((K + 31) / 32 + 1);
            if (err / (bound > 0 ? bound : 1e-300) > worst) worst = err / bound;
            if (err > bound) {
                if (ok) fprintf(stderr, "AMX %dx%dx%d layout %d: %.9g vs %.9g at %d,%d\n", M, N, K, layout,
                                v1[(size_t)m * N + n], e, m, n);
                ok = false;
            }
        }
    free(a); free(b); free(c0); free(v1); free(v2);
    return ok;
}

TEST(tgemm_amx_matches_reference) {
    if (!k_gemm_amx_available()) SKIP("no AMX-BF16 (or the kernel refused tile data): the vdpbf16ps path runs");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int layout = 0; layout < 3; layout++)
            for (int acc = 0; acc < 2; acc++) CHECK(amx_case(shapes[s].M, shapes[s].N, shapes[s].K, layout, acc));
    CHECK(amx_case(64, 96, 320, 0, false)); /* whole 32x32 blocks: tiles straight to C */
    CHECK(amx_case(64, 96, 320, 2, true));
}

/* BF16 mode really rounds its operands: 1 + 2^-10 is not a BF16 value. */
TEST(tgemm_bf16_rounds_operands) {
    float a[2] = {1.0f + 0x1p-10f, 1.0f}, b[2] = {1.0f, 1.0f}, c[2];
    k_view A = {a, 1, 1}, B = {b, 1, 1};
    k_gemm(c, 1, 1, 1, 1, A, B, false, K_GEMM_F32);
    CHECK(c[0] == 1.0f + 0x1p-10f);
    k_gemm(c, 1, 1, 1, 1, A, B, false, K_GEMM_BF16);
    CHECK(c[0] == 1.0f);
}
