/* tinternal.h: structures shared by the training model's files (train.c,
 * tkda.c, tmla.c, tmoe.c). Not a public header. */
#ifndef K3_TRAIN_TINTERNAL_H
#define K3_TRAIN_TINTERNAL_H

#include "train/train.h"
#include "train/tops.h"

/* Offsets (in floats) of one layer's tensors in w / g. */
typedef struct {
    size_t qkv, conv, f_a, f_b, A_log, dt_bias, b_proj, g_proj, o_norm, o_proj;
} kda_w;
typedef struct {
    size_t q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o_proj, g_proj;
} mla_w;
typedef struct {
    size_t gate_up, down;   /* dense MLP, or the fused shared experts */
} mlp_w;
typedef struct {
    size_t router, lat_down, lat_norm, lat_up;
    mlp_w shared;
    size_t *w13, *w2;       /* [Ne] per expert: w1|w3 stacked [2I][lat], w2 [lat][I] */
} moe_w;

struct tm_layer {
    char kind;              /* 'K' or 'M' */
    bool dense;
    int moe;                /* ordinal among MoE layers, -1 if dense */
    size_t in_norm, post_norm, attn_res_norm, attn_res_proj, mlp_res_norm, mlp_res_proj;
    kda_w kda;
    mla_w mla;
    mlp_w mlp;
    moe_w moe_w;
};

/* Saved activations. N = B*T rows. The KDA forward is the model graph's
 * (model.h k3_kda_rec names the same arrays). */
typedef struct {
    float *pre;   /* [3][N][P] q, k, v projections before the conv */
    float *cv;    /* [3][N][P] conv outputs before SiLU */
    float *q, *k; /* [N][P] after SiLU and the per-head L2 norm (q unscaled) */
    float *rq, *rk; /* [N][H] L2 inverse norms */
    float *v;     /* [N][P] after SiLU */
    float *beta;  /* [N][H] */
    float *fa;    /* [N][D] */
    float *zb;    /* [N][P] z + dt_bias */
    float *gl;    /* [N][P] log-decay */
    float *o;     /* [N][P] recurrent output (pre-norm) */
    float *ro;    /* [N*H] head norm inverse rms */
    float *gate;  /* [N][P] sigmoid(g_proj x) */
    float *y;     /* [N][P] o_proj input */
    float *Sck;   /* [B][H][nck][D][D] state at every chunk start */
    size_t Sck_cap; /* floats allocated for Sck */
} kda_acts;

typedef k3_mla_rec mla_acts; /* the model graph's MLA record (model.h) */

typedef k3_mlp_rec mlp_acts; /* the model graph's MLP record (model.h) */

typedef k3_moe_rec moe_acts; /* the model graph's LatentMoE record (model.h) */

typedef struct {
    float *a;            /* [N][E] pre-attention AttnRes output (layer 0: NULL, a = p_in) */
    float *al_a, *r_a;   /* [N][m] */
    int m_a;
    float *xin, *rin;    /* [N][E], [N] */
    float *p_mid, *p_out;/* [N][E] */
    float *mm, *al_m, *r_m;
    int m_m;
    float *xm, *rm;
    kda_acts kda;
    mla_acts mla;
    mlp_acts mlp;
    moe_acts moe;
} layer_acts;

struct tm_acts {
    int cap;             /* rows allocated */
    int B, T;            /* of the last forward */
    int32_t *tok;        /* [B][T+1] copy */
    int *tgt;            /* [N] */
    float *h0;           /* [N][E] embedding rows */
    layer_acts *l;       /* [L] */
    float *xf, *al_f, *r_f;  /* final AttnRes output and its saved softmax */
    int m_f;
    float *xn, *rn;      /* final norm output and inverse rms */
    /* backward scratch */
    float *dblk;         /* [nblocks][N][E] */
    float *d1, *d2, *d3, *d4; /* [N][E] */
    float *scratch;      /* per-layer backward scratch, large enough for every layer kind */
    size_t scratch_n;
};

/* Per-layer entry points; x is the normed layer input [N][E], out [N][E]. */
size_t kda_scratch(const tmodel *m, int N);
void kda_alloc(const tmodel *m, kda_acts *a, int cap, int B, int T);
void kda_free(kda_acts *a);
void kda_forward(tmodel *m, const tm_layer *ly, kda_acts *a, const float *x, float *out, int B, int T);
/* dx overwritten; scratch of kda_scratch floats. */
void kda_backward(tmodel *m, const tm_layer *ly, kda_acts *a, const float *x, const float *dout,
                  float *dx, int B, int T, float *scratch);

size_t mla_scratch(const tmodel *m, int N);
void mla_alloc(const tmodel *m, mla_acts *a, int cap, int B, int T);
void mla_free(mla_acts *a);
void mla_forward(tmodel *m, const tm_layer *ly, mla_acts *a, const float *x, float *out, int B, int T);
void mla_backward(tmodel *m, const tm_layer *ly, mla_acts *a, const float *x, const float *dout,
                  float *dx, int B, int T, float *scratch);

size_t mlp_scratch(const tmodel *m, int N, int width);
void mlp_alloc(mlp_acts *a, int cap, int width);
void mlp_free(mlp_acts *a);
/* out is overwritten with the sublayer output; the backward overwrites dx
 * (mlp_backward adds to it when accumulate). */
void mlp_forward(tmodel *m, const mlp_w *w, mlp_acts *a, int width, const float *x, float *out, int N);
void mlp_backward(tmodel *m, const mlp_w *w, mlp_acts *a, int width, const float *x, const float *dout,
                  float *dx, int N, float *scratch, bool accumulate);

size_t moe_scratch(const tmodel *m, int N);
void moe_alloc(const tmodel *m, moe_acts *a, int cap);
void moe_free(moe_acts *a);
void moe_forward(tmodel *m, const tm_layer *ly, moe_acts *a, const float *x, float *out, int N);
void moe_backward(tmodel *m, const tm_layer *ly, moe_acts *a, const float *x, const float *dout,
                  float *dx, int N, float *scratch);

#endif
