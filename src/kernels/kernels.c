/* kernels.c: path selection, the scalar reference for every primitive, and
 * the public kernels written once on top of the primitive table (see
 * internal.h). The scalar code here IS the definition of the results; the
 * SIMD files must reproduce it bit for bit. */
#include "kernels/internal.h"
#include "util/common.h"

#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* ---- path selection ------------------------------------------------------
 * The one place that decides which instruction set the kernels use. Each
 * SIMD table is completed from the scalar one (merge), so a primitive that a
 * path does not implement (yet) runs the scalar reference there: same bits,
 * never an instruction the CPU lacks. The training GEMM (gemm.c), whose
 * tiles are not in the table, asks k_isa_active(), so K3_ISA rules it too,
 * and the extensions it needs beyond a path (k_cpu_bf16, k_cpu_amx) are
 * checked here as well: the program's one CPU feature check. */

static const char *const isa_names[K_ISA_COUNT] = {"scalar", "avx2", "avx512", "neon"};

const char *k_isa_name(k_isa isa) { return isa >= 0 && isa < K_ISA_COUNT ? isa_names[isa] : "?"; }

/* What the CPU and OS support (libgcc's checks include the OS's XSAVE state
 * for the ymm/zmm registers). */
static unsigned isa_mask(void) {
    static int mask = -1;
    if (mask < 0) {
        unsigned m = 1u << K_ISA_SCALAR;
#if defined(__x86_64__)
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) m |= 1u << K_ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("fma"))
            m |= 1u << K_ISA_AVX512;
#elif defined(__aarch64__)
        if (getauxval(AT_HWCAP) & HWCAP_ASIMD) m |= 1u << K_ISA_NEON;
#endif
        mask = (int)m;
    }
    return (unsigned)mask;
}

bool k_isa_available(k_isa isa) { return isa >= 0 && isa < K_ISA_COUNT && (isa_mask() >> isa & 1u); }

int k_isa_parse(const char *value, unsigned avail, k_isa *isa, char *msg, size_t cap) {
    for (int i = 0; i < K_ISA_COUNT; i++) {
        if (strcmp(value, isa_names[i]) != 0) continue;
        if (!(avail >> i & 1u)) {
            char have[64] = "";
            for (int j = 0; j < K_ISA_COUNT; j++)
                if (avail >> j & 1u) {
                    if (have[0]) strcat(have, " ");
                    strcat(have, isa_names[j]);
                }
            snprintf(msg, cap, "this CPU lacks the %s instructions (available: %s)", value, have);
            return -1;
        }
        *isa = (k_isa)i;
        return 0;
    }
    snprintf(msg, cap, "unknown instruction set (use scalar, avx2, avx512 or neon)");
    return -1;
}

static k_vops g_tabs[K_ISA_COUNT];
static k_isa g_default = K_ISA_SCALAR, g_active = K_ISA_SCALAR;
static bool g_ready;

/* simd with its empty slots taken from the scalar table; k_vops holds only
 * function pointers, compared and copied slot by slot. */
typedef void (*k_fnptr)(void);
_Static_assert(sizeof(k_vops) % sizeof(k_fnptr) == 0, "k_vops must hold only function pointers");
enum { NSLOTS = sizeof(k_vops) / sizeof(k_fnptr) };
static void merge(k_vops *out, const k_vops *simd) {
    k_fnptr s[NSLOTS], v[NSLOTS];
    memcpy(s, &k_scalar_ops, sizeof s);
    memcpy(v, simd, sizeof v);
    for (int i = 0; i < NSLOTS; i++)
        if (!v[i]) v[i] = s[i];
    memcpy(out, v, sizeof v);
}

static void isa_init(void) {
    if (g_ready) return;
    g_tabs[K_ISA_SCALAR] = k_scalar_ops;
    merge(&g_tabs[K_ISA_AVX2], &k_scalar_ops);
    merge(&g_tabs[K_ISA_AVX512], &k_scalar_ops);
    merge(&g_tabs[K_ISA_NEON], &k_scalar_ops);
#if defined(__x86_64__)
    merge(&g_tabs[K_ISA_AVX2], &k_avx2_ops);
    merge(&g_tabs[K_ISA_AVX512], &k_avx512_ops);
#elif defined(__aarch64__)
    merge(&g_tabs[K_ISA_NEON], &k_neon_ops);
#endif
    g_default = K_ISA_SCALAR;
    for (int i = K_ISA_COUNT - 1; i > 0; i--)
        if (k_isa_available((k_isa)i)) { g_default = (k_isa)i; break; }
    const char *env = getenv("K3_ISA");
    if (env && *env) {
        char msg[160];
        if (k_isa_parse(env, isa_mask(), &g_default, msg, sizeof msg)) {
            fprintf(stderr, "k3: K3_ISA=%s: %s\n", env, msg);
            exit(K3_EXIT_USAGE);
        }
    }
    g_active = g_default;
    g_ready = true;
}

/* At program start, before any thread exists: a bad K3_ISA stops every k3
 * program (k3, tests, benchmarks) before it does anything. */
__attribute__((constructor)) static void isa_init_at_start(void) { isa_init(); }

k_isa k_isa_active(void) {
    isa_init();
    return g_active;
}

bool k_set_isa(k_isa isa) {
    isa_init();
    if (!k_isa_available(isa)) return false;
    g_active = isa;
    return true;
}

void k_set_scalar(bool scalar_only) {
    isa_init();
    g_active = scalar_only ? K_ISA_SCALAR : g_default;
}

bool k_simd_available(void) { return k_isa_available(K_ISA_AVX512); }

bool k_cpu_bf16(void) {
#if defined(__x86_64__)
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = k_isa_available(K_ISA_AVX512) && __builtin_cpu_supports("avx512bf16");
    }
    return have;
#else
    return false;
#endif
}

bool k_cpu_amx(void) {
#if defined(__x86_64__) && defined(__linux__)
    static int have = -1;
    if (have < 0) {
        enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
        unsigned a, b, c, d;
        bool cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) /* AMX-TILE */ &&
                   (d & (1u << 22)) /* AMX-BF16 */;
        /* the AMX packers use AVX512_BF16's conversion; every AMX CPU has it */
        have = cpu && k_cpu_bf16() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return have;
#else
    return false;
#endif
}

const k_vops *k_ops(void) {
    isa_init();
    return &g_tabs[g_active];
}

const char *k_path_name(void) { return k_isa_name(k_isa_active()); }

/* ---- weights --------------------------------------------------------------- */

const float k_e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float k_e8m0(uint8_t s) {
    if (s == 255) return 0.0f;
    if (s == 0) return 0x1p-127f; /* the one subnormal scale */
    return km_pow2i((int)s - 127);
}

/* Bytes per row of packed MXFP4 and scale bytes per row. MXFP4 rows need an
 * even cols (two codes per byte); the loader checks shapes. */
static inline size_t mx_row_bytes(const k3_mat *W) { return (size_t)W->cols / 2; }
static inline size_t mx_row_groups(const k3_mat *W) {
    return ((size_t)W->cols + (size_t)W->group - 1) / (size_t)W->group;
}

void k_mat_row(const k3_mat *W, int row, float *out) {
    size_t n = (size_t)W->cols;
    switch (W->type) {
    case KW_F32:
        memcpy(out, (const float *)W->data + (size_t)row * n, n * sizeof(float));
        break;
    case KW_BF16: {
        const uint16_t *p = (const uint16_t *)W->data + (size_t)row * n;
        for (size_t j = 0; j < n; j++) out[j] = k3_bf16_to_f32(p[j]);
        break;
    }
    case KW_MXFP4: {
        const uint8_t *p = (const uint8_t *)W->data + (size_t)row * mx_row_bytes(W);
        const uint8_t *sc = W->scales + (size_t)row * mx_row_groups(W);
        for (size_t j = 0; j < n; j++) {
            uint8_t b = p[j >> 1];
            int code = (j & 1) ? (b >> 4) : (b & 15);
            out[j] = k_e2m1[code] * k_e8m0(sc[j / (size_t)W->group]);
        }
        break;
    }
    }
}

/* ---- scalar primitives (the reference) ------------------------------------ */

static float s_dot(const float *w, const float *x, int n) {
    float acc[16] = {0};
    for (int j = 0; j < n; j++) acc[j & 15] = fmaf(w[j], x[j], acc[j & 15]);
    return k_tree16(acc);
}

static float s_sum(const float *x, int n) {
    float acc[16] = {0};
    for (int j = 0; j < n; j++) acc[j & 15] += x[j];
    return k_tree16(acc);
}

static void s_axpy(float *y, float a, const float *x, int n) {
    for (int j = 0; j < n; j++) y[j] = fmaf(a, x[j], y[j]);
}
static void s_vfma(float *y, const float *a, const float *b, int n) {
    for (int j = 0; j < n; j++) y[j] = fmaf(a[j], b[j], y[j]);
}
static void s_scale(float *y, const float *x, float s, int n) {
    for (int j = 0; j < n; j++) y[j] = x[j] * s;
}
static void s_vmul(float *y, const float *a, const float *b, int n) {
    for (int j = 0; j < n; j++) y[j] = a[j] * b[j];
}
static void s_vadd(float *y, const float *a, const float *b, int n) {
    for (int j = 0; j < n; j++) y[j] = a[j] + b[j];
}
static void s_vexp(float *y, const float *x, int n) {
    for (int j = 0; j < n; j++) y[j] = km_exp(x[j]);
}
static void s_subscale(float *y, const float *a, const float *b, float s, int n) {
    for (int j = 0; j < n; j++) y[j] = (a[j] - b[j]) * s;
}
static void s_divs(float *y, const float *x, float d, int n) {
    for (int j = 0; j < n; j++) y[j] = x[j] / d;
}
static void s_gemm_acc(float *C, int ldc, int M, int N, const float *A, int sam, int sak, int K,
                       const float *B, int ldb) {
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++)
            s_axpy(C + (size_t)m * ldc, A[(size_t)m * sam + (size_t)k * sak], B + (size_t)k * ldb, N);
}
static void s_dots(float *out, const float *x, const float *B, size_t ldb, int rows, int len) {
    for (int p = 0; p < rows; p++) out[p] = s_dot(x, B + (size_t)p * ldb, len);
}
static void s_kda_rows_decay(float *S, int D, const float *a, const float *k, float *u) {
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        s_scale(Si, Si, a[i], D);
        s_axpy(u, k[i], Si, D);
    }
}
static void s_kda_rows_write(float *S, int D, const float *k, const float *d, const float *qs, float *o) {
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        s_axpy(Si, k[i], d, D);
        s_axpy(o, qs[i], Si, D);
    }
}
static void s_kda_rows_write_decay(float *S, int D, const float *k, const float *d, const float *qs, float *o,
                                   const float *a2, const float *k2, float *u2) {
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        s_axpy(Si, k[i], d, D);
        s_axpy(o, qs[i], Si, D);
        s_scale(Si, Si, a2[i], D);
        s_axpy(u2, k2[i], Si, D);
    }
}
static void s_silu(float *x, int n) {
    for (int j = 0; j < n; j++) x[j] = x[j] / (1.0f + km_exp(-x[j]));
}
static void s_situ(float *out, const float *gate, const float *up, int n, float b1, float b2) {
    for (int j = 0; j < n; j++) {
        float a = gate[j];
        float g = (b1 * km_tanh(a / b1)) * km_sigmoid(a);
        out[j] = g * (b2 * km_tanh(up[j] / b2));
    }
}
static void s_sigmoid_mul(float *y, const float *gate, int n) {
    for (int j = 0; j < n; j++) y[j] = y[j] * km_sigmoid(gate[j]);
}

/* One weight row against one input, canonical order; w[j] is formed exactly
 * in f32 from the stored type. */
static float s_row_dot(const k3_mat *W, int r, const float *x) {
    int n = W->cols;
    float acc[16] = {0};
    switch (W->type) {
    case KW_F32: return s_dot((const float *)W->data + (size_t)r * (size_t)n, x, n);
    case KW_BF16: {
        const uint16_t *p = (const uint16_t *)W->data + (size_t)r * (size_t)n;
        for (int j = 0; j < n; j++) acc[j & 15] = fmaf(k3_bf16_to_f32(p[j]), x[j], acc[j & 15]);
        break;
    }
    case KW_MXFP4: {
        const uint8_t *p = (const uint8_t *)W->data + (size_t)r * mx_row_bytes(W);
        const uint8_t *sc = W->scales + (size_t)r * mx_row_groups(W);
        int G = W->group;
        for (int g0 = 0, gi = 0; g0 < n; g0 += G, gi++) {
            float s = k_e8m0(sc[gi]);
            int ge = g0 + G < n ? g0 + G : n;
            for (int j = g0; j < ge; j++) {
                uint8_t b = p[j >> 1];
                int code = (j & 1) ? (b >> 4) : (b & 15);
                acc[j & 15] = fmaf(k_e2m1[code] * s, x[j], acc[j & 15]);
            }
        }
        break;
    }
    }
    return k_tree16(acc);
}

static void s_rowdots(const k3_mat *W, const float *X, int n, float *Y, int r0, int r1, const void *aux) {
    (void)aux;
    for (int t = 0; t < n; t++)
        for (int r = r0; r < r1; r++)
            Y[(size_t)t * (size_t)W->rows + (size_t)r] = s_row_dot(W, r, X + (size_t)t * (size_t)W->cols);
}

const k_vops k_scalar_ops = {
    .dot = s_dot, .sum = s_sum, .axpy = s_axpy, .vfma = s_vfma, .scale = s_scale, .vmul = s_vmul,
    .vadd = s_vadd, .vexp = s_vexp, .subscale = s_subscale, .divs = s_divs,
    .prepare = NULL, .rowdots = s_rowdots, .gemm_acc = s_gemm_acc, .dots = s_dots, .kda_rows_decay = s_kda_rows_decay,
    .kda_rows_write = s_kda_rows_write, .silu = s_silu, .situ = s_situ, .sigmoid_mul = s_sigmoid_mul,
    .kda_rows_write_decay = s_kda_rows_write_decay,
};

/* ---- products --------------------------------------------------------------- */

float k_dot(const float *w, const float *x, int n) { return k_ops()->dot(w, x, n); }

/* Threads split rows, never a dot: every dot is computed whole by one thread,
 * so the bits never depend on the thread count or on which thread ran which
 * rows. A batch of products is cut into items (a run of rows of one job,
 * about K_ITEM_MACS multiply-adds, a multiple of 16 rows) that the threads of
 * ONE parallel region take in turn (dynamic: a thread that the OS delays
 * simply takes fewer items). Small batches stay on the calling thread: a
 * team start costs more than the work. The bar is per thread of the team, as
 * a team's start grows with it: on a Zen 4 VM with 2 threads, 256K
 * multiply-adds as the bar kept most of a models/default token's products on
 * one thread, and 64K decoded 1.2x faster. */
#define K_ROW_ALIGN 16
#define K_ITEM_MACS (64.0 * 1024)
#define K_PAR_MACS_PER_THREAD (32.0 * 1024)

typedef struct {
    int job, r0, r1;
} k_item;

/* Rows per item of a job: about K_ITEM_MACS multiply-adds, a multiple of 16. */
static int item_rows(const k_prod *J) {
    double per_row = (double)J->W->cols * (double)J->n;
    double rb = K_ITEM_MACS / (per_row > 1 ? per_row : 1);
    if (rb > 1 << 20) rb = 1 << 20;
    int r = ((int)rb + K_ROW_ALIGN - 1) / K_ROW_ALIGN * K_ROW_ALIGN;
    return r < K_ROW_ALIGN ? K_ROW_ALIGN : r;
}

static void run_products(const k_prod *jobs, int nj, const int *r0s, const int *r1s) {
    const k_vops *ops = k_ops();
    double work = 0;
    size_t nitems = 0;
    for (int i = 0; i < nj; i++) {
        if (jobs[i].n <= 0 || r1s[i] <= r0s[i]) continue;
        work += (double)(r1s[i] - r0s[i]) * (double)jobs[i].W->cols * (double)jobs[i].n;
        int rb = item_rows(&jobs[i]);
        nitems += (size_t)((r1s[i] - r0s[i] + rb - 1) / rb);
    }
    if (work <= 0) return;
    /* the items, each job's prepared input and where it starts: the calling
     * thread's scratch (a decode makes thousands of small products a token) */
    size_t prep = 0, ib = ((nitems * sizeof(k_item) + 63) / 64) * 64;
    char *mem = k_scratch(K_SCRATCH_ITEMS, ib + (size_t)nj * (sizeof(void *) + sizeof(size_t)));
    k_item *it = (k_item *)mem;
    const void **aux = (const void **)(mem + ib);
    size_t *at = (size_t *)(aux + nj);
    for (int i = 0; i < nj; i++) {
        size_t f = ops->prepare && jobs[i].n > 0 && r1s[i] > r0s[i] ? ops->prepare(jobs[i].W, jobs[i].X, jobs[i].n, NULL)
                                                                      : 0;
        at[i] = f ? prep : SIZE_MAX;
        prep += (f + 15) / 16 * 16; /* each copy 64-byte aligned */
    }
    float *pbuf = prep ? k_scratch(K_SCRATCH_PREP, prep * sizeof(float)) : NULL;
    int ni = 0;
    for (int i = 0; i < nj; i++) {
        aux[i] = NULL;
        if (jobs[i].n <= 0 || r1s[i] <= r0s[i]) continue;
        if (at[i] != SIZE_MAX) {
            ops->prepare(jobs[i].W, jobs[i].X, jobs[i].n, pbuf + at[i]);
            aux[i] = pbuf + at[i];
        }
        int rb = item_rows(&jobs[i]);
        for (int r = r0s[i]; r < r1s[i]; r += rb)
            it[ni++] = (k_item){i, r, r + rb < r1s[i] ? r + rb : r1s[i]};
    }
#pragma omp parallel for schedule(dynamic, 1) if (work > K_PAR_MACS_PER_THREAD * omp_get_max_threads() && ni > 1)
    for (int q = 0; q < ni; q++) {
        const k_prod *J = &jobs[it[q].job];
        ops->rowdots(J->W, J->X, J->n, J->Y, it[q].r0, it[q].r1, aux[it[q].job]);
    }
}

void k_products(const k_prod *jobs, int njobs) {
    if (njobs <= 0) return;
    int *r0 = k_scratch(K_SCRATCH_JOBS, 2 * (size_t)njobs * sizeof *r0), *r1 = r0 + njobs;
    for (int i = 0; i < njobs; i++) {
        r0[i] = 0;
        r1[i] = jobs[i].W->rows;
    }
    run_products(jobs, njobs, r0, r1);
}

uint64_t k_mat_bytes(const k3_mat *W, int rows) {
    uint64_t n = (uint64_t)(rows > 0 ? rows : 0) * (uint64_t)W->cols;
    switch (W->type) {
    case KW_F32: return n * 4;
    case KW_BF16: return n * 2;
    case KW_MXFP4: return n / 2 + n / (uint64_t)(W->group > 0 ? W->group : 32);
    }
    return 0;
}

void k_products_rows(const k_prod *jobs, int njobs, const int *r0, const int *r1) {
    if (njobs > 0) run_products(jobs, njobs, r0, r1);
}

void k_row_share(int rows, int part, int parts, int *r0, int *r1) {
    int64_t units = ((int64_t)rows + K_ROW_ALIGN - 1) / K_ROW_ALIGN;
    int64_t a = units * part / parts * K_ROW_ALIGN, b = units * (part + 1) / parts * K_ROW_ALIGN;
    *r0 = (int)(a < rows ? a : rows);
    *r1 = (int)(b < rows ? b : rows);
}

void k_matvec(const k3_mat *W, const float *x, float *y) {
    k_prod j = {W, x, 1, y};
    int r0 = 0, r1 = W->rows;
    run_products(&j, 1, &r0, &r1);
}

void k_matvec_rows(const k3_mat *W, const float *x, float *y, int r0, int r1) {
    if (r0 < 0) r0 = 0;
    if (r1 > W->rows) r1 = W->rows;
    k_prod j = {W, x, 1, y};
    if (r1 > r0) run_products(&j, 1, &r0, &r1);
}

void k_matmul(const k3_mat *W, const float *X, int n, float *Y) {
    k_prod j = {W, X, n, Y};
    int r0 = 0, r1 = W->rows;
    if (n > 0) run_products(&j, 1, &r0, &r1);
}

void k_dots(float *out, const float *x, const float *B, size_t ldb, int rows, int len) {
    if (rows > 0) k_ops()->dots(out, x, B, ldb, rows, len);
}

void k_gemm_acc(float *C, int ldc, int M, int N, const float *A, int lda, int K, const k3_mat *B, int b0) {
    if (M <= 0 || N <= 0 || K <= 0) return;
    const k_vops *ops = k_ops();
    if (B->type == KW_F32) {
        ops->gemm_acc(C, ldc, M, N, A, lda, 1, K, (const float *)B->data + (size_t)b0 * (size_t)B->cols, B->cols);
        return;
    }
    /* other storage: widen the K rows once (exact), then the same product */
    float *Bw = xmalloc_array((size_t)K * (size_t)B->cols, sizeof *Bw);
    for (int k = 0; k < K; k++) k_mat_row(B, b0 + k, Bw + (size_t)k * (size_t)B->cols);
    ops->gemm_acc(C, ldc, M, N, A, lda, 1, K, Bw, B->cols);
    free(Bw);
}

/* ---- elementwise and norms ---------------------------------------------------- */

float k_sum(const float *x, int n) { return k_ops()->sum(x, n); }
/* The square sum is the canonical dot of x with itself (fma per element). */
float k_sumsq(const float *x, int n) { return k_ops()->dot(x, x, n); }

void k_rmsnorm(float *y, const float *x, const float *g, int n, float eps) {
    const k_vops *ops = k_ops();
    float ms = ops->dot(x, x, n) / (float)n;
    float r = sqrtf(ms + eps);
    ops->divs(y, x, r, n);
    if (g) ops->vmul(y, y, g, n);
}

void k_l2norm(float *x, int n, float eps) {
    const k_vops *ops = k_ops();
    float r = sqrtf(ops->dot(x, x, n) + eps);
    ops->divs(x, x, r, n);
}

K3_HOT float k_sigmoid(float x) { return km_sigmoid(x); }
void k_silu(float *x, int n) { k_ops()->silu(x, n); }

void k_situ_glu(float *out, const float *gate, const float *up, int n, float b1, float b2) {
    k_ops()->situ(out, gate, up, n, b1, b2);
}

void k_softmax(float *x, int n) {
    if (n <= 0) return;
    const k_vops *ops = k_ops();
    float m = x[0];
    for (int i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    for (int i = 0; i < n; i++) x[i] -= m;
    ops->vexp(x, x, n);
    float s = ops->sum(x, n);
    ops->divs(x, x, s, n);
}

/* ---- router ------------------------------------------------------------------ */

void k_router_topk(const float *logits, const float *bias, int n, int k, bool renorm, float scale, int *idx,
                   float *w) {
    k_router_select(logits, bias, n, k, renorm, scale, idx, w, NULL, NULL);
}

K3_HOT void k_router_select(const float *logits, const float *bias, int n, int k, bool renorm, float scale, int *idx,
                            float *w, float *s_out, float *cut) {
    if (k > n) k = n;
    float *s = xmalloc_array((size_t)(n > 0 ? n : 1), sizeof *s);
    float *sel = xmalloc_array((size_t)(n > 0 ? n : 1), sizeof *sel);
    unsigned char *taken = xcalloc((size_t)(n > 0 ? n : 1), 1);
    for (int j = 0; j < n; j++) {
        s[j] = km_sigmoid(logits[j]);
        float v = bias ? s[j] + bias[j] : s[j];
        sel[j] = v != v ? -INFINITY : v; /* a NaN score is never preferred */
    }
    /* k passes of "best remaining": strict > keeps the lowest index on ties. */
    for (int i = 0; i < k; i++) {
        int best = -1;
        for (int j = 0; j < n; j++)
            if (!taken[j] && (best < 0 || sel[j] > sel[best])) best = j;
        taken[best] = 1;
        idx[i] = best;
        w[i] = s[best];
    }
    if (cut && k < n) { /* the best one left out */
        int best = -1;
        for (int j = 0; j < n; j++)
            if (!taken[j] && (best < 0 || sel[j] > sel[best])) best = j;
        *cut = sel[best];
    }
    if (s_out) memcpy(s_out, s, (size_t)n * sizeof *s);
    if (renorm && k > 1) {
        float tot = 0;
        for (int i = 0; i < k; i++) tot += w[i];
        tot += 1e-20f;
        for (int i = 0; i < k; i++) w[i] /= tot;
    }
    for (int i = 0; i < k; i++) w[i] *= scale;
    free(s);
    free(sel);
    free(taken);
}

/* ---- per-thread scratch ---------------------------------------------------------------- */

typedef struct {
    void *p[K_SCRATCH_N];
    size_t cap[K_SCRATCH_N];
} scratch_set;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *v) {
    scratch_set *s = v;
    for (int i = 0; i < K_SCRATCH_N; i++) free(s->p[i]);
    free(s);
}

static void scratch_key_make(void) {
    if (pthread_key_create(&scratch_key, scratch_free) != 0) {
        fprintf(stderr, "k3: out of thread-specific keys for the kernels' scratch buffers\n");
        exit(K3_EXIT_RUNTIME);
    }
}

void *k_scratch(k_scratch_slot slot, size_t bytes) {
    pthread_once(&scratch_once, scratch_key_make);
    scratch_set *s = pthread_getspecific(scratch_key);
    if (!s) {
        s = xcalloc(1, sizeof *s);
        if (pthread_setspecific(scratch_key, s) != 0) {
            fprintf(stderr, "k3: cannot keep the kernels' per-thread scratch buffer\n");
            exit(K3_EXIT_RUNTIME);
        }
    }
    if (bytes > s->cap[slot]) {
        free(s->p[slot]);
        s->p[slot] = xmalloc_aligned(bytes);
        s->cap[slot] = bytes;
    }
    return s->p[slot];
}
