/* model_impl.h: the model struct shared by weights.c (binding) and model.c
 * (the forward pass). Not a public header: use model.h. */
#ifndef K3_MODEL_IMPL_H
#define K3_MODEL_IMPL_H

#include "model/model.h"
#include "formats/safetensors.h"

struct k3_model {
    k3_config cfg;            /* num_layers cut to opts.layers */
    float mla_eps;            /* MLA latent-norm epsilon in use */
    int kda_chunk;            /* > 0: chunkwise KDA for multi-token calls */
    int chunk;                /* positions per forward pass (opts.prefill_chunk, default K3_PREFILL_CHUNK) */
    k3_mat embed;             /* [V][E] */
    k3_mat lm_head;           /* [V][E] */
    float *norm;              /* final RMSNorm gain [E] */
    float *out_res_q;         /* final AttnRes folded query [E] */
    k3_layer_w *layers;       /* [cfg.num_layers] */
    k3_owned owned;           /* every allocation made while binding */
    uint64_t mapped_bytes;    /* tensor bytes used in place (mmap / blob) */
    st_index *ix;             /* safetensors shards, NULL for a blob */
    float *blob;              /* the peer blob, NULL for safetensors */
    k3_weight_source src;     /* where layers and experts come from now */
};

#endif
