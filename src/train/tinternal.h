/* tinternal.h: structures shared by the training module's files: the
 * model's (train.c, tkda.c, tmla.c, tmoe.c, optim.c, ckpt.c) and the run's
 * (trainer.c the loop, rundir.c its directory's files, lossplot.c loss.svg).
 * Not a public header. */
#ifndef K3_TRAIN_TINTERNAL_H
#define K3_TRAIN_TINTERNAL_H

#include <jansson.h>

#include "tokenizer/tokenizer.h"
#include "train/data.h"
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

/* Saved activations: the model graph's records (model/records.h k3_model_rec,
 * k3_layer_rec, filled by k3_forward_rec), N = B*T rows. */
typedef k3_kda_rec kda_acts;
typedef k3_mla_rec mla_acts;
typedef k3_mlp_rec mlp_acts;
typedef k3_moe_rec moe_acts;

struct tm_acts {
    int cap;             /* rows allocated */
    int B, T;            /* of the last forward */
    int32_t *tok;        /* [B][T+1] copy */
    int *tgt;            /* [N] */
    k3_model_rec rec;    /* every activation the backward reads (rec.l: [L]) */
    size_t *ssave_cap;   /* [L] floats allocated for rec.l[l].kda.Ssave (sized by the KDA mode) */
    /* backward scratch */
    float *dblk;         /* [nblocks][N][E] */
    float *d1, *d2, *d3, *d4; /* [N][E] */
    float *scratch;      /* per-layer backward scratch, large enough for every layer kind */
    size_t scratch_n;
};

/* AttnRes sources of layer l's two AttnRes (blocks completed before it plus
 * the partial; 0: layer 0's attention input is the embedding itself) and of
 * the output AttnRes. */
static inline int tm_src_attn(int l, int S) { return l ? (l + S - 1) / S + 1 : 0; }
static inline int tm_src_mlp(int l, int S) { return l / S + 2; }

/* The mode of every training GEMM of m (linear layers, BF16 attention,
 * Newton-Schulz): m->bf16 is the one place it is set. */
static inline k_gemm_mode tm_gemm_mode(const tmodel *m) { return m->bf16 ? K_GEMM_BF16 : K_GEMM_F32; }

/* The KDA form the kernels are asked for: 0 (recurrent) or tmodel.kda_chunk,
 * at most TM_MAX_KDA_CHUNK (tkda.c). */
int tm_kda_chunk(const tmodel *m);

/* Per-layer backward entry points; x is the normed layer input [N][E]. */
size_t kda_scratch(const tmodel *m, int N);
void kda_alloc(const tmodel *m, kda_acts *a, int cap);
/* Floats of the states the forward saves for B sequences of T (Ssave). */
size_t kda_ssave_floats(const tmodel *m, int B, int T);
void kda_free(kda_acts *a);
/* dx overwritten; scratch of kda_scratch floats. */
void kda_backward(tmodel *m, const tm_layer *ly, kda_acts *a, const float *x, const float *dout,
                  float *dx, int B, int T, float *scratch);

size_t mla_scratch(const tmodel *m, int N);
void mla_alloc(const tmodel *m, mla_acts *a, int cap, int B, int T);
void mla_free(mla_acts *a);
void mla_backward(tmodel *m, const tm_layer *ly, mla_acts *a, const float *x, const float *dout,
                  float *dx, int B, int T, float *scratch);

size_t mlp_scratch(const tmodel *m, int N, int width);
void mlp_alloc(mlp_acts *a, int cap, int width);
void mlp_free(mlp_acts *a);
/* out is overwritten with the sublayer output; the backward overwrites dx
 * (mlp_backward adds to it when accumulate). */
void mlp_backward(tmodel *m, const mlp_w *w, mlp_acts *a, int width, const float *x, const float *dout,
                  float *dx, int N, float *scratch, bool accumulate);

size_t moe_scratch(const tmodel *m, int N);
void moe_alloc(const tmodel *m, moe_acts *a, int cap);
void moe_free(moe_acts *a);
/* Training's bookkeeping after a forward: MoE layer ly's expert loads and,
 * when recording, its Quantile Balancing margins (s - cut per token). */
void moe_account(tmodel *m, const tm_layer *ly, const moe_acts *a, int N);
void moe_backward(tmodel *m, const tm_layer *ly, moe_acts *a, const float *x, const float *dout,
                  float *dx, int N, float *scratch);

/* ---- the training run --------------------------------------------------------------- */

/* One `k3 train` run: its settings, model, optimiser, data and the state of
 * its directory (k3_train_run owns it). */
typedef struct {
    ttrain_opts o;
    char *config_text;
    k3_config cfg;
    tmodel m;
    topt opt;
    k3_shard train, val;
    k3_tokenizer *tok;   /* the data directory's tokenizer: bytes per token, sample text */
    int eot;             /* <|endoftext|>: samples start from it and stop at it (-1: none) */
    int B, T, A;
    int64_t start, end, total;
    uint64_t seed;
    double best_loss;
    int64_t best_step, ckpt_step;
    char *train_json;
    char *init_from;     /* the checkpoint --init started this run from, and its step (provenance) */
    int64_t init_step;
    char *init_data;     /* the data directory that checkpoint was trained on (its tokenizer) */
    int metrics_fd, samples_fd;
    double started;
    json_t *latest, *latest_eval;
    /* history for loss.svg */
    int64_t *hs, *he;
    double *hl, *hv;
    size_t nh, ne, caph, cape;
    const char *phase;
    bool resumed;
    int64_t resumed_from;
    int64_t *step_load;
    int64_t val_windows;
    /* data parallel (several ranks under mpirun): this rank computes units
     * (micro-batches) [u0, u0 + k) of every step; only the writer (rank 0)
     * writes the run directory. gunit: the units' gradients after the first
     * (rank 0: one scratch for its running fold); qb_all: every rank's
     * Quantile Balancing margins of a step, in unit order. */
    int ranks, me, k, u0;
    bool writer;
    float **gunit;
    int ngunit;
    double *uloss;
    float *qb_all;
    bool stop;     /* the stop request as agreed after the last step (g_stop may change any time) */
} trun;

/* rundir.c: the run directory (docs/run-dir.md). trun_write_state and
 * tplot_write_svg do nothing on a rank that is not the writer; the trainer
 * calls the other writers on the writer alone. */
double trun_wall(void);                                  /* Unix time of a record */
char *trun_path(const trun *r, const char *name);        /* NAME in the output directory */
json_t *trun_jnum(double v);                             /* a number, null if not finite */
/* Appends one record as a single write. */
int trun_append_line(int fd, json_t *rec, const char *what, k3_err *err);
/* s[0..n) with every sequence that is not valid UTF-8 replaced by U+FFFD. */
char *trun_utf8_clean(const uint8_t *s, size_t n);
int trun_write_state(trun *r, const char *status, const char *error, k3_err *err);
/* Removes the k3-sample-PID-* folders of dead processes in tdir. */
void trun_remove_stale_samples(const char *tdir);
/* Fills what the run has not set (0) from a checkpoint's train_json; -1 if
 * it is not JSON. */
int trun_parse_train_json(trun *r, const char *text);
char *trun_make_train_json(const trun *r);
/* Creates the directory (a fresh run refuses one that holds a run), starts
 * or trims the .jsonl files, opens them for appending (the writer only). */
int trun_open_dir(trun *r, k3_err *err);

/* lossplot.c: the loss history and loss.svg */
void tplot_add_train(trun *r, int64_t step, double loss);
void tplot_add_eval(trun *r, int64_t step, double loss);
int tplot_write_svg(trun *r, k3_err *err);

#endif
