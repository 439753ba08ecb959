/* cmd_tokenize.c: `k3 tokenize` (text to ids) and `k3 detokenize` (ids to
 * bytes) with a tiktoken tokenizer directory. */
#include "chat/chat.h"
#include "cli/commands.h"
#include "tokenizer/tokenizer.h"

#include <stdlib.h>
#include <string.h>

const char *const cmd_tokenize_help =
    "usage: k3 tokenize TOK_DIR (--text S | --file F) [--allow-special] [--json]\n"
    "       k3 tokenize TOK_DIR --chat REQUEST.json [--json]\n"
    "\n"
    "Encodes UTF-8 text to token ids with the tokenizer in TOK_DIR (tiktoken.model\n"
    "and, optionally, tokenizer_config.json), exactly as tiktoken does.\n"
    "\n"
    "  --text S          the text to encode\n"
    "  --file F          read the text from file F ('-' for standard input)\n"
    "  --allow-special   special token names in the text (e.g. <|im_end|>) become\n"
    "                    their ids; without it they are encoded as plain text\n"
    "  --chat REQUEST    the prompt ids of a chat request ('-' for standard input)\n"
    "                    in the Kimi K3 chat template (XTML), as the release's\n"
    "                    encoder gives them: a JSON object with messages, tools,\n"
    "                    tool_choice, response_format, thinking (default true),\n"
    "                    thinking_effort, add_generation_prompt (default true),\n"
    "                    image_prompts (docs/chat.md). TOK_DIR must have the XTML\n"
    "                    markup tokens\n"
    "  --json            print {\"ids\": [...], \"count\": N} instead of the ids\n"
    "\n"
    "Prints the ids comma-separated on one line.\n"
    "\n"
    "exit codes: 0 ok; 1 I/O error; 2 usage error, invalid tokenizer files,\n"
    "invalid UTF-8 input, an invalid chat request or a tokenizer without XTML ids.\n";

const char *const cmd_detokenize_help =
    "usage: k3 detokenize TOK_DIR --ids 1,2,3\n"
    "\n"
    "Decodes token ids to bytes with the tokenizer in TOK_DIR and writes them to\n"
    "standard output unchanged (special ids give their names).\n"
    "\n"
    "exit codes: 0 ok; 1 I/O error; 2 usage error, invalid tokenizer files or an\n"
    "id outside the vocabulary.\n";


static int finish_stdout(void) {
    if (fflush(stdout) != 0 || ferror(stdout)) {
        k3_err err;
        k3_fail(&err, K3_EXIT_RUNTIME, "standard output: write error");
        return k3_report(&err);
    }
    return K3_OK;
}

static void print_ids(const int32_t *ids, size_t n, bool json) {
    if (json) fputs("{\"ids\": [", stdout);
    for (size_t i = 0; i < n; i++) printf(i ? (json ? ", %d" : ",%d") : "%d", ids[i]);
    if (json) printf("], \"count\": %zu}", n);
    putchar('\n');
}

/* --chat: the request file to prompt ids through the chat template. */
static int tokenize_chat(const char *dir, const char *path, bool json) {
    k3_err err = {0};
    const char *src = strcmp(path, "-") ? path : "standard input";
    char *data;
    size_t len;
    if (k3_read_file(path, &data, &len, &err)) return k3_report(&err);
    json_error_t je;
    json_t *req = json_loadb(data, len, JSON_ALLOW_NUL | JSON_REJECT_DUPLICATES, &je); /* as serve reads a request */
    free(data);
    if (!req) {
        k3_fail(&err, K3_EXIT_USAGE, "%s: invalid JSON at line %d column %d: %s", src, je.line,
                je.column, je.text);
        return k3_report(&err);
    }
    k3_tokenizer *t = NULL;
    k3_chat *c = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    const char *where = src; /* what a failure names: the request or the tokenizer */
    int rc = k3_chat_check_fields(req, &err);
    if (!rc && (rc = tok_load(dir, &t, &err))) where = NULL; /* its message names the file */
    else if (!rc && (rc = k3_chat_new(t, &c, &err))) where = dir;
    else if (!rc) rc = k3_chat_encode(c, req, &ids, &n, &err);
    if (rc && where) {
        k3_err inner = err;
        k3_fail(&err, inner.code, "%s: %s", where, inner.msg);
    }
    if (!rc) print_ids(ids, n, json);
    free(ids);
    k3_chat_free(c);
    tok_free(t);
    json_decref(req);
    if (rc) return k3_report(&err);
    return finish_stdout();
}

int cmd_tokenize(int argc, char **argv) {
    const char *dir = NULL, *text = NULL, *file = NULL, *chat = NULL;
    bool allow = false, json = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--text") == 0 || strcmp(a, "--file") == 0 || strcmp(a, "--chat") == 0) {
            if (i + 1 >= argc) return k3_usage_error("tokenize", "%s needs a value", a);
            if (text || file || chat)
                return k3_usage_error("tokenize", "give one of --text, --file or --chat");
            if (a[2] == 't') text = argv[++i];
            else if (a[2] == 'f') file = argv[++i];
            else chat = argv[++i];
        } else if (strcmp(a, "--allow-special") == 0) {
            allow = true;
        } else if (strcmp(a, "--json") == 0) {
            json = true;
        } else if (a[0] == '-' && a[1]) {
            return k3_usage_error("tokenize", "unknown option '%s'", a);
        } else if (!dir) {
            dir = a;
        } else {
            return k3_usage_error("tokenize", "unexpected argument '%s'", a);
        }
    }
    if (!dir) return k3_usage_error("tokenize", "missing TOK_DIR");
    if (chat) {
        if (allow) return k3_usage_error("tokenize", "--allow-special does not apply to --chat");
        return tokenize_chat(dir, chat, json);
    }
    if (!text && !file) return k3_usage_error("tokenize", "give --text S, --file F or --chat R");

    k3_err err = {0};
    k3_tokenizer *t;
    if (tok_load(dir, &t, &err)) return k3_report(&err);
    char *data = NULL;
    size_t len;
    if (file) {
        if (k3_read_file(file, &data, &len, &err)) {
            tok_free(t);
            return k3_report(&err);
        }
    } else {
        len = strlen(text);
    }
    const char *in = data ? data : text;
    const char *src = !file ? "--text" : strcmp(file, "-") ? file : "standard input";
    size_t bad = tok_utf8_check((const uint8_t *)in, len);
    if (bad != len) {
        k3_fail(&err, K3_EXIT_USAGE, "%s: invalid UTF-8 at byte %zu", src, bad);
        free(data);
        tok_free(t);
        return k3_report(&err);
    }
    /* Long inputs go in chunks cut where the ids cannot change (tok_safe_cut),
     * with a progress bar; the ids are printed only once all are known, so a
     * failure prints nothing on stdout (never a partial list). */
    k3_progress pr;
    k3_progress_start(&pr, "tokenize", len, true);
    int32_t *all = NULL;
    size_t count = 0;
    int rc = K3_OK;
    for (size_t pos = 0; pos < len || (pos == 0 && len == 0);) {
        size_t end = len - pos > (64u << 20) ? tok_safe_cut(t, in, len, pos + (64u << 20)) : len;
        int32_t *ids;
        size_t n;
        rc = tok_encode(t, in + pos, end - pos, allow, &ids, &n, &err);
        if (rc) break;
        if (!all) {
            all = ids;
        } else {
            all = xrealloc_array(all, count + n, sizeof *all);
            if (n) memcpy(all + count, ids, n * sizeof *ids);
            free(ids);
        }
        count += n;
        pos = end;
        k3_progress_update(&pr, pos);
        if (len == 0) break;
    }
    k3_progress_finish(&pr);
    free(data);
    tok_free(t);
    if (rc) {
        free(all);
        return k3_report(&err);
    }
    print_ids(all, count, json);
    free(all);
    return finish_stdout();
}

int cmd_detokenize(int argc, char **argv) {
    const char *dir = NULL, *ids_s = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--ids") == 0) {
            if (i + 1 >= argc) return k3_usage_error("detokenize", "--ids needs a value");
            ids_s = argv[++i];
        } else if (a[0] == '-' && a[1]) {
            return k3_usage_error("detokenize", "unknown option '%s'", a);
        } else if (!dir) {
            dir = a;
        } else {
            return k3_usage_error("detokenize", "unexpected argument '%s'", a);
        }
    }
    if (!dir) return k3_usage_error("detokenize", "missing TOK_DIR");
    if (!ids_s) return k3_usage_error("detokenize", "missing --ids");
    k3_err err = {0};
    k3_tokenizer *t;
    if (tok_load(dir, &t, &err)) return k3_report(&err);
    int32_t *ids;
    size_t n;
    int rc = k3_parse_ids(ids_s, tok_vocab_size(t), &ids, &n, &err);
    uint8_t *bytes = NULL;
    size_t len = 0;
    if (!rc) {
        rc = tok_decode(t, ids, n, &bytes, &len, &err);
        free(ids);
    }
    tok_free(t);
    if (rc) return k3_report(&err);
    fwrite(bytes, 1, len, stdout);
    free(bytes);
    return finish_stdout();
}
