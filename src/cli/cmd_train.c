/* cmd_train.c: `k3 train`. Flag parsing only; the run is src/train/trainer.c. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "dist/dist.h"
#include "train/train.h"

const char *const cmd_train_help =
    "usage: k3 train --data-dir DIR --output-dir DIR --steps N [options]\n"
    "       k3 train --inventory [--config F]\n"
    "\n"
    "Trains a K3-architecture model from scratch on the token shards that\n"
    "'k3 prepare' wrote to DIR (train.bin, val.bin, tiktoken.model), in f32 on the\n"
    "CPU: forward and backward of every component, Muon (Per-Head Muon for the\n"
    "attention Q/K/V projections) + AdamW, Quantile Balancing of the router biases.\n"
    "The run directory gets state.json, metrics.jsonl, samples.jsonl, loss.svg and\n"
    "the checkpoints latest.safetensors and best.safetensors (docs/run-dir.md).\n"
    "\n"
    "  --config F                 model config (released key names); default\n"
    "                             configs/smol-50m.json; with --resume the\n"
    "                             checkpoint's own config (a given one must match)\n"
    "  --steps N                  the schedule's total optimiser steps\n"
    "  --stop-at S                end after step S with a checkpoint (split a run)\n"
    "  --resume F                 continue bit-identically from a checkpoint\n"
    "  --init F                   a new run that starts from a checkpoint's\n"
    "                             weights and model config (fine-tuning, or a\n"
    "                             second phase on other data): a fresh optimiser,\n"
    "                             schedule and data order; --data-dir must be\n"
    "                             prepared with that run's tokenizer\n"
    "                             (k3 prepare --tokenizer)\n"
    "  --batch-size B             sequences per micro-batch (16)\n"
    "  --seq-len T                tokens per sequence (256)\n"
    "  --gradient-accumulation A  micro-batches per optimiser step (2)\n"
    "  --lr X                     peak learning rate (3e-3); warmup 1% of the\n"
    "                             steps, cosine to 10% of X\n"
    "  --weight-decay X           decoupled weight decay, w *= 1 - lr X a step\n"
    "                             (0.1): every parameter but the norm gains,\n"
    "                             A_log and dt_bias; kept on --resume\n"
    "  --optimizer muon|adamw     muon: Muon for matrices, AdamW for the rest\n"
    "                             (default); adamw: AdamW for everything\n"
    "  --eval-interval N          validation loss every N steps (250) and at the end\n"
    "  --eval-tokens N            validation tokens per evaluation (65536)\n"
    "  --checkpoint-interval N    latest.safetensors every N steps (= eval interval)\n"
    "  --sample-interval N        generate a sample every N steps (500) and at the end\n"
    "  --sample-tokens N          tokens per sample (128)\n"
    "  --skip-samples             no samples\n"
    "  --seed S                   initialisation and data order (1337)\n"
    "  --bf16                     BF16 operands for the linear-layer products and\n"
    "                             Muon's Newton-Schulz (F32 accumulation and master\n"
    "                             weights; AMX tiles where the CPU has AMX-BF16,\n"
    "                             else vdpbf16ps); off by default, kept on --resume\n"
    "                             (docs/training-speed.md). Needs AVX512_BF16 on\n"
    "                             the AVX-512 path: refused elsewhere (exit 2)\n"
    "  --no-bf16                  F32 products, also when resuming a --bf16 run\n"
    "  --kda-chunk N              chunkwise KDA with N-position chunks (16);\n"
    "                             0: the exact recurrent form (reference, slower)\n"
    "  --quiet                    no per-step lines on stdout\n"
    "  --inventory                print the parameter inventory of --config and exit\n"
    "\n"
    "Several ranks (data parallel, docs/mpi.md): mpirun -np R k3 train ... with\n"
    "the same flags; each rank computes A/R of the micro-batches (R must divide\n"
    "--gradient-accumulation A, else exit 2), the gradients are added in\n"
    "micro-batch order, so the weights and metrics are bit-identical to one\n"
    "process at the same flags, and a checkpoint resumes at any rank count.\n"
    "Rank 0 alone prints and writes the run directory. Each micro-batch's\n"
    "gradient is computed on its own and added to the step's: with A > 1 the\n"
    "bits differ from k3 builds before data-parallel training (docs/training.md).\n"
    "\n"
    "Gradient clipping 1.0,\n"
    "AdamW betas (0.9, 0.95), Muon momentum 0.95 (Nesterov). Ctrl-C (SIGINT,\n"
    "SIGTERM, SIGUSR1; under mpirun: SIGUSR1 to mpirun) ends the run after the\n"
    "current step with a checkpoint. Exit codes: 0 done, 1 runtime error\n"
    "(including a non-finite loss), 2 bad flags, config or data, 4 bad checkpoint.\n";

/* Every integer flag has explicit bounds, checked on the 64-bit value before
 * it is stored (an int field never sees a value it cannot hold). */
static int parse_i64(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!k3_parse_i64(s, lo, hi, out))
        return k3_usage_error("train", "%s wants an integer in %lld..%lld, got '%s'", flag, (long long)lo,
                              (long long)hi, s);
    return 0;
}

int cmd_train(int argc, char **argv) {
    k3_dist_silence_others(); /* under mpirun rank 0 alone prints */
    ttrain_opts o;
    memset(&o, 0, sizeof o);
    bool inventory = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(cmd_train_help, stdout);
            return 0;
        }
        if (strcmp(a, "--skip-samples") == 0) { o.skip_samples = true; continue; }
        if (strcmp(a, "--bf16") == 0) { o.bf16 = 1; continue; }
        if (strcmp(a, "--no-bf16") == 0) { o.bf16 = 2; continue; }
        if (strcmp(a, "--quiet") == 0) { o.quiet = true; continue; }
        if (strcmp(a, "--inventory") == 0) { inventory = true; continue; }
        if (i + 1 >= argc) return k3_usage_error("train", "unknown flag or missing value: %s", a);
        const char *v = argv[++i];
        int64_t x = 0;
        int rc = 0;
        if (strcmp(a, "--data-dir") == 0) o.data_dir = v;
        else if (strcmp(a, "--output-dir") == 0) o.output_dir = v;
        else if (strcmp(a, "--config") == 0) o.config_path = v;
        else if (strcmp(a, "--resume") == 0) o.resume = v;
        else if (strcmp(a, "--init") == 0) o.init = v;
        else if (strcmp(a, "--steps") == 0) { if (!(rc = parse_i64(a, v, 1, INT64_MAX / 2, &x))) o.steps = x; }
        else if (strcmp(a, "--stop-at") == 0) { if (!(rc = parse_i64(a, v, 1, INT64_MAX / 2, &x))) o.stop_at = x; }
        else if (strcmp(a, "--batch-size") == 0) { if (!(rc = parse_i64(a, v, 1, 4096, &x))) o.batch = (int)x; }
        else if (strcmp(a, "--seq-len") == 0) { if (!(rc = parse_i64(a, v, 1, 65536, &x))) o.seq = (int)x; }
        else if (strcmp(a, "--gradient-accumulation") == 0) { if (!(rc = parse_i64(a, v, 1, 4096, &x))) o.accum = (int)x; }
        else if (strcmp(a, "--eval-interval") == 0) { if (!(rc = parse_i64(a, v, 1, INT32_MAX, &x))) o.eval_interval = (int)x; }
        else if (strcmp(a, "--eval-tokens") == 0) { if (!(rc = parse_i64(a, v, 1, INT64_MAX / 2, &x))) o.eval_tokens = x; }
        else if (strcmp(a, "--checkpoint-interval") == 0) { if (!(rc = parse_i64(a, v, 1, INT32_MAX, &x))) o.checkpoint_interval = (int)x; }
        else if (strcmp(a, "--sample-interval") == 0) { if (!(rc = parse_i64(a, v, 1, INT32_MAX, &x))) o.sample_interval = (int)x; }
        else if (strcmp(a, "--sample-tokens") == 0) { if (!(rc = parse_i64(a, v, 1, 65536, &x))) o.sample_tokens = (int)x; }
        else if (strcmp(a, "--seed") == 0) { if (!(rc = parse_i64(a, v, 0, INT64_MAX, &x))) { o.seed = (uint64_t)x; o.seed_set = true; } }
        else if (strcmp(a, "--lr") == 0) {
            char *end;
            o.lr = strtod(v, &end);
            if (*end || end == v || !(o.lr > 0) || o.lr > 10) return k3_usage_error("train", "--lr wants a positive number, got '%s'", v);
        } else if (strcmp(a, "--weight-decay") == 0) {
            char *end;
            o.weight_decay = strtod(v, &end);
            if (*end || end == v || !(o.weight_decay >= 0) || o.weight_decay > 10)
                return k3_usage_error("train", "--weight-decay wants a number in 0..10, got '%s'", v);
            o.weight_decay_set = true;
        } else if (strcmp(a, "--kda-chunk") == 0) {
            if ((rc = parse_i64(a, v, 0, TM_MAX_KDA_CHUNK, &x))) return rc;
            o.kda_chunk = x ? (int)x : -1;
        } else if (strcmp(a, "--optimizer") == 0) {
            if (strcmp(v, "muon") == 0) o.optimizer = 1;
            else if (strcmp(v, "adamw") == 0) o.optimizer = 2;
            else return k3_usage_error("train", "--optimizer wants muon or adamw, got '%s'", v);
        } else return k3_usage_error("train", "unknown flag: %s", a);
        if (rc) return rc;
    }
    k3_err err = {0};
    if (o.init && o.resume)
        return k3_usage_error("train", "--init starts a new run and --resume continues one: give one of them");
    if (!o.config_path && !o.resume && !o.init) o.config_path = "configs/smol-50m.json";
    if (inventory) {
        k3_config c;
        tmodel m;
        if (k3_config_load(o.config_path, &c, &err) || tm_build(&m, &c, &err)) return k3_report(&err);
        printf("%s:\n", o.config_path);
        tm_print_inventory(&m, stdout);
        tm_free(&m);
        return 0;
    }
    if (!o.data_dir) return k3_usage_error("train", "--data-dir is required");
    if (!o.output_dir) return k3_usage_error("train", "--output-dir is required");
    if (!o.steps) return k3_usage_error("train", "--steps is required");
    if (o.stop_at > o.steps) return k3_usage_error("train", "--stop-at %lld is past --steps %lld", (long long)o.stop_at, (long long)o.steps);
    int rc = k3_train_run(&o, &err);
    return rc ? k3_report(&err) : 0;
}
