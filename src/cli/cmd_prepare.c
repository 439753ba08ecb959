/* cmd_prepare.c: `k3 prepare`: read a text corpus, split it into training and
 * validation stories, train a byte-level BPE tokenizer (or reuse one), and
 * write both splits as token shards (train/data.h) beside the tokenizer.
 * With --format chat the documents are chat conversations: the tokenizer
 * also gets the XTML markup ids, and each conversation is written as the
 * ids the chat template (chat/chat.h) renders for it, so a model trained on
 * the shards sees exactly what `k3 chat` and `k3 serve` feed it. */
#include "chat/chat.h"
#include "cli/commands.h"
#include "tokenizer/bpe_train.h"
#include "tokenizer/tokenizer.h"
#include "train/corpus.h"
#include "train/data.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <dirent.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *const cmd_prepare_help =
    "usage: k3 prepare --input FILE... --output-dir DIR [options]\n"
    "\n"
    "Reads a text corpus, splits it into training and validation stories, trains a\n"
    "byte-level BPE tokenizer on the training stories and writes, into DIR:\n"
    "  tiktoken.model, tokenizer_config.json   the tokenizer (as `k3 run` loads it)\n"
    "  train.bin, val.bin                      token shards (docs/prepare.md)\n"
    "  stats.json                              stories, bytes, tokens per split\n"
    "Stories are joined with the <|endoftext|> id after each story.\n"
    "\n"
    "input:\n"
    "  --input FILE...            one or more files, read in order\n"
    "  --format F                 auto (default), stories, text, jsonl or chat:\n"
    "                               stories: stories separated by a line <|endoftext|>\n"
    "                               text:    documents separated by blank lines\n"
    "                               jsonl:   one JSON object per line, its \"text\" field\n"
    "                               chat:    one conversation per line, a chat request\n"
    "                                        ({\"messages\": [...], \"thinking\": ...}, as\n"
    "                                        `k3 tokenize --chat` takes it) ending with the\n"
    "                                        assistant's reply; written as the chat\n"
    "                                        template renders it, and the tokenizer gets\n"
    "                                        the XTML ids <|open|> <|close|> <|sep|>\n"
    "                                        <|end_of_msg|> [EOS] (never chosen by auto)\n"
    "                             auto picks jsonl for *.jsonl or a first '{', stories\n"
    "                             when a line <|endoftext|> occurs, else text\n"
    "  --validation-input FILE... validation stories come from these files (and none\n"
    "                             are taken from --input)\n"
    "  --validation-stories N     the last N input stories are the validation split\n"
    "  --validation-fraction F    the last F of the input stories (default 0.05)\n"
    "\n"
    "tokenizer:\n"
    "  --vocab-size N             total ids, specials included (default 8192). The\n"
    "                             one id after the BPE tokens is the special\n"
    "                             <|endoftext|>, so N-1 are BPE tokens; at least 257\n"
    "                             (with --format chat six specials follow: N-6)\n"
    "  --tokenizer-stories N      train on the first N training stories (default all)\n"
    "  --pattern kimi|gpt2        pre-tokenizer pattern (default kimi)\n"
    "  --tokenizer DIR            reuse the tokenizer in DIR instead of training one\n"
    "  --threads N                worker threads (default: OMP_NUM_THREADS or all cores)\n"
    "\n"
    "Errors (missing input, empty corpus, vocabulary too small, bad flags) print one\n"
    "line and exit 2.\n";

/* Special ids after the BPE ranks. The Kimi layout reserves 256; a trained
 * tokenizer records its own count ("num_reserved_special_tokens") so a small
 * vocabulary is not spent on unused specials: just <|endoftext|>. */
#define N_RESERVED 1

/* A chat model's specials: <|endoftext|> still separates the conversations in
 * the shards, the rest are the markup the template writes and the parser and
 * the stop test read by id. */
static const char *const chat_specials[] = {CORPUS_EOT_TEXT, "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>",
                                            "[EOS]"};
#define N_CHAT_SPECIALS 6

/* ---- tokenizing a split into a shard -------------------------------------- */
typedef struct {
    uint64_t stories, bytes, tokens;
} split_stats;

typedef struct {
    k3_shard_writer *w;
    split_stats *st;
} shard_sink_ctx;

static int shard_sink(void *ctx, const int32_t *ids, size_t n, size_t bytes, k3_err *err) {
    shard_sink_ctx *c = ctx;
    int rc = shard_writer_append(c->w, ids, n, err);
    if (!rc) {
        c->st->tokens += n;
        c->st->bytes += bytes;
    }
    return rc;
}

/* A split's shard made whole (n documents written) or, after an error,
 * removed. */
static int close_split(k3_shard_writer *w, int rc, size_t n, split_stats *st, k3_err *err) {
    if (rc) {
        shard_writer_abort(w);
        return rc;
    }
    st->stories = n;
    shard_writer_add_docs(w, n);
    return shard_writer_commit(w, NULL, err);
}

static int write_split(const k3_tokenizer *tk, const char *path, const char *const *doc,
                       const size_t *len, size_t n, int32_t eot, uint64_t tok_hash,
                       const char *label, split_stats *st, k3_err *err) {
    k3_shard_writer *w;
    int rc = shard_writer_open(path, (uint32_t)tok_vocab_size(tk), (uint32_t)eot, tok_hash, &w, err);
    if (rc) return rc;
    memset(st, 0, sizeof *st);
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) total += len[i];
    k3_progress prog;
    k3_progress_start(&prog, label, total, true);
    shard_sink_ctx sc = {w, st};
    rc = corpus_encode(tk, doc, len, n, eot, shard_sink, &sc, &prog, err);
    k3_progress_finish(&prog);
    return close_split(w, rc, n, st, err);
}

/* ---- chat conversations (--format chat) ---------------------------------- */
typedef struct {
    json_t **conv;      /* chat requests, add_generation_prompt false */
    const char **file;  /* where each came from, for errors */
    size_t *line;
    size_t n, cap;
} chat_set;

static void chat_set_free(chat_set *cs) {
    for (size_t i = 0; i < cs->n; i++) json_decref(cs->conv[i]);
    free(cs->conv);
    free(cs->file);
    free(cs->line);
    memset(cs, 0, sizeof *cs);
}

/* One conversation per non-blank line: a chat request whose fields the
 * template reads (checked as `k3 tokenize --chat` checks them) and whose
 * last message is the assistant's reply, the text the model learns to
 * write. */
static int chat_read(chat_set *cs, const char *path, k3_err *err) {
    char *text;
    size_t len, pos = 0, line = 0;
    int rc = k3_read_file(path, &text, &len, err);
    if (rc) return rc;
    while (!rc && pos < len) {
        line++;
        const char *nl = memchr(text + pos, '\n', len - pos);
        size_t e = nl ? (size_t)(nl - text) : len, b = pos;
        while (b < e && (text[b] == ' ' || text[b] == '\t' || text[b] == '\r')) b++;
        if (b < e) {
            json_error_t je;
            k3_err fe = {0};
            json_t *o = json_loadb(text + pos, e - pos, 0, &je);
            json_t *msgs = json_object_get(o, "messages"), *agp = json_object_get(o, "add_generation_prompt");
            size_t nm = json_is_array(msgs) ? json_array_size(msgs) : 0;
            const char *role = nm ? json_string_value(json_object_get(json_array_get(msgs, nm - 1), "role")) : NULL;
            if (!o) rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: %s", path, line, je.text);
            else if (!json_is_object(o)) rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: not a JSON object", path, line);
            else if (k3_chat_check_fields(o, &fe)) rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: %s", path, line, fe.msg);
            else if (!role || strcmp(role, "assistant"))
                rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: the last message must be the assistant's reply", path, line);
            else if (agp && !json_is_false(agp))
                rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: add_generation_prompt: a conversation ends with its reply, "
                             "so it must be false or absent", path, line);
            if (rc) {
                json_decref(o);
                break;
            }
            json_object_set_new(o, "add_generation_prompt", json_false());
            if (cs->n == cs->cap) {
                cs->cap = cs->cap ? 2 * cs->cap : 1024;
                cs->conv = xrealloc_array(cs->conv, cs->cap, sizeof *cs->conv);
                cs->file = xrealloc_array(cs->file, cs->cap, sizeof *cs->file);
                cs->line = xrealloc_array(cs->line, cs->cap, sizeof *cs->line);
            }
            cs->conv[cs->n] = o;
            cs->file[cs->n] = path;
            cs->line[cs->n++] = line;
        }
        pos = nl ? e + 1 : len;
    }
    free(text);
    return rc;
}

/* The texts of conversations [0, n), what the tokenizer is trained on:
 * every message's content (a string, or its text parts) and reasoning.
 * Pointers into the JSON; the arrays are malloc'd. */
static size_t chat_texts(const chat_set *cs, size_t n, const char ***docs, size_t **lens) {
    size_t nd = 0, cap = 1024;
    *docs = xmalloc_array(cap, sizeof **docs);
    *lens = xmalloc_array(cap, sizeof **lens);
    for (size_t i = 0; i < n; i++) {
        size_t k;
        json_t *m;
        json_array_foreach(json_object_get(cs->conv[i], "messages"), k, m) {
            json_t *parts[64];
            size_t np = 0, j;
            json_t *c = json_object_get(m, "content"), *part;
            parts[np++] = json_object_get(m, "reasoning_content");
            if (json_is_array(c)) {
                json_array_foreach(c, j, part) if (np < 64) parts[np++] = json_object_get(part, "text");
            } else {
                parts[np++] = c;
            }
            for (j = 0; j < np; j++) {
                if (!json_is_string(parts[j]) || !json_string_length(parts[j])) continue;
                if (nd == cap) {
                    cap *= 2;
                    *docs = xrealloc_array(*docs, cap, sizeof **docs);
                    *lens = xrealloc_array(*lens, cap, sizeof **lens);
                }
                (*docs)[nd] = json_string_value(parts[j]);
                (*lens)[nd++] = json_string_length(parts[j]);
            }
        }
    }
    return nd;
}

/* Conversations [0, n) as the template renders them, each followed by eot.
 * A split's bytes are its text's: the markup ids count as tokens, not
 * bytes. */
static int write_chat_split(const k3_tokenizer *tk, const k3_chat *ch, const char *path, const chat_set *cs,
                            size_t from, size_t n, int32_t eot, uint64_t tok_hash, const char *label,
                            split_stats *st, k3_err *err) {
    k3_shard_writer *w;
    int rc = shard_writer_open(path, (uint32_t)tok_vocab_size(tk), (uint32_t)eot, tok_hash, &w, err);
    if (rc) return rc;
    memset(st, 0, sizeof *st);
    k3_progress prog;
    k3_progress_start(&prog, label, n, false);
    for (size_t i = from; i < from + n && !rc; i++) {
        int32_t *ids = NULL;
        size_t m = 0;
        k3_err ce = {0};
        if (k3_chat_encode(ch, cs->conv[i], &ids, &m, &ce)) {
            rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: %s", cs->file[i], cs->line[i], ce.msg);
            break;
        }
        for (size_t j = 0; j < m; j++) {
            size_t b = 0;
            if (ids[j] < tok_n_base(tk)) (void)tok_token_bytes(tk, ids[j], &b);
            st->bytes += b;
        }
        rc = shard_writer_append(w, ids, m, err);
        if (!rc) rc = shard_writer_append(w, &eot, 1, err);
        st->tokens += m + 1;
        free(ids);
        k3_progress_update(&prog, i - from + 1);
    }
    k3_progress_finish(&prog);
    return close_split(w, rc, n, st, err);
}

/* ---- flags ----------------------------------------------------------------- */
static int parse_u64(const char *flag, const char *v, uint64_t lo, uint64_t hi, uint64_t *out) {
    char *e;
    errno = 0;
    unsigned long long x = strtoull(v, &e, 10);
    if (!*v || *e || errno || v[0] == '-' || x < lo || x > hi)
        return k3_usage_error("prepare", "%s: expected an integer in %llu..%llu, got '%s'", flag,
                              (unsigned long long)lo, (unsigned long long)hi, v);
    *out = x;
    return 0;
}

static int copy_file(const char *src, const char *dst, bool optional, k3_err *err) {
    if (optional && access(src, F_OK) != 0) return 0;
    char *d;
    size_t n;
    int rc = k3_read_file(src, &d, &n, err);
    if (rc) return rc;
    rc = k3_write_file_atomic(dst, d, n, err);
    free(d);
    return rc;
}

static json_t *split_json(const split_stats *s) {
    json_t *o = json_object();
    json_object_set_new(o, "stories", json_integer((json_int_t)s->stories));
    json_object_set_new(o, "bytes", json_integer((json_int_t)s->bytes));
    json_object_set_new(o, "tokens", json_integer((json_int_t)s->tokens));
    /* separators are not text: bytes per token counts only the text's tokens */
    uint64_t text_tokens = s->tokens - s->stories;
    json_object_set_new(o, "bytes_per_token", json_real(text_tokens ? (double)s->bytes / (double)text_tokens : 0.0));
    return o;
}

static void remove_stale_stages(const char *out_dir) {
    DIR *d = opendir(out_dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t pid;
        if (strncmp(e->d_name, ".k3-prepare.tmp.", 16) != 0 || !k3_parse_i64(e->d_name + 16, 1, INT32_MAX, &pid) ||
            !k3_pid_gone(pid))
            continue;
        char *p = k3_path_join(out_dir, e->d_name); /* the staging directory holds plain files only */
        k3_remove_flat_dir(p);
        free(p);
    }
    closedir(d);
}

/* Moves every staged file into out_dir (each rename is atomic). */
static int unstage(const char *stage, const char *out_dir, k3_err *err) {
    DIR *d = opendir(stage);
    if (!d) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot read: %s", stage, strerror(errno));
    struct dirent *e;
    int rc = K3_OK;
    while (!rc && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *from = k3_path_join(stage, e->d_name), *to = k3_path_join(out_dir, e->d_name);
        if (rename(from, to) != 0) rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot move into place: %s", to, strerror(errno));
        free(from);
        free(to);
    }
    closedir(d);
    if (!rc) rmdir(stage);
    return rc;
}

int cmd_prepare(int argc, char **argv) {
    const char **inputs = xcalloc((size_t)argc, sizeof *inputs), **vinputs = xcalloc((size_t)argc, sizeof *vinputs);
    int n_in = 0, n_vin = 0;
    const char *out_dir = NULL, *tok_dir = NULL, *pattern = "kimi";
    char stage[3900];
    bool staged = false;
    uint64_t vocab = 8192, tok_stories = 0, val_stories = 0, threads = 0;
    double val_frac = 0.05;
    bool have_val_stories = false, have_val_frac = false;
    corpus_format fmt = CORPUS_AUTO;
    bool chat = false;
    int rc = 0;
    for (int i = 1; i < argc && !rc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
        if (!strcmp(a, "--input") || !strcmp(a, "--validation-input")) {
            bool val = a[2] == 'v';
            int before = val ? n_vin : n_in;
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                if (val) vinputs[n_vin++] = argv[++i];
                else inputs[n_in++] = argv[++i];
            }
            if ((val ? n_vin : n_in) == before) rc = k3_usage_error("prepare", "%s needs at least one file", a);
        } else if (!has_val && (!strcmp(a, "--output-dir") || !strcmp(a, "--vocab-size") ||
                                !strcmp(a, "--tokenizer-stories") || !strcmp(a, "--validation-stories") ||
                                !strcmp(a, "--validation-fraction") || !strcmp(a, "--pattern") ||
                                !strcmp(a, "--tokenizer") || !strcmp(a, "--format") || !strcmp(a, "--threads"))) {
            rc = k3_usage_error("prepare", "%s needs a value", a);
        } else if (!strcmp(a, "--output-dir")) {
            out_dir = argv[++i];
        } else if (!strcmp(a, "--vocab-size")) {
            rc = parse_u64(a, argv[++i], 0, 1u << 24, &vocab);
        } else if (!strcmp(a, "--tokenizer-stories")) {
            rc = parse_u64(a, argv[++i], 1, UINT64_MAX, &tok_stories);
        } else if (!strcmp(a, "--validation-stories")) {
            rc = parse_u64(a, argv[++i], 0, UINT64_MAX, &val_stories);
            have_val_stories = true;
        } else if (!strcmp(a, "--validation-fraction")) {
            char *e;
            val_frac = strtod(argv[++i], &e);
            if (!*argv[i] || *e || !(val_frac >= 0.0 && val_frac < 1.0))
                rc = k3_usage_error("prepare", "--validation-fraction: expected a number in [0, 1), got '%s'", argv[i]);
            have_val_frac = true;
        } else if (!strcmp(a, "--pattern")) {
            pattern = argv[++i];
            if (strcmp(pattern, "kimi") && strcmp(pattern, "gpt2"))
                rc = k3_usage_error("prepare", "--pattern: expected kimi or gpt2, got '%s'", pattern);
        } else if (!strcmp(a, "--tokenizer")) {
            tok_dir = argv[++i];
        } else if (!strcmp(a, "--format")) {
            const char *f = argv[++i];
            chat = !strcmp(f, "chat");
            if (!chat && (!corpus_parse_format(f, &fmt) || fmt == CORPUS_RAW))
                rc = k3_usage_error("prepare", "--format: expected auto, stories, text, jsonl or chat, got '%s'", f);
        } else if (!strcmp(a, "--threads")) {
            rc = parse_u64(a, argv[++i], 1, 4096, &threads);
        } else {
            rc = k3_usage_error("prepare", "unknown argument '%s'", a);
        }
    }
    if (!rc && !n_in) rc = k3_usage_error("prepare", "--input FILE... is required");
    if (!rc && !out_dir) rc = k3_usage_error("prepare", "--output-dir DIR is required");
    if (!rc && have_val_stories + have_val_frac + (n_vin > 0) > 1)
        rc = k3_usage_error("prepare", "give only one of --validation-input, --validation-stories, --validation-fraction");
    int n_reserved = chat ? N_CHAT_SPECIALS : N_RESERVED;
    if (!rc && !tok_dir && vocab < 256 + (uint64_t)n_reserved)
        rc = k3_usage_error("prepare", "--vocab-size %llu is too small: the 256 byte tokens and %d special id%s need at least %d",
                            (unsigned long long)vocab, n_reserved, n_reserved == 1 ? "" : "s", 256 + n_reserved);
    if (rc) {
        free(inputs);
        free(vinputs);
        return rc;
    }
    if (threads) omp_set_num_threads((int)threads);

    k3_err err = {0};
    corpus train = {0}, valc = {0};
    chat_set ctrain = {0}, cval = {0};
    const char **cdocs = NULL;
    size_t *clens = NULL;
    k3_chat *ch = NULL;
    k3_tokenizer *tk = NULL;
    char path[4096];
    double t0 = k3_now(), t_tok = 0, t_enc = 0;
    split_stats st_train = {0}, st_val = {0};
    size_t n_tok_stories = 0;
    const char **vdoc;
    const size_t *vlen;
    size_t n_val;
    if (chat) {
        /* the conversations stand in for the stories from here on: train.n
         * and valc.n count them, the tokenizer's documents are their texts */
        for (int i = 0; i < n_in && !rc; i++) rc = chat_read(&ctrain, inputs[i], &err);
        for (int i = 0; i < n_vin && !rc; i++) rc = chat_read(&cval, vinputs[i], &err);
        train.n = ctrain.n;
        valc.n = cval.n;
    } else {
        for (int i = 0; i < n_in && !rc; i++) rc = corpus_read_file(&train, inputs[i], fmt, CORPUS_TEXT, NULL, &err);
        for (int i = 0; i < n_vin && !rc; i++) rc = corpus_read_file(&valc, vinputs[i], fmt, CORPUS_TEXT, NULL, &err);
    }
    if (rc) goto done;
    if (train.n == 0) {
        rc = k3_fail(&err, K3_EXIT_USAGE, "%s%s: empty corpus (no stories)", inputs[0], n_in > 1 ? " ..." : "");
        goto done;
    }
    /* validation: the separate files, or the last stories of the input */
    if (n_vin) {
        if (valc.n == 0) {
            rc = k3_fail(&err, K3_EXIT_USAGE, "%s: empty validation corpus (no stories)", vinputs[0]);
            goto done;
        }
        vdoc = valc.doc;
        vlen = valc.len;
        n_val = valc.n;
    } else {
        n_val = have_val_stories ? (size_t)val_stories : (size_t)llround(val_frac * (double)train.n);
        if (n_val >= train.n) {
            rc = k3_fail(&err, K3_EXIT_USAGE, "%s: %zu stories, so %zu for validation leaves none to train on",
                         inputs[0], train.n, n_val);
            goto done;
        }
        train.n -= n_val;
        vdoc = chat ? NULL : train.doc + train.n;
        vlen = chat ? NULL : train.len + train.n;
    }
    if ((rc = k3_mkdir_p(out_dir, &err))) goto done;
    /* Everything is written into a staging directory inside out_dir and moved
     * into place only when all of it is written: a failure (a full disk, a
     * bad input half-way) leaves the previous tokenizer and shards whole. A
     * staging directory of a process that no longer exists is removed. */
    remove_stale_stages(out_dir);
    if (snprintf(stage, sizeof stage, "%s/.k3-prepare.tmp.%ld", out_dir, (long)getpid()) >= (int)sizeof stage) {
        rc = k3_fail(&err, K3_EXIT_USAGE, "%s: path too long", out_dir);
        goto done;
    }
    if (mkdir(stage, 0755) != 0) {
        rc = k3_fail(&err, K3_EXIT_RUNTIME, "%s: cannot create: %s", stage, strerror(errno));
        goto done;
    }
    staged = true;
    const char *wdir = stage;

    if (tok_dir) {
        /* reuse: copy the tokenizer so the output directory is self-contained */
        char src[4096];
        const char *names[2] = {"tiktoken.model", "tokenizer_config.json"};
        for (int k = 0; k < 2 && !rc; k++) {
            if (snprintf(src, sizeof src, "%s/%s", tok_dir, names[k]) >= (int)sizeof src ||
                snprintf(path, sizeof path, "%s/%s", wdir, names[k]) >= (int)sizeof path) {
                rc = k3_fail(&err, K3_EXIT_USAGE, "%s: path too long", out_dir);
                break;
            }
            if (k == 0 && access(src, F_OK) != 0) {
                rc = k3_fail(&err, K3_EXIT_USAGE, "%s: no tiktoken.model in --tokenizer directory", tok_dir);
                break;
            }
            rc = copy_file(src, path, k == 1, &err);
        }
        if (rc) goto done;
    } else {
        /* train on the first N training stories */
        double ts = k3_now();
        n_tok_stories = tok_stories && tok_stories < train.n ? (size_t)tok_stories : train.n;
        tok_splitter *sp;
        if ((rc = tok_splitter_new(strcmp(pattern, "gpt2") ? TOK_PATTERN_KIMI : TOK_PATTERN_GPT2, &sp, &err))) goto done;
        const char *const *tdoc = train.doc;
        const size_t *tlen = train.len;
        size_t n_tdoc = n_tok_stories;
        static const char *const story_specials[1] = {CORPUS_EOT_TEXT};
        const char *const *specials = chat ? chat_specials : story_specials;
        if (chat) {
            n_tdoc = chat_texts(&ctrain, n_tok_stories, &cdocs, &clens);
            tdoc = cdocs;
            tlen = clens;
        }
        uint64_t tb = 0;
        for (size_t i = 0; i < n_tdoc; i++) tb += tlen[i];
        k3_progress prog;
        k3_progress_start(&prog, "pre-tokens", tb, true);
        bpe_counts *cnt = bpe_counts_new();
        rc = bpe_count_docs(cnt, sp, tdoc, tlen, n_tdoc, specials, n_reserved, &prog, &err);
        k3_progress_finish(&prog);
        tok_splitter_free(sp);
        bpe_model m = {0};
        if (!rc) {
            bpe_train_opts o = {.target_tokens = (int)(vocab - (uint64_t)n_reserved), .unique_tokens = true, .progress = true};
            rc = bpe_train(cnt, &o, &m, &err);
        }
        bpe_counts_free(cnt);
        if (!rc && m.n_tokens < (int)(vocab - (uint64_t)n_reserved))
            fprintf(stderr, "k3: note: the tokenizer stories allow only %d BPE tokens; the vocabulary is %d, not %llu\n",
                    m.n_tokens, m.n_tokens + n_reserved, (unsigned long long)vocab);
        if (!rc) rc = bpe_write_tiktoken(&m, wdir, specials, n_reserved, n_reserved, CORPUS_EOT_TEXT, pattern, &err);
        bpe_model_free(&m);
        if (rc) goto done;
        t_tok = k3_now() - ts;
    }

    if ((rc = tok_load(wdir, &tk, &err))) goto done;
    int32_t eot = corpus_separator_id(tk);
    if (eot < 0) {
        rc = k3_fail(&err, K3_EXIT_USAGE, "%s: tokenizer has neither %s nor an eos_token to separate stories",
                     tok_dir ? tok_dir : out_dir, CORPUS_EOT_TEXT);
        goto done;
    }
    uint64_t hash;
    if ((rc = data_tokenizer_hash(wdir, &hash, &err))) goto done;
    double te = k3_now();
    if (snprintf(path, sizeof path, "%s/train.bin", wdir) >= (int)sizeof path) {
        rc = k3_fail(&err, K3_EXIT_USAGE, "%s: path too long", out_dir);
        goto done;
    }
    k3_err ce = {0};
    if (chat && k3_chat_new(tk, &ch, &ce)) {
        rc = k3_fail(&err, K3_EXIT_USAGE, "%s: %s", tok_dir ? tok_dir : out_dir, ce.msg);
        goto done;
    }
    if (chat) rc = write_chat_split(tk, ch, path, &ctrain, 0, train.n, eot, hash, "tokenize train", &st_train, &err);
    else rc = write_split(tk, path, train.doc, train.len, train.n, eot, hash, "tokenize train", &st_train, &err);
    if (!rc && n_val) {
        snprintf(path, sizeof path, "%s/val.bin", wdir);
        if (chat)
            rc = write_chat_split(tk, ch, path, n_vin ? &cval : &ctrain, n_vin ? 0 : train.n, n_val, eot, hash,
                                  "tokenize val", &st_val, &err);
        else rc = write_split(tk, path, vdoc, vlen, n_val, eot, hash, "tokenize val", &st_val, &err);
    }
    if (rc) goto done;
    t_enc = k3_now() - te;

    json_t *root = json_object();
    json_object_set_new(root, "vocab_size", json_integer(tok_vocab_size(tk)));
    json_object_set_new(root, "bpe_tokens", json_integer(tok_n_base(tk)));
    json_object_set_new(root, "eot_id", json_integer(eot));
    json_object_set_new(root, "tokenizer", json_string(tok_dir ? "reused" : "trained"));
    if (!tok_dir) {
        json_object_set_new(root, "pattern", json_string(pattern));
        json_object_set_new(root, "tokenizer_stories", json_integer((json_int_t)n_tok_stories));
    }
    json_object_set_new(root, "train", split_json(&st_train));
    json_object_set_new(root, "validation", split_json(&st_val));
    json_object_set_new(root, "seconds_tokenizer", json_real(t_tok));
    json_object_set_new(root, "seconds_tokenize", json_real(t_enc));
    json_object_set_new(root, "seconds_total", json_real(k3_now() - t0));
    char *js = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    snprintf(path, sizeof path, "%s/stats.json", wdir);
    size_t jl = strlen(js);
    js = xrealloc(js, jl + 2);
    js[jl] = '\n';
    rc = k3_write_file_atomic(path, js, jl + 1, &err);
    free(js);
    if (rc) goto done;
    if ((rc = unstage(stage, out_dir, &err))) goto done;
    staged = false;

    printf("%-11s %10s %14s %12s %12s\n", "split", "stories", "bytes", "tokens", "bytes/token");
    const split_stats *ss[2] = {&st_train, &st_val};
    const char *names[2] = {"train", "validation"};
    for (int k = 0; k < 2; k++) {
        uint64_t tt = ss[k]->tokens - ss[k]->stories;
        printf("%-11s %10llu %14llu %12llu %12.3f\n", names[k], (unsigned long long)ss[k]->stories,
               (unsigned long long)ss[k]->bytes, (unsigned long long)ss[k]->tokens,
               tt ? (double)ss[k]->bytes / (double)tt : 0.0);
    }
    printf("vocabulary %d (%d BPE tokens), <|endoftext|> = %d; tokenizer %.1fs, tokenize %.1fs; wrote %s\n",
           tok_vocab_size(tk), tok_n_base(tk), eot, t_tok, t_enc, out_dir);

done:
    if (staged) k3_remove_flat_dir(stage);
    if (ch) k3_chat_free(ch);
    if (tk) tok_free(tk);
    if (chat) train.n = valc.n = 0;
    corpus_free(&train);
    corpus_free(&valc);
    chat_set_free(&ctrain);
    chat_set_free(&cval);
    free(cdocs);
    free(clens);
    free(inputs);
    free(vinputs);
    return rc ? k3_report(&err) : 0;
}
