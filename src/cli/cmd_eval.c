/* cmd_eval.c: `k3 eval MODEL_DIR --text FILE`: how well a model predicts a
 * text. The text is read as `k3 prepare` reads a corpus (train/corpus.h: a
 * file of stories separated by <|endoftext|> lines, or JSONL, is its
 * documents each followed by the separator id, the token stream the trainer
 * sees; any other file is scored byte for byte), encoded with the model's
 * tokenizer (specials such as <|endoftext|> become their ids; no BOS is
 * added) and scored in windows:
 * window k feeds tokens [k*stride, k*stride + ctx) from a fresh state, and
 * scores the next-token predictions that no earlier window scored (all of
 * them in window 0, the last `stride` in the others), so every token after
 * the first is scored exactly once. With stride == ctx this is the trainer's
 * validation: consecutive windows of ctx inputs, each predicting ctx targets.
 *
 * Figures: nats per token = total negative log-likelihood (natural log) of
 * the scored tokens / their number; bits per byte = that total / ln 2 / the
 * UTF-8 bytes those tokens stand for (a special token stands for none). Bits
 * per byte compares models with different tokenizers. Log-softmax is taken
 * in double precision per row, in one fixed order. */
#include "cli/commands.h"
#include "engine/engine.h"
#include "train/corpus.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *const cmd_eval_help =
    "usage: k3 eval MODEL_DIR --text FILE [options]\n"
    "       k3 eval --compare MODEL_A MODEL_B --text FILE [options]\n"
    "\n"
    "Scores a text with a model: nats per token, bits per byte, tokens and bytes\n"
    "scored. The text is read as k3 prepare reads a corpus (--format), encoded with\n"
    "the model's tokenizer (special names such as <|endoftext|> become their ids;\n"
    "no BOS is added) and read in windows of --ctx\n"
    "tokens, each from a fresh state, one every --stride tokens; each window\n"
    "scores the predictions no earlier window scored, so every token after the\n"
    "first is scored once, with at least ctx - stride tokens of context (except in\n"
    "the first window).\n"
    "\n"
    "  nats per token = sum over scored tokens of -ln p(token | context) / tokens\n"
    "  bits per byte  = (that sum) / ln 2 / (UTF-8 bytes of the scored tokens;\n"
    "                   a special token covers 0 bytes)\n"
    "\n"
    "With --stride equal to --ctx (the default) the windows are the ones k3 train\n"
    "validates on (--seq-len tokens each), so for a model trained by k3 train the\n"
    "figure equals the trainer's val_loss on the same tokens: `k3 eval --text F`\n"
    "scores the ids `k3 prepare --validation-input F` writes.\n"
    "\n"
    "options:\n"
    "  --text FILE          the text to score (\"-\": standard input)\n"
    "  --format F           how to read it (default auto):\n"
    "                         stories: stories separated by a line <|endoftext|>\n"
    "                                  (the newline before the line belongs to\n"
    "                                  it), each scored followed by the\n"
    "                                  <|endoftext|> id, as k3 prepare writes them\n"
    "                         jsonl:   one JSON object per line, its \"text\"\n"
    "                                  field, each followed by <|endoftext|>\n"
    "                         text:    documents separated by blank lines, each\n"
    "                                  followed by <|endoftext|>\n"
    "                         raw:     the file as it is, every byte scored\n"
    "                       auto: jsonl for *.jsonl or a first '{', stories when a\n"
    "                       line <|endoftext|> occurs, else raw\n"
    "  --ctx N              window length in tokens (default: the config's\n"
    "                       max_position_embeddings, at most 4096; else 256, the\n"
    "                       k3 train default --seq-len)\n"
    "  --stride S           tokens between window starts, 1..ctx (default: ctx)\n"
    "  --max-tokens N       score only the first N tokens of the text (N >= 2);\n"
    "                       under --compare with two tokenizers those are two\n"
    "                       spans of text: the output says so (same_span)\n"
    "  --compare A B        score the text with two models, side by side\n"
    "  --json               print a JSON object (nats_per_token, bits_per_byte,\n"
    "                       tokens, bytes, ctx, stride, windows, total_nats,\n"
    "                       format, documents); with\n"
    "                       --compare {\"a\": {...}, \"b\": {...}}\n"
    "  --quiet              no progress bar\n"
    "\n" K3_ENGINE_HELP
    "\n"
    "exit codes: 0 ok, 1 runtime/I-O, 2 usage or bad input (no tokenizer, a text\n"
    "of fewer than 2 tokens, invalid UTF-8 or JSONL, no separator id for a\n"
    "format that needs one), 3 cannot fit the memory budget, 4 checkpoint data\n"
    "error (including non-finite logits)\n";

typedef struct {
    const char *model;
    double nats;
    int64_t tokens, bytes, windows;
    int64_t span_bytes;   /* text bytes of the ids scored from (--max-tokens cuts by tokens) */
    int ctx, stride;
} eval_result;

/* The text as documents (raw: one document, scored without a separator). */
typedef struct {
    corpus docs;
    corpus_format format;
} eval_text;

typedef struct {
    k3_engine_opts eo;
    const char *text_path;
    corpus_format format;
    int ctx, stride;          /* 0: defaults */
    int64_t max_tokens;       /* 0: all */
    bool json, quiet;
} eval_args;

/* max_position_embeddings from config.json (text_config first), 0 if none. */
static int64_t config_max_pos(const char *dir) {
    char p[4200];
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_t *root = json_load_file(p, 0, NULL);
    if (!root) return 0;
    json_t *tc = json_object_get(root, "text_config");
    json_t *v = tc ? json_object_get(tc, "max_position_embeddings") : NULL;
    if (!v) v = json_object_get(root, "max_position_embeddings");
    int64_t n = json_is_integer(v) ? (int64_t)json_integer_value(v) : 0;
    json_decref(root);
    return n > 0 ? n : 0;
}

/* -ln softmax(row)[target], in double, one fixed order. */
static double nll_row(const float *row, int V, int target) {
    return k3_log_sum_exp(row, V) - (double)row[target];
}

static bool row_finite(const float *row, int V, int *bad) {
    for (int i = 0; i < V; i++)
        if (!isfinite(row[i])) {
            *bad = i;
            return false;
        }
    return true;
}

typedef struct {
    int32_t *v;
    size_t n, cap;
    int vocab;
    const char *what;
} idbuf;

static int id_sink(void *ctx, const int32_t *ids, size_t n, size_t bytes, k3_err *err) {
    (void)bytes;
    idbuf *b = ctx;
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= b->vocab)
            return k3_fail(err, K3_EXIT_USAGE, "%s: token id %d is outside the model's vocabulary [0, %d)", b->what,
                           ids[i], b->vocab);
    if (b->n + n > b->cap) {
        b->cap = b->n + n > 2 * b->cap ? b->n + n : 2 * b->cap;
        b->v = xrealloc_array(b->v, b->cap, sizeof *b->v);
    }
    memcpy(b->v + b->n, ids, n * sizeof *ids);
    b->n += n;
    return K3_OK;
}

/* The ids the model scores: the raw text's, or each document's then the
 * separator's, as k3 prepare writes them into a shard. */
static int encode_text(const k3_engine *e, const char *what, const eval_text *t, int32_t **ids, size_t *n,
                       k3_err *err) {
    if (t->format == CORPUS_RAW)
        return k3_engine_encode(e, what, t->docs.n ? t->docs.doc[0] : "", t->docs.n ? t->docs.len[0] : 0, true, ids,
                                n, err);
    if (!k3_engine_tokenizer(e))
        return k3_fail(err, K3_EXIT_USAGE, "%s: no tokenizer (no tiktoken.model in %s): give --tok DIR", what,
                       k3_engine_model_dir(e));
    int32_t eot = corpus_separator_id(k3_engine_tokenizer(e));
    if (eot < 0)
        return k3_fail(err, K3_EXIT_USAGE,
                       "%s: the tokenizer has neither %s nor an eos_token to separate the %s documents (--format raw "
                       "scores the file as it is)",
                       what, CORPUS_EOT_TEXT, corpus_format_name(t->format));
    idbuf b = {.vocab = k3_engine_vocab(e), .what = what};
    int rc = corpus_encode(k3_engine_tokenizer(e), t->docs.doc, t->docs.len, t->docs.n, eot, id_sink, &b, NULL, err);
    if (rc) {
        free(b.v);
        return rc;
    }
    *ids = b.v ? b.v : xmalloc(sizeof(int32_t));
    *n = b.n;
    return K3_OK;
}

static int eval_model(const eval_args *a, const char *model_dir, const eval_text *text, eval_result *res,
                      k3_err *err) {
    memset(res, 0, sizeof *res);
    res->model = model_dir;
    int64_t ctx = a->ctx;
    if (!ctx) {
        int64_t mp = config_max_pos(model_dir);
        ctx = mp ? (mp < 4096 ? mp : 4096) : 256;
    }
    int64_t stride = a->stride ? a->stride : ctx;
    if (stride > ctx)
        return k3_fail(err, K3_EXIT_USAGE, "--stride %lld is longer than the window (--ctx %lld)", (long long)stride,
                       (long long)ctx);
    res->ctx = (int)ctx;
    res->stride = (int)stride;
    k3_engine_opts eo = a->eo;
    eo.model_dir = model_dir;
    eo.need_tokenizer = true;
    eo.max_pos = ctx;
    k3_engine *e = NULL;
    k3_state *s = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    int rc = k3_engine_open(&eo, &e, err);
    if (rc) return rc;
    size_t n = 0;
    if ((rc = encode_text(e, a->text_path, text, &ids, &n, err))) goto out;
    if (a->max_tokens && (int64_t)n > a->max_tokens) n = (size_t)a->max_tokens;
    {
        const int nb = tok_n_base(k3_engine_tokenizer(e));
        for (size_t i = 0; i < n; i++) {
            size_t bl = 0;
            if (ids[i] < nb && tok_token_bytes(k3_engine_tokenizer(e), ids[i], &bl)) res->span_bytes += (int64_t)bl;
        }
    }
    if (n < 2) {
        rc = k3_fail(err, K3_EXIT_USAGE, "%s: the text is %zu token%s: nothing to score (need at least 2)", a->text_path,
                     n, n == 1 ? "" : "s");
        goto out;
    }
    const int V = k3_engine_vocab(e);
    const size_t chunk = (size_t)k3_engine_chunk(e);
    if ((rc = k3_engine_state_new(e, ctx, (uint64_t)chunk * (uint64_t)V * sizeof(float), &s, err))) goto out;
    logits = xmalloc_array(chunk * (size_t)V, sizeof(float));
    const int nbase = tok_n_base(k3_engine_tokenizer(e));
    k3_progress pb;
    k3_progress_start(&pb, "eval", (uint64_t)(n - 1), false);
    if (a->quiet) pb.enabled = false;
    size_t scored_to = 0; /* targets ids[1..scored_to] are scored */
    for (size_t st = 0; st < n - 1 && !rc; st += (size_t)stride) {
        size_t end = st + (size_t)ctx < n - 1 ? st + (size_t)ctx : n - 1; /* inputs [st, end), targets up to end */
        k3_state_reset(s);
        res->windows++;
        /* inputs whose target is already scored are fed without logits */
        size_t first = scored_to > st ? scored_to : st; /* first input with a new target */
        if (first > st && (rc = k3_engine_feed(e, s, ids + st, first - st, NULL, false, true, NULL, err))) break;
        for (size_t p = first; p < end && !rc; p += chunk) {
            size_t m = end - p < chunk ? end - p : chunk;
            if ((rc = k3_engine_feed(e, s, ids + p, m, logits, true, true, NULL, err))) break;
            for (size_t i = 0; i < m; i++) {
                const float *row = logits + i * (size_t)V;
                int bad;
                if (!row_finite(row, V, &bad)) {
                    rc = k3_fail(err, K3_EXIT_DATA,
                                 "%s: logit %d is not finite at position %zu: the checkpoint holds non-finite weights",
                                 model_dir, bad, p + i);
                    break;
                }
                int32_t t = ids[p + i + 1];
                res->nats += nll_row(row, V, t);
                size_t bl = 0;
                if (t < nbase && tok_token_bytes(k3_engine_tokenizer(e), t, &bl)) res->bytes += (int64_t)bl;
                res->tokens++;
            }
        }
        scored_to = end;
        k3_progress_update(&pb, scored_to);
        if (end == n - 1) break;
    }
    if (!rc) k3_progress_finish(&pb);
out:
    free(logits);
    free(ids);
    if (s) k3_engine_state_free(e, s);
    k3_engine_free(e);
    return rc;
}

static double npt(const eval_result *r) { return r->tokens ? r->nats / (double)r->tokens : NAN; }
static double bpb(const eval_result *r) { return r->bytes ? r->nats / log(2.0) / (double)r->bytes : NAN; }

static json_t *result_json(const eval_result *r, const char *text, const eval_text *t) {
    json_t *o = json_object();
    json_object_set_new(o, "model", json_string(r->model));
    json_object_set_new(o, "text", json_string(text));
    json_object_set_new(o, "nats_per_token", json_real(npt(r)));
    json_object_set_new(o, "bits_per_byte", r->bytes ? json_real(bpb(r)) : json_null());
    json_object_set_new(o, "tokens", json_integer(r->tokens));
    json_object_set_new(o, "bytes", json_integer(r->bytes));
    json_object_set_new(o, "span_bytes", json_integer(r->span_bytes));
    json_object_set_new(o, "ctx", json_integer(r->ctx));
    json_object_set_new(o, "stride", json_integer(r->stride));
    json_object_set_new(o, "windows", json_integer(r->windows));
    json_object_set_new(o, "total_nats", json_real(r->nats));
    json_object_set_new(o, "format", json_string(corpus_format_name(t->format)));
    json_object_set_new(o, "documents", json_integer((json_int_t)t->docs.n));
    return o;
}

static void print_text(const char *text, const eval_text *t) {
    if (t->format == CORPUS_RAW) printf("%s: raw text, every byte scored\n", text);
    else printf("%s: %zu documents (--format %s), each followed by %s\n", text, t->docs.n,
                corpus_format_name(t->format), CORPUS_EOT_TEXT);
}

static void print_one(const eval_result *r, const char *text, const eval_text *t) {
    print_text(text, t);
    printf("%s on %s: %lld tokens (%lld bytes) scored in %lld windows of %d tokens, stride %d\n", r->model, text,
           (long long)r->tokens, (long long)r->bytes, (long long)r->windows, r->ctx, r->stride);
    printf("nats per token  %.6f\n", npt(r));
    if (r->bytes) printf("bits per byte   %.6f\n", bpb(r));
    else printf("bits per byte   - (the scored tokens cover no bytes)\n");
}

static void print_compare(const eval_result *r, const char *text, const eval_text *t) {
    print_text(text, t);
    printf("%s: windows of %d tokens, stride %d (A) / %d tokens, stride %d (B)\n", text, r[0].ctx, r[0].stride,
           r[1].ctx, r[1].stride);
    printf("%-16s %18s %18s\n", "", "A", "B");
    printf("%-16s %18s %18s\n", "model", r[0].model, r[1].model);
    printf("%-16s %18.6f %18.6f\n", "nats per token", npt(&r[0]), npt(&r[1]));
    printf("%-16s %18.6f %18.6f\n", "bits per byte", bpb(&r[0]), bpb(&r[1]));
    printf("%-16s %18lld %18lld\n", "tokens", (long long)r[0].tokens, (long long)r[1].tokens);
    printf("%-16s %18lld %18lld\n", "bytes", (long long)r[0].bytes, (long long)r[1].bytes);
    if (r[0].span_bytes != r[1].span_bytes) /* two tokenizers: N tokens are not the same text */
        printf("note: --max-tokens cuts the text after %lld bytes for A and %lld for B: the two scores are of "
               "different spans, not comparable\n", (long long)r[0].span_bytes, (long long)r[1].span_bytes);
}

int cmd_eval(int argc, char **argv) {
    eval_args a;
    memset(&a, 0, sizeof a);
    k3_engine_opts_init(&a.eo);
    const char *models[2] = {NULL, NULL};
    int nmodels = 0;
    bool compare = false;
    k3_err err = {0};
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t n;
        if (!strcmp(o, "--text")) {
            if (!v) return k3_usage_error("eval", "--text needs a value");
            a.text_path = v;
            i++;
        } else if (!strcmp(o, "--format")) {
            if (!v || !corpus_parse_format(v, &a.format))
                return k3_usage_error("eval", "--format: expected auto, stories, text, jsonl or raw, got '%s'",
                                      v ? v : "");
            i++;
        } else if (!strcmp(o, "--ctx") || !strcmp(o, "--stride")) {
            if (!v || !k3_parse_i64(v, 1, 1 << 20, &n))
                return k3_usage_error("eval", "%s: '%s' is not a token count in 1..1048576", o, v ? v : "");
            if (o[2] == 'c') a.ctx = (int)n;
            else a.stride = (int)n;
            i++;
        } else if (!strcmp(o, "--max-tokens")) {
            if (!v || !k3_parse_i64(v, 2, INT64_MAX / 2, &n))
                return k3_usage_error("eval", "--max-tokens: '%s' is not a count >= 2", v ? v : "");
            a.max_tokens = n;
            i++;
        } else if (!strcmp(o, "--compare")) {
            if (i + 2 >= argc) return k3_usage_error("eval", "--compare needs two model directories");
            if (compare || nmodels) return k3_usage_error("eval", "--compare takes the place of MODEL_DIR");
            models[0] = argv[i + 1];
            models[1] = argv[i + 2];
            nmodels = 2;
            compare = true;
            i += 2;
        } else if (!strcmp(o, "--json")) {
            a.json = true;
        } else if (!strcmp(o, "--quiet")) {
            a.quiet = true;
        } else if (o[0] == '-' && o[1]) {
            bool used = false;
            if (k3_engine_parse_flag(&a.eo, "eval", argc, argv, &i, &used, &err)) return k3_report(&err);
            if (!used) return k3_usage_error("eval", "unknown option '%s'", o);
        } else {
            if (nmodels) return k3_usage_error("eval", compare ? "--compare takes the place of MODEL_DIR"
                                                               : "unexpected argument '%s'", o);
            models[nmodels++] = o;
        }
    }
    if (a.eo.mem.list_presets) {
        k3_presets_print(stdout);
        return K3_OK;
    }
    if (!nmodels) return k3_usage_error("eval", "no MODEL_DIR given");
    if (!a.text_path) return k3_usage_error("eval", "give the text to score: --text FILE");
    if (a.ctx && a.stride > a.ctx)
        return k3_usage_error("eval", "--stride %d is longer than --ctx %d", a.stride, a.ctx);
    char *text = NULL;
    size_t len = 0;
    int rc = k3_read_file(a.text_path, &text, &len, &err);
    if (rc) return k3_report(&err);
    eval_text t = {0};
    rc = corpus_read_text(&t.docs, a.text_path, text, len, a.format, CORPUS_RAW, &t.format, &err);
    eval_result res[2];
    for (int m = 0; m < nmodels && !rc; m++) rc = eval_model(&a, models[m], &t, &res[m], &err);
    if (rc) {
        corpus_free(&t.docs);
        free(text);
        return k3_report(&err);
    }
    if (a.json) {
        json_t *o = compare ? json_pack("{s:o, s:o, s:b}", "a", result_json(&res[0], a.text_path, &t), "b",
                                        result_json(&res[1], a.text_path, &t), "same_span",
                                        res[0].span_bytes == res[1].span_bytes)
                            : result_json(&res[0], a.text_path, &t);
        char *s = json_dumps(o, JSON_INDENT(1) | JSON_REAL_PRECISION(17));
        json_decref(o);
        if (s) puts(s);
        free(s);
    } else if (compare) {
        print_compare(res, a.text_path, &t);
    } else {
        print_one(&res[0], a.text_path, &t);
    }
    corpus_free(&t.docs);
    free(text);
    return K3_OK;
}
