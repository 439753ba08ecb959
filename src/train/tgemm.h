/* tgemm.h: the training matrix product (internal to src/train).
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
 * BF16 mode on AMX (tgemm_amx.c; used when the CPU has AMX-BF16 and Linux
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
#ifndef K3_TRAIN_TGEMM_H
#define K3_TRAIN_TGEMM_H

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    const float *p;
    ptrdiff_t rs, cs; /* row and column strides in floats */
} tg_view;

typedef enum { TG_F32 = 0, TG_BF16 = 1 } tg_mode;

void tg_gemm(float *C, ptrdiff_t ldc, int M, int N, int K, tg_view A, tg_view B, bool acc, tg_mode mode);

/* Force the scalar reference (tests compare it with the vector path). */
void tg_set_scalar(bool on);
bool tg_bf16_available(void); /* the CPU has AVX512_BF16 */
bool tg_amx_available(void);  /* AMX-BF16 usable (CPUID + arch_prctl) and not switched off */
void tg_set_amx(bool on);     /* tests: allow (default) or forbid the AMX path */
/* The AMX product (tgemm_amx.c); only when tg_amx_available(). */
void tg_gemm_amx(float *C, ptrdiff_t ldc, int M, int N, int K, tg_view A, tg_view B, bool acc);

#endif
