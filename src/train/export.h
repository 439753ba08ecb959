/* export.h: a trained model as a model directory in the released layout
 * (k3-checkpoint-format.md sections 2-4), so that `k3 run` (src/model/) loads
 * it unchanged:
 *   config.json        the training config, nested as released (text_config,
 *                      linear_attn_config), plus text_config.quantization_config
 *                      when the routed experts are MXFP4, the stored dtype and the
 *                      tokenizer's bos/eos ids
 *   model.safetensors  every parameter and router bias under its released name
 *   tiktoken.model, tokenizer_config.json   copied from the data directory
 * Every file is written atomically; config.json last, so a directory with a
 * config.json is complete. */
#ifndef K3_TRAIN_EXPORT_H
#define K3_TRAIN_EXPORT_H

#include "train/train.h"

/* ---- MXFP4 (OCP microscaling, E2M1 elements, E8M0 scale per group) -------- */
#define MXFP4_GROUP 32

/* The E2M1 code (0..15, bit 3 the sign) nearest to v (ties to the even code;
 * beyond 6 saturates to +-6; a result of zero is +0, code 0). */
uint8_t mxfp4_code(float v);
/* Quantises one group of 32 values: returns the E8M0 scale byte and fills
 * codes[32]. The exponent is the one of floor(log2(amax)) - 2 + {-1, 0, +1}
 * whose dequantised group has the least squared error (ties: the smaller
 * exponent); an all-zero group gets scale 127 (2^0). */
uint8_t mxfp4_quantize_group(const float *x, uint8_t *codes);
/* A [rows][cols] f32 matrix (cols a multiple of 32) to packed[rows][cols/2]
 * (low nibble = element 2c, high nibble = element 2c+1) and
 * scales[rows][cols/32]. */
void mxfp4_quantize(const float *w, int rows, int cols, uint8_t *packed, uint8_t *scales);

/* ---- export ----------------------------------------------------------------- */
typedef enum { TEX_F32 = 0, TEX_BF16, TEX_MXFP4 } tex_dtype;

typedef struct {
    tex_dtype dtype;        /* trunk matrices: TEX_F32 or TEX_BF16 (vectors stay F32) */
    tex_dtype experts;      /* routed experts: TEX_F32, TEX_BF16 or TEX_MXFP4 */
    const char *tok_dir;    /* tokenizer to copy (tiktoken.model + tokenizer_config.json); NULL: none */
    int64_t step;           /* recorded in the safetensors metadata (-1: none) */
} texport_opts;

/* Writes m (with its router biases) to out_dir (created if missing; one level).
 * config_json is the model config text (as in the training checkpoint).
 * Errors: K3_EXIT_USAGE for a config the chosen dtypes cannot hold (MXFP4 needs
 * expert dims divisible by 32) or an unusable tokenizer, K3_EXIT_RUNTIME for I/O. */
int texport_write(const tmodel *m, const char *config_json, const char *out_dir, const texport_opts *o,
                  k3_err *err);

/* Validation loss over the first windows of T+1 tokens (stride T, at most
 * max_tokens targets) of data_dir/val.bin, computed twice: with the training
 * forward on m (f32) and through the inference engine on the model directory
 * model_dir (the export). bpb uses the text bytes of the target ids (the
 * tokenizer in data_dir; specials count 0 bytes). */
typedef struct {
    double train_loss, engine_loss;  /* mean cross-entropy, nats per token */
    double train_bpb, engine_bpb;
    int64_t tokens, bytes;
} texport_eval;
int texport_evaluate(tmodel *m, const char *model_dir, const char *data_dir, int T, int64_t max_tokens, texport_eval *ev, k3_err *err);

#endif
