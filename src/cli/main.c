/* main.c: the `k3` command. One table of subcommands; `k3 MODEL_DIR ...` is
 * accepted as `k3 run MODEL_DIR ...` (the released engine's form). */
#include "cli/commands.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "dist/dist.h"

#define K3_VERSION "0.1.0"

typedef struct {
    const char *name;
    int (*fn)(int, char **);
    const char *const *help;
    const char *summary;
} command;

static const command commands[] = {
    {"run", cmd_run, &cmd_run_help, "generate text from a model directory"},
    {"chat", cmd_chat, &cmd_chat_help, "chat with a model in the terminal (XTML chat template)"},
    {"serve", cmd_serve, &cmd_serve_help, "OpenAI-compatible HTTP server with a chat page"},
    {"eval", cmd_eval, &cmd_eval_help, "nats per token and bits per byte of a model on a text"},
    {"inspect", cmd_inspect, &cmd_inspect_help, "census of a checkpoint: bytes, parameters, layer map"},
    {"verify", cmd_verify, &cmd_verify_help, "check every shard's sha256 and every tensor's byte range"},
    {"tokenize", cmd_tokenize, &cmd_tokenize_help, "text to token ids with a tiktoken tokenizer"},
    {"detokenize", cmd_detokenize, &cmd_detokenize_help, "token ids to bytes"},
    {"pack-trunk", cmd_pack_trunk, &cmd_pack_trunk_help, "pack the dense trunk into one streamable file"},
    {"cache-sim", cmd_cache_sim, &cmd_cache_sim_help, "replay an expert trace under cache policies"},
    {"doctor", cmd_doctor, &cmd_doctor_help, "check this machine and suggest a budget"},
    {"prepare", cmd_prepare, &cmd_prepare_help, "train a BPE tokenizer and tokenize a text corpus"},
    {"train", cmd_train, &cmd_train_help, "train a K3-architecture model from scratch"},
    {"export", cmd_export, &cmd_export_help, "export a training checkpoint as a model directory"},
    {"dashboard", cmd_dashboard, &cmd_dashboard_help, "serve a live web page for training runs"},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *f) {
    fprintf(f,
            "k3 " K3_VERSION ": run and train Kimi K3-architecture models on a CPU\n\n"
            "usage: k3 COMMAND [ARGS...]\n"
            "       k3 MODEL_DIR [ARGS...]      same as 'k3 run MODEL_DIR ...'\n"
            "       k3 help COMMAND | k3 COMMAND --help\n"
            "       k3 --version\n\ncommands:\n");
    for (size_t i = 0; i < NCOMMANDS; i++)
        fprintf(f, "  %-11s %s%s\n", commands[i].name, commands[i].summary,
                commands[i].fn ? "" : " (not in this build)");
    fprintf(f,
            "\nexit codes:\n"
            "  0  success\n"
            "  1  runtime failure (I/O error, out of memory)\n"
            "  2  usage error, or invalid config or input\n"
            "  3  refused up front: the run cannot fit the memory budget\n"
            "  4  checkpoint data error (truncated shard, bad header, wrong dtype or shape)\n");
}

static const command *find(const char *name) {
    for (size_t i = 0; i < NCOMMANDS; i++)
        if (strcmp(commands[i].name, name) == 0) return &commands[i];
    return NULL;
}

static int print_help(const command *c) {
    if (!c->fn || !c->help) {
        fprintf(stderr, "k3: command '%s' is not available in this build\n", c->name);
        return K3_EXIT_USAGE;
    }
    fputs(*c->help, stdout);
    return K3_OK;
}

/* Commands that run as one job over several ranks; the others refuse. */
static int check_ranks(const command *c) {
    if (k3_dist_size() <= 1 || c->fn == cmd_run || c->fn == cmd_chat || c->fn == cmd_serve || c->fn == cmd_train)
        return K3_OK;
    char line[256];
    snprintf(line, sizeof line, "%s: not for several ranks (mpirun -np %d): only 'k3 run', 'k3 chat', 'k3 serve' and "
             "'k3 train' run as one job over ranks",
             c->name, k3_dist_size());
    if (!k3_dist_defer_error(K3_EXIT_USAGE, line)) fprintf(stderr, "k3: %s\n", line);
    return K3_EXIT_USAGE;
}

static int dispatch(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "k3: no command given (see 'k3 --help')\n");
        return K3_EXIT_USAGE;
    }
    const char *a = argv[1];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); return K3_OK; }
    if (!strcmp(a, "--version") || !strcmp(a, "-V")) { printf("k3 %s\n", K3_VERSION); return K3_OK; }
    if (!strcmp(a, "help")) {
        if (argc < 3) { usage(stdout); return K3_OK; }
        const command *c = find(argv[2]);
        if (!c) { fprintf(stderr, "k3: unknown command '%s' (see 'k3 --help')\n", argv[2]); return K3_EXIT_USAGE; }
        return print_help(c);
    }
    const command *c = find(a);
    if (!c) {
        struct stat st;
        if (stat(a, &st) == 0 && S_ISDIR(st.st_mode)) {
            /* k3 MODEL_DIR ...: rewrite as k3 run MODEL_DIR ... */
            c = find("run");
            argv[0] = (char *)"run";
            if (check_ranks(c)) return K3_EXIT_USAGE;
            if (!c->fn) { fprintf(stderr, "k3: command 'run' is not available in this build\n"); return K3_EXIT_USAGE; }
            return c->fn(argc, argv);
        }
        fprintf(stderr, "k3: unknown command '%s' (see 'k3 --help')\n", a);
        return K3_EXIT_USAGE;
    }
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--")) break;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return print_help(c);
    }
    if (!c->fn) { fprintf(stderr, "k3: command '%s' is not available in this build\n", a); return K3_EXIT_USAGE; }
    if (check_ranks(c)) return K3_EXIT_USAGE;
    return c->fn(argc - 1, argv + 1);
}

/* Output to a full disk or device (`> /dev/full`) is a failure, whatever the
 * command: buffered text is flushed here and any write error is one line. */
static int check_stdout(int rc) {
    errno = 0;
    bool flush_failed = fflush(stdout) != 0;
    int e = errno;
    if ((flush_failed || ferror(stdout)) && rc == K3_OK) {
        if (flush_failed && e) fprintf(stderr, "k3: standard output: write failed: %s\n", strerror(e));
        else fprintf(stderr, "k3: standard output: write failed\n");
        return K3_EXIT_RUNTIME;
    }
    return rc;
}

/* Under mpirun (dist/dist.h) every rank runs this; the job ends with one
 * exit code and at most one error line (rank 0's). */
int main(int argc, char **argv) {
    int rc = k3_dist_init(&argc, &argv);
    if (!rc) rc = check_stdout(dispatch(argc, argv));
    return k3_dist_finish(rc);
}
