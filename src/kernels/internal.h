/* internal.h (src/kernels only): the seam between the portable reference
 * code and the SIMD files (AVX2, AVX-512, NEON). Everything here obeys the canonical order of
 * kernels.h, so a table of scalar functions and a table of vector functions
 * are interchangeable bit for bit. */
#ifndef K3_KERNELS_INTERNAL_H
#define K3_KERNELS_INTERNAL_H

#include "kernels/kernels.h"

/* Vector primitives on f32 arrays of any length n >= 0. All are elementwise
 * (no order question) except dot/sum/sumsq, which use the 16-lane + tree
 * order. Composite kernels (KDA, norms) are written once on top of these. */
typedef struct {
    float (*dot)(const float *a, const float *b, int n);
    float (*sum)(const float *x, int n);
    void (*axpy)(float *y, float a, const float *x, int n);          /* y = fma(a, x, y) */
    void (*vfma)(float *y, const float *a, const float *b, int n);   /* y = fma(a, b, y) */
    void (*scale)(float *y, const float *x, float s, int n);         /* y = x * s */
    void (*vmul)(float *y, const float *a, const float *b, int n);   /* y = a * b */
    void (*vadd)(float *y, const float *a, const float *b, int n);   /* y = a + b */
    void (*vexp)(float *y, const float *x, int n);                   /* y = km_exp(x) */
    void (*subscale)(float *y, const float *a, const float *b, float s, int n); /* y = (a - b) * s */
    void (*divs)(float *y, const float *x, float d, int n);          /* y = x / d */
    /* A copy of X arranged for W's tiles, made once per product: with dst
     * NULL, the floats it needs (0: declined); else written to dst (64-byte
     * aligned). rowdots: Y[t][r] for t < n, r0 <= r < r1 (Y is [n][rows]);
     * aux is that copy (NULL when prepare is NULL or declined). */
    size_t (*prepare)(const k3_mat *W, const float *X, int n, float *dst);
    void (*rowdots)(const k3_mat *W, const float *X, int n, float *Y, int r0, int r1, const void *aux);
    /* C[m][j] += sum_k A(m,k) B[k][j] for m < M, j < N, k < K, with
     * A(m,k) = A[m*sam + k*sak]; each C element gets fma(A(m,k), B[k][j], c)
     * for k = 0, 1, ... in order (the same bits as a loop of axpy). */
    void (*gemm_acc)(float *C, int ldc, int M, int N, const float *A, int sam, int sak, int K,
                     const float *B, int ldb);
    void (*dots)(float *out, const float *x, const float *B, size_t ldb, int rows, int len);
    /* The two row sweeps of one recurrent KDA step over S [D][D]:
     * rows_decay:  for i: S_i = S_i * a[i];  u = fma(k[i], S_i, u)
     * rows_write:  for i: S_i = fma(k[i], d, S_i);  o = fma(qs[i], S_i, o)
     * (u, o accumulate over i in increasing order, elementwise). */
    void (*kda_rows_decay)(float *S, int D, const float *a, const float *k, float *u);
    void (*kda_rows_write)(float *S, int D, const float *k, const float *d, const float *qs, float *o);
    void (*silu)(float *x, int n);
    void (*situ)(float *out, const float *gate, const float *up, int n, float b1, float b2);
    void (*sigmoid_mul)(float *y, const float *gate, int n);          /* y *= sigmoid(gate) */
    /* rows_write of one step fused with rows_decay of the next, one pass over
     * S instead of two (prefill): for i: S_i = fma(k[i], d, S_i);
     * o = fma(qs[i], S_i, o); S_i = S_i * a2[i]; u2 = fma(k2[i], S_i, u2).
     * The same operations per element as the two sweeps one after the other.
     * May be NULL (then the two sweeps run). */
    void (*kda_rows_write_decay)(float *S, int D, const float *k, const float *d, const float *qs, float *o,
                                 const float *a2, const float *k2, float *u2);
} k_vops;

/* Software prefetch of the product tiles. A tile's rb rows are one
 * contiguous run of the matrix, so while it sweeps its columns it asks for
 * the bytes dist past its start, in step with what it consumes, and the
 * tiles after it find their rows in cache: the hardware prefetcher ramps up
 * too slowly on a tile's short row streams (a row of a 1280-wide BF16 matrix
 * is 40 lines). Tiles over several inputs (tb of them: a batched decode, a
 * verifying pass, a short prefill chunk) stream the rows the same way, and
 * without it waited on them: on a Zen 4 core, 2 rows of models/default took
 * twice the time of 1 before and 1.2-1.5 times after. Returns that address,
 * or NULL where it would run past the matrix's rows rows. A MXFP4 tile also
 * asks for those rows' scales at once (k_mv_prefetch_scales). A prefetch
 * changes no bits. */
static inline const char *k_mv_prefetch(const k3_mat *W, int rows, int r, int rb, size_t row_bytes, size_t dist) {
    if ((size_t)(r + rb) * row_bytes + dist > (size_t)rows * row_bytes) return NULL;
    return (const char *)W->data + (size_t)r * row_bytes + dist;
}
/* the ng scales a row of each of the rb rows dist bytes past row r's */
static inline void k_mv_prefetch_scales(const k3_mat *W, int r, int rb, size_t row_bytes, int ng, size_t dist) {
    const char *ps = (const char *)W->scales + (size_t)r * (size_t)ng + dist / row_bytes * (size_t)ng;
    for (int q = 0; q < rb * ng; q += 64) __builtin_prefetch(ps + q, 0, 3); /* prefetcht0 on x86 */
}

/* Per-thread scratch of the SIMD paths: 64-byte aligned, at least bytes,
 * contents undefined. It only grows and is kept while the thread lives, so a
 * hot product pays no allocation or page faults per call; it is freed when
 * the thread exits (a pthread key's destructor), so threads that end (an
 * OpenMP team's, a server's) leave nothing behind. One buffer per slot: a
 * caller may hold one slot's buffer while asking for another's. */
/* PANEL, AMX: inside a product's tiles; JOBS, ITEMS, PREP: a product's own
 * bookkeeping on the calling thread (k_products), around the tiles. */
typedef enum { K_SCRATCH_PANEL, K_SCRATCH_AMX, K_SCRATCH_JOBS, K_SCRATCH_ITEMS, K_SCRATCH_PREP, K_SCRATCH_N } k_scratch_slot;
void *k_scratch(k_scratch_slot slot, size_t bytes);

extern const k_vops k_scalar_ops;
#if defined(__x86_64__)
/* Partial tables are fine: a NULL slot runs the scalar primitive. */
extern const k_vops k_avx2_ops;
extern const k_vops k_avx512_ops;
/* Products over >= 8 inputs decode rows once into an f32 panel (default on);
 * off runs the direct tiles. Same bits; for benchmarks only. */
void k_avx512_set_panel(bool on);
#endif
#if defined(__aarch64__)
extern const k_vops k_neon_ops;
#endif
/* The BF16 training product on AMX tiles (gemm_amx.c), called by k_gemm
 * only when k_gemm_amx_available(); it calls nothing of gemm.c. */
void k_gemm_amx(float *C, ptrdiff_t ldc, int M, int N, int K, k_view A, k_view B, bool acc);

/* The table in force (kernels.c: K3_ISA or the best path the CPU has), with
 * every slot filled. Compare k_isa_active(), never table addresses. */
const k_vops *k_ops(void);

/* Canonical 16-lane tree over acc[16] (destroys acc). */
static inline float k_tree16(float *acc) {
    for (int s = 8; s >= 1; s >>= 1)
        for (int l = 0; l < s; l++) acc[l] += acc[l + s];
    return acc[0];
}

#endif
