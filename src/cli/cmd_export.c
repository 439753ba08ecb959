/* cmd_export.c: `k3 export CHECKPOINT OUT_DIR`. Flag parsing and the report;
 * the writer and the MXFP4 encoder are src/train/export.c. */
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/commands.h"
#include "train/export.h"

const char *const cmd_export_help =
    "usage: k3 export CHECKPOINT OUT_DIR [options]\n"
    "\n"
    "Writes a training checkpoint (latest.safetensors or best.safetensors of a\n"
    "'k3 train' run) as a model directory in the released layout, which 'k3 run'\n"
    "loads unchanged: config.json (nested as released; quantization_config when\n"
    "the experts are MXFP4), model.safetensors (released tensor names) and the\n"
    "trained tokenizer (tiktoken.model, tokenizer_config.json) copied from the data\n"
    "directory the checkpoint records. Files are written atomically, config.json\n"
    "last. Then it measures what the export costs: the validation loss of the\n"
    "f32 checkpoint (training forward) and of the exported model (inference\n"
    "engine) on the same windows of val.bin, and prints both and the change.\n"
    "\n"
    "  --dtype bf16|f32          matrices (default bf16); vectors stay F32\n"
    "  --experts mxfp4|bf16|f32  routed experts (default mxfp4: E2M1 values, one\n"
    "                            E8M0 scale per group of 32 chosen for least\n"
    "                            squared error; needs expert dims divisible by 32)\n"
    "  --data-dir DIR            tokenizer and val.bin (default: the data directory\n"
    "                            recorded in the checkpoint)\n"
    "  --no-tokenizer            export without a tokenizer (then 'k3 run' takes\n"
    "                            --ids only) and skip the validation loss\n"
    "  --eval-tokens N           validation tokens for the loss (default 16384;\n"
    "                            0: skip the measurement)\n"
    "  --seq-len T               validation window (default: the run's seq_len)\n"
    "\n"
    "exit codes: 0 ok, 1 I/O, 2 bad flags, a missing checkpoint, an unusable data\n"
    "directory or tokenizer, 4 not a valid training checkpoint\n";

static int parse_dtype(const char *flag, const char *v, bool mx_ok, tex_dtype *out) {
    if (!strcmp(v, "bf16")) *out = TEX_BF16;
    else if (!strcmp(v, "f32")) *out = TEX_F32;
    else if (mx_ok && !strcmp(v, "mxfp4")) *out = TEX_MXFP4;
    else return k3_usage_error("export", "%s wants %s, got '%s'", flag, mx_ok ? "mxfp4, bf16 or f32" : "bf16 or f32", v);
    return 0;
}

static const char *dname(tex_dtype d) { return d == TEX_MXFP4 ? "mxfp4" : d == TEX_BF16 ? "bf16" : "f32"; }

static uint64_t file_size(const char *dir, const char *name) {
    char *p = k3_path_join(dir, name);
    struct stat st;
    int r = stat(p, &st);
    free(p);
    return r == 0 ? (uint64_t)st.st_size : 0;
}

int cmd_export(int argc, char **argv) {
    const char *pos[2] = {NULL, NULL};
    int npos = 0;
    texport_opts o = {.dtype = TEX_BF16, .experts = TEX_MXFP4, .tok_dir = NULL, .step = -1};
    const char *data_dir = NULL;
    bool no_tok = false;
    long long eval_tokens = 16384, seq = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(cmd_export_help, stdout);
            return 0;
        }
        if (!strcmp(a, "--no-tokenizer")) { no_tok = true; continue; }
        if (a[0] != '-' || !a[1]) {
            if (npos == 2) return k3_usage_error("export", "unexpected argument '%s'", a);
            pos[npos++] = a;
            continue;
        }
        if (i + 1 >= argc) return k3_usage_error("export", "unknown flag or missing value: %s", a);
        const char *v = argv[++i];
        int rc = 0;
        if (!strcmp(a, "--dtype")) rc = parse_dtype(a, v, false, &o.dtype);
        else if (!strcmp(a, "--experts")) rc = parse_dtype(a, v, true, &o.experts);
        else if (!strcmp(a, "--data-dir")) data_dir = v;
        else if (!strcmp(a, "--eval-tokens") || !strcmp(a, "--seq-len")) {
            char *end;
            errno = 0;
            long long x = strtoll(v, &end, 10);
            long long lo = !strcmp(a, "--seq-len") ? 1 : 0;
            if (errno || *end || end == v || x < lo || x > (1LL << 40))
                return k3_usage_error("export", "%s wants an integer >= %lld, got '%s'", a, lo, v);
            if (!strcmp(a, "--seq-len")) seq = x;
            else eval_tokens = x;
            if (seq > 65536) return k3_usage_error("export", "--seq-len %s is out of range", v);
        } else return k3_usage_error("export", "unknown flag: %s", a);
        if (rc) return rc;
    }
    if (npos != 2) return k3_usage_error("export", "want CHECKPOINT and OUT_DIR");
    const char *ckpt_path = pos[0], *out_dir = pos[1];
    struct stat cst;
    if (stat(ckpt_path, &cst) == 0 && S_ISDIR(cst.st_mode)) /* a run directory reads as shards of one model */
        return k3_usage_error("export", "%s is a directory: give the checkpoint file, e.g. %s/latest.safetensors or "
                              "%s/best.safetensors of a k3 train run", ckpt_path, ckpt_path, ckpt_path);

    k3_err err = {0};
    tckpt ck;
    int rc = tckpt_open(ckpt_path, &ck, &err);
    if (rc) return k3_report(&err);
    k3_config cfg;
    tmodel m;
    memset(&m, 0, sizeof m);
    if ((rc = k3_config_parse(ck.meta.config_json, ckpt_path, &cfg, &err))) goto done;
    if ((rc = tm_build(&m, &cfg, &err))) goto done;
    if ((rc = tckpt_load(&ck, &m, NULL, &err))) goto done;
    if (ck.unverified)
        fprintf(stderr, "k3: note: %s is a version 1 checkpoint without a payload checksum: its weights are not verified\n",
                ckpt_path);
    if (!no_tok) {
        if (!data_dir) data_dir = ck.meta.data_dir;
        if (!data_dir || !*data_dir) {
            rc = k3_fail(&err, K3_EXIT_USAGE, "%s: the checkpoint records no data directory (pass --data-dir DIR or --no-tokenizer)",
                         ckpt_path);
            goto done;
        }
        if (!file_size(data_dir, "tiktoken.model")) {
            rc = k3_fail(&err, K3_EXIT_USAGE, "%s: no tiktoken.model (the checkpoint's data directory; pass --data-dir DIR or --no-tokenizer)",
                         data_dir);
            goto done;
        }
        o.tok_dir = data_dir;
    }
    if (!seq) {
        json_t *tj = json_loads(ck.meta.train_json, 0, NULL);
        seq = tj ? json_integer_value(json_object_get(tj, "seq_len")) : 0;
        json_decref(tj);
        if (seq <= 0) seq = 256;
    }
    o.step = ck.meta.step;
    if ((rc = texport_write(&m, ck.meta.config_json, out_dir, &o, &err))) goto done;
    uint64_t bytes = file_size(out_dir, "model.safetensors");
    printf("exported %s (step %lld) to %s: matrices %s, routed experts %s, model.safetensors %.2f MB%s\n", ckpt_path,
           (long long)ck.meta.step, out_dir, dname(o.dtype), dname(o.experts), (double)bytes / 1e6,
           o.tok_dir ? ", tokenizer copied" : ", no tokenizer");
    fflush(stdout);
    if (o.tok_dir && eval_tokens > 0) {
        texport_eval ev;
        if ((rc = texport_evaluate(&m, out_dir, data_dir, (int)seq, eval_tokens, &ev, &err))) goto done;
        printf("validation, %lld tokens in windows of %lld: f32 checkpoint loss %.5f (%.4f bits/byte); "
               "exported loss %.5f (%.4f bits/byte); change %+.5f\n",
               (long long)ev.tokens, seq, ev.train_loss, ev.train_bpb, ev.engine_loss, ev.engine_bpb,
               ev.engine_loss - ev.train_loss);
    }
done:
    tm_free(&m);
    tckpt_close(&ck);
    return rc ? k3_report(&err) : 0;
}
