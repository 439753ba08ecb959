/* cmd_chat.c: `k3 chat MODEL_DIR`: an interactive chat in the terminal.
 *
 * Each turn renders the whole conversation with the XTML template
 * (src/chat) and hands the ids to a session (src/session), which feeds only
 * what its state has not seen; replies are parsed by token id into reasoning
 * and answer. Standard input that is not a terminal works the same, one
 * message per line (how the tests drive it). A failing line (a refused
 * message, a /save or --out write that fails) prints one error line and the
 * chat goes on; the exit status at the end is the first failure's code, so a
 * script knows (a command's error is never taken for /quit). */
#include "chat/chat.h"
#include "cli/commands.h"
#include "draft/draft.h"
#include "engine/engine.h"
#include "generate/generate.h"
#include "session/session.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *const cmd_chat_help =
    "usage: k3 chat MODEL_DIR [options]\n"
    "\n"
    "Chats with a Kimi K3 chat model (a tokenizer with the XTML ids) in the\n"
    "terminal. Type a message and Enter; lines starting with / are commands:\n"
    "  /reset          forget the conversation (the state cache stays)\n"
    "  /save FILE      save the conversation and its decode state\n"
    "  /load FILE      continue a saved conversation (same model only)\n"
    "  /think on|off   thinking for the next turns\n"
    "  /help, /quit     (Ctrl-C stops a reply; at the prompt, or Ctrl-D, it quits)\n"
    "Reasoning is shown dimmed (prefixed with '[think] ' when stdout is not a\n"
    "terminal); time to first token and tokens/s follow each reply on stderr.\n"
    "Standard input need not be a terminal: one message (or command) a line.\n"
    "\n"
    "options:\n"
    "  --system TEXT        system prompt\n"
    "  --think, --no-think  thinking on (default) or off\n"
    "  --gen N              at most N tokens per reply (default 1024)\n"
    "  --max-context N      positions the conversation may reach (default 4096)\n"
    K3_SAMPLE_HELP
    "                       (turn t, from 0, samples with seed S + t, as\n"
    "                       `k3 run --seed S+t` would)\n"
    "  --state-cache-gb G   budget of the state cache (default 2; 0: none). It\n"
    "                       keeps decode-state snapshots at turn ends and every\n"
    "                       --state-grid positions, so a history that re-renders\n"
    "                       differently from what was generated resumes from the\n"
    "                       deepest snapshot before the difference\n"
    "  --state-grid N       positions between grid snapshots (default 1024)\n"
    "  --speculate K        speculative decoding: up to K drafted ids (1-16) verified\n"
    "                       per forward pass; drafts from the whole conversation\n"
    "                       (n-gram lookup) unless --draft is given. The replies\n"
    "                       are exactly those without it (docs/speculation.md)\n"
    K3_DRAFT_HELP
    K3_DRAFT_P_MIN_HELP
    "  --load FILE          start from a saved conversation: its messages, thinking\n"
    "                       setting and turn count (over --system and --think)\n"
    "  --cold               re-prefill the whole conversation every turn (for\n"
    "                       comparison: the replies are the same bits)\n"
    "  --out FILE.json      after every turn, write the turns (prompt_ids,\n"
    "                       generated_ids, reused, ttft_s, tokens_per_s,\n"
    "                       decode_passes, drafts_proposed, drafts_accepted) and\n"
    "                       the messages\n"
    "\n" K3_ENGINE_HELP
    "\n"
    "A line that fails (a refused message or command, a /save, /load or --out\n"
    "that cannot be done) prints one error line and the chat goes on, the\n"
    "conversation kept; the exit status at the end is the first failure's code.\n"
    "\n"
    "exit codes: 0 ok, 1 runtime/I-O (a file that cannot be written or read),\n"
    "2 usage (a model without a tokenizer or without the XTML ids, a\n"
    "conversation longer than --max-context, a refused line), 3 cannot\n"
    "fit the memory budget, 4 checkpoint or session file data error (a session\n"
    "of another model, a corrupt or truncated file)\n";

typedef struct {
    const char *model_dir, *system, *load, *out;
    bool thinking, cold;
    int64_t gen, max_ctx, grid;
    k3_spec_flags sf;      /* --speculate, --draft, --draft-p-min */
    k3_sample_opts so;     /* sampling flags (engine/engine.h) */
    uint64_t cache_bytes;  /* --state-cache-gb */
    k3_engine_opts eo;
} chat_args;

static int parse_args(int argc, char **argv, chat_args *a) {
    memset(a, 0, sizeof *a);
    k3_engine_opts_init(&a->eo);
    a->thinking = true;
    a->gen = 1024;
    a->max_ctx = 4096;
    k3_sample_opts_init(&a->so);
    k3_spec_flags_init(&a->sf);
    a->cache_bytes = K3_STATE_CACHE_BYTES_DEFAULT;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE() \
    do { if (!v) return k3_usage_error("chat", "%s needs a value", o); i++; } while (0)
        int64_t n;
        if (!strcmp(o, "--help") || !strcmp(o, "-h")) {
            fputs(cmd_chat_help, stdout);
            return -1;
        }
        if (o[0] != '-' || !o[1]) {
            if (a->model_dir) return k3_usage_error("chat", "unexpected argument '%s'", o);
            a->model_dir = o;
        } else if (!strcmp(o, "--system")) { NEED_VALUE(); a->system = v; }
        else if (!strcmp(o, "--think")) a->thinking = true;
        else if (!strcmp(o, "--no-think")) a->thinking = false;
        else if (!strcmp(o, "--cold")) a->cold = true;
        else if (!strcmp(o, "--load")) { NEED_VALUE(); a->load = v; }
        else if (!strcmp(o, "--out")) { NEED_VALUE(); a->out = v; }
        else if (!strcmp(o, "--gen")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 1, INT_MAX / 2, &n)) return k3_usage_error("chat", "--gen: '%s' is not a count >= 1", v);
            a->gen = n;
        } else if (!strcmp(o, "--max-context")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 2, INT_MAX / 2, &n))
                return k3_usage_error("chat", "--max-context: '%s' is not a count >= 2", v);
            a->max_ctx = n;
        } else if (!strcmp(o, "--state-grid")) {
            NEED_VALUE();
            if (!k3_parse_i64(v, 1, INT_MAX / 2, &n))
                return k3_usage_error("chat", "--state-grid: '%s' is not a count >= 1", v);
            a->grid = n;
        } else if (!strcmp(o, "--state-cache-gb")) {
            NEED_VALUE();
            k3_err e = {0};
            if (k3_state_cache_parse_gb("chat", v, &a->cache_bytes, &e)) return k3_report(&e);
        } else {
            bool used;
            k3_err e = {0};
            if (k3_sample_parse_flag(&a->so, "chat", argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used && k3_spec_parse_flag(&a->sf, "chat", argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used && k3_engine_parse_flag(&a->eo, "chat", argc, argv, &i, &used, &e)) return k3_report(&e);
            if (!used) return k3_usage_error("chat", "unknown option '%s'", o);
        }
#undef NEED_VALUE
    }
    if (a->eo.mem.list_presets) return K3_OK;
    if (!a->model_dir) return k3_usage_error("chat", "no MODEL_DIR given");
    {
        k3_err e = {0};
        if (k3_spec_flags_check(&a->sf, "chat", &e)) return k3_report(&e);
    }
    if (a->system) { /* refused like `k3 run --prompt`, never dropped from the conversation */
        size_t sl = strlen(a->system), bad = tok_utf8_check((const uint8_t *)a->system, sl);
        if (bad != sl) return k3_usage_error("chat", "--system: invalid UTF-8 at byte %zu", bad);
    }
    k3_err e = {0};
    if (k3_sample_opts_check(&a->so, "chat", &e)) return k3_report(&e);
    return K3_OK;
}

/* ---- the chat ------------------------------------------------------------------------ */
/* In a terminal, Ctrl-C stops the reply being generated (it is kept, cut
 * off); at the prompt it ends the chat. */
static volatile sig_atomic_t interrupted;
static void on_sigint(int sig) {
    (void)sig;
    interrupted = 1;
}

typedef struct {
    const chat_args *a;
    k3_engine *e;
    k3_chat *chat;
    k3_state *st;
    k3_state_cache *cache;
    k3_session *s;
    k3_drafter *drafter;  /* --speculate: n-gram over the session's ids (the whole
                             rendered conversation) or the draft model */
    k3_spec *spec;        /* the verifying feed, kept across turns (its controller
                             goes on adapting); NULL without --speculate */
    uint64_t model_id;
    json_t *messages;   /* the conversation, OpenAI-shaped */
    json_t *turns;      /* for --out */
    bool thinking;
    int turn;           /* user turns so far (the sampling seed offset) */
    float *logits;
    bool tty_in, tty_out;
    /* reasoning display */
    bool line_start, in_reasoning, shown_reasoning;
} chat_ctx;

static json_t *request(chat_ctx *c, bool gen_prompt) {
    json_t *r = json_object();
    json_object_set(r, "messages", c->messages);
    json_object_set_new(r, "thinking", json_boolean(c->thinking));
    json_object_set_new(r, "add_generation_prompt", json_boolean(gen_prompt));
    return r;
}

/* marks (may be NULL): where each message ends (the state cache keeps those
 * boundaries: after /reset the system prompt's end is resumed, not re-fed) */
static int render(chat_ctx *c, bool gen_prompt, int32_t **ids, size_t *n, size_t **marks, size_t *nmarks,
                  k3_err *err) {
    json_t *r = request(c, gen_prompt);
    int rc = k3_chat_encode_marked(c->chat, r, ids, n, marks, nmarks, err);
    json_decref(r);
    return rc;
}

static void reset_conversation(chat_ctx *c) {
    json_decref(c->messages);
    c->messages = json_array();
    if (c->a->system) {
        json_t *m = json_object();
        json_object_set_new(m, "role", json_string("system"));
        json_object_set_new(m, "content", json_string(c->a->system));
        json_array_append_new(c->messages, m);
    }
    c->turn = 0;
}

static void show(chat_ctx *c, const char *txt, size_t len, bool reasoning) {
    if (!len) return;
    if (reasoning && !c->in_reasoning) {
        if (c->tty_out) fputs("\033[2m", stdout);
        c->in_reasoning = c->shown_reasoning = true;
    }
    if (!reasoning && c->in_reasoning) {
        if (c->tty_out) fputs("\033[0m", stdout);
        if (!c->line_start) fputc('\n', stdout);
        c->line_start = true;
        c->in_reasoning = false;
    }
    for (size_t i = 0; i < len; i++) {
        if (reasoning && !c->tty_out && c->line_start) fputs("[think] ", stdout);
        fputc(txt[i], stdout);
        c->line_start = txt[i] == '\n';
    }
    fflush(stdout);
}

static void show_delta(chat_ctx *c, const k3_chat_delta *d) {
    show(c, d->reasoning, d->reasoning_len, true);
    show(c, d->content, d->content_len, false);
    if (d->tool_call) {
        char *j = json_dumps(d->tool_call, JSON_COMPACT);
        if (j) {
            show(c, "[tool call] ", 12, false);
            show(c, j, strlen(j), false);
            show(c, "\n", 1, false);
            free(j);
        }
    }
}

static json_t *ids_json(const int32_t *v, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

static int write_out(chat_ctx *c, k3_err *err) {
    if (!c->a->out) return K3_OK;
    json_t *o = json_object();
    json_object_set(o, "turns", c->turns);
    json_object_set(o, "messages", c->messages);
    char *txt = json_dumps(o, JSON_INDENT(1));
    json_decref(o);
    if (!txt) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot serialise the transcript", c->a->out);
    int rc = k3_write_file_atomic(c->a->out, txt, strlen(txt), err);
    free(txt);
    return rc;
}

static const char *source_name(int s) { return s == 2 ? "snapshot" : s == 1 ? "session" : "cold"; }

/* A reply being generated: the loop's on_token shows each id's delta. */
typedef struct {
    chat_ctx *c;
    k3_chat_parser *p;
} chat_reply;

static int reply_token(void *ctx, int32_t id, k3_gen_verdict *verdict, k3_err *err) {
    chat_reply *r = ctx;
    k3_chat_delta d;
    int rc = k3_chat_parser_feed(r->p, id, &d, err);
    if (rc) return rc;
    show_delta(r->c, &d);
    if (d.stop) *verdict = K3_GEN_STOP_KEEP;
    return K3_OK;
}

static bool reply_interrupted(void *ctx) {
    (void)ctx;
    return interrupted != 0;
}

/* One user message: render, prefill through the session, generate, parse. */
static int turn(chat_ctx *c, const char *text, k3_err *err) {
    const chat_args *a = c->a;
    json_t *um = json_object();
    json_object_set_new(um, "role", json_string("user"));
    json_object_set_new(um, "content", json_string(text));
    json_array_append_new(c->messages, um);
    int32_t *ids = NULL;
    size_t n = 0, *marks = NULL, nmarks = 0;
    int rc = render(c, true, &ids, &n, &marks, &nmarks, err);
    if (!rc && (int64_t)n >= a->max_ctx)
        rc = k3_fail(err, K3_EXIT_USAGE, "conversation is %zu tokens, --max-context is %lld: /reset or restart with "
                     "a larger --max-context", n, (long long)a->max_ctx);
    if (rc) {
        json_array_remove(c->messages, json_array_size(c->messages) - 1);
        free(ids);
        free(marks);
        return rc;
    }
    int64_t gen = a->gen;
    if (gen > a->max_ctx - (int64_t)n) gen = a->max_ctx - (int64_t)n;
    if (a->cold) k3_session_reset(c->s);
    size_t reused = 0;
    double t0 = k3_now();
    rc = k3_session_prefill_marked(c->s, ids, n, marks, nmarks, c->logits, &reused, err);
    free(marks);
    if (rc) {
        json_array_remove(c->messages, json_array_size(c->messages) - 1);
        free(ids);
        return rc;
    }
    int source = k3_session_last_source(c->s);
    k3_sampler sp;
    k3_sample_opts_sampler(&a->so, k3_engine_vocab(c->e), (uint64_t)c->turn, &sp);
    k3_chat_parser *p = k3_chat_parser_new(c->chat, c->thinking);
    chat_reply cr = {.c = c, .p = p};
    double t_end;
    c->line_start = true;
    c->in_reasoning = c->shown_reasoning = false;
    interrupted = 0;
    k3_gen_opts go;
    k3_gen_opts_init(&go);
    go.max_tokens = gen;
    go.what = a->model_dir;
    go.ctx = &cr;
    go.on_token = reply_token;
    go.cancelled = reply_interrupted;
    go.spec = c->spec;
    k3_gen_result res;
    rc = k3_generate(c->s, &sp, c->logits, &go, &res, err);
    /* the stop id is part of the rendered message: the loop fed it too */
    bool stopped = res.end == K3_GEN_END_STOP;
    double t_first = res.t_first;
    int32_t *gids = res.ids;
    size_t ng = res.n;
    t_end = k3_now();
    k3_chat_delta d;
    k3_chat_parser_flush(p, &d);
    show_delta(c, &d);
    if (c->in_reasoning && c->tty_out) fputs("\033[0m", stdout);
    if (!c->line_start) fputc('\n', stdout);
    fflush(stdout);
    k3_sampler_free(&sp);
    const char *finish = "stop";
    json_t *msg = k3_chat_parser_message(p, !stopped, &finish);
    k3_chat_parser_free(p);
    if (rc) {
        json_decref(msg);
        free(gids);
        free(ids);
        json_array_remove(c->messages, json_array_size(c->messages) - 1);
        k3_session_reset(c->s);
        if (c->spec) { /* a pass the error left open is gone with the reset */
            k3_spec_free(c->spec);
            c->spec = k3_spec_new(c->drafter, a->sf.speculate, k3_engine_vocab(c->e));
        }
        return rc;
    }
    k3_session_snapshot(c->s);
    json_array_append_new(c->messages, msg);
    c->turn++;
    /* does the history, re-rendered, hold exactly the tokens generated? */
    int32_t *hist = NULL;
    size_t nh = 0, same = 0;
    rc = render(c, false, &hist, &nh, NULL, NULL, err);
    size_t ns = k3_session_len(c->s);
    const int32_t *sid = k3_session_ids(c->s);
    while (!rc && same < nh && same < ns && hist[same] == sid[same]) same++;
    free(hist);
    if (rc) {
        free(gids);
        free(ids);
        return rc;
    }
    double ttft = t_first - t0, dec = t_end - t_first;
    double tps = ng > 1 && dec > 0 ? (double)(ng - 1) / dec : 0;
    char rr[96];
    if (same == ns) snprintf(rr, sizeof rr, "re-rendered history extends the state");
    else snprintf(rr, sizeof rr, "re-rendered history departs from the state at position %zu", same);
    char sr[128] = "";
    if (c->spec)
        snprintf(sr, sizeof sr, "; %llu passes, %llu of %llu drafts accepted", (unsigned long long)res.passes,
                 (unsigned long long)res.accepted, (unsigned long long)res.drafted);
    fprintf(stderr,
            "[turn %d: prompt %zu tokens, reused %zu (%s); first token %.3f s; %zu tokens, %.2f tok/s%s; %s; %s]\n",
            c->turn, n, reused, source_name(source), ttft, ng, tps, sr,
            stopped ? "stop" : interrupted ? "interrupted" : finish, rr);
    json_t *t = json_object();
    json_object_set_new(t, "prompt_ids", ids_json(ids, n));
    json_object_set_new(t, "generated_ids", ids_json(gids, ng));
    json_object_set_new(t, "reused", json_integer((json_int_t)reused));
    json_object_set_new(t, "source", json_string(source_name(source)));
    json_object_set_new(t, "finish_reason", json_string(stopped ? "stop" : finish));
    json_object_set_new(t, "ttft_s", json_real(ttft));
    json_object_set_new(t, "tokens_per_s", json_real(tps));
    json_object_set_new(t, "history_matches", json_boolean(same == ns));
    json_object_set_new(t, "decode_passes", json_integer((json_int_t)res.passes));
    json_object_set_new(t, "drafts_proposed", json_integer((json_int_t)res.drafted));
    json_object_set_new(t, "drafts_accepted", json_integer((json_int_t)res.accepted));
    json_array_append_new(c->turns, t);
    free(gids);
    free(ids);
    return write_out(c, err);
}

static int save(chat_ctx *c, const char *path, k3_err *err) {
    /* bring the state to the history exactly as it re-renders, so the loaded
     * conversation's next turn feeds only the new message */
    int32_t *hist = NULL;
    size_t nh = 0;
    int rc = render(c, false, &hist, &nh, NULL, NULL, err);
    if (!rc && nh > 0) rc = k3_session_prefill(c->s, hist, nh, NULL, NULL, err);
    free(hist);
    if (rc) return rc;
    json_t *x = json_object();
    json_object_set(x, "messages", c->messages);
    json_object_set_new(x, "thinking", json_boolean(c->thinking));
    json_object_set_new(x, "turns", json_integer(c->turn));
    char *txt = json_dumps(x, JSON_COMPACT);
    json_decref(x);
    if (!txt) return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot serialise the conversation", path);
    /* (under mpirun every rank prefilled alike; rank 0 writes the file) */
    rc = k3_engine_rank(c->e) == 0 ? k3_session_save(c->s, path, c->model_id, txt, strlen(txt), err) : K3_OK;
    free(txt);
    if (!rc) fprintf(stderr, "[saved %zu tokens to %s]\n", k3_session_len(c->s), path);
    return rc;
}

static int load(chat_ctx *c, const char *path, k3_err *err) {
    char *extra = NULL;
    size_t xl = 0;
    int rc = k3_session_load(c->s, path, c->model_id, &extra, &xl, err);
    if (rc) return rc;
    json_error_t je;
    json_t *x = json_loadb(extra ? extra : "", xl, 0, &je);
    free(extra);
    json_t *msgs = json_object_get(x, "messages"), *th = json_object_get(x, "thinking"),
           *tn = json_object_get(x, "turns");
    if (!json_is_array(msgs) || !json_is_boolean(th) || !json_is_integer(tn) || json_integer_value(tn) < 0) {
        json_decref(x);
        k3_session_reset(c->s);
        return k3_fail(err, K3_EXIT_DATA, "%s: session file holds no k3 chat conversation", path);
    }
    json_decref(c->messages);
    c->messages = json_incref(msgs);
    c->thinking = json_is_true(th);
    c->turn = (int)json_integer_value(tn);
    json_decref(x);
    fprintf(stderr, "[loaded %zu tokens, %zu messages, %d turn%s from %s; thinking %s]\n", k3_session_len(c->s),
            json_array_size(c->messages), c->turn, c->turn == 1 ? "" : "s", path, c->thinking ? "on" : "off");
    return K3_OK;
}

static const char *const chat_commands =
    "commands: /reset, /save FILE, /load FILE, /think on|off, /help, /quit\n";

/* A /command line; *quit is set for /quit (K3_OK: a command's error code
 * can never be read as the request to quit). */
static int command(chat_ctx *c, char *line, bool *quit, k3_err *err) {
    char *arg = line + strcspn(line, " \t");
    if (*arg) *arg++ = 0;
    arg += strspn(arg, " \t");
    if (!strcmp(line, "/quit") || !strcmp(line, "/exit")) {
        *quit = true;
        return K3_OK;
    }
    if (!strcmp(line, "/help")) {
        fputs(chat_commands, stderr);
        return K3_OK;
    }
    if (!strcmp(line, "/reset")) {
        reset_conversation(c);
        k3_session_reset(c->s);
        fputs("[conversation reset]\n", stderr);
        return K3_OK;
    }
    if (!strcmp(line, "/think")) {
        if (!strcmp(arg, "on")) c->thinking = true;
        else if (!strcmp(arg, "off")) c->thinking = false;
        else return k3_fail(err, K3_EXIT_USAGE, "/think: want on or off");
        fprintf(stderr, "[thinking %s]\n", c->thinking ? "on" : "off");
        return K3_OK;
    }
    if (!strcmp(line, "/save") || !strcmp(line, "/load")) {
        if (!*arg) return k3_fail(err, K3_EXIT_USAGE, "%s needs a FILE", line);
        return line[1] == 's' ? save(c, arg, err) : load(c, arg, err);
    }
    return k3_fail(err, K3_EXIT_USAGE, "%s: unknown command (%s)", line, "try /help");
}

/* *reported: the error in err was printed already (a failing line, when the
 * chat went on to the end of its input). */
static int chat(const chat_args *a, k3_err *err, bool *reported) {
    chat_ctx c = {.a = a, .thinking = a->thinking};
    k3_engine_opts eo = a->eo;
    eo.model_dir = a->model_dir;
    eo.need_tokenizer = true;
    eo.max_pos = a->max_ctx;
    if (a->sf.speculate) eo.mem.so.pass_tokens = a->sf.speculate + 1; /* a verifying pass in one chunk */
    int rc = k3_engine_open(&eo, &c.e, err);
    if (rc) return rc;
    /* under mpirun: rank 0 reads the input and talks, every rank computes */
    chat_args quiet_rank;
    if (k3_engine_rank(c.e) > 0) {
        quiet_rank = *a;
        quiet_rank.out = NULL;
        a = c.a = &quiet_rank;
        k3_engine_silence_others(c.e);
    }
    const char *tok_dir = eo.tok_dir ? eo.tok_dir : a->model_dir;
    if ((rc = k3_chat_new(k3_engine_tokenizer(c.e), &c.chat, err))) {
        /* the way out: a checkpoint that has them, and what this one can still do */
        k3_err inner = *err;
        k3_fail(err, rc,
                "%s: %s; chat needs a checkpoint whose tokenizer has them: the shipped chat model models/chat (in "
                "the source tree, or share/k3/models/chat where k3 is installed; docs/chat-model.md), the Kimi K3 "
                "release, or a small random one from `python3 tools/gen_checkpoint.py DIR --preset tiny --set "
                "vocab_size=163840` (docs/chat.md). This model still runs with `k3 run` and `k3 serve` "
                "(/v1/completions)",
                tok_dir, inner.msg);
        goto done;
    }
    const k3_config *cfg = k3_engine_config(c.e);
    uint64_t budget = a->cold ? 0 : a->cache_bytes;
    uint64_t V = (uint64_t)k3_engine_vocab(c.e);
    if ((rc = k3_engine_state_new(c.e, a->max_ctx, budget + V * sizeof(float), &c.st, err))) goto done;
    if ((rc = k3_engine_identity(c.e, &c.model_id, err))) goto done;
    c.cache = k3_state_cache_new(cfg, budget, (int)a->grid);
    c.s = k3_session_open(c.e, c.st, c.cache);
    if ((rc = k3_drafter_for(c.e, a->sf.draft, a->sf.p_min, a->sf.speculate, a->max_ctx, &c.drafter, err))) goto ready;
    if (c.drafter) c.spec = k3_spec_new(c.drafter, a->sf.speculate, k3_engine_vocab(c.e));
    c.logits = xmalloc_array((size_t)V, sizeof *c.logits);
    c.turns = json_array();
    c.tty_in = isatty(0);
    c.tty_out = isatty(1);
    reset_conversation(&c);
    if (a->load) rc = load(&c, a->load, err);
    /* after --load: the banner states the loaded conversation's thinking, not the flag's */
    if (!rc && c.tty_in) { /* a script gets only the per-turn lines, so an error stays one line */
        k3_state_cache_stats cs = k3_state_cache_get_stats(c.cache);
        fprintf(stderr,
                "k3 chat: %s, %d layers, threads %d; context %lld; state cache %s (a snapshot: %s + %s per position, "
                "grid %d); thinking %s\n",
                a->model_dir, cfg->num_layers, k3_engine_threads(c.e), (long long)a->max_ctx,
                k3_size_str(budget), k3_size_str(cs.kda_bytes), k3_size_str(cs.row_bytes), cs.grid, c.thinking ? "on" : "off");
    }
ready:
    if ((rc = k3_engine_ready(c.e, rc, err))) goto done; /* every rank of a job, or none */
    if (c.tty_in) {
        fputs(chat_commands, stderr);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_sigint; /* no SA_RESTART: getline at the prompt returns */
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
    }
    char *line = NULL;
    size_t cap = 0;
    int failed = 0; /* the first failing line's code: the exit status at the end */
    for (;;) {
        if (c.tty_in) {
            fputs("> ", stdout);
            fflush(stdout);
        }
        interrupted = 0;
        ssize_t len = (ssize_t)k3_engine_getline(c.e, &line, &cap, stdin); /* rank 0's line, on every rank */
        if (len < 0) {
            if (interrupted) clearerr(stdin), fputc('\n', stdout);
            break;
        }
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (len == 0) continue;
        k3_err e = {0};
        int r;
        bool quit = false;
        if (line[0] == '/') r = command(&c, line, &quit, &e);
        else if (memchr(line, 0, (size_t)len)) r = k3_fail(&e, K3_EXIT_USAGE, "stdin: a message holds a NUL byte");
        else if (tok_utf8_check((const uint8_t *)line, (size_t)len) != (size_t)len)
            r = k3_fail(&e, K3_EXIT_USAGE, "stdin: a message is not valid UTF-8 (byte %zu)",
                        tok_utf8_check((const uint8_t *)line, (size_t)len));
        else r = turn(&c, line, &e);
        r = k3_engine_agree(c.e, r, &e, "a chat turn"); /* the same next step on every rank */
        if (r) { /* one line; the conversation is kept and the chat goes on */
            k3_report(&e);
            if (!failed) failed = r;
        } else if (quit) break;
    }
    free(line);
    if (!rc && ferror(stdin)) rc = k3_fail(err, K3_EXIT_RUNTIME, "stdin: %s", strerror(errno));
    if (!rc && failed) {
        rc = failed;
        *reported = true;
    }
done:
    k3_spec_free(c.spec);
    k3_session_free(c.s);
    k3_state_cache_free(c.cache);
    if (c.st) k3_engine_state_free(c.e, c.st);
    free(c.logits);
    json_decref(c.messages);
    json_decref(c.turns);
    k3_chat_free(c.chat);
    k3_drafter_free(c.drafter);
    k3_engine_free(c.e);
    return rc;
}

int cmd_chat(int argc, char **argv) {
    chat_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc < 0) return K3_OK;
    if (rc) return rc;
    if (a.eo.mem.list_presets) {
        k3_presets_print(stdout);
        return K3_OK;
    }
    k3_err err = {0};
    bool reported = false;
    rc = chat(&a, &err, &reported);
    if (rc) return reported ? rc : k3_report(&err);
    return K3_OK;
}
