/* stream_plan.c: the memory plan of a streamed run (stream.h): what stays
 * resident, what is pinned, the expert cache and batch sizes, from the config
 * and the shard headers alone, before any weight byte is read; and where each
 * routed expert's bytes are in the shards (the layout the expert fetch reads).
 * The weight source that follows the plan is stream.c. */
#include "formats/names.h"
#include "memory/stream_internal.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

void k3_stream_opts_init(k3_stream_opts *o) {
    memset(o, 0, sizeof *o);
    o->trunk_gb = -1;
    o->cache_gb = -1;
    o->policy = XC_LFU;
    o->io_depth = 32;
    o->trunk_depth = 4;
    o->trunk_piece = 2u << 20;
    o->expert_priority = true;
    o->expert_overlap = true;
    o->pin_spread = true;
    const char *d = getenv("K3_DIRECT_IO");
    o->direct = !(d && !strcmp(d, "0"));
    /* tuning knobs for measurements (bench_stream); the defaults are the measured best */
    const char *e;
    if ((e = getenv("K3_TRUNK_DEPTH")) && atoi(e) > 0) o->trunk_depth = atoi(e);
    if ((e = getenv("K3_TRUNK_PIECE_KB")) && atoi(e) >= 4) o->trunk_piece = (uint64_t)atoi(e) << 10;
    if ((e = getenv("K3_EXPERT_PRIORITY"))) o->expert_priority = strcmp(e, "0") != 0;
    if ((e = getenv("K3_EXPERT_OVERLAP"))) o->expert_overlap = strcmp(e, "0") != 0;
    if ((e = getenv("K3_PIN_SPREAD"))) o->pin_spread = strcmp(e, "0") != 0;
}

uint64_t k3s_align4k(uint64_t x) { return (x + K3_DIO_ALIGN - 1) & ~(uint64_t)(K3_DIO_ALIGN - 1); }
static double gb(uint64_t b) { return (double)b / 1e9; }

int k3s_tdtype(st_dtype d, k3_tdtype *out) {
    switch (d) {
    case ST_F32: *out = KT_F32; return 0;
    case ST_F16: *out = KT_F16; return 0;
    case ST_BF16: *out = KT_BF16; return 0;
    case ST_U8: *out = KT_U8; return 0;
    default: return -1;
    }
}

/* ---- where an expert's bytes are ---------------------------------------------
 * Per matrix (w1 gate, w3 up, w2 down): MXFP4 (weight_packed + weight_scale)
 * or an unquantised weight. When all of an expert's tensors form one
 * contiguous run in one shard (the release does this: spec section 1) it is
 * one read; otherwise one read per tensor, each into its own aligned part of
 * the buffer. */

/* The layer is bound without its experts (k3_bind_layer_no_experts), so their
 * shapes and dtypes are checked here, as the binder would. */
static int expert_shape(const st_tensor *t, st_dtype want, bool any_float, int64_t rows, int64_t cols, k3_err *err) {
    if (any_float ? t->dtype != ST_BF16 && t->dtype != ST_F32 : t->dtype != want)
        return k3_fail(err, K3_EXIT_DATA, "%s: dtype %s, expected %s", t->name, st_dtype_name(t->dtype),
                       any_float ? "BF16 or F32 (F16 routed experts cannot be streamed)" : st_dtype_name(want));
    if (t->rank != 2 || t->shape[0] != rows || t->shape[1] != cols)
        return k3_fail(err, K3_EXIT_DATA, "%s: shape does not match the config: expected [%lld, %lld]", t->name,
                       (long long)rows, (long long)cols);
    return K3_OK;
}

int k3s_expert_layout(const k3_config *c, st_index *ix, const char *prefix, int L, int e, const k3_stream_opts *o,
                      xlayout *x, k3_err *err) {
    static const int wnum[3] = {1, 3, 2};
    memset(x, 0, sizeof *x);
    char name[512];
    int group = c->mxfp4_group > 0 ? c->mxfp4_group : 32;
    for (int m = 0; m < 3; m++) {
        int64_t rows = m == XW2 ? c->latent_dim : c->moe_inter, cols = m == XW2 ? c->moe_inter : c->latent_dim;
        int k = snprintf(name, sizeof name, "%slayers.%d." K3N_EXPERT_FMT K3N_PACKED, prefix, L, e,
                         wnum[m]);
        if (k < 0 || (size_t)k >= sizeof name) return k3_fail(err, K3_EXIT_RUNTIME, "tensor name too long");
        const st_tensor *p = st_find(ix, name);
        int rc;
        if (p) {
            snprintf(name + k - 6, sizeof name - (size_t)(k - 6), "scale");
            const st_tensor *s = st_find(ix, name);
            if (!s) return k3_fail(err, K3_EXIT_DATA, "missing tensor %s", name);
            if (cols % 2 || cols % group)
                return k3_fail(err, K3_EXIT_DATA, "%s: %lld inputs is not a multiple of the MXFP4 group %d", p->name,
                               (long long)cols, group);
            if ((rc = expert_shape(p, ST_U8, false, rows, cols / 2, err)) ||
                (rc = expert_shape(s, ST_U8, false, rows, cols / group, err)))
                return rc;
            x->data[m] = x->n;
            x->t[x->n++] = p;
            x->scale[m] = x->n;
            x->t[x->n++] = s;
        } else {
            name[k - 7] = 0; /* ".weight_packed" -> ".weight" */
            const st_tensor *w = st_find(ix, name);
            if (!w) {
                name[k - 7] = '_';
                return k3_fail(err, K3_EXIT_DATA, "missing tensor %s", name);
            }
            if ((rc = expert_shape(w, ST_BF16, true, rows, cols, err))) return rc;
            x->data[m] = x->n;
            x->scale[m] = -1;
            x->t[x->n++] = w;
        }
    }
    for (int i = 0; i < x->n; i++) {
        x->off[i] = x->t[i]->offset;
        x->len[i] = x->t[i]->nbytes;
    }
    if (o && o->tp_experts && o->tp_ranks > 1) { /* this rank's rows of each matrix and its scales */
        uint64_t acc = 0;
        for (int i = 0; i < x->n; i++) {
            const st_tensor *t = x->t[i];
            int r0, r1;
            k_row_share((int)t->shape[0], o->tp_rank, o->tp_ranks, &r0, &r1);
            uint64_t rb = t->nbytes / (uint64_t)t->shape[0];
            x->off[i] = t->offset + (uint64_t)r0 * rb;
            x->len[i] = (uint64_t)(r1 - r0) * rb;
            x->pos[i] = (int64_t)(acc + (x->off[i] & (K3_DIO_ALIGN - 1))) - (int64_t)((uint64_t)r0 * rb);
            acc += x->len[i] ? k3_dio_span(x->off[i], x->len[i]) : 0;
        }
        x->one_run = false;
        x->need = acc ? acc : K3_DIO_ALIGN;
        return K3_OK;
    }
    /* one run? same shard, back to back in some order, float data aligned */
    int ord[6] = {0, 1, 2, 3, 4, 5};
    for (int i = 0; i < x->n; i++) ord[i] = i;
    for (int i = 1; i < x->n; i++)
        for (int j = i; j > 0 && x->t[ord[j]]->offset < x->t[ord[j - 1]]->offset; j--) {
            int tmp = ord[j];
            ord[j] = ord[j - 1];
            ord[j - 1] = tmp;
        }
    bool one = true;
    for (int i = 0; i < x->n && one; i++) {
        const st_tensor *t = x->t[ord[i]];
        if (t->shard != x->t[0]->shard || t->offset % st_dtype_size(t->dtype)) one = false;
        if (i > 0 && t->offset != x->t[ord[i - 1]]->offset + x->t[ord[i - 1]]->nbytes) one = false;
    }
    x->one_run = one;
    if (one) {
        uint64_t start = x->t[ord[0]]->offset & ~(uint64_t)(K3_DIO_ALIGN - 1);
        uint64_t end = x->t[ord[x->n - 1]]->offset + x->t[ord[x->n - 1]]->nbytes;
        for (int i = 0; i < x->n; i++) x->pos[i] = (int64_t)(x->t[i]->offset - start);
        x->need = k3s_align4k(end - start);
    } else {
        uint64_t acc = 0;
        for (int i = 0; i < x->n; i++) {
            const st_tensor *t = x->t[i];
            if (t->offset % st_dtype_size(t->dtype))
                return k3_fail(err, K3_EXIT_DATA, "%s: data offset %llu is not aligned to its dtype", t->name,
                               (unsigned long long)t->offset);
            x->pos[i] = (int64_t)(acc + (t->offset & (K3_DIO_ALIGN - 1)));
            acc += k3_dio_span(t->offset, t->nbytes);
        }
        x->need = acc;
    }
    return K3_OK;
}

/* ---- the plan ------------------------------------------------------------------ */

/* Bytes the binder allocates for a bound layer: widened small vectors (norm
 * gains, conv taps, biases, AttnRes queries), F16 matrices widened to F32.
 * (Layers are bound without their experts: no table of expert matrices.) */
static uint64_t copies_of(const char *name, int rank, const int64_t *shape, st_dtype dt) {
    uint64_t numel = 1;
    for (int i = 0; i < rank; i++) numel *= (uint64_t)shape[i];
    if (rank == 1 || strstr(name, "conv1d") || strstr(name, "_res_proj.") || dt == ST_F16) return numel * 4 + 64;
    return 0;
}

bool k3s_tp_rows(const k3_stream_opts *o, const char *name, int rank, const int64_t *shape, st_dtype dt, int *r0,
                 int *r1) {
    if (o->tp_ranks <= 1 || rank != 2 || shape[0] <= 1 || shape[0] > INT_MAX || dt == ST_F16 ||
        strstr(name, "kv_b_proj") || strstr(name, "f_b_proj") || strstr(name, "conv1d") || strstr(name, "_res_proj.") || strstr(name, K3N_EMBED))
        return false;
    k_row_share((int)shape[0], o->tp_rank, o->tp_ranks, r0, r1);
    return true;
}

/* A mapped tensor's bytes this process touches: under a split trunk only
 * its rows' share of a matrix the products split (k3s_tp_rows). */
static uint64_t touched(const k3_stream_opts *o, const st_tensor *t) {
    int r0, r1;
    if (!k3s_tp_rows(o, t->name, t->rank, t->shape, t->dtype, &r0, &r1)) return t->nbytes;
    return t->nbytes / (uint64_t)t->shape[0] * (uint64_t)(r1 - r0);
}

/* ---- a rank's share of a packed run ---------------------------------------------- */

typedef struct { uint64_t a, b; int i; } want_range;

static int cmp_range(const void *x, const void *y) {
    const want_range *p = x, *q = y;
    return p->a < q->a ? -1 : p->a > q->a ? 1 : p->i - q->i;
}

void k3s_share_make(const k3_trunk_run *run, const k3_stream_opts *o, k3s_share *sh) {
    int nt = run->ntensors;
    size_t cap = (size_t)(nt ? nt : 1);
    memset(sh, 0, sizeof *sh);
    sh->tpos = xcalloc(cap, sizeof *sh->tpos);
    sh->g0 = xcalloc(cap, sizeof *sh->g0);
    sh->g1 = xcalloc(cap, sizeof *sh->g1);
    sh->ext = xcalloc(cap, sizeof *sh->ext);
    want_range *w = xcalloc(cap, sizeof *w);
    int nw = 0;
    for (int i = 0; i < nt; i++) {
        const k3_trunk_tensor *t = &run->tensors[i];
        uint64_t gb, a = t->offset, b = t->offset + t->nbytes;
        int64_t ng = k3_trunk_granule(t, &gb);
        int r0, r1;
        sh->g0[i] = 0;
        sh->g1[i] = ng;
        if (ng > 1 && k3s_tp_rows(o, t->name, t->rank, t->shape, t->dtype, &r0, &r1)) {
            /* the share is whole granules: k_row_share deals whole runs of
             * K3_TRUNK_CRC_ROWS rows, the last part ending at the last row */
            uint64_t rb = t->nbytes / (uint64_t)t->shape[0];
            a = t->offset + (uint64_t)r0 * rb;
            b = t->offset + (uint64_t)r1 * rb;
            sh->g0[i] = r0 / K3_TRUNK_CRC_ROWS;
            sh->g1[i] = r1 > r0 ? (r1 + K3_TRUNK_CRC_ROWS - 1) / K3_TRUNK_CRC_ROWS : sh->g0[i];
        }
        if (a < b) w[nw++] = (want_range){a, b, i};
    }
    qsort(w, (size_t)nw, sizeof *w, cmp_range);
    int *at = xcalloc(cap, sizeof *at);
    for (int k = 0; k < nw; k++) {
        uint64_t a = w[k].a & ~(uint64_t)(K3_DIO_ALIGN - 1), b = k3s_align4k(w[k].b);
        if (b > run->bytes) b = run->bytes;
        k3s_extent *e = sh->n ? &sh->ext[sh->n - 1] : NULL;
        if (e && a <= e->off + e->len) {
            if (b > e->off + e->len) e->len = b - e->off;
        } else {
            sh->ext[sh->n++] = (k3s_extent){.off = a, .len = b - a};
        }
        at[w[k].i] = sh->n - 1;
    }
    for (int k = 0; k < sh->n; k++) {
        sh->ext[k].pos = sh->need;
        sh->need += k3s_align4k(sh->ext[k].len);
        sh->bytes += sh->ext[k].len;
    }
    for (int k = 0; k < nw; k++) {
        const k3s_extent *e = &sh->ext[at[w[k].i]];
        sh->tpos[w[k].i] = (int64_t)e->pos + (int64_t)run->tensors[w[k].i].offset - (int64_t)e->off;
    }
    free(at);
    free(w);
}

void k3s_share_free(k3s_share *sh) {
    free(sh->ext);
    free(sh->tpos);
    free(sh->g0);
    free(sh->g1);
    memset(sh, 0, sizeof *sh);
}

int k3s_share_pieces(const k3s_share *sh, uint64_t piece) {
    int64_t n = 0;
    for (int k = 0; k < sh->n; k++) n += (int64_t)((sh->ext[k].len + piece - 1) / piece);
    return (int)n;
}

void k3s_share_piece(const k3s_share *sh, uint64_t piece, int k, uint64_t *off, uint64_t *len, uint64_t *pos) {
    for (int x = 0; x < sh->n; x++) {
        const k3s_extent *e = &sh->ext[x];
        int64_t np = (int64_t)((e->len + piece - 1) / piece);
        if (k >= np) {
            k -= (int)np;
            continue;
        }
        uint64_t d = (uint64_t)k * piece;
        *off = e->off + d;
        *len = e->len - d < piece ? e->len - d : piece;
        *pos = e->pos + d;
        return;
    }
    *off = *len = *pos = 0;
}

const uint8_t *k3s_share_at(const k3s_share *sh, const uint8_t *buf, int i) {
    /* (integer arithmetic: the address may lie before buf) */
    return (const uint8_t *)((uintptr_t)buf + (uintptr_t)sh->tpos[i]);
}

int k3s_share_check(const k3_trunk_run *run, const k3s_share *sh, const uint8_t *buf) {
    for (int i = 0; i < run->ntensors; i++) {
        const k3_trunk_tensor *t = &run->tensors[i];
        uint64_t gb;
        k3_trunk_granule(t, &gb);
        const uint8_t *base = k3s_share_at(sh, buf, i);
        for (int64_t g = sh->g0[i]; g < sh->g1[i]; g++) {
            uint64_t o = (uint64_t)g * gb, n = t->nbytes - o < gb ? t->nbytes - o : gb;
            if (k3_crc32c(0, base + o, n) != t->gcrc[g]) return i;
        }
    }
    return -1;
}

static int layer_sizes(const k3_config *c, st_index *ix, const k3_trunk *trunk, const k3_stream_opts *o,
                       k3_mem_plan *p, k3_err *err) {
    if (trunk) {
        for (int L = 0; L < c->num_layers; L++) {
            const k3_trunk_run *r = k3_trunk_run_for(trunk, L);
            if (!r)
                return k3_fail(err, K3_EXIT_DATA, "%s/trunk.json: no run for layer %d (packed from another model?)",
                               trunk->dir, L);
            k3s_share sh; /* this rank's share of the run (all of it with one process) */
            k3s_share_make(r, o, &sh);
            p->layer_bytes[L] = sh.bytes;
            k3s_share_free(&sh);
            for (int i = 0; i < r->ntensors; i++)
                p->bind_bytes[L] += copies_of(r->tensors[i].name, r->tensors[i].rank, r->tensors[i].shape,
                                              r->tensors[i].dtype);
        }
    } else {
        for (size_t i = 0; i < st_count(ix); i++) {
            const st_tensor *t = st_at(ix, i);
            int L = k3_trunk_layer_of(t->name);
            if (L < 0 || L >= c->num_layers || !k3_trunk_wants(t->name)) continue;
            p->layer_bytes[L] += touched(o, t);
            p->bind_bytes[L] += copies_of(t->name, t->rank, t->shape, t->dtype);
        }
    }
    for (int L = 0; L < c->num_layers; L++) p->layers_all += p->layer_bytes[L];
    return K3_OK;
}

/* Model-level tensors as the model uses them, mapped from the shards: the
 * whole head every token, one embedding row per distinct token (a page fault
 * maps up to 64 KiB around it), widened norms. */
static uint64_t head_size(const k3_config *c, st_index *ix, const k3_stream_opts *o, int64_t max_pos) {
    uint64_t b = 0;
    for (size_t i = 0; i < st_count(ix); i++) {
        const st_tensor *t = st_at(ix, i);
        if (k3_trunk_layer_of(t->name) >= 0 || !k3_trunk_wants(t->name)) continue;
        if (strstr(t->name, K3N_EMBED) && t->dtype != ST_F16 && c->vocab_size > 0) {
            uint64_t row = t->nbytes / (uint64_t)c->vocab_size, per = row < 65536 ? 65536 : row + 4096;
            uint64_t rows = (uint64_t)(max_pos < c->vocab_size ? max_pos : c->vocab_size);
            b += rows * per < t->nbytes ? rows * per : t->nbytes;
        } else if (t->rank >= 2 && t->shape[0] > 1 && t->dtype != ST_F16) {
            b += touched(o, t); /* the head: its vocabulary rows' share under a split trunk */
        } else {
            b += t->nbytes + (uint64_t)t->numel * 4;
        }
    }
    return b;
}

/* Which P of NL layers are pinned. Spread evenly (layer L when (L+r+1)P/NL
 * passes an integer, for a rotation r), so that between two streamed layers
 * there is at most a little pinned compute: with a prefix, the ring (two
 * layers ahead) is full long before the pinned prefix and the head have
 * computed, and the disk idles for the rest of that compute (measured: the
 * pinned rungs of the ladder). Of the rotations, the one that pins the most
 * bytes (fewest read per token, smallest slots); the prefix [0, P) only when
 * it pins more, or when pin_spread is off. */
static void choose_pinned(int P, int NL, int r, bool *pin) {
    for (int L = 0; L < NL; L++)
        pin[L] = r < 0 ? L < P : (int64_t)(L + r + 1) * P / NL > (int64_t)(L + r) * P / NL;
}

/* Chooses the pinned layers and the ring for a trunk limit: most pinned layers
 * with two slots (reads overlap compute), else with one (no overlap). */
static bool fit_trunk(const k3_config *c, k3_mem_plan *p, double limit, bool spread) {
    int NL = c->num_layers;
    for (int slots = 2; slots >= 1; slots--) {
        for (int P = NL; P >= 0; P--) {
            bool found = false;
            uint64_t best_pin = 0;
            /* candidates: the rotations of the spread pattern, then the prefix (k == NL) */
            for (int k = spread ? 0 : NL; k <= NL; k++) {
                int r = k == NL ? -1 : k;
                uint64_t pin = 0, slot = 0, copy = 0;
                bool set[K3_MAX_LAYERS];
                choose_pinned(P, NL, r, set);
                for (int L = 0; L < NL; L++) {
                    if (set[L]) {
                        pin += k3s_align4k(p->layer_bytes[L]) + p->bind_bytes[L];
                        continue;
                    }
                    if (k3s_align4k(p->layer_bytes[L]) > slot) slot = k3s_align4k(p->layer_bytes[L]);
                    if (p->bind_bytes[L] > copy) copy = p->bind_bytes[L];
                }
                int ns = P == NL ? 0 : (NL - P == 1 ? 1 : slots);
                uint64_t ring = (uint64_t)ns * (slot + copy);
                uint64_t need = p->head_bytes + pin + ring;
                if ((double)need > limit || (found && pin <= best_pin)) continue;
                found = true;
                best_pin = pin;
                p->pinned = P;
                memcpy(p->pin, set, sizeof set);
                p->pinned_bytes = pin;
                p->ring_slots = ns;
                p->slot_bytes = ns ? slot : 0;
                p->ring_bytes = ring;
                p->trunk_bytes = need;
            }
            if (found) return true;
        }
    }
    return false;
}

static uint64_t plan_total(const k3_mem_plan *p) {
    return p->trunk_bytes + p->expert_bytes + p->table_bytes + p->state.total + p->pass_bytes + p->index_bytes;
}

int k3_plan_make(const k3_config *c, st_index *ix, const k3_trunk *trunk, const k3_stream_opts *o,
                 int64_t max_pos, k3_mem_plan *p, k3_err *err) {
    memset(p, 0, sizeof *p);
    p->num_layers = c->num_layers;
    p->num_experts = c->num_experts;
    p->top_k = c->experts_per_token;
    p->max_pos = max_pos;
    p->streamed = trunk != NULL;
    for (int L = 0; L < c->num_layers; L++) p->n_moe += !c->layer_dense[L];
    int rc;
    if (o->experts_only && trunk)
        return k3_fail(err, K3_EXIT_USAGE, "a source of the routed experts alone takes no packed trunk");
    if (!o->experts_only) {
        if ((rc = layer_sizes(c, ix, trunk, o, p, err))) return rc;
        /* (a packed trunk's model-level run is read whole at open, once, for its
         * checksum; of the head's matrix only this rank's rows are kept) */
        p->head_bytes = head_size(c, ix, o, max_pos);
    }
    double tlimit = o->trunk_gb < 0 ? 1e300 : o->trunk_gb * 1e9;
    double xlimit = o->cache_gb < 0 ? 1e300 : o->cache_gb * 1e9;

    /* trunk part */
    if (trunk) {
        if (!fit_trunk(c, p, tlimit, o->pin_spread)) {
            uint64_t big = 0, copy = 0;
            for (int L = 0; L < c->num_layers; L++) {
                if (k3s_align4k(p->layer_bytes[L]) > big) big = k3s_align4k(p->layer_bytes[L]);
                if (p->bind_bytes[L] > copy) copy = p->bind_bytes[L];
            }
            return k3_fail(err, K3_EXIT_BUDGET,
                           "--trunk-gb %.3g: the trunk needs at least %s (model-level tensors %s + one ring "
                           "slot of %s for the largest layer)",
                           o->trunk_gb, k3_size_str(p->head_bytes + big + copy), k3_size_str(p->head_bytes),
                           k3_size_str(big + copy));
        }
    } else if (!o->experts_only) {
        uint64_t copies = 0;
        for (int L = 0; L < c->num_layers; L++) copies += p->bind_bytes[L];
        p->pinned = c->num_layers;
        for (int L = 0; L < c->num_layers; L++) p->pin[L] = true;
        p->pinned_bytes = p->layers_all + copies;
        p->trunk_bytes = p->head_bytes + p->pinned_bytes;
        if ((double)p->trunk_bytes > tlimit)
            return k3_fail(err, K3_EXIT_BUDGET,
                           "--trunk-gb %.3g: the trunk needs %s resident; pack it (k3 pack-trunk MODEL_DIR "
                           "TRUNK_DIR) and run with --trunk TRUNK_DIR to stream it",
                           o->trunk_gb, k3_size_str(p->trunk_bytes));
    }

    /* expert part: the experts this process holds (all, or its share of an
     * expert-parallel job) */
    p->total_experts = 0;
    int most = 0; /* the most held in one layer: what one batch can need */
    const char *prefix = k3_names_prefix(ix);
    for (int L = 0; L < c->num_layers; L++) {
        if (c->layer_dense[L]) continue;
        int here = 0;
        for (int e = 0; e < c->num_experts; e++) {
            if (o->owned && !o->owned[(size_t)L * c->num_experts + e]) continue;
            here++;
            xlayout x;
            if ((rc = k3s_expert_layout(c, ix, prefix, L, e, o, &x, err))) return rc;
            if (x.need > p->expert_buf) p->expert_buf = x.need;
        }
        p->total_experts += here;
        if (here > most) most = here;
    }
    int want_chunk = o->chunk > 0 ? o->chunk : K3_PREFILL_CHUNK;
    if (want_chunk < o->pass_tokens) want_chunk = o->pass_tokens; /* a verifying pass is one chunk */
    p->chunk = want_chunk;
    if (p->total_experts > 0) {
        int k = c->experts_per_token;
        int64_t pool = (int64_t)(xlimit / (double)p->expert_buf);
        if (xlimit >= 1e300 || pool > p->total_experts) pool = p->total_experts;
        int64_t batch = (int64_t)want_chunk * k < most ? (int64_t)want_chunk * k : most;
        if (pool >= p->total_experts) {
            /* every expert fits: nothing is ever evicted, a batch needs no extra buffers */
            p->cache_experts = p->total_experts;
            p->batch_experts = 0;
        } else {
            if (pool < batch && o->chunk > 0)
                return k3_fail(err, K3_EXIT_BUDGET,
                               "--cache-gb %.3g holds %lld expert buffers of %s; a prefill chunk of %d tokens "
                               "needs up to %lld (use a smaller --chunk or a larger --cache-gb)",
                               o->cache_gb, (long long)pool, k3_size_str(p->expert_buf), want_chunk, (long long)batch);
            int floor_chunk = o->pass_tokens > 1 ? o->pass_tokens : 1;
            if (pool < batch && o->pass_tokens > 1) {
                /* a verifying pass must be one chunk: its experts' union has to fit */
                int64_t need = (int64_t)o->pass_tokens * k < most ? (int64_t)o->pass_tokens * k : most;
                if (pool < need)
                    return k3_fail(err, K3_EXIT_BUDGET,
                                   "--cache-gb %.3g holds %lld expert buffers of %s; a verifying pass of %d ids "
                                   "(--speculate %d) needs up to %lld (use a smaller --speculate or a larger "
                                   "--cache-gb)",
                                   o->cache_gb, (long long)pool, k3_size_str(p->expert_buf), o->pass_tokens,
                                   o->pass_tokens - 1, (long long)need);
            }
            while (pool < batch && p->chunk > floor_chunk) {
                p->chunk = p->chunk / 2 > floor_chunk ? p->chunk / 2 : floor_chunk;
                batch = (int64_t)p->chunk * k < most ? (int64_t)p->chunk * k : most;
            }
            if (pool < batch)
                return k3_fail(err, K3_EXIT_BUDGET,
                               "--cache-gb %.3g holds %lld expert buffers of %s; one token needs %lld",
                               o->cache_gb, (long long)pool, k3_size_str(p->expert_buf), (long long)batch);
            p->batch_experts = (int)batch;
            p->cache_experts = pool - batch;
        }
        p->expert_bytes = (uint64_t)(p->cache_experts + p->batch_experts) * p->expert_buf;
        p->table_bytes = (uint64_t)c->num_layers * (uint64_t)c->num_experts * 4 + (uint64_t)p->total_experts * 160 +
                         (uint64_t)p->cache_experts * 96;
    }

    p->state = k3_state_size_chunk(c, p->chunk, max_pos);
    p->pass_bytes = k3_state_pass_bytes(c, o->pass_tokens);
    p->index_bytes = st_footprint(ix);
    p->total = plan_total(p);
    const char *lname;
    uint64_t limit = k3_mem_limit(o->mem_limit, &lname);
    /* without --chunk, a smaller chunk's scratch may fit where the default's does not */
    int floor_chunk = o->pass_tokens > 1 ? o->pass_tokens : 1;
    while (o->chunk <= 0 && p->chunk > floor_chunk && limit && p->total + K3_PLAN_OVERHEAD > limit) {
        p->chunk = p->chunk / 2 > floor_chunk ? p->chunk / 2 : floor_chunk;
        p->state = k3_state_size_chunk(c, p->chunk, max_pos);
        p->total = plan_total(p);
    }
    if (limit && p->total + K3_PLAN_OVERHEAD > limit)
        return k3_fail(err, K3_EXIT_BUDGET,
                       "the memory plan needs %s (trunk %s, experts %s, state %s at %lld positions, speculation "
                       "record %s, checkpoint index %s) + %s overhead but %s is %s: choose a smaller --preset, --trunk-gb or --cache-gb, "
                       "or fewer positions",
                       k3_size_str(p->total), k3_size_str(p->trunk_bytes), k3_size_str(p->expert_bytes + p->table_bytes),
                       k3_size_str(p->state.total), (long long)max_pos, k3_size_str(p->pass_bytes),
                       k3_size_str(p->index_bytes), k3_size_str(K3_PLAN_OVERHEAD),
                       lname, k3_size_str(limit));
    return K3_OK;
}

static void mb_cell(char *buf, size_t n, uint64_t b) {
    if (b >= 1000000000ull) snprintf(buf, n, "%8.3f GB", gb(b));
    else if (b >= 1000000ull) snprintf(buf, n, "%8.1f MB", (double)b / 1e6);
    else snprintf(buf, n, "%8.1f kB", (double)b / 1e3);
}

static const char *hsize(uint64_t b, char *buf, size_t n) {
    mb_cell(buf, n, b);
    while (*buf == ' ') buf++;
    return buf;
}

/* "0-3", "2,5,8,10" or "0-1,3-4,6": the pinned (or streamed) layers. */
static void layer_list(const k3_mem_plan *p, bool pinned, char *buf, size_t cap) {
    size_t at = 0;
    buf[0] = 0;
    for (int L = 0; L < p->num_layers; L++) {
        if (p->pin[L] != pinned) continue;
        int e = L;
        while (e + 1 < p->num_layers && p->pin[e + 1] == pinned) e++;
        int k = e > L ? snprintf(buf + at, cap - at, "%s%d-%d", at ? "," : "", L, e)
                      : snprintf(buf + at, cap - at, "%s%d", at ? "," : "", L);
        if (k < 0 || (size_t)k >= cap - at) { buf[at] = 0; return; }
        at += (size_t)k;
        L = e;
    }
}

void k3_plan_print(const k3_mem_plan *p, const k3_stream_opts *o, FILE *f) {
    char b[32], h[32], lim[96];
    if (o->trunk_gb < 0 && o->cache_gb < 0) snprintf(lim, sizeof lim, "no limits");
    else snprintf(lim, sizeof lim, "trunk %s GB, cache %s GB", o->trunk_gb < 0 ? "all" : "", o->cache_gb < 0 ? "all" : "");
    if (o->trunk_gb >= 0 || o->cache_gb >= 0) {
        char t[24], x[24];
        if (o->trunk_gb < 0) snprintf(t, sizeof t, "all");
        else snprintf(t, sizeof t, "%.3g", o->trunk_gb);
        if (o->cache_gb < 0) snprintf(x, sizeof x, "all");
        else snprintf(x, sizeof x, "%.3g", o->cache_gb);
        snprintf(lim, sizeof lim, "--trunk-gb %s, --cache-gb %s", t, x);
    }
    fprintf(f, "k3: memory plan (%s%s%s%lld positions)\n", o->preset ? "preset " : "", o->preset ? o->preset : "",
            o->preset ? "; " : "", (long long)p->max_pos);
    fprintf(f, "k3:   budget               %s\n", lim);
    mb_cell(b, sizeof b, p->head_bytes);
    if (p->streamed)
        fprintf(f, "k3:   model-level tensors %s  head, final norms (read from trunk.bin), embedding rows in use "
                   "(mapped from it)\n", b);
    else
        fprintf(f, "k3:   model-level tensors %s  head, final norms, embedding rows in use (mapped)\n", b);
    if (!p->streamed) {
        mb_cell(b, sizeof b, p->pinned_bytes);
        fprintf(f, "k3:   trunk resident      %s  %d layers mapped from the shards (no --trunk)%s\n", b, p->num_layers,
                o->tp_ranks > 1 ? "; this rank's rows of the split matrices" : "");
    } else {
        mb_cell(b, sizeof b, p->pinned_bytes);
        char pl[K3_MAX_LAYERS * 4 + 8], sl[K3_MAX_LAYERS * 4 + 8];
        layer_list(p, true, pl, sizeof pl);
        layer_list(p, false, sl, sizeof sl);
        if (p->pinned > 0)
            fprintf(f, "k3:   trunk pinned        %s  layer%s %s resident\n", b, p->pinned > 1 ? "s" : "", pl);
        else
            fprintf(f, "k3:   trunk pinned        %s  no layer pinned\n", b);
        mb_cell(b, sizeof b, p->ring_bytes);
        if (p->ring_slots)
            fprintf(f, "k3:   ring slots          %s  %d x %s, layers %s streamed%s\n", b, p->ring_slots,
                    hsize(p->slot_bytes, h, sizeof h), sl,
                    p->ring_slots == 2 ? ", next layer read during compute" : ", no read-ahead (one slot)");
        else
            fprintf(f, "k3:   ring slots          %s  none (every layer pinned)\n", b);
    }
    mb_cell(b, sizeof b, p->expert_bytes);
    fprintf(f, "k3:   expert cache        %s  %lld of %lld experts x %s (%s) + %d batch buffers; chunk %d\n", b,
            (long long)p->cache_experts, (long long)p->total_experts, hsize(p->expert_buf, h, sizeof h),
            xc_policy_name(o->policy), p->batch_experts, p->chunk);
    mb_cell(b, sizeof b, p->table_bytes);
    fprintf(f, "k3:   cache tables        %s\n", b);
    mb_cell(b, sizeof b, p->index_bytes);
    fprintf(f, "k3:   checkpoint index    %s  tensor records and names of every shard\n", b);
    mb_cell(b, sizeof b, p->state.kda_bytes);
    fprintf(f, "k3:   KDA state           %s\n", b);
    mb_cell(b, sizeof b, p->state.mla_bytes);
    fprintf(f, "k3:   MLA latent cache    %s  at %lld positions\n", b, (long long)p->max_pos);
    mb_cell(b, sizeof b, p->state.scratch_bytes);
    fprintf(f, "k3:   scratch             %s\n", b);
    if (p->pass_bytes) {
        mb_cell(b, sizeof b, p->pass_bytes);
        fprintf(f, "k3:   speculation record  %s  passes of %d ids (KDA copy + per-id recurrence inputs)\n", b,
                o->pass_tokens);
    }
    mb_cell(b, sizeof b, p->total);
    fprintf(f, "k3:   total               %s  (+ %.0f MB fixed overhead: peak RSS stays below %.3f GB)\n", b,
            (double)K3_PLAN_OVERHEAD / 1e6, gb(p->total + K3_PLAN_OVERHEAD));
}
