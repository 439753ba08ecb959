/* kmath.h (internal to src/kernels): exp, tanh and sigmoid built only from
 * IEEE-exact operations (+ - * / fma, rounding to integer, exponent bit
 * construction), so the AVX-512 path can repeat them lane by lane and get the
 * same bits. libm's expf/tanhf would tie our results to one glibc version and
 * cannot be vectorised identically. Accuracy: about 1 ulp (checked against
 * double in tests/test_kernels.c). */
#ifndef K3_KERNELS_KMATH_H
#define K3_KERNELS_KMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

#endif
