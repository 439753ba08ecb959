/* train.h: training a K3-architecture model in C (the public header of the
 * training module; data.h is the token-shard side, owned separately).
 *
 * The model keeps every parameter in ONE flat f32 buffer (w) in the canonical
 * order of the parameter table, with a gradient buffer (g) of the same layout;
 * names are the released tensor names, so export maps one to one. The router's
 * e_score_correction_bias is not a parameter: it lives in `bias`, receives no
 * gradient and is set by Quantile Balancing.
 *
 * One micro-batch is B sequences of T+1 tokens (inputs t[0..T-1], targets
 * t[1..T]). tm_forward saves every activation the backward needs; tm_backward
 * ADDS the gradient of (scale * summed cross-entropy) to g, so accumulation is
 * repeated forward/backward pairs with scale = 1/(tokens per optimiser step). */
#ifndef K3_TRAIN_TRAIN_H
#define K3_TRAIN_TRAIN_H

#include "formats/config.h"
#include "model/source.h"
#include "util/common.h"

/* ---- parameter table ------------------------------------------------------- */
typedef enum {
    TG_ADAMW = 0,   /* AdamW with weight decay (embeddings, head, conv, pseudo-queries) */
    TG_ADAMW_ND,    /* AdamW, no weight decay (norm gains, A_log, dt_bias) */
    TG_MUON,        /* Muon on the whole 2-D matrix */
    TG_MUON_HEADS,  /* Per-Head Muon: each row block orthogonalised on its own */
} tgroup;

#define TM_MAX_BLOCKS 256

/* Bounds of the trainer's fixed-size per-row scratch; tm_build refuses a
 * config beyond them (K3_EXIT_USAGE), so no array is ever overrun. */
#define TM_MAX_ATTNRES_SOURCES 64 /* AttnRes inputs of one layer: blocks + the partial */
#define TM_MAX_TOPK 64            /* num_experts_per_token */
#define TM_MAX_EXPERTS 1024       /* routed experts per MoE layer */
#define TM_MAX_KDA_CHUNK 64       /* --kda-chunk, positions per chunk */

typedef struct {
    char name[112];
    int rank;
    int shape[3];
    size_t off, numel;     /* in floats, into w / g */
    tgroup group;
    int nblocks;           /* TG_MUON_HEADS: row counts of the blocks, in order */
    int *blocks;           /* owned by the model */
    const char *component; /* for the inventory breakdown */
} tparam;

typedef struct tm_layer tm_layer;  /* internal */
typedef struct tm_acts tm_acts;    /* internal */

typedef struct { const char *name; int i; } tm_name; /* one entry of the name index */

typedef struct {
    k3_config cfg;
    int np;
    tparam *params;
    tm_name *by_name;      /* [np] the parameters in name order (tm_find's binary search) */
    size_t nw;             /* total parameter floats */
    float *w, *g;
    int n_moe;             /* MoE layers, in layer order */
    int *moe_layer;        /* [n_moe] layer index of each */
    float *bias;           /* [n_moe][num_experts] router selection biases */
    tm_layer *layers;      /* [L] */
    size_t embed, head, norm, out_res_norm, out_res_proj; /* offsets */
    tm_acts *acts;         /* activation workspace (allocated for cap tokens) */
    float *logits;         /* [B*T][V] after tm_forward (gradient after tm_backward) */
    /* Quantile Balancing: margins s - alpha of every token routed since the last
     * tm_qb_update while qb_record is set: [qb_cap][n_moe][num_experts]. */
    bool qb_record;
    int qb_cap, qb_n;
    float *qb_marg;
    /* routing statistics of the last forward: load [n_moe][num_experts] */
    int64_t *load;
    /* compute modes (tm_build sets the defaults; docs/training-speed.md):
     * kda_chunk 0 runs KDA in the exact recurrent form with BPTT (the
     * reference); > 0 the chunkwise form with chunks of that length (clamped
     * so exp(|gate_lower_bound| * chunk) stays finite in f32). bf16 rounds the
     * operands of the linear-layer products to BF16 (F32 accumulation, F32
     * master weights); off by default. */
    int kda_chunk;
    bool bf16;
} tmodel;

/* Builds the parameter table for cfg and allocates w, g (zero) and bias (zero).
 * Refuses configs the trainer cannot run (K3_EXIT_USAGE, one line). */
int tm_build(tmodel *m, const k3_config *cfg, k3_err *err);
void tm_free(tmodel *m);
/* Initialises every parameter (see train.c for the distributions) from seed. */
void tm_init(tmodel *m, uint64_t seed);
/* A second model sharing m's parameters and biases, with its own activation
 * workspace (sampling at another batch shape without disturbing training). */
void tm_view(tmodel *view, const tmodel *m);
void tm_view_free(tmodel *view);
/* false (and *bad = the parameter index) if any parameter is NaN or infinite. */
bool tm_all_finite(const tmodel *m, int *bad);
/* Index of a parameter by released name, -1 if none. */
int tm_find(const tmodel *m, const char *name);
/* Prints the per-component parameter inventory; returns the total. */
size_t tm_print_inventory(const tmodel *m, FILE *f);
/* Bias vector of MoE layer `layer` (NULL if the layer is dense). */
float *tm_bias(tmodel *m, int layer);
/* The released name of that bias. */
void tm_bias_name(int layer, char *buf, size_t n);

/* The parameters as tensors of the released layout, for model/source.h's
 * k3_model_open_lookup (ctx is a tm_lookup_ctx): layer -1 names the
 * model-level tensors, layer >= 0 a layer's ("self_attn.q_proj.weight"); the
 * router biases are served from `bias`. The data point into w and bias, so
 * a model opened on them computes with the current parameters in place.
 * t->where is the full name, in the context's buffer (valid until its next
 * lookup). */
typedef struct {
    const tmodel *m;
    char where[192];
} tm_lookup_ctx;
int tm_lookup(void *ctx, int layer, const char *name, k3_tensor *t, k3_err *err);

/* Forward over B sequences of T+1 tokens (ids < V); returns the SUM of the
 * B*T cross-entropy terms. Keeps the logits in m->logits. */
double tm_forward(tmodel *m, const int32_t *tokens, int B, int T);
/* g += d(scale * loss_sum)/d params for the last tm_forward. */
void tm_backward(tmodel *m, float scale);
/* Recomputes every MoE layer's bias from the recorded margins (exact
 * (1 - k/n) quantile, mean removed) and clears the record. */
void tm_qb_update(tmodel *m);

/* ---- optimiser ---------------------------------------------------------------- */
typedef struct {
    double lr, min_lr_ratio, warmup_frac, weight_decay, clip;
    double beta1, beta2, eps;   /* AdamW */
    double momentum;            /* Muon (Nesterov) */
    bool muon;                  /* false: AdamW for every parameter */
    int total_steps;
} topt_cfg;

void topt_defaults(topt_cfg *c);

typedef struct {
    topt_cfg c;
    float *m1, *m2;      /* AdamW moments / Muon momentum (m1); same layout as w */
    int64_t step;        /* optimiser steps taken */
} topt;

void topt_init(topt *o, const tmodel *m, const topt_cfg *c);
void topt_free(topt *o);
double topt_lr(const topt_cfg *c, int64_t step);
/* Clips g to norm c.clip, applies one update to w, returns the pre-clip norm.
 * Does not clear g. */
double topt_step(topt *o, tmodel *m, double *lr_out);

/* ---- checkpoints (ckpt.c) ------------------------------------------------------------ */
typedef struct {
    int64_t step, total_steps, data_position, best_step; /* best_step -1: no eval yet */
    double best_val_loss;
    uint64_t seed;
    const char *config_json, *train_json, *data_dir;  /* JSON texts / path */
} tckpt_meta;

struct st_index;
typedef struct {
    struct st_index *ix;
    const char *path;
    tckpt_meta meta;     /* strings point into the index (valid until tckpt_close) */
    int64_t opt_step;
    bool unverified;     /* version 1: no payload checksum to check */
} tckpt;

/* Atomic write of model, router biases, optimiser state and metadata. */
int tckpt_save(const char *path, const tmodel *m, const topt *o, const tckpt_meta *meta, k3_err *err);
/* Opens and validates a checkpoint's header and metadata (K3_EXIT_DATA when it
 * is not one); then tckpt_load fills a model built from meta.config_json, and
 * the optimiser state when o != NULL. */
int tckpt_open(const char *path, tckpt *ck, k3_err *err);
int tckpt_load(tckpt *ck, tmodel *m, topt *o, k3_err *err);
void tckpt_close(tckpt *ck);

/* ---- the training run (trainer.c) ------------------------------------------------------- */
typedef struct {
    const char *data_dir, *output_dir, *config_path, *resume;
    const char *init;                /* weights (only) from this checkpoint; a fresh run */
    int64_t steps, stop_at;          /* stop_at 0: none */
    int batch, accum, seq;           /* 0: default (16, 2, 256) or the checkpoint's */
    double lr;                       /* 0: default or the checkpoint's */
    double weight_decay;             /* used when weight_decay_set, else default or the checkpoint's */
    bool weight_decay_set;
    int eval_interval, sample_interval, sample_tokens, checkpoint_interval;
    int64_t eval_tokens;             /* validation tokens per evaluation (0: default) */
    bool skip_samples;
    bool seed_set;
    uint64_t seed;
    int optimizer;                   /* 0 default/checkpoint, 1 muon, 2 adamw */
    int bf16;                        /* 0 default (off)/checkpoint, 1 on, 2 off */
    int kda_chunk;                   /* 0 default (16)/checkpoint; -1 recurrent reference; > 0 chunk */
    bool quiet;
} ttrain_opts;

int k3_train_run(const ttrain_opts *o, k3_err *err);

/* loss.svg (lossplot.c): the train losses (hs[i], hl[i]) and the validation
 * losses (he[i], hv[i]) against the step, written atomically to path;
 * non-finite values are skipped. */
int tplot_loss_svg(const char *path, const int64_t *hs, const double *hl, size_t nh, const int64_t *he,
                   const double *hv, size_t ne, k3_err *err);

#endif
