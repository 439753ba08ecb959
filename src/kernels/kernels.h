/* kernels.h: the numeric kernels of k3. One module, used by inference and
 * training alike. Every kernel has a scalar reference path and a SIMD path
 * (AVX2, AVX-512 or NEON where the CPU has it) that give IDENTICAL bits;
 * tests check every path against the scalar one.
 *
 * Canonical reduction order (the determinism contract). A dot product of
 * length n is computed with 16 lane accumulators: lane l accumulates elements
 * j = l, l+16, l+32, ... in increasing j with a fused multiply-add
 * (acc[l] = fmaf(w[j], x[j], acc[l])), starting from +0.0f; the lanes are then
 * combined by a fixed tree: for s = 8, 4, 2, 1: acc[l] += acc[l+s] for l < s;
 * the result is acc[0]. The scalar path does exactly this with fmaf; the
 * AVX-512 path does it with one 16-wide vector, the AVX2 path with two 8-wide
 * vectors (lanes 0-7 and 8-15, the first tree level adds them), the NEON
 * path with four 4-wide ones, and the same tree. Consequences:
 *  - results do not depend on thread count: threads split rows, never a dot;
 *  - k_matmul over n inputs gives, for each input, the same bits as k_matvec;
 *  - a weight's storage (F32, BF16, MXFP4) only changes how w[j] is formed:
 *    BF16 widens exactly; MXFP4 forms E2M1[code] * 2^(scale-127) exactly in
 *    f32, so an MXFP4 product equals the F32 product of its dequantised matrix.
 * Sums that are not dots (norm statistics, softmax denominators) use the same
 * 16-lane + tree scheme with plain adds (k_sum, k_sumsq) unless stated.
 *
 * Layouts: matrices are row-major [rows][cols] and compute y = W x (row = output
 * feature), as stored in the checkpoint. Activations are f32. */
#ifndef K3_KERNELS_H
#define K3_KERNELS_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ---- path selection --------------------------------------------------- */
/* Instruction-set paths. Every path gives the scalar reference's bits; on
 * x86-64 the binary is built for the baseline and reaches a wider path only
 * after a CPUID check, so it runs on any x86-64 CPU; on ARM64 the NEON path
 * (part of the base architecture) is checked through HWCAP. The path in
 * force is the best one the CPU has, unless the environment variable K3_ISA
 * (scalar, avx2, avx512 or neon) names another: it is read once, at program
 * start, and a value that is unknown or that the CPU lacks stops the program
 * with one line "k3: K3_ISA=...: ..." and exit code 2. */
typedef enum { K_ISA_SCALAR = 0, K_ISA_AVX2, K_ISA_AVX512, K_ISA_NEON, K_ISA_COUNT } k_isa;
const char *k_isa_name(k_isa isa);   /* "scalar", "avx2", "avx512", "neon" */
bool k_isa_available(k_isa isa);     /* the CPU and OS support the path */
k_isa k_isa_active(void);            /* the path in force now */
/* Selects a path for what follows (tests, benchmarks); false, changing
 * nothing, when it is not available. */
bool k_set_isa(k_isa isa);
/* Parses a K3_ISA value: 0 and *isa, or nonzero with a one-line reason in msg
 * (unknown name, or a path missing from avail, a mask of 1u << k_isa). */
int k_isa_parse(const char *value, unsigned avail, k_isa *isa, char *msg, size_t cap);

/* Older switches, kept: k_set_scalar(true) selects the scalar path, false
 * the default one (K3_ISA or the best); k_simd_available() is
 * k_isa_available(K_ISA_AVX512); k_path_name() the active path's name. */
void k_set_scalar(bool scalar_only);
bool k_simd_available(void);
const char *k_path_name(void);

/* Extensions the training GEMM uses beyond a path (checked here, with the
 * paths, so the program has one CPU feature check): AVX512_BF16 (with the
 * AVX-512 path's features), and AMX-BF16 with the tile data Linux hands out
 * only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, asked once).
 * Neither depends on K3_ISA; the GEMM combines them with k_isa_active(). */
bool k_cpu_bf16(void);
bool k_cpu_amx(void);

/* Hot loops outside the kernels (model glue, training ops): K3_HOT before a
 * function definition compiles it, OpenMP regions included, for x86-64-v4
 * (AVX-512), x86-64-v3 (AVX2 + FMA) and baseline x86-64, and the loader
 * picks one by CPUID (GCC target_clones: an ifunc). The binary is built for
 * baseline x86-64, where fmaf is a libm call and loops vectorise 4 wide at
 * most; this gives such a function back what -march=native gave it. Bits do
 * not change: with -ffp-contract=off and no fast-math the compiler may widen
 * elementwise work and inline fmaf as one instruction, never fuse or
 * reassociate. K3_ISA does not steer these clones (there is no numeric path
 * to choose); tests/cli/test_portable.sh checks the machine code. Use it on
 * functions that profile hot, not everywhere: each costs three copies. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define K3_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define K3_HOT
#endif

/* ---- weights ------------------------------------------------------------ */
typedef enum { KW_F32 = 0, KW_BF16, KW_MXFP4 } kw_type;

typedef struct {
    kw_type type;
    int rows, cols;          /* logical shape; cols is the contraction dim */
    const void *data;        /* F32: float[rows][cols]; BF16: uint16_t[rows][cols];
                                MXFP4: uint8_t packed[rows][cols/2], low nibble =
                                even element */
    const uint8_t *scales;   /* MXFP4 only: E8M0 [rows][cols/group] */
    int group;               /* MXFP4 group size (32 in K3) */
} k3_mat;

/* E2M1 code -> value; scale byte 255 (NaN in OCP MX) zeroes its group. */
extern const float k_e2m1[16];
float k_e8m0(uint8_t s); /* 2^(s-127) exactly, 0 for 255 */

/* Decode one row (or a column range) of any weight to f32 (for tests/export;
 * the hot paths never materialise a whole MXFP4 matrix). */
void k_mat_row(const k3_mat *W, int row, float *out);
/* Bytes of `rows` rows of W as stored (MXFP4: the packed values and their scales). */
uint64_t k_mat_bytes(const k3_mat *W, int rows);

/* ---- products ------------------------------------------------------------ */
float k_dot(const float *w, const float *x, int n);       /* canonical order */
void k_matvec(const k3_mat *W, const float *x, float *y);  /* y[rows] = W x; OpenMP over rows */
/* Y[t][rows] = W X[t] for t < n, X is [n][cols]. Same bits as n k_matvec calls. */
void k_matmul(const k3_mat *W, const float *X, int n, float *Y);
/* Like k_matvec but only rows [r0, r1). */
void k_matvec_rows(const k3_mat *W, const float *x, float *y, int r0, int r1);
/* A batch of independent products, Y[t][rows] = W X[t] for t < n, run in ONE
 * parallel region (one thread-team start instead of one per matrix; threads
 * take row blocks of any job). Same bits as k_matmul on each job in turn.
 * Jobs must not write where another job reads. n == 0 jobs are skipped. */
typedef struct {
    const k3_mat *W;
    const float *X;
    int n;
    float *Y;
} k_prod;
void k_products(const k_prod *jobs, int njobs);
/* The same for rows [r0[i], r1[i]) of each job's W only (the other outputs
 * are not written): every output element is the dot k_products computes for
 * it, so a matrix's rows may be spread over processes (tensor parallelism,
 * dist/tensor_par.h) without changing a bit. */
void k_products_rows(const k_prod *jobs, int njobs, const int *r0, const int *r1);
/* Part `part` of `parts` of a matrix's rows, [*r0, *r1): whole runs of 16
 * rows (the kernels' row items) dealt out as evenly as they go, the last
 * part ending at rows; a part may be empty when there are more parts than
 * runs. The parts tile [0, rows) in order. */
void k_row_share(int rows, int part, int parts, int *r0, int *r1);
/* out[p] = canonical dot of x with B + p*ldb, both of length len, for p < rows
 * (attention scores against a cache whose rows are wider than the dot). */
void k_dots(float *out, const float *x, const float *B, size_t ldb, int rows, int len);
/* C[m][j] += sum_k A[m*lda + k] * B(b0 + k, j) for m < M, j < N <= B->cols,
 * k < K, where B(r, j) is weight row r widened exactly. Each C element gets
 * fma(A, B, c) for k = 0, 1, ... in order: the bits of a loop of axpy, not of
 * a canonical dot (MLA's absorbed query and attention-weighted latent). */
void k_gemm_acc(float *C, int ldc, int M, int N, const float *A, int lda, int K, const k3_mat *B, int b0);

/* ---- elementwise and norms ----------------------------------------------- */
float k_sum(const float *x, int n);
float k_sumsq(const float *x, int n);
/* y = g * x / sqrt(mean(x^2) + eps); g may be NULL (no gain). y may alias x. */
void k_rmsnorm(float *y, const float *x, const float *g, int n, float eps);
/* x /= sqrt(sum(x^2) + eps), in place (KDA q/k, eps 1e-6). */
void k_l2norm(float *x, int n, float eps);
float k_sigmoid(float x);
void k_silu(float *x, int n);
/* out[i] = [b1*tanh(a/b1)*sigmoid(a)] * [b2*tanh(u/b2)], sigmoid of the UNCAPPED a. */
void k_situ_glu(float *out, const float *gate, const float *up, int n, float b1, float b2);
/* softmax in place over n (max-subtracted, f32). */
void k_softmax(float *x, int n);

/* ---- exp, tanh, sigmoid with the same bits everywhere ---------------------
 * Built only from IEEE-exact operations (+ - * / fma, rounding to integer,
 * exponent bit construction), so every SIMD path repeats them lane by lane
 * and gets the same bits, and the model glue and the trainer, which inline
 * them in their own loops, agree with the kernels (km_sigmoid is k_sigmoid).
 * libm's expf/tanhf would tie results to one glibc version and cannot be
 * vectorised identically. Accuracy: about 1 ulp (checked against double in
 * tests/test_kernels.c). The KM_ constants are the SIMD paths' too. */
/* Shared constants: the SIMD file uses the same ones. */
#define KM_EXP_HI    89.0f     /* above: the result overflows to +inf anyway */
#define KM_EXP_LO    (-104.0f) /* below: the result underflows to 0 anyway */
#define KM_LOG2E     0x1.715476p+0f
#define KM_LN2_HI    0x1.62ep-1f /* trailing zero bits: k * hi is exact */
#define KM_LN2_LO    0x1.0bfbe8p-15f
/* Taylor coefficients 1/k! for e^r on |r| <= ln2/2 (truncation < 0.1 ulp). */
#define KM_E7 (1.0f / 5040.0f)
#define KM_E6 (1.0f / 720.0f)
#define KM_E5 (1.0f / 120.0f)
#define KM_E4 (1.0f / 24.0f)
#define KM_E3 (1.0f / 6.0f)
#define KM_E2 0.5f
/* tanh(x) = x + x^3 P(x^2) for |x| < KM_TANH_SMALL: least-squares fit on the
 * relative error (max 1.25 ulp in f32 Horner); above it 1 - 2/(e^{2x}+1) has
 * no harmful cancellation. */
#define KM_TANH_SMALL 0.625f
#define KM_T0 (-0x1.555554p-2f)
#define KM_T1 0x1.111082p-3f
#define KM_T2 (-0x1.b9f416p-5f)
#define KM_T3 0x1.63c9a2p-6f
#define KM_T4 (-0x1.0d302ep-7f)
#define KM_T5 0x1.1d7a58p-9f

static inline float km_pow2i(int e) { /* 2^e for e in [-126, 127] */
    uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float km_exp(float x) {
    if (x != x) return x + x;
    float xc = x < KM_EXP_LO ? KM_EXP_LO : x;
    xc = xc > KM_EXP_HI ? KM_EXP_HI : xc;
    float kf = nearbyintf(xc * KM_LOG2E);
    float r = fmaf(-kf, KM_LN2_HI, xc);
    r = fmaf(-kf, KM_LN2_LO, r);
    float p = KM_E7;
    p = fmaf(p, r, KM_E6);
    p = fmaf(p, r, KM_E5);
    p = fmaf(p, r, KM_E4);
    p = fmaf(p, r, KM_E3);
    p = fmaf(p, r, KM_E2);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    /* 2^k in two factors so both stay normal; the second product rounds once
     * (into the subnormal range or to inf) exactly like a single scaling. */
    int k = (int)kf;
    int k1 = k >> 1, k2 = k - k1;
    return (p * km_pow2i(k1)) * km_pow2i(k2);
}

static inline float km_sigmoid(float x) { return 1.0f / (1.0f + km_exp(-x)); }

static inline float km_tanh(float x) {
    float a = fabsf(x);
    if (a < KM_TANH_SMALL) {
        float z = x * x;
        float p = KM_T5;
        p = fmaf(p, z, KM_T4);
        p = fmaf(p, z, KM_T3);
        p = fmaf(p, z, KM_T2);
        p = fmaf(p, z, KM_T1);
        p = fmaf(p, z, KM_T0);
        return fmaf(x * z, p, x);
    }
    float e = km_exp(a + a);
    float t = 1.0f - 2.0f / (e + 1.0f);
    return copysignf(t, x);
}

/* ---- KDA ------------------------------------------------------------------ */
/* Depthwise causal conv over T steps, C channels, K taps, fused SiLU.
 * x: [T][C] pre-conv inputs; w: [C][K] (w[c][K-1] multiplies the current input);
 * state: [C][K-1] the previous K-1 inputs per channel, oldest first (zeros at
 * sequence start); updated to the last K-1 inputs on return. y: [T][C]. */
void k_shortconv_silu(float *y, const float *x, int T, int C, const float *w, int K, float *state);
/* The same conv without the SiLU (y: the conv outputs). */
void k_shortconv(float *y, const float *x, int T, int C, const float *w, int K, float *state);

/* Log-decay g[h][d] = lower * sigmoid(exp(A_log[h]) * (z[h*D+d] + dt_bias[h*D+d]))
 * for one position; z, g: [H*D]. zb (may be NULL, may alias z) gets
 * z + dt_bias, what training's backward reads. */
void k_kda_gate(float *g, float *zb, const float *z, const float *A_log, const float *dt_bias, int H, int D,
                float lower);

/* Recurrent KDA over T positions, H heads, head dim D, state S [H][D][D]
 * (rows = key channels, cols = value channels), updated in place.
 * q, k: [T][H*D], already L2-normalised per head (q NOT yet scaled: the kernel
 * multiplies by 1/sqrt(D)); v: [T][H*D]; g: [T][H*D] log-decay; beta: [T][H].
 * Per step: S = diag(exp g) S; u = S^T k; S += k (beta (v - u))^T; o = S^T q/sqrt(D).
 * o: [T][H*D]. */
void k_kda_recurrent(float *o, float *S, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, int T, int H, int D);
/* Chunkwise (UT/WY) form of the same function, requested chunk length C; the
 * caller promises every log-decay g >= lower (< 0), and the chunk is clamped
 * to k_kda_block_len(C, lower) so that the factored decays e^G, e^-G stay in
 * f32 range. Agrees with k_kda_recurrent to fp32 rounding (not bitwise). */
void k_kda_chunked(float *o, float *S, const float *q, const float *k, const float *v,
                   const float *g, const float *beta, int T, int H, int D, int C, float lower);

/* Both forms over nseq independent sequences of T positions each (rows
 * s*T + t of q, k, v, g, o; beta [nseq*T][H]; S [nseq][H][D][D]). C <= 0: the
 * recurrent form; C > 0: the chunkwise form. Threads split (sequence, head)
 * pairs. Ssave (may be NULL) gets the state entering every block of
 * k_kda_block_len(C, lower) positions, [nseq][H][nblocks][D][D]: what
 * training's backward restarts from. Bits do not depend on Ssave. */
void k_kda_forward(float *o, float *S, const float *q, const float *k, const float *v, const float *g,
                   const float *beta, int nseq, int T, int H, int D, int C, float lower, float *Ssave);
/* The same over sequences whose states lie apart and whose lengths differ (a
 * batch of decode states): sequence s has seq[s].T rows from row seq[s].row
 * of q, k, v, g, o (of beta: [row][H]), its state [H][D][D] at seq[s].S and
 * its own form seq[s].C. Threads split all (sequence, head) pairs at once;
 * each pair's bits are those of k_kda_forward on that sequence alone. */
typedef struct {
    float *S;
    size_t row;
    int T, C;
} k_kda_seq;
void k_kda_forward_seqs(float *o, const float *q, const float *k, const float *v, const float *g,
                        const float *beta, const k_kda_seq *seq, int nseq, int H, int D, float lower);
/* Positions per saved state: the clamped chunk (C > 0) or K_KDA_RECUR_BLOCK. */
#define K_KDA_RECUR_BLOCK 16
int k_kda_block_len(int C, float lower);

/* The chunkwise form's workspace and its first half (everything up to W and
 * Z = V - KG S0 - A W), shared with training's backward (k_kda_chunk_bwd),
 * which recomputes a chunk from its saved entering state and walks these
 * products in reverse.
 * Layout of one chunk of L <= C rows: [C][D] row blocks, [D][C] transposes,
 * [C][C] lower-triangular matrices (names as in kda.c's comment); the d*
 * fields are the backward's, in the same allocation. */
typedef struct {
    int C, D;
    float *G, *eG, *eN, *KG, *KN, *QG, *KC, *Z, *W, *O; /* [C][D] */
    float *KNT, *WT;                                   /* [D][C] */
    float *Am, *Bm, *dA, *dBm;                         /* [C][C] */
    float *S0T, *dST, *dS0;                            /* [D][D] */
    float *bd;                                         /* [C] diagonal of Bm: q_t.k_t / sqrt(D) */
    float *dQG, *dKG, *dKN, *dKC, *dW, *E, *nZ, *dG;   /* [C][D] */
    float *buf;
} k_kda_cws;
void k_kda_cws_init(k_kda_cws *w, int C, int D);
void k_kda_cws_free(k_kda_cws *w);
/* q, k, v, gl: L rows of stride st; beta stride sb; S0 [D][D]. */
void k_kda_chunk_prep(k_kda_cws *w, const float *q, const float *k, const float *v, const float *gl,
                      const float *beta, int L, size_t st, size_t sb, const float *S0);
/* Training's backward of one chunk of L rows (same strides as the prep),
 * recomputed from its entering state S0: dS is d(loss)/d(state after the
 * chunk) on entry and d/d(S0) on return; dout rows are d/d(o). Writes dq, dk,
 * dv, dgl (stride st) and dbeta (stride sb). Same bits on every path. */
void k_kda_chunk_bwd(k_kda_cws *w, float *dS, const float *S0, const float *q, const float *k, const float *v,
                     const float *gl, const float *beta, const float *dout, float *dq, float *dk, float *dv,
                     float *dgl, float *dbeta, int L, size_t st, size_t sb);

/* Head-wise output: out[h] = rmsnorm(o[h]; gain[D], eps) * sigmoid(gate[h]) for
 * one position, o/gate/out: [H*D]. */
void k_kda_out_norm_gate(float *out, const float *o, const float *gain, const float *gate, int H, int D,
                         float eps);

/* ---- router ----------------------------------------------------------------- */
/* Given logits [n] (router product), computes s = sigmoid(logits), selects the k
 * largest s + bias (bias may be NULL); ties go to the LOWER expert index.
 * Writes idx[k] (in descending order of selection score) and weights w[k] from
 * the unbiased s, renormalised to sum 1 if renorm && k > 1 (denominator
 * sum + 1e-20), then multiplied by scale. */
void k_router_topk(const float *logits, const float *bias, int n, int k, bool renorm, float scale,
                   int *idx, float *w);
/* The same selection, also giving what training records (either may be
 * NULL): s_out[n] the sigmoid scores, *cut the selection score (s + bias) of
 * the best expert left out (written only when k < n), Quantile Balancing's
 * per-token threshold. */
void k_router_select(const float *logits, const float *bias, int n, int k, bool renorm, float scale, int *idx,
                     float *w, float *s_out, float *cut);

/* ---- the training GEMM (gemm.c, gemm_amx.c) ---------------------------------
 *
 * C[m][n] = C0 + sum_k A(m,k) B(k,n) for m < M, n < N, where C0 is C's value
 * (acc) or +0, and A, B are strided views (element (i,j) at p[i*rs + j*cs]),
 * so one routine serves the forward X W^T, dX = dY W and dW = dY^T X.
 *
 * Numerics, F32 mode: every C element is ONE fused multiply-add chain over k
 * in increasing order, c = fmaf(A(m,k), B(k,n), c). The AVX-512 path keeps one
 * element per lane and only changes which chains run side by side, so it has
 * the scalar path's bits; threads split output tiles, never a chain, so the
 * bits do not depend on the thread count or on the blocking.
 *
 * BF16 mode (opt-in, `k3 train --bf16`): A and B are rounded to BF16 (round to
 * nearest even) and each element accumulates in F32 over pairs of k as the
 * AVX512_BF16 instruction vdpbf16ps does: c += a(k+1) b(k+1), then
 * c += a(k) b(k), each rounded to F32 (the products are exact), denormal
 * inputs read as zero and denormal sums flushed to zero; an odd K is padded
 * with a zero pair element. The scalar emulation gives the same bits as the
 * instruction (test tgemm_bf16_scalar_equals_simd). Without AVX512_BF16 the
 * emulation runs.
 *
 * BF16 mode on AMX (gemm_amx.c; used when the CPU has AMX-BF16 and Linux
 * grants the tile data, else the vdpbf16ps path above): the same BF16
 * operands, accumulated in F32 by TDPBF16PS, 32 k per instruction in
 * increasing k. Inside one instruction the hardware's accumulation is its
 * own: no sequence of IEEE roundings we probed reproduces it (pairs rounded
 * then added in order, either order within a pair, one rounding per pair or
 * per instruction, round-toward-zero), so the AMX path is tested against an
 * exact (double) BF16-product reference at a tight tolerance, not bit for
 * bit against the emulation. It is still deterministic: an element's
 * instruction sequence depends only on K, never on the thread count or the
 * job split (test tgemm_amx_matches_reference). */
typedef struct {
    const float *p;
    ptrdiff_t rs, cs; /* row and column strides in floats */
} k_view;

typedef enum { K_GEMM_F32 = 0, K_GEMM_BF16 = 1 } k_gemm_mode;

void k_gemm(float *C, ptrdiff_t ldc, int M, int N, int K, k_view A, k_view B, bool acc, k_gemm_mode mode);
/* C [M][M] = A [M][K] B [K][M] where the caller knows the product is
 * symmetric (X X^T, or S S with S symmetric): the same bits as k_gemm, for
 * about half the work in F32 (the upper triangle, copied down). */
void k_gemm_sym(float *C, ptrdiff_t ldc, int M, int K, k_view A, k_view B, k_gemm_mode mode);

/* Force the scalar reference (tests compare it with the vector path). */
void k_gemm_set_scalar(bool on);
bool k_gemm_bf16_available(void); /* the CPU has AVX512_BF16 (k_cpu_bf16) */
bool k_gemm_amx_available(void);   /* AMX-BF16 usable (k_cpu_amx) and not switched off */
/* The BF16 products have fast tiles (vdpbf16ps or AMX) on the path in force:
 * the AVX-512 path with AVX512_BF16. Elsewhere only the bit-exact scalar
 * emulation could run them, ~100x slower than F32, so callers refuse or
 * skip the BF16 mode instead. */
bool k_gemm_bf16_fast(void);
/* One line on the training products this CPU runs (K3_ISA respected): which
 * tiles the F32 and the --bf16 products use. For k3 doctor. */
void k3_train_gemm_describe(char *buf, size_t n);
void k_gemm_set_amx(bool on);      /* tests: allow (default) or forbid the AMX path */

#endif
