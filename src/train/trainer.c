/* trainer.c: `k3 train`: the training loop, evaluation, samples and
 * checkpoints. What the run writes into its directory besides the
 * checkpoints (docs/run-dir.md) is rundir.c's, loss.svg lossplot.c's.
 *
 * Determinism and resume. Everything a step does is a function of the saved
 * state: the micro-batch windows are drawn by a counter-based hash of (seed,
 * step, micro-batch, row), so the data position is the step itself; the
 * learning rate is a function of (step, total); Quantile Balancing clears its
 * margins at every step. A checkpoint therefore holds all a run needs, and
 * `--resume` continues bit-identically. */
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "dist/data_par.h"
#include "dist/dist.h"
#include "generate/generate.h"
#include "model/model.h"
#include "session/session.h"
#include "tokenizer/tokenizer.h"
#include "train/data.h"
#include "train/export.h"
#include "train/tinternal.h"

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) { (void)sig; g_stop = 1; }

/* ---- data ------------------------------------------------------------------------- */

/* Micro-batch a of step s: row b is the window of T+1 tokens starting at a
 * position drawn by hashing (seed, s, a, b). */
static void make_batch(trun *r, int64_t step, int a, int32_t *tok) {
    uint64_t span = r->train.info.n_tokens - (uint64_t)r->T; /* windows start in [0, span) */
    for (int b = 0; b < r->B; b++) {
        uint64_t h = k3_mix64(r->seed * K3_GOLDEN64 + k3_mix64((uint64_t)step * 0x100000001B3ull +
                                                                  (uint64_t)a * 65537u + (uint64_t)b + 1));
        shard_read(&r->train, h % span, (size_t)r->T + 1, tok + (size_t)b * (r->T + 1));
    }
}

/* ---- evaluation and samples ----------------------------------------------------------- */

/* Text bytes an id stands for: its BPE bytes; a special counts 0. */
static int64_t text_bytes(const trun *r, int32_t id) {
    size_t len = 0;
    if (id >= tok_n_base(r->tok) || !tok_token_bytes(r->tok, id, &len)) return 0;
    return (int64_t)len;
}

static int evaluate(trun *r, int64_t step, k3_err *err) {
    r->phase = "eval";
    trun_write_state(r, "running", NULL, err);
    const int B = r->B, T = r->T;
    int32_t *tok = xmalloc_array((size_t)B * (T + 1), sizeof(int32_t));
    /* Batch i of B windows is computed by rank i % R; the per-batch sums are
     * gathered and added in batch order, as one process adds them. */
    const int64_t nbat = (r->val_windows + B - 1) / B;
    typedef struct { double loss; int64_t bytes; } batch_sum;
    batch_sum *bs = xcalloc((size_t)nbat, sizeof *bs);
    for (int64_t i = r->me; i < nbat; i += r->ranks) {
        const int64_t w0 = i * B;
        int64_t nbytes = 0;
        for (int b = 0; b < B; b++) {
            int64_t w = w0 + b < r->val_windows ? w0 + b : w0; /* pad the last batch; padded rows not counted */
            shard_read(&r->val, (uint64_t)w * T, (size_t)T + 1, tok + (size_t)b * (T + 1));
        }
        tm_forward(&r->m, tok, B, T);
        /* per-row losses: recompute from logits for the counted rows */
        int rows = (int)(r->val_windows - w0 < B ? r->val_windows - w0 : B);
        double s;
        int *tg = xmalloc_array((size_t)rows * T, sizeof(int));
        for (int b = 0; b < rows; b++)
            for (int t = 0; t < T; t++) {
                int id = tok[(size_t)b * (T + 1) + t + 1];
                tg[b * T + t] = id;
                nbytes += text_bytes(r, id);
            }
        t_cross_entropy(r->m.logits, tg, rows * T, r->cfg.vocab_size, &s, NULL, 0.0f);
        free(tg);
        bs[i] = (batch_sum){s, nbytes};
    }
    free(tok);
    if (r->ranks > 1) {
        batch_sum *all = xmalloc_array((size_t)r->ranks * (size_t)nbat, sizeof *all);
        k3_dp_allgather(bs, (size_t)nbat * sizeof *bs, all, "the validation losses");
        for (int64_t i = 0; i < nbat; i++) bs[i] = all[(size_t)(i % r->ranks) * (size_t)nbat + (size_t)i];
        free(all);
    }
    double loss = 0;
    int64_t ntok = 0, nbytes = 0;
    for (int64_t i = 0; i < nbat; i++) {
        int64_t rows = r->val_windows - i * B < B ? r->val_windows - i * B : B;
        loss += bs[i].loss;
        nbytes += bs[i].bytes;
        ntok += rows * T;
    }
    free(bs);
    double vl = loss / (double)ntok;
    double bpb = nbytes ? loss / ((double)nbytes * log(2.0)) : NAN;
    json_t *rec = json_object();
    json_object_set_new(rec, "kind", json_string("eval"));
    json_object_set_new(rec, "step", json_integer(step));
    json_object_set_new(rec, "time", json_real(trun_wall()));
    json_object_set_new(rec, "val_loss", trun_jnum(vl));
    json_object_set_new(rec, "val_bpb", trun_jnum(bpb));
    json_object_set_new(rec, "val_tokens", json_integer(ntok));
    int rc = r->writer ? trun_append_line(r->metrics_fd, rec, "metrics.jsonl", err) : K3_OK;
    json_decref(r->latest_eval);
    r->latest_eval = rec;
    tplot_add_eval(r, step, vl);
    if (!r->o.quiet) printf("eval step %lld | val_loss %.4f | val_bpb %.4f | %lld tokens\n", (long long)step, vl, bpb,
                            (long long)ntok);
    fflush(stdout);
    if (!rc) rc = tplot_write_svg(r, err);
    if (!rc && isfinite(vl) && (r->best_step < 0 || vl < r->best_loss)) {
        r->best_loss = vl;
        r->best_step = step;
        if (!r->writer) { r->phase = "train"; return K3_OK; }
        r->phase = "checkpoint";
        tckpt_meta meta = {step, r->total, step * (int64_t)r->A * r->B * r->T, r->best_step, r->best_loss,
                           r->seed, r->config_text, r->train_json, r->o.data_dir};
        char *p = trun_path(r, "best.safetensors");
        rc = tckpt_save(p, &r->m, &r->opt, &meta, err);
        free(p);
    }
    r->phase = "train";
    return rc;
}

/* Samples run through the inference graph (src/model/) with its cached
 * decoder and its sampler, the code `k3 run` uses: a model is opened on the
 * current parameters in memory (tm_lookup: the f32 tensors in place, no
 * export), decoded token by token at temperature 0.8, and freed. The sampler
 * is seeded by (seed, step), so samples never touch the training state and
 * resume stays bit-identical. */
#define SAMPLE_TEMPERATURE 0.8f /* the dashboard's samples: varied but on topic */
static int sample(trun *r, int64_t step, k3_err *err) {
    if (!r->writer) return K3_OK; /* the other ranks neither decode nor write */
    r->phase = "sample";
    trun_write_state(r, "running", NULL, err);
    const int n = r->o.sample_tokens, V = r->cfg.vocab_size;
    const char *tmp = getenv("TMPDIR");
    trun_remove_stale_samples(tmp && *tmp ? tmp : "/tmp");
    k3_model *km = NULL;
    k3_state *st = NULL;
    k3_session *sess = NULL;
    tm_lookup_ctx lc = {.m = &r->m};
    int rc = k3_model_open_lookup(&r->m.cfg, tm_lookup, &lc, NULL, &km, err);
    if (!rc) rc = k3_state_new(km, n + 1, &st, err);
    if (!rc) sess = k3_session_new(km, st, NULL);
    float *lg = xmalloc_array((size_t)V, sizeof(float));
    k3_sampler sp;
    k3_sampler_init(&sp, V, SAMPLE_TEMPERATURE, 0, 1.0f, 0.0f, k3_mix64(r->seed ^ k3_mix64((uint64_t)step + 77)));
    int32_t first = r->eot >= 0 ? r->eot : 0;
    k3_gen_result res = {0};
    if (!rc) rc = k3_session_feed(sess, &first, 1, lg, err);
    if (!rc) {
        k3_gen_opts go;
        k3_gen_opts_init(&go);
        go.max_tokens = n;
        go.eos_id = r->eot; /* ends the sample; not part of its text */
        go.what = "the model being trained";
        rc = k3_generate(sess, &sp, lg, &go, &res, err);
    }
    size_t len = res.n - (res.end == K3_GEN_END_EOS);
    k3_sampler_free(&sp);
    free(lg);
    k3_session_free(sess);
    if (st) k3_state_free(st);
    if (km) k3_model_free(km);
    uint8_t *bytes = NULL;
    size_t bl = 0;
    if (!rc) rc = tok_decode(r->tok, res.ids, len, &bytes, &bl, err);
    k3_gen_result_free(&res);
    if (rc) return rc;
    char *text = trun_utf8_clean(bytes, bl);
    free(bytes);
    json_t *rec = json_object();
    json_object_set_new(rec, "step", json_integer(step));
    json_object_set_new(rec, "time", json_real(trun_wall()));
    json_object_set_new(rec, "text", json_string(text));
    json_object_set_new(rec, "tokens", json_integer((json_int_t)len));
    rc = trun_append_line(r->samples_fd, rec, "samples.jsonl", err);
    json_decref(rec);
    if (!r->o.quiet) printf("sample step %lld: %s\n", (long long)step, text);
    free(text);
    r->phase = "train";
    return rc;
}

static int checkpoint(trun *r, int64_t step, k3_err *err) {
    if (!r->writer) { r->ckpt_step = step; return K3_OK; }
    r->phase = "checkpoint";
    trun_write_state(r, "running", NULL, err);
    tckpt_meta meta = {step, r->total, step * (int64_t)r->A * r->B * r->T, r->best_step, r->best_loss,
                       r->seed, r->config_text, r->train_json, r->o.data_dir};
    char *p = trun_path(r, "latest.safetensors");
    int rc = tckpt_save(p, &r->m, &r->opt, &meta, err);
    free(p);
    if (!rc) r->ckpt_step = step;
    r->phase = "train";
    return rc;
}

/* ---- one optimiser step ----------------------------------------------------------------- */

/* The gradient of a step is the left fold, in unit order, of the units'
 * gradients, each computed from zero: g = ((G_0 + G_1) + G_2) + ... (the
 * training GEMM's dW chain runs over one micro-batch's rows). A process that
 * holds the first units folds them as it goes (one scratch buffer); the
 * others keep theirs apart, and k3_dp_fold completes the fold across ranks,
 * so the bits are the same at every rank count. The losses (a double sum in
 * unit order), the expert loads (integers) and the Quantile Balancing margins
 * (rows in unit order) are gathered whole, so every rank then takes the same
 * optimiser step and bias update as one process. */
static int train_step(trun *r, int32_t *tok, k3_err *err) {
    tmodel *m = &r->m;
    const int Ne = r->cfg.num_experts;
    const size_t nload = (size_t)(m->n_moe ? m->n_moe : 1) * (size_t)Ne;
    double t0 = k3_now();
    memset(r->step_load, 0, sizeof(int64_t) * nload);
    m->qb_record = true;
    const float scale = 1.0f / (float)((int64_t)r->A * r->B * r->T);
    float *g = m->g;
    for (int j = 0; j < r->k; j++) {
        /* rank 0 folds into g as it goes; another rank keeps each unit apart */
        float *dst = j == 0 ? g : r->gunit[r->me == 0 ? 0 : j - 1];
        memset(dst, 0, m->nw * sizeof(float));
        make_batch(r, r->start, r->u0 + j, tok);
        r->uloss[j] = tm_forward(m, tok, r->B, r->T);
        for (size_t i = 0; i < (size_t)m->n_moe * Ne; i++) r->step_load[i] += m->load[i];
        m->g = dst;
        tm_backward(m, scale);
        m->g = g;
        if (r->me == 0 && j > 0) k3_dp_add(g, dst, m->nw);
    }
    m->qb_record = false;
    double loss = 0;
    if (r->ranks > 1) {
        const float **mine = xmalloc_array((size_t)r->k, sizeof *mine);
        int *counts = xmalloc_array((size_t)r->ranks, sizeof *counts);
        int nv = r->me == 0 ? 1 : r->k;
        mine[0] = g;
        for (int j = 1; j < nv; j++) mine[j] = r->gunit[j - 1];
        for (int q = 0; q < r->ranks; q++) counts[q] = q == 0 ? 1 : r->k;
        k3_dp_fold(g, mine, counts, m->nw, "the gradients");
        free(mine);
        free(counts);
        /* unit losses and expert loads, in rank (= unit) order */
        size_t rec = (size_t)r->k * sizeof(double) + nload * sizeof(int64_t);
        char *b = xmalloc(rec), *all = xmalloc_array((size_t)r->ranks, rec);
        memcpy(b, r->uloss, (size_t)r->k * sizeof(double));
        memcpy(b + (size_t)r->k * sizeof(double), r->step_load, nload * sizeof(int64_t));
        k3_dp_allgather(b, rec, all, "the losses and expert loads");
        memset(r->step_load, 0, sizeof(int64_t) * nload);
        for (int q = 0; q < r->ranks; q++) {
            const char *p = all + (size_t)q * rec;
            for (int j = 0; j < r->k; j++) {
                double l;
                memcpy(&l, p + (size_t)j * sizeof(double), sizeof l);
                loss += l;
            }
            for (size_t i = 0; i < nload; i++) {
                int64_t v;
                memcpy(&v, p + (size_t)r->k * sizeof(double) + i * sizeof(int64_t), sizeof v);
                r->step_load[i] += v;
            }
        }
        free(b);
        free(all);
        if (r->qb_all) { /* the margins of every unit, in unit order, replace this rank's */
            const size_t row = (size_t)m->n_moe * (size_t)Ne * sizeof(float);
            const size_t mine_n = (size_t)m->qb_n;
            k3_dp_allgather(m->qb_marg, mine_n * row, r->qb_all, "the Quantile Balancing margins");
            float *t = m->qb_marg;
            m->qb_marg = r->qb_all;
            r->qb_all = t;
            m->qb_n = (int)(mine_n * (size_t)r->ranks);
        }
    } else {
        for (int j = 0; j < r->k; j++) loss += r->uloss[j];
    }
    loss *= scale;
    double lr;
    double gn = topt_step(&r->opt, m, &lr);
    tm_qb_update(m);
    r->start++;
    double dt = k3_now() - t0;
    int64_t toks = (int64_t)r->A * r->B * r->T;
    json_t *rec = json_object();
    json_object_set_new(rec, "kind", json_string("train"));
    json_object_set_new(rec, "step", json_integer(r->start));
    json_object_set_new(rec, "time", json_real(trun_wall()));
    json_object_set_new(rec, "train_loss", trun_jnum(loss));
    json_object_set_new(rec, "lr", json_real(lr));
    json_object_set_new(rec, "grad_norm", trun_jnum(gn));
    json_object_set_new(rec, "tokens", json_integer(r->start * toks));
    json_object_set_new(rec, "tokens_per_s", json_real(toks / dt));
    json_object_set_new(rec, "step_time_s", json_real(dt));
    json_object_set_new(rec, "peak_rss_bytes", json_integer((json_int_t)k3_peak_rss_bytes()));
    if (m->n_moe) {
        json_t *el = json_array();
        for (int q = 0; q < m->n_moe; q++) {
            const int64_t *ld = r->step_load + (size_t)q * Ne;
            int64_t tot = 0, mx = 0, dead = 0;
            for (int e = 0; e < Ne; e++) { tot += ld[e]; if (ld[e] > mx) mx = ld[e]; if (!ld[e]) dead++; }
            json_t *o = json_object();
            json_object_set_new(o, "layer", json_integer(m->moe_layer[q]));
            json_object_set_new(o, "dead_frac", json_real((double)dead / Ne));
            json_object_set_new(o, "max_over_mean", json_real(tot ? (double)mx * Ne / (double)tot : 1.0));
            json_t *ls = json_array();
            for (int e = 0; e < Ne; e++) json_array_append_new(ls, json_real(tot ? (double)ld[e] / tot : 0.0));
            json_object_set_new(o, "loads", ls);
            json_array_append_new(el, o);
        }
        json_object_set_new(rec, "expert_load", el);
    }
    int rc = r->writer ? trun_append_line(r->metrics_fd, rec, "metrics.jsonl", err) : K3_OK;
    json_decref(r->latest);
    r->latest = rec;
    tplot_add_train(r, r->start, loss);
    if (!r->o.quiet)
        printf("step %lld/%lld | loss %.4f | lr %.3g | grad norm %.3f | %.0f tok/s | %.2f s\n", (long long)r->start,
               (long long)r->total, loss, lr, gn, toks / dt, dt);
    fflush(stdout);
    if (rc) return rc;
    if (!isfinite(loss) || !isfinite(gn))
        return k3_fail(err, K3_EXIT_RUNTIME, "step %lld: the loss or gradient is not finite", (long long)r->start);
    return trun_write_state(r, "running", NULL, err);
}

/* ---- setup ------------------------------------------------------------------------------ */

static bool same_layout(const tmodel *a, const tmodel *b) {
    if (a->np != b->np) return false;
    for (int i = 0; i < a->np; i++) {
        if (strcmp(a->params[i].name, b->params[i].name) != 0 || a->params[i].rank != b->params[i].rank) return false;
        for (int k = 0; k < a->params[i].rank; k++)
            if (a->params[i].shape[k] != b->params[i].shape[k]) return false;
    }
    return a->cfg.rms_eps == b->cfg.rms_eps && a->cfg.gate_lower_bound == b->cfg.gate_lower_bound &&
           a->cfg.attn_res_block_size == b->cfg.attn_res_block_size &&
           a->cfg.experts_per_token == b->cfg.experts_per_token && a->cfg.situ_beta == b->cfg.situ_beta &&
           a->cfg.situ_linear_beta == b->cfg.situ_linear_beta;
}

/* Token ids mean nothing across tokenizers: a run started with --init must
 * read shards written with the checkpoint's tokenizer (k3 prepare
 * --tokenizer). The checkpoint names the data directory it was trained on;
 * where that tokenizer can still be read the two are compared by the hash
 * their shards carry (data_tokenizer_hash: vocabulary and special tokens). */
static int same_tokenizer(const char *was, const char *now, const char *ckpt, bool quiet, k3_err *err) {
    if (!was) return K3_OK;
    uint64_t a, b;
    k3_err ignore = {0};
    if (data_tokenizer_hash(was, &a, &ignore)) {
        if (!quiet)
            fprintf(stderr, "k3: note: %s was trained on %s, whose tokenizer cannot be read here: make sure %s was "
                            "prepared with the same one (k3 prepare --tokenizer)\n", ckpt, was, now);
        return K3_OK;
    }
    int rc = data_tokenizer_hash(now, &b, err);
    if (rc) return rc;
    if (a != b)
        return k3_fail(err, K3_EXIT_USAGE,
                       "%s: its tokenizer differs from the one %s was trained with (in %s): prepare the data with "
                       "k3 prepare --tokenizer %s", now, ckpt, was, was);
    return K3_OK;
}

static int setup(trun *r, k3_err *err) {
    const ttrain_opts *o = &r->o;
    int rc;
    tckpt ck = {0};
    bool have_ck = false;
    const int bf16_flag = o->bf16; /* before the checkpoint's setting fills it in */
    topt_cfg oc;
    topt_defaults(&oc);
    r->B = o->batch;
    r->T = o->seq;
    r->A = o->accum;
    r->opt.c.lr = o->lr;
    r->opt.c.weight_decay = o->weight_decay_set ? o->weight_decay : -1;
    r->best_step = -1;
    r->ckpt_step = -1;
    if (o->resume) {
        if ((rc = tckpt_open(o->resume, &ck, err))) return rc;
        have_ck = true;
        r->config_text = xstrdup(ck.meta.config_json);
        if (trun_parse_train_json(r, ck.meta.train_json))
            return k3_fail(err, K3_EXIT_DATA, "%s: checkpoint training settings are not JSON", o->resume);
        r->seed = o->seed_set ? o->seed : ck.meta.seed;
        r->start = ck.meta.step;
        r->resumed = true;
        r->resumed_from = ck.meta.step;
        r->best_step = ck.meta.best_step;
        r->best_loss = ck.meta.best_val_loss;
        r->ckpt_step = ck.meta.step;
        if ((rc = k3_config_parse(r->config_text, o->resume, &r->cfg, err))) { tckpt_close(&ck); return rc; }
    } else if (o->init) {
        /* a fresh run (its own schedule, data order and optimiser moments) on
         * the checkpoint's model and weights: fine-tuning, or a second phase
         * on other data */
        if ((rc = tckpt_open(o->init, &ck, err))) return rc;
        have_ck = true;
        r->config_text = xstrdup(ck.meta.config_json);
        r->init_from = xstrdup(o->init);
        r->init_step = ck.meta.step;
        r->init_data = ck.meta.data_dir ? xstrdup(ck.meta.data_dir) : NULL;
        r->seed = o->seed_set ? o->seed : 1337;
        if ((rc = k3_config_parse(r->config_text, o->init, &r->cfg, err))) { tckpt_close(&ck); return rc; }
    } else {
        size_t len;
        if ((rc = k3_read_file(o->config_path, &r->config_text, &len, err))) return rc;
        if ((rc = k3_config_parse(r->config_text, o->config_path, &r->cfg, err))) return rc;
        r->seed = o->seed_set ? o->seed : 1337;
    }
    if (!r->B) r->B = 16;
    if (!r->T) r->T = 256;
    if (!r->A) r->A = 2;
    if (r->A % r->ranks) {
        if (have_ck) tckpt_close(&ck);
        char ok[160] = "";
        size_t at = 0;
        for (int d = 1; d <= r->A && at < sizeof ok - 16; d++)
            if (r->A % d == 0) at += (size_t)snprintf(ok + at, sizeof ok - at, "%s%d", at ? ", " : "", d);
        return k3_fail(err, K3_EXIT_USAGE,
                       "%d ranks cannot share %d micro-batches a step (%s %d): each rank computes whole "
                       "micro-batches, so the rank count must divide %d (-np %s), or change --gradient-accumulation",
                       r->ranks, r->A, o->accum ? "--gradient-accumulation" : "the checkpoint's gradient accumulation",
                       r->A, r->A, ok);
    }
    r->k = r->A / r->ranks;
    r->u0 = r->me * r->k;
    if (r->opt.c.lr == 0) r->opt.c.lr = 3e-3;
    oc.lr = r->opt.c.lr;
    if (r->opt.c.weight_decay >= 0) oc.weight_decay = r->opt.c.weight_decay;
    oc.muon = r->o.optimizer != 2;
    oc.total_steps = (int)o->steps;
    r->total = o->steps;
    r->end = o->stop_at && o->stop_at < o->steps ? o->stop_at : o->steps;
    if (have_ck && r->start >= r->end) {
        tckpt_close(&ck);
        return k3_fail(err, K3_EXIT_USAGE, "%s: the checkpoint is at step %lld, nothing to do for --steps %lld%s",
                       o->resume, (long long)r->start, (long long)o->steps, o->stop_at ? " / --stop-at" : "");
    }
    if ((rc = tm_build(&r->m, &r->cfg, err))) { if (have_ck) tckpt_close(&ck); return rc; }
    r->m.bf16 = r->o.bf16 == 1;
    if (r->m.bf16 && !k_gemm_bf16_fast()) { /* one smol-50m step of batch 4x256 took over 5 minutes emulated on a Zen 3 core */
        if (have_ck) tckpt_close(&ck);
        return k3_fail(err, K3_EXIT_USAGE,
                       "%s: BF16 products need AVX512_BF16 on the AVX-512 kernel path (here: %s) and would run "
                       "as a scalar emulation ~100x slower than F32; %s",
                       bf16_flag == 1 ? "--bf16" : o->resume, k_path_name(),
                       bf16_flag == 1 ? "train without --bf16" : "the run used --bf16: resume with --no-bf16");
    }
    if (r->o.kda_chunk) r->m.kda_chunk = r->o.kda_chunk < 0 ? 0 : r->o.kda_chunk;
    if (have_ck && o->config_path) {
        /* a config given with --resume or --init must describe the checkpoint's model */
        char *text;
        size_t len;
        k3_config c2;
        tmodel m2;
        if ((rc = k3_read_file(o->config_path, &text, &len, err))) { tckpt_close(&ck); return rc; }
        rc = k3_config_parse(text, o->config_path, &c2, err);
        free(text);
        if (rc) { tckpt_close(&ck); return rc; }
        if ((rc = tm_build(&m2, &c2, err))) { tckpt_close(&ck); return rc; }
        bool same = same_layout(&m2, &r->m);
        tm_free(&m2);
        if (!same) {
            tckpt_close(&ck);
            return k3_fail(err, K3_EXIT_USAGE, "%s: config disagrees with the checkpoint %s", o->config_path,
                           o->resume ? o->resume : o->init);
        }
    }
    topt_init(&r->opt, &r->m, &oc);
    if (have_ck) {
        rc = tckpt_load(&ck, &r->m, r->resumed ? &r->opt : NULL, err);
        bool unverified = ck.unverified;
        tckpt_close(&ck);
        if (rc) return rc;
        if (unverified && !o->quiet)
            fprintf(stderr, "k3: note: %s is a version 1 checkpoint without a payload checksum: its weights are not "
                            "verified\n", o->resume ? o->resume : o->init);
    } else {
        tm_init(&r->m, r->seed);
    }
    int bad;
    if (!tm_all_finite(&r->m, &bad))
        return k3_fail(err, K3_EXIT_DATA, "parameter %s is not finite", r->m.params[bad].name);
    /* data */
    if ((rc = data_open_split(o->data_dir, "train", (uint32_t)r->cfg.vocab_size, &r->train, err))) return rc;
    if ((rc = data_open_split(o->data_dir, "val", (uint32_t)r->cfg.vocab_size, &r->val, err))) return rc;
    if (r->train.info.n_tokens < (uint64_t)r->T + 2)
        return k3_fail(err, K3_EXIT_USAGE, "%s: train split has %llu tokens, fewer than --seq-len + 2", o->data_dir,
                       (unsigned long long)r->train.info.n_tokens);
    if (r->val.info.n_tokens < (uint64_t)r->T + 1)
        return k3_fail(err, K3_EXIT_USAGE, "%s: validation split has %llu tokens, fewer than --seq-len + 1",
                       o->data_dir, (unsigned long long)r->val.info.n_tokens);
    int64_t avail = (int64_t)((r->val.info.n_tokens - 1) / (uint64_t)r->T);
    int64_t want = (o->eval_tokens ? o->eval_tokens : 65536) / r->T;
    r->val_windows = want < 1 ? 1 : want < avail ? want : avail;
    if ((rc = tok_load(o->data_dir, &r->tok, err))) return rc;
    if ((rc = same_tokenizer(r->init_data, o->data_dir, o->init, o->quiet, err))) return rc;
    if (tok_vocab_size(r->tok) > r->cfg.vocab_size)
        return k3_fail(err, K3_EXIT_USAGE, "%s: the tokenizer has %d ids, more than the model's vocab_size %d", o->data_dir,
                       tok_vocab_size(r->tok), r->cfg.vocab_size);
    r->eot = tok_special_id(r->tok, "<|endoftext|>");
    if (r->eot < 0) r->eot = tok_eos_id(r->tok);
    r->train_json = trun_make_train_json(r);
    r->step_load = xcalloc((size_t)(r->m.n_moe ? r->m.n_moe : 1) * (size_t)r->cfg.num_experts, sizeof(int64_t));
    r->uloss = xcalloc((size_t)r->k, sizeof(double));
    r->ngunit = r->me == 0 ? (r->k > 1) : r->k - 1;
    r->gunit = xcalloc((size_t)(r->ngunit ? r->ngunit : 1), sizeof *r->gunit);
    for (int j = 0; j < r->ngunit; j++) r->gunit[j] = xmalloc_array(r->m.nw, sizeof(float));
    if (r->ranks > 1 && r->m.n_moe && r->cfg.experts_per_token < r->cfg.num_experts) {
        /* room for the whole step's margins, so the gathered rows can take the place of this rank's */
        size_t rows = (size_t)r->A * (size_t)r->B * (size_t)r->T;
        size_t row = (size_t)r->m.n_moe * (size_t)r->cfg.num_experts;
        r->m.qb_cap = (int)rows;
        r->m.qb_marg = xrealloc_array(r->m.qb_marg, rows * row, sizeof(float));
        r->qb_all = xmalloc_array(rows * row, sizeof(float));
    }
    return K3_OK;
}

/* ---- several ranks ------------------------------------------------------------------------ */

/* The ranks must run the same job: the command lines are compared at start
 * (dist.h), and here what the files gave each rank: the model config and
 * settings, the token shards (every byte) and the starting state (weights,
 * router biases, optimiser moments: a fresh initialisation or the checkpoint
 * read). The first that differs is named. */
static int check_same_job(trun *r, k3_err *err) {
    if (r->ranks == 1) return K3_OK;
    uint64_t h[3];
    h[0] = k3_fnv1a64(1469598103934665603ull, r->config_text, strlen(r->config_text));
    const int64_t nums[] = {r->B, r->T, r->A, r->start, r->end, r->total, (int64_t)r->seed, r->opt.c.muon,
                            r->m.bf16, r->m.kda_chunk, r->val_windows, r->best_step, r->opt.step};
    h[0] = k3_fnv1a64(h[0], nums, sizeof nums);
    h[0] = k3_fnv1a64(h[0], &r->opt.c.lr, sizeof r->opt.c.lr);
    uint32_t c = k3_crc32c(0, r->train.map, r->train.map_len);
    h[1] = ((uint64_t)k3_crc32c(c, r->val.map, r->val.map_len) << 32) | (uint32_t)r->train.info.n_tokens;
    c = k3_crc32c(0, r->m.w, r->m.nw * sizeof(float));
    c = k3_crc32c(c, r->m.bias, (size_t)r->m.n_moe * (size_t)r->cfg.num_experts * sizeof(float));
    c = k3_crc32c(c, r->opt.m1, r->m.nw * sizeof(float));
    c = k3_crc32c(c, r->opt.m2, r->m.nw * sizeof(float));
    h[2] = c;
    uint64_t *all = xmalloc_array((size_t)r->ranks * 3, sizeof *all);
    k3_dp_allgather(h, sizeof h, all, "start-up (the training job's identity)");
    int bad = -1, what = 0;
    for (int q = 1; q < r->ranks && bad < 0; q++)
        for (int i = 0; i < 3 && bad < 0; i++)
            if (all[3 * q + i] != all[i]) { bad = q; what = i; }
    free(all);
    if (bad < 0) return K3_OK;
    static const char *const part[3] = {"model config or training settings (from --config / --resume)",
                                        "token shards in --data-dir", "starting weights and optimiser state"};
    return k3_fail(err, K3_EXIT_USAGE,
                   "rank %d of %d (%s): its %s differ from rank 0's (%s): every rank must see identical files "
                   "(the same paths on every host)",
                   bad, r->ranks, k3_dist_host(bad), part[what], k3_dist_host(0));
}

/* Every rank leaves the loop at the same step: a status (rank 0 writes the
 * run directory alone, so it can fail alone) and, with share_stop, a stop
 * request (a signal reaches the ranks at different times) are agreed on. */
static int sync_ranks(trun *r, int rc, bool share_stop, const char *what, k3_err *err) {
    int32_t mine = g_stop ? 1 : 0; /* read once: a signal may come in between */
    if (share_stop) r->stop = mine;
    if (r->ranks == 1) return rc;
    rc = k3_dist_agree(rc, err, what);
    if (rc || !share_stop) return rc;
    int32_t *all = xmalloc_array((size_t)r->ranks, sizeof *all);
    k3_dp_allgather(&mine, sizeof mine, all, what);
    for (int q = 0; q < r->ranks; q++)
        if (all[q]) r->stop = true;
    free(all);
    return K3_OK;
}

static void teardown(trun *r) {
    if (r->metrics_fd > 0) close(r->metrics_fd);
    if (r->samples_fd > 0) close(r->samples_fd);
    shard_close(&r->train);
    shard_close(&r->val);
    if (r->tok) tok_free(r->tok);
    topt_free(&r->opt);
    tm_free(&r->m);
    json_decref(r->latest);
    json_decref(r->latest_eval);
    free(r->config_text);
    free(r->train_json);
    free(r->init_from);
    free(r->init_data);
    free(r->hs);
    free(r->hl);
    free(r->he);
    free(r->hv);
    free(r->step_load);
    free(r->uloss);
    for (int j = 0; j < r->ngunit; j++) free(r->gunit[j]);
    free(r->gunit);
    free(r->qb_all);
}

int k3_train_run(const ttrain_opts *opts, k3_err *err) {
    trun r;
    memset(&r, 0, sizeof r);
    r.o = *opts;
    if (!r.o.eval_interval) r.o.eval_interval = 250;
    if (!r.o.sample_interval) r.o.sample_interval = 500;
    if (!r.o.sample_tokens) r.o.sample_tokens = 128;
    if (!r.o.checkpoint_interval) r.o.checkpoint_interval = r.o.eval_interval;
    r.started = trun_wall();
    r.phase = "init";
    r.ranks = k3_dist_size();
    r.me = k3_dist_rank();
    r.writer = r.me == 0;
    r.k = 1;
    int rc = setup(&r, err);
    rc = sync_ranks(&r, rc, false, "start-up", err);
    if (!rc) rc = check_same_job(&r, err); /* the same verdict on every rank */
    if (!rc) {
        if (r.writer) rc = trun_open_dir(&r, err);
        rc = sync_ranks(&r, rc, false, "start-up (the run directory)", err);
    }
    if (rc) {
        if (r.metrics_fd > 0) trun_write_state(&r, "failed", err->msg, &(k3_err){0});
        teardown(&r);
        return rc;
    }
    g_stop = 0;
    /* SIGUSR1 too: mpirun forwards it to every rank as it is, while on
     * SIGINT / SIGTERM it gives the ranks one second before SIGKILL */
    struct sigaction sa = {0}, old_int, old_term, old_usr1;
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    sigaction(SIGUSR1, &sa, &old_usr1);
    if (!r.o.quiet) {
        printf("k3 train: %s, %lld parameters (router biases not counted)\n",
               r.o.config_path ? r.o.config_path : r.o.resume ? r.o.resume : r.o.init, (long long)r.m.nw);
        tm_print_inventory(&r.m, stdout);
        printf("batch %d x %d tokens x accumulation %d = %d tokens/step, %lld steps, lr %g (%s), seed %llu%s\n", r.B,
               r.T, r.A, r.A * r.B * r.T, (long long)r.total, r.opt.c.lr, r.opt.c.muon ? "Muon + AdamW" : "AdamW",
               (unsigned long long)r.seed, r.resumed ? ", resumed" : "");
        if (r.init_from && !r.resumed)
            printf("weights from %s (step %lld); a fresh optimiser and schedule\n", r.init_from, (long long)r.init_step);
        if (r.ranks > 1)
            printf("data parallel: %d ranks, %d micro-batch%s a step each\n", r.ranks, r.k, r.k > 1 ? "es" : "");
        fflush(stdout);
    }
    trun_write_state(&r, "running", NULL, err);
    r.phase = "train";
    if (!r.resumed) {
        rc = evaluate(&r, 0, err);
        if (!rc && !r.o.skip_samples && r.o.sample_interval > 0) rc = sample(&r, 0, err);
        rc = sync_ranks(&r, rc, false, "the first evaluation", err);
    }
    int32_t *tok = xmalloc_array((size_t)r.B * (r.T + 1), sizeof(int32_t));
    bool stopped = false;
    while (!rc && r.start < r.end) {
        rc = train_step(&r, tok, err);
        rc = sync_ranks(&r, rc, true, "a training step", err);
        if (rc) break;
        int64_t s = r.start;
        bool last = s == r.end;
        if (r.stop) { stopped = true; last = true; }
        if (s % r.o.eval_interval == 0 || (last && s == r.total)) rc = evaluate(&r, s, err);
        /* and one at the end, as for the evaluation, so the run's latest sample
         * is of its final weights (not at --stop-at: a resumed run's samples
         * stay those of the run straight through) */
        if (!rc && !r.o.skip_samples && r.o.sample_interval > 0 && (s % r.o.sample_interval == 0 || (last && s == r.total)))
            rc = sample(&r, s, err);
        if (!rc && (s % r.o.checkpoint_interval == 0 || last)) rc = checkpoint(&r, s, err);
        rc = sync_ranks(&r, rc, false, "an evaluation, sample or checkpoint", err);
        if (stopped) break;
    }
    free(tok);
    r.phase = "done";
    if (rc) {
        trun_write_state(&r, "failed", err->msg, &(k3_err){0});
    } else {
        if (!r.ne || r.he[r.ne - 1] != r.start) tplot_write_svg(&r, err);
        rc = trun_write_state(&r, r.start == r.total ? "finished" : "stopped", NULL, err);
    }
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    sigaction(SIGUSR1, &old_usr1, NULL);
    teardown(&r);
    return rc;
}
