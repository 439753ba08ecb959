/* cmd_inspect.c: `k3 inspect MODEL_DIR [--json]`, the census of a checkpoint.
 *
 * Every tensor is put in one class by its name (k3-checkpoint-format.md
 * section 3; the language_model. prefix of released names is optional):
 *   routed experts   layers.L.block_sparse_moe.experts.E.*
 *   shared experts   layers.L.block_sparse_moe.shared_experts.*
 *   router + latent  the rest of block_sparse_moe (router, its bias, the latent
 *                    down/up projections and routed_expert_norm)
 *   attention        layers.L.self_attn.*
 *   dense MLP        layers.L.mlp.*
 *   AttnRes          *_res_norm / *_res_proj (per layer and output)
 *   embeddings/head  model.embed_tokens, lm_head
 *   norms/other      everything else (layer norms, final norm, unknown names)
 *   vision           vision_tower.*, mm_projector.* (not counted in the text figures)
 * Parameters: a U8 *.weight_packed tensor holds two MXFP4 codes per byte; its
 * *.weight_scale companion holds scales, not parameters. Everything else
 * counts one parameter per element. The resident floor and the always-active
 * parameters are the text totals less the routed experts. */
#include "formats/names.h"
#include "cli/commands.h"
#include "formats/config.h"
#include "formats/safetensors.h"
#include "model/model.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *const cmd_inspect_help =
    "usage: k3 inspect MODEL_DIR [--json]\n"
    "\n"
    "Census of a checkpoint directory (or one .safetensors file): files and bytes,\n"
    "bytes and parameters by class (routed experts, shared experts, MoE router and\n"
    "latent projections, attention, dense MLP, AttnRes, embeddings/head,\n"
    "norms/other; vision tower and projector apart), the resident floor (all text\n"
    "tensors but the routed experts), always-active parameters, routed-expert size,\n"
    "per-layer trunk bytes, the layer map (K = KDA, M = MLA) and a dtype histogram.\n"
    "Every header is validated; model.safetensors.index.json, when present, is\n"
    "cross-checked; config.json, when present, is read strictly and checked against\n"
    "the tensors (embedding shape, layer map, dense layers).\n"
    "\n"
    "  --json   print the census as one JSON object\n"
    "\n"
    "exit codes: 0 ok; 1 I/O error; 2 usage, missing path, no shards or invalid\n"
    "config.json; 4 checkpoint data error (bad header, index or shape mismatch)\n";

enum { C_ROUTED, C_SHARED, C_ROUTER, C_ATTN, C_DENSE, C_ATTNRES, C_EMBED, C_OTHER, C_VISION, NCLASS };
static const char *const class_label[NCLASS] = {
    "routed experts", "shared experts", "router + latent", "attention", "dense MLP",
    "AttnRes",        "embeddings/head", "norms/other",    "vision/projector"};
static const char *const class_key[NCLASS] = {
    "routed_experts", "shared_experts", "moe_router_latent", "attention", "dense_mlp",
    "attnres",        "embeddings_head", "norms_other",      "vision"};

typedef struct {
    uint64_t tensors, bytes, params;
} tally;

typedef struct {
    uint64_t bytes, lo, hi;
    int shard;
    bool used, split; /* split: spans two shards */
} span;

typedef struct {
    bool present, kda, mla, dense, moe;
    span trunk;
    span *ex;   /* per routed expert */
    int nex;    /* highest expert index + 1 */
} layer_info;

static void span_add(span *s, const st_tensor *t) {
    if (!s->used) {
        s->used = true;
        s->lo = t->offset;
        s->hi = t->offset + t->nbytes;
        s->shard = t->shard;
    } else {
        if (t->shard != s->shard) s->split = true;
        if (t->offset < s->lo) s->lo = t->offset;
        if (t->offset + t->nbytes > s->hi) s->hi = t->offset + t->nbytes;
    }
    s->bytes += t->nbytes;
}
static bool span_contiguous(const span *s) { return !s->split && s->hi - s->lo == s->bytes; }

/* "1234567" -> "1,234,567" in one of a few rotating buffers. */
static const char *commas(uint64_t v) {
    static char buf[8][32];
    static int k;
    char tmp[32], *out = buf[k++ & 7];
    int n = snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v), j = 0;
    for (int i = 0; i < n; i++) {
        if (i && (n - i) % 3 == 0) out[j++] = ',';
        out[j++] = tmp[i];
    }
    out[j] = 0;
    return out;
}

/* Parses "<digits>." at *p; returns the number or -1. */
static long parse_index(const char **p, long max) {
    const char *s = *p;
    long v = 0;
    if (*s < '0' || *s > '9') return -1;
    while (*s >= '0' && *s <= '9') {
        v = v * 10 + (*s++ - '0');
        if (v >= max) return -1;
    }
    if (*s != '.') return -1;
    *p = s + 1;
    return v;
}

static bool starts(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }
static bool ends(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

#define MAX_EXPERTS (1 << 20)

/* Classifies t; sets *layer (or -1) and *expert (or -1). */
static int classify(const char *name, long *layer, long *expert) {
    *layer = *expert = -1;
    if (starts(name, "vision_tower.") || starts(name, "mm_projector.")) return C_VISION;
    const char *n = starts(name, K3N_HEAD_PARENT) ? name + strlen(K3N_HEAD_PARENT) : name;
    if (!strcmp(n, K3N_HEAD) || !strcmp(n, K3N_PREFIX_PLAIN K3N_EMBED)) return C_EMBED;
    if (starts(n, K3N_PREFIX_PLAIN "output_attn_res_")) return C_ATTNRES;
    if (!starts(n, K3N_PREFIX_PLAIN "layers.")) return C_OTHER;
    const char *r = n + strlen(K3N_PREFIX_PLAIN "layers.");
    long L = parse_index(&r, K3_MAX_LAYERS);
    if (L < 0) return C_OTHER;
    *layer = L;
    if (starts(r, K3N_EXPERTS)) {
        const char *e = r + strlen(K3N_EXPERTS);
        *expert = parse_index(&e, MAX_EXPERTS);
        return *expert >= 0 ? C_ROUTED : C_OTHER;
    }
    if (starts(r, K3N_SHARED ".")) return C_SHARED;
    if (starts(r, K3N_MOE)) return C_ROUTER;
    if (starts(r, K3N_ATTN)) return C_ATTN;
    if (starts(r, K3N_MLP ".")) return C_DENSE;
    if (starts(r, "self_attention_res_") || starts(r, "mlp_res_")) return C_ATTNRES;
    return C_OTHER;
}

static uint64_t params_of(const st_tensor *t) {
    if (t->dtype == ST_U8 && ends(t->name, K3N_PACKED)) return 2 * (uint64_t)t->numel;
    if (t->dtype == ST_U8 && ends(t->name, K3N_SCALE)) return 0;
    return (uint64_t)t->numel;
}

int cmd_inspect(int argc, char **argv) {
    const char *dir = NULL;
    bool as_json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) as_json = true;
        else if (argv[i][0] == '-' && argv[i][1]) return k3_usage_error("inspect", "unknown option '%s'", argv[i]);
        else if (!dir) dir = argv[i];
        else return k3_usage_error("inspect", "more than one MODEL_DIR given");
    }
    if (!dir) return k3_usage_error("inspect", "MODEL_DIR is required");

    k3_err err = {0};
    st_index *ix = NULL;
    int rc = st_open(dir, &ix, &err);
    if (rc) return k3_report(&err);

    /* config.json when the model directory has one */
    k3_config *cfg = NULL;
    char cpath[4096] = "";
    struct stat st;
    if (stat(dir, &st) == 0 && S_ISDIR(st.st_mode)) {
        int w = snprintf(cpath, sizeof cpath, "%s/config.json", dir);
        if (w < 0 || (size_t)w >= sizeof cpath) {
            st_close(ix);
            return k3_usage_error("inspect", "path too long");
        }
        if (stat(cpath, &st) == 0) {
            cfg = xmalloc(sizeof *cfg);
            if ((rc = k3_config_load(cpath, cfg, &err)) || (rc = k3_config_check_index(cfg, ix, &err))) {
                free(cfg);
                st_close(ix);
                return k3_report(&err);
            }
        } else {
            cpath[0] = 0;
        }
    }

    tally cls[NCLASS] = {{0}};
    tally dt[ST_NDTYPES] = {{0}};
    layer_info *lay = xcalloc(K3_MAX_LAYERS, sizeof *lay);
    int nlayers = 0;
    size_t n = st_count(ix);
    for (size_t i = 0; i < n; i++) {
        const st_tensor *t = st_at(ix, i);
        long L, E;
        int c = classify(t->name, &L, &E);
        cls[c].tensors++;
        cls[c].bytes += t->nbytes;
        cls[c].params += params_of(t);
        dt[t->dtype].tensors++;
        dt[t->dtype].bytes += t->nbytes;
        if (L < 0) continue;
        layer_info *li = &lay[L];
        li->present = true;
        if (L + 1 > nlayers) nlayers = (int)L + 1;
        if (c == C_ROUTED) {
            if (E >= li->nex) {
                int cap = li->nex ? li->nex : 8;
                while (cap <= E) cap *= 2;
                li->ex = xrealloc_array(li->ex, (size_t)cap, sizeof *li->ex);
                memset(li->ex + li->nex, 0, (size_t)(cap - li->nex) * sizeof *li->ex);
                li->nex = cap;
            }
            span_add(&li->ex[E], t);
            li->moe = true;
            continue;
        }
        span_add(&li->trunk, t);
        const char *a = strstr(t->name, ".self_attn.");
        if (a) {
            a += 11;
            if (starts(a, "q_proj.") || starts(a, "A_log") || starts(a, "f_a_proj.")) li->kda = true;
            if (starts(a, "q_a_proj.") || starts(a, "kv_b_proj.") || starts(a, "kv_a_proj_with_mqa.")) li->mla = true;
        }
        if (c == C_DENSE) li->dense = true;
        if (c == C_ROUTER || c == C_SHARED) li->moe = true;
    }

    /* routed experts: count, sizes, contiguity */
    uint64_t nexp = 0, emin = UINT64_MAX, emax = 0, econtig = 0, eparams = 0;
    for (int L = 0; L < nlayers; L++)
        for (int e = 0; e < lay[L].nex; e++) {
            const span *s = &lay[L].ex[e];
            if (!s->used) continue;
            nexp++;
            if (s->bytes < emin) emin = s->bytes;
            if (s->bytes > emax) emax = s->bytes;
            econtig += span_contiguous(s);
        }
    if (nexp) eparams = cls[C_ROUTED].params / nexp;
    bool eparams_exact = nexp && cls[C_ROUTED].params % nexp == 0 && emin == emax;

    /* layer map from the tensors, checked against the config */
    char *map = xmalloc((size_t)nlayers + 1);
    int nk = 0, nm = 0, ndense = 0, nmoe = 0;
    for (int L = 0; L < nlayers; L++) {
        layer_info *li = &lay[L];
        map[L] = !li->present ? '-' : li->kda && li->mla ? '?' : li->kda ? 'K' : li->mla ? 'M' : '-';
        nk += map[L] == 'K';
        nm += map[L] == 'M';
        ndense += li->dense;
        nmoe += li->moe && !li->dense;
    }
    map[nlayers] = 0;
    rc = K3_OK;
    for (int L = 0; L < nlayers && rc == K3_OK; L++)
        if (map[L] == '?')
            rc = k3_fail(&err, K3_EXIT_DATA, "%s: layer %d holds both KDA and MLA attention tensors", dir, L);
        else if (lay[L].dense && lay[L].moe)
            rc = k3_fail(&err, K3_EXIT_DATA, "%s: layer %d holds both a dense MLP and a MoE", dir, L);
    if (cfg && rc == K3_OK) {
        if (nlayers != cfg->num_layers)
            rc = k3_fail(&err, K3_EXIT_DATA, "%s: tensors cover %d layers but %s says num_hidden_layers %d", dir,
                         nlayers, cpath, cfg->num_layers);
        for (int L = 0; L < nlayers && rc == K3_OK; L++) {
            if (map[L] != cfg->layer_kind[L])
                rc = k3_fail(&err, K3_EXIT_DATA, "%s: layer %d has %s tensors but %s makes it %s", dir, L,
                             map[L] == 'K' ? "KDA" : map[L] == 'M' ? "MLA" : "no attention", cpath,
                             cfg->layer_kind[L] == 'K' ? "KDA" : "MLA");
            else if (lay[L].dense != cfg->layer_dense[L])
                rc = k3_fail(&err, K3_EXIT_DATA, "%s: layer %d is %s in the tensors but %s in %s", dir, L,
                             lay[L].dense ? "dense" : "MoE", cfg->layer_dense[L] ? "dense" : "MoE", cpath);
        }
    }
    if (rc) {
        k3_report(&err);
        goto out;
    }

    uint64_t file_bytes = 0, tensor_bytes = 0;
    for (int s = 0; s < st_nshards(ix); s++) file_bytes += st_shard_at(ix, s)->file_size;
    for (int c = 0; c < NCLASS; c++) tensor_bytes += cls[c].bytes;
    tally text = {0};
    for (int c = 0; c < C_VISION; c++) {
        text.tensors += cls[c].tensors;
        text.bytes += cls[c].bytes;
        text.params += cls[c].params;
    }
    uint64_t active = text.params - cls[C_ROUTED].params, floor_bytes = text.bytes - cls[C_ROUTED].bytes;

    if (as_json) {
        json_t *o = json_object();
        json_object_set_new(o, "path", json_string(dir));
        json_object_set_new(o, "shards", json_integer(st_nshards(ix)));
        json_object_set_new(o, "file_bytes", json_integer((json_int_t)file_bytes));
        json_object_set_new(o, "tensor_bytes", json_integer((json_int_t)tensor_bytes));
        json_object_set_new(o, "header_bytes", json_integer((json_int_t)(file_bytes - tensor_bytes)));
        json_object_set_new(o, "tensors", json_integer((json_int_t)n));
        json_t *jc = json_object();
        for (int c = 0; c < NCLASS; c++)
            json_object_set_new(jc, class_key[c], json_pack("{s:I,s:I,s:I}", "tensors", (json_int_t)cls[c].tensors,
                                                            "bytes", (json_int_t)cls[c].bytes, "params",
                                                            (json_int_t)cls[c].params));
        json_object_set_new(o, "classes", jc);
        json_object_set_new(o, "text", json_pack("{s:I,s:I,s:I}", "tensors", (json_int_t)text.tensors, "bytes",
                                                 (json_int_t)text.bytes, "params", (json_int_t)text.params));
        json_object_set_new(o, "always_active_params", json_integer((json_int_t)active));
        json_object_set_new(o, "resident_floor_bytes", json_integer((json_int_t)floor_bytes));
        if (cfg) {
            json_object_set_new(o, "snapshot_kda_bytes", json_integer((json_int_t)k3_state_snapshot_bytes(cfg, 0)));
            json_object_set_new(o, "snapshot_bytes_per_position",
                                json_integer((json_int_t)(k3_state_row_floats(cfg) * 4)));
        }
        json_object_set_new(o, "routed_experts",
                            json_pack("{s:I,s:I,s:I,s:o,s:I}", "count", (json_int_t)nexp, "min_bytes",
                                      (json_int_t)(nexp ? emin : 0), "max_bytes", (json_int_t)emax,
                                      "params_each", eparams_exact ? json_integer((json_int_t)eparams) : json_null(),
                                      "contiguous", (json_int_t)econtig));
        json_object_set_new(o, "layer_map", json_string(map));
        json_t *jl = json_array();
        for (int L = 0; L < nlayers; L++) {
            layer_info *li = &lay[L];
            uint64_t eb = 0, ne = 0;
            for (int e = 0; e < li->nex; e++)
                if (li->ex[e].used) {
                    ne++;
                    eb += li->ex[e].bytes;
                }
            char kind[2] = {map[L], 0};
            json_array_append_new(jl, json_pack("{s:i,s:s,s:s,s:I,s:b,s:I,s:I}", "layer", L, "kind", kind, "mlp",
                                                li->dense ? "dense" : li->moe ? "moe" : "none", "trunk_bytes",
                                                (json_int_t)li->trunk.bytes, "trunk_contiguous",
                                                span_contiguous(&li->trunk), "experts", (json_int_t)ne,
                                                "expert_bytes", (json_int_t)eb));
        }
        json_object_set_new(o, "layers", jl);
        json_t *jd = json_object();
        for (int d = 0; d < ST_NDTYPES; d++)
            if (dt[d].tensors)
                json_object_set_new(jd, st_dtype_name((st_dtype)d),
                                    json_pack("{s:I,s:I}", "tensors", (json_int_t)dt[d].tensors, "bytes",
                                              (json_int_t)dt[d].bytes));
        json_object_set_new(o, "dtypes", jd);
        json_object_set_new(o, "config", cfg ? json_pack("{s:s,s:s}", "path", cpath, "defaults_used",
                                                         cfg->defaults_used)
                                             : json_null());
        char *s = json_dumps(o, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
        json_decref(o);
        if (!s) {
            rc = k3_fail(&err, K3_EXIT_RUNTIME, "inspect: cannot format JSON");
            k3_report(&err);
            goto out;
        }
        puts(s);
        free(s);
        goto out;
    }

    printf("model: %s\n", dir);
    printf("files: %s bytes in %d shard%s (tensor data %s, headers %s)\n", commas(file_bytes), st_nshards(ix), st_nshards(ix) == 1 ? "" : "s",
           commas(tensor_bytes), commas(file_bytes - tensor_bytes));
    printf("tensors: %s (text %s, vision/projector %s)\n", commas(n), commas(text.tensors),
           commas(cls[C_VISION].tensors));
    if (cfg)
        printf("config: %s (defaults taken: %s)\n", cpath, cfg->defaults_used[0] ? cfg->defaults_used : "none");
    else
        printf("config: none (layer map from tensor names only)\n");
    printf("layers: %d (%d KDA, %d MLA; %d dense, %d MoE)\n", nlayers, nk, nm, ndense, nmoe);
    printf("layer map: %s\n\n", map);
    printf("%-18s %10s %22s %20s\n", "class", "tensors", "bytes", "parameters");
    for (int c = 0; c < NCLASS; c++) {
        if (c == C_VISION)
            printf("%-18s %10s %22s %20s\n", "text total", commas(text.tensors), commas(text.bytes),
                   commas(text.params));
        printf("%-18s %10s %22s %20s%s\n", class_label[c], commas(cls[c].tensors), commas(cls[c].bytes),
               commas(cls[c].params), c == C_VISION ? "  (not in the text figures)" : "");
    }
    printf("\nalways-active parameters: %s (text, all but routed experts)\n", commas(active));
    printf("resident floor: %s bytes (text, all but routed experts)\n", commas(floor_bytes));
    if (cfg) /* what one entry of the k3 chat / k3 serve state cache costs (session.h) */
        printf("decode-state snapshot: %s bytes of KDA state + %s bytes per position of MLA rows\n",
               commas(k3_state_snapshot_bytes(cfg, 0)), commas(k3_state_row_floats(cfg) * 4));
    if (nexp && emin == emax)
        printf("routed experts: %s routed experts of exactly %s bytes (%s parameters each); %s stored as one contiguous run\n",
               commas(nexp), commas(emin), eparams_exact ? commas(eparams) : "?", commas(econtig));
    else if (nexp)
        printf("routed experts: %s, sizes from %s to %s bytes; %s stored as one contiguous run\n", commas(nexp),
               commas(emin), commas(emax), commas(econtig));
    else
        printf("routed experts: none\n");
    printf("\ndtype      tensors                  bytes\n");
    for (int d = 0; d < ST_NDTYPES; d++)
        if (dt[d].tensors)
            printf("%-6s %11s %22s\n", st_dtype_name((st_dtype)d), commas(dt[d].tensors), commas(dt[d].bytes));
    if (nlayers) {
        printf("\nlayer kind mlp        trunk bytes  contiguous  experts         expert bytes\n");
        for (int L = 0; L < nlayers; L++) {
            layer_info *li = &lay[L];
            uint64_t eb = 0, ne = 0;
            for (int e = 0; e < li->nex; e++)
                if (li->ex[e].used) {
                    ne++;
                    eb += li->ex[e].bytes;
                }
            printf("%5d  %c   %-5s %16s  %-10s %8s %20s\n", L, map[L], li->dense ? "dense" : li->moe ? "moe" : "-",
                   commas(li->trunk.bytes), span_contiguous(&li->trunk) ? "yes" : "no", commas(ne), commas(eb));
        }
    }
out:
    for (int L = 0; L < K3_MAX_LAYERS; L++) free(lay[L].ex);
    free(lay);
    free(map);
    free(cfg);
    st_close(ix);
    return rc;
}
