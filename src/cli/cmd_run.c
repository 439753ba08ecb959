/* cmd_run.c: `k3 run MODEL_DIR` (also `k3 MODEL_DIR`): prefill a prompt, then
 * decode token by token (or recompute the whole prefix each step with --full),
 * streaming text to stdout and a report to stderr. */
#include "cli/commands.h"
#include "draft/draft.h"
#include "engine/engine.h"
#include "generate/generate.h"
#include "session/session.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *const cmd_run_help =
    "usage: k3 run MODEL_DIR [options]      (or: k3 MODEL_DIR [options])\n"
    "\n"
    "Runs a Kimi K3-architecture checkpoint: prefills the prompt, then generates\n"
    "token by token, carrying the KDA state and the MLA latent cache. Text streams\n"
    "to stdout as it is produced (or the ids, without a tokenizer); the report\n"
    "(timings, tokens/s, peak RSS) goes to stderr.\n"
    "\n"
    "prompt (exactly one):\n"
    "  --prompt TEXT        encode TEXT with the tokenizer (named specials allowed)\n"
    "  --prompt-file FILE   the same, reading FILE\n"
    "  --ids 1,2,3          token ids as given (works without a tokenizer)\n"
    "\n"
    "options:\n"
    "  --gen N              generate at most N tokens (default 32); generation also\n"
    "                       stops at the config's eos_token_id (else the tokenizer's)\n"
    "  --incremental        prefill once, then feed one token per step (default)\n"
    "  --full               recompute the whole prefix every step (a check: the\n"
    "                       logits are bit-identical to --incremental)\n"
    K3_SAMPLE_HELP
    "  --speculate K        speculative decoding: up to K drafted ids (1-16) verified\n"
    "                       per forward pass, fewer while they are rejected; drafts\n"
    "                       from the sequence's own history (n-gram lookup) unless\n"
    "                       --draft is given. The generated ids and logits are\n"
    "                       exactly those of plain decoding (docs/speculation.md)\n"
    K3_DRAFT_HELP
    K3_DRAFT_P_MIN_HELP
    "  --out FILE.json      write prompt_ids, generated_ids, text, prefill_s,\n"
    "                       decode_s, tokens_per_s, peak_rss_bytes, threads,\n"
    "                       bytes_read_per_token (weights, RAM or disk), ...\n"
    "  --dump-logits FILE   little-endian f32 rows of vocab_size logits, one per\n"
    "                       token fed (the prompt, then the first N-1 generated);\n"
    "                       row i predicts token i+1\n"
    "  --quiet              print nothing but errors (use with --out)\n"
    "  --verbose            also report every forward call on stderr (time, bytes\n"
    "                       read, expert hits); --out always has these lines\n"
    "\n"
    K3_ENGINE_HELP
    "\n"
    "exit codes: 0 ok, 1 runtime/I-O, 2 usage or bad input (empty prompt, id\n"
    "outside the vocabulary), 3 cannot fit the memory budget, 4 checkpoint data\n"
    "error (missing tensor, wrong shape or dtype)\n";

typedef struct {
    const char *model_dir, *prompt, *prompt_file, *ids, *out, *dump;
    int64_t gen;
    k3_spec_flags sf;      /* --speculate, --draft, --draft-p-min */
    bool full, incremental, quiet, verbose;
    k3_sample_opts so;     /* sampling flags (engine/engine.h) */
    k3_engine_opts eo;     /* model, threads and memory flags (engine/engine.h) */
} run_args;

/* ---- argument parsing ---------------------------------------------------- */


static int parse_args(int argc, char **argv, run_args *a) {
    memset(a, 0, sizeof *a);
    k3_engine_opts_init(&a->eo);
    k3_sample_opts_init(&a->so);
    k3_spec_flags_init(&a->sf);
    a->gen = 32;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE() \
    do { if (!v) return k3_usage_error("run", "%s needs a value", o); i++; } while (0)
        int64_t n;
        if (!strcmp(o, "--help") || !strcmp(o, "-h")) { /* reached through `k3 MODEL_DIR --help` */
            fputs(cmd_run_help, stdout);
            return -1;
        }
        if (o[0] != '-' || !o[1]) {
            if (a->model_dir) return k3_usage_error("run", "unexpected argument '%s'", o);
            a->model_dir = o;
        }
        else if (!strcmp(o, "--prompt")) { NEED_VALUE(); if (a->prompt) return k3_usage_error("run", "--prompt given twice"); a->prompt = v; }
        else if (!strcmp(o, "--prompt-file")) { NEED_VALUE(); if (a->prompt_file) return k3_usage_error("run", "--prompt-file given twice"); a->prompt_file = v; }
        else if (!strcmp(o, "--ids")) { NEED_VALUE(); if (a->ids) return k3_usage_error("run", "--ids given twice"); a->ids = v; }
        else if (!strcmp(o, "--gen")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 0, INT64_MAX / 2, &n)) return k3_usage_error("run", "--gen: '%s' is not a count >= 0", v);
            a->gen = n;
        } else if (!strcmp(o, "--full")) a->full = true;
        else if (!strcmp(o, "--incremental")) a->incremental = true;
        else if (!strcmp(o, "--quiet")) a->quiet = true;
        else if (!strcmp(o, "--verbose")) a->verbose = true;
        else if (!strcmp(o, "--out")) { NEED_VALUE(); a->out = v; }
        else if (!strcmp(o, "--dump-logits")) { NEED_VALUE(); a->dump = v; }
        else {
            bool used;
            k3_err e = {0};
            if (k3_sample_parse_flag(&a->so, "run", argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used && k3_spec_parse_flag(&a->sf, "run", argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used && k3_engine_parse_flag(&a->eo, "run", argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used) return k3_usage_error("run", "unknown option '%s'", o);
        }
#undef NEED_VALUE
    }
    if (a->eo.mem.list_presets) return K3_OK;
    if (!a->model_dir) return k3_usage_error("run", "no MODEL_DIR given");
    int np = !!a->prompt + !!a->prompt_file + !!a->ids;
    if (np != 1)
        return k3_usage_error("run", np ? "give only one of --prompt, --prompt-file, --ids"
                                        : "give a prompt: --prompt TEXT, --prompt-file FILE or --ids 1,2,3");
    if (a->full && a->incremental) return k3_usage_error("run", "--full and --incremental exclude each other");
    {
        k3_err e = {0};
        if (k3_spec_flags_check(&a->sf, "run", &e)) return k3_report(&e);
    }
    if (a->full && a->sf.speculate) return k3_usage_error("run", "--full recomputes every step: it takes no --speculate");
    k3_err e = {0};
    if (k3_sample_opts_check(&a->so, "run", &e)) return k3_report(&e);
    return K3_OK;
}

/* ---- helpers ------------------------------------------------------------- */

static int prompt_ids(const run_args *a, const k3_engine *e, int32_t **ids, size_t *n, k3_err *err) {
    if (a->ids) {
        if (!*a->ids) return k3_fail(err, K3_EXIT_USAGE, "--ids: empty prompt");
        return k3_parse_ids(a->ids, k3_engine_vocab(e), ids, n, err);
    }
    const char *what = a->prompt ? "--prompt" : a->prompt_file;
    if (!k3_engine_tokenizer(e))
        return k3_fail(err, K3_EXIT_USAGE, "%s: no tokenizer (no tiktoken.model in %s): use --ids or --tok DIR", what,
                       a->model_dir);
    char *text = NULL;
    size_t len;
    if (a->prompt) {
        text = xstrdup(a->prompt);
        len = strlen(text);
    } else {
        int rc = k3_read_file(a->prompt_file, &text, &len, err);
        if (rc) return rc;
    }
    int rc = K3_OK;
    if (len == 0) rc = k3_fail(err, K3_EXIT_USAGE, "%s: empty prompt", what);
    else rc = k3_engine_encode(e, what, text, len, true, ids, n, err);
    free(text);
    if (!rc && *n == 0) {
        free(*ids);
        *ids = NULL;
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: the prompt encodes to no tokens", what);
    }
    return rc;
}

/* Writes n rows of logits to the dump (little-endian f32). */
static int dump_rows(k3_atomic_file *df, const float *rows, size_t nfloats, k3_err *err) {
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the logits dump assumes a little-endian host"
#endif
    return k3_atomic_write(df, rows, nfloats * sizeof(float), err);
}

/* An upper bound on the prompt's tokens, known before the tokenizer
 * and the weights are loaded (a token is at least one byte; one BOS). */
static int64_t prompt_bound(const run_args *a) {
    if (a->ids) {
        int64_t n = 1;
        for (const char *p = a->ids; *p; p++) n += *p == ',';
        return n;
    }
    if (a->prompt) return (int64_t)strlen(a->prompt) + 1;
    struct stat st;
    return stat(a->prompt_file, &st) == 0 ? (int64_t)st.st_size + 1 : 1;
}

/* ---- the run ---------------------------------------------------------------------- */

typedef struct {
    const run_args *a;
    k3_engine *e;
    k3_state *s;
    k3_session *sess;  /* on s, no state cache */
    k3_tokenizer *tok;
    tok_stream ts;
    uint8_t *tbuf;
    size_t tbuf_cap;
    int32_t *seq;      /* prompt + generated */
    size_t nseq, nprompt, nemitted;
    float *logits;     /* [chunk][V] when dumping the prompt, else [V] */
    k3_atomic_file df;
    bool dumping;
    bool all_rows;     /* every prompt row's logits: rank 0 dumps them, and under a split
                          trunk (dist/tensor_par.h) the head is a collective every rank joins */
    json_t *dist;      /* expert-parallel figures (rank 0 of several), or NULL */
    k3_drafter *drafter;
    k3_spec *spec;     /* --speculate: the verifying feed, or NULL */
    k3_gen_result res; /* the generation's counters, for the report */
} run_ctx;

/* Streams one token's text (or id); a write error on stdout (a full disk or
 * device) stops the run instead of generating into the void. The loop's
 * on_token: the end-of-sequence id never reaches it. */
static int emit_token(void *ctx, int32_t id, k3_gen_verdict *verdict, k3_err *err) {
    run_ctx *r = ctx;
    (void)verdict;
    r->nemitted++;
    if (r->tok) {
        size_t len = 0;
        tok_token_bytes(r->tok, id, &len);
        if (len + 16 > r->tbuf_cap) {
            r->tbuf_cap = len + 16;
            r->tbuf = xrealloc(r->tbuf, r->tbuf_cap);
        }
        size_t k = tok_stream_feed(&r->ts, id, r->tbuf, r->tbuf_cap);
        if (!r->a->quiet && k) {
            fwrite(r->tbuf, 1, k, stdout);
            fflush(stdout);
        }
    } else if (!r->a->quiet) {
        printf("%s%d", r->nemitted > 1 ? " " : "", id);
        fflush(stdout);
    }
    if (ferror(stdout)) return k3_fail(err, K3_EXIT_RUNTIME, "standard output: write failed: %s", strerror(errno));
    return K3_OK;
}

/* The loop's on_logits: every decode row goes to the dump. */
static int dump_row(void *ctx, const float *row, k3_err *err) {
    run_ctx *r = ctx;
    return r->dumping ? dump_rows(&r->df, row, (size_t)k3_engine_vocab(r->e), err) : K3_OK;
}

/* Feeds the prompt in slices (a progress bar for long prompts; when dumping,
 * every prompt row is written without holding [n][V]); the split does not
 * change the logits bits. Leaves the last row's logits in r->logits[0..V). */
static int prefill(run_ctx *r, k3_err *err) {
    size_t V = (size_t)k3_engine_vocab(r->e);
    const size_t slice = (size_t)k3_engine_chunk(r->e); /* --chunk */
    k3_progress pb;
    k3_progress_start(&pb, "prefill", r->nprompt, false);
    if (r->a->quiet) pb.enabled = false;
    for (size_t i = 0; i < r->nprompt; i += slice) {
        size_t n = r->nprompt - i < slice ? r->nprompt - i : slice;
        bool last = i + n == r->nprompt;
        int rc = k3_session_feed_rows(r->sess, r->seq + i, n, r->all_rows || last ? r->logits : NULL, r->all_rows,
                                      true, err);
        if (!rc && r->dumping) rc = dump_rows(&r->df, r->logits, n * V, err);
        if (rc) return rc;
        if (r->all_rows && n > 1) memmove(r->logits, r->logits + (n - 1) * V, V * sizeof(float));
        k3_progress_update(&pb, i + n);
    }
    k3_progress_finish(&pb);
    return K3_OK;
}

static int write_out_json(run_ctx *r, double prefill_s, double decode_s, int threads, const char *stop, k3_err *err) {
    json_t *o = json_object(), *pi = json_array(), *gi = json_array();
    for (size_t i = 0; i < r->nprompt; i++) json_array_append_new(pi, json_integer(r->seq[i]));
    for (size_t i = r->nprompt; i < r->nseq; i++) json_array_append_new(gi, json_integer(r->seq[i]));
    size_t ngen = r->nseq - r->nprompt;
    json_object_set_new(o, "model", json_string(r->a->model_dir));
    json_object_set_new(o, "prompt_ids", pi);
    json_object_set_new(o, "generated_ids", gi);
    if (r->tok) {
        /* ids the tokenizer does not know (a model vocabulary larger than the
         * tokenizer's) have no text, as in the stream */
        int32_t *known = xmalloc_array(ngen ? ngen : 1, sizeof *known);
        size_t nk = 0;
        for (size_t i = r->nprompt; i < r->nseq; i++)
            if (r->seq[i] < tok_vocab_size(r->tok)) known[nk++] = r->seq[i];
        uint8_t *bytes = NULL;
        size_t len = 0;
        int rc = tok_decode(r->tok, known, nk, &bytes, &len, err);
        free(known);
        if (rc) { json_decref(o); return rc; }
        /* invalid UTF-8 cannot go into JSON as is: replace it */
        json_t *t = json_stringn((const char *)bytes, len);
        if (!t) {
            for (size_t i = 0; i < len; i++)
                if (bytes[i] >= 0x80) bytes[i] = '?';
            t = json_stringn((const char *)bytes, len);
        }
        json_object_set_new(o, "text", t ? t : json_string(""));
        free(bytes);
    }
    json_object_set_new(o, "mode", json_string(r->a->full ? "full" : "incremental"));
    json_object_set_new(o, "stop", json_string(stop));
    json_object_set_new(o, "prefill_s", json_real(prefill_s));
    json_object_set_new(o, "decode_s", json_real(decode_s));
    double steps = ngen > 1 ? (double)(ngen - 1) : 0;
    json_object_set_new(o, "tokens_per_s", json_real(decode_s > 0 ? steps / decode_s : 0));
    json_object_set_new(o, "prefill_tokens_per_s", json_real(prefill_s > 0 ? (double)r->nprompt / prefill_s : 0));
    json_object_set_new(o, "peak_rss_bytes", json_integer((json_int_t)k3_peak_rss_bytes()));
    json_object_set_new(o, "threads", json_integer(threads));
    /* per decoding pass: 1 and 0 drafts without --speculate */
    json_object_set_new(o, "speculate", json_integer(r->a->sf.speculate));
    json_object_set_new(o, "decode_passes", json_integer((json_int_t)r->res.passes));
    json_object_set_new(o, "drafts_proposed", json_integer((json_int_t)r->res.drafted));
    json_object_set_new(o, "drafts_accepted", json_integer((json_int_t)r->res.accepted));
    json_object_set_new(o, "tokens_per_pass",
                        json_real(r->res.passes ? (double)r->res.fed / (double)r->res.passes : 0.0));
    /* weights read per generated token by the decode calls (runmem.h): a
     * verifying pass reads them once for all the ids it feeds */
    k3_runmem_reads rd = k3_engine_decode_reads(r->e);
    double per = ngen ? 1.0 / (double)ngen : 0.0;
    json_object_set_new(o, "bytes_read_per_token", json_real((double)rd.touched * per));
    json_object_set_new(o, "disk_bytes_read_per_token", json_real((double)rd.disk * per));
    json_object_set_new(o, "layers", json_integer(k3_engine_config(r->e)->num_layers));
    k3_engine_report_json(r->e, o);
    if (r->dist) json_object_set(o, "expert_parallel", r->dist);
    char *txt = json_dumps(o, JSON_INDENT(1));
    json_decref(o);
    if (!txt) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot serialise the report", r->a->out);
    size_t tl = strlen(txt);
    char *withnl = xmalloc(tl + 2);
    memcpy(withnl, txt, tl);
    withnl[tl] = '\n';
    free(txt);
    int rc = k3_write_file_atomic(r->a->out, withnl, tl + 1, err);
    free(withnl);
    return rc;
}

static int run(const run_args *a, k3_err *err) {
    run_ctx r = {.a = a};
    int rc;
    /* a bad output path fails now, not after the whole generation */
    if (a->out && (rc = k3_check_output_path(a->out, "--out", err))) goto done;
    if (a->dump && (rc = k3_check_output_path(a->dump, "--dump-logits", err))) goto done;
    k3_engine_opts eo = a->eo;
    eo.model_dir = a->model_dir;
    eo.max_pos = prompt_bound(a) + a->gen;
    if (a->sf.speculate) eo.mem.so.pass_tokens = a->sf.speculate + 1; /* a verifying pass in one chunk */
    if ((rc = k3_engine_open(&eo, &r.e, err))) goto done;
    /* under mpirun, the ranks after the first compute alongside it silently */
    run_args quiet_rank;
    r.all_rows = a->dump != NULL;
    if (k3_engine_rank(r.e) > 0) {
        quiet_rank = *a;
        quiet_rank.quiet = true;
        quiet_rank.out = quiet_rank.dump = NULL;
        a = r.a = &quiet_rank;
    }
    r.tok = k3_engine_tokenizer(r.e);
    k3_engine_set_step_log(r.e, a->verbose && !a->quiet ? stderr : NULL);
    int threads = k3_engine_threads(r.e);
    const k3_config *c = k3_engine_config(r.e);
    size_t V = (size_t)c->vocab_size;
    int32_t *pids = NULL;
    if ((rc = prompt_ids(a, r.e, &pids, &r.nprompt, err))) goto ready;

    /* the state at the real length, before anything else is allocated */
    int64_t max_pos = (int64_t)r.nprompt + a->gen;
    uint64_t logit_bytes = (uint64_t)V * sizeof(float) * (r.all_rows ? (uint64_t)k3_engine_chunk(r.e) : 1);
    if ((rc = k3_engine_state_new(r.e, max_pos, logit_bytes, &r.s, err))) { free(pids); goto ready; }
    r.seq = xmalloc_array((size_t)max_pos, sizeof *r.seq);
    memcpy(r.seq, pids, r.nprompt * sizeof *r.seq);
    free(pids);
    r.nseq = r.nprompt;
    r.sess = k3_session_open(r.e, r.s, NULL);
    if ((rc = k3_drafter_for(r.e, a->sf.draft, a->sf.p_min, a->sf.speculate, max_pos, &r.drafter, err))) goto ready;
    if (r.drafter) r.spec = k3_spec_new(r.drafter, a->sf.speculate, (int)V);
    r.logits = xmalloc_array(V * (r.all_rows ? (size_t)k3_engine_chunk(r.e) : 1), sizeof(float));
    if (a->dump) {
        if ((rc = k3_atomic_open(&r.df, a->dump, err))) goto ready;
        r.dumping = true;
    }
ready: /* every rank of an expert-parallel job is ready, or none starts */
    if ((rc = k3_engine_ready(r.e, rc, err))) goto done;
    if (r.tok) tok_stream_init(&r.ts, r.tok);
    int eos = k3_engine_eos_id(r.e);
    if (!a->quiet)
        fprintf(stderr, "model %s: %d layers (%s), vocab %d; prompt %zu tokens; threads %d\n", a->model_dir,
                c->num_layers, a->full ? "full recompute" : "incremental", c->vocab_size, r.nprompt, threads);

    if (!a->quiet) k3_engine_print_plan(r.e, stderr);
    k3_sampler sp;
    k3_sample_opts_sampler(&a->so, (int)V, 0, &sp);
    double t0 = k3_now();
    const char *stop = "length";
    k3_engine_mark m0 = k3_engine_mark_now(r.e);
    rc = prefill(&r, err);
    double t1 = k3_now(), t2 = t1;
    k3_engine_mark m1 = k3_engine_mark_now(r.e);
    if (!rc) {
        k3_gen_opts go;
        k3_gen_opts_init(&go);
        go.max_tokens = a->gen;
        /* the end-of-sequence token ends the text; its name is not part of it
         * (it is still in generated_ids) */
        go.eos_id = eos;
        go.recompute = a->full;
        go.what = a->model_dir;
        go.ctx = &r;
        go.on_token = emit_token;
        go.on_logits = dump_row;
        go.spec = r.spec;
        rc = k3_generate(r.sess, &sp, r.logits, &go, &r.res, err);
        memcpy(r.seq + r.nseq, r.res.ids, r.res.n * sizeof *r.seq);
        r.nseq += r.res.n;
        if (r.res.end == K3_GEN_END_EOS) stop = "eos";
    }
    t2 = k3_now();
    k3_engine_mark m2 = k3_engine_mark_now(r.e);
    k3_sampler_free(&sp);
    /* the other ranks of the job would wait for this one's next exchange */
    if ((rc = k3_engine_fail(r.e, rc, err))) goto done;
    if (k3_engine_ranks(r.e) > 1) { /* every rank's exchange figures, for rank 0's report */
        FILE *rf = a->quiet ? NULL : stderr;
        json_t *pj = k3_engine_dist_report(r.e, "prefill", &m0, &m1, t1 - t0, r.nprompt, rf);
        size_t steps = r.nseq - r.nprompt > 1 ? r.nseq - r.nprompt - 1 : 0;
        json_t *dj = k3_engine_dist_report(r.e, "decode", &m1, &m2, t2 - t1, steps, rf);
        if (pj || dj) {
            r.dist = json_object();
            if (pj) json_object_set_new(r.dist, "prefill", pj);
            if (dj) json_object_set_new(r.dist, "decode", dj);
        }
    }
    if (r.tok && !a->quiet) {
        uint8_t tail[16];
        size_t k = tok_stream_flush(&r.ts, tail, sizeof tail);
        if (k) fwrite(tail, 1, k, stdout);
    }
    if (!a->quiet && r.nseq > r.nprompt) putchar('\n');
    fflush(stdout);
    if (r.dumping) {
        if ((rc = k3_atomic_commit(&r.df, err))) { r.dumping = false; goto done; }
        r.dumping = false;
    }
    size_t ngen = r.nseq - r.nprompt;
    double prefill_s = t1 - t0, decode_s = t2 - t1;
    if (!a->quiet) k3_engine_print_summary(r.e, stderr);
    if (!a->quiet)
        fprintf(stderr,
                "prefill %zu tokens in %.3f s (%.1f tok/s); generated %zu tokens (stop: %s), decode %.3f s "
                "(%.2f tok/s); peak RSS %.1f MiB; threads %d\n",
                r.nprompt, prefill_s, prefill_s > 0 ? (double)r.nprompt / prefill_s : 0.0, ngen, stop, decode_s,
                decode_s > 0 && ngen > 1 ? (double)(ngen - 1) / decode_s : 0.0,
                (double)k3_peak_rss_bytes() / (1024.0 * 1024), threads);
    if (r.spec && !a->quiet)
        fprintf(stderr, "speculation: %llu passes fed %llu ids (%.2f a pass); %llu of %llu drafts accepted\n",
                (unsigned long long)r.res.passes, (unsigned long long)r.res.fed,
                r.res.passes ? (double)r.res.fed / (double)r.res.passes : 0.0, (unsigned long long)r.res.accepted,
                (unsigned long long)r.res.drafted);
    if (a->out) rc = write_out_json(&r, prefill_s, decode_s, threads, stop, err);
done:
    json_decref(r.dist);
    k3_gen_result_free(&r.res);
    k3_spec_free(r.spec);
    if (r.dumping) k3_atomic_abort(&r.df);
    free(r.seq);
    free(r.logits);
    free(r.tbuf);
    k3_session_free(r.sess);
    if (r.e) k3_engine_state_free(r.e, r.s);
    k3_drafter_free(r.drafter);
    k3_engine_free(r.e);
    return rc;
}

int cmd_run(int argc, char **argv) {
    run_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc < 0) return K3_OK; /* --help */
    if (rc) return rc;
    if (a.eo.mem.list_presets) {
        k3_presets_print(stdout);
        return K3_OK;
    }
    k3_err err = {0};
    rc = run(&a, &err);
    if (rc) return k3_report(&err);
    return K3_OK;
}
