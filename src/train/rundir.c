/* rundir.c: the files of a `k3 train` run directory besides the checkpoints
 * and loss.svg (docs/run-dir.md): state.json (rewritten atomically),
 * metrics.jsonl and samples.jsonl (one record a write; trimmed to the
 * checkpoint's step on --resume), the folder's set-up, and the training
 * settings as the JSON a checkpoint carries (train_json). The loop that
 * fills them is trainer.c; the picture is lossplot.c. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "train/tinternal.h"

double trun_wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

char *trun_path(const trun *r, const char *name) { return k3_path_join(r->o.output_dir, name); }

/* ---- JSON helpers ---------------------------------------------------------------- */

json_t *trun_jnum(double v) { return isfinite(v) ? json_real(v) : json_null(); }

/* Appends one record as a single write (docs/run-dir.md). */
int trun_append_line(int fd, json_t *rec, const char *what, k3_err *err) {
    /* 17 digits: the Unix times must keep their milliseconds (docs/run-dir.md);
     * %.9g would round a present-day time to 10 seconds */
    char *s = json_dumps(rec, JSON_COMPACT | JSON_REAL_PRECISION(17));
    size_t n = strlen(s);
    char *line = xmalloc(n + 2);
    memcpy(line, s, n);
    line[n] = '\n';
    free(s);
    ssize_t w = write(fd, line, n + 1);
    free(line);
    if (w != (ssize_t)(n + 1)) return k3_fail(err, K3_EXIT_RUNTIME, "%s: write failed: %s", what, strerror(errno));
    return K3_OK;
}

/* Replaces every byte sequence that is not valid UTF-8 by U+FFFD. */
char *trun_utf8_clean(const uint8_t *s, size_t n) {
    char *out = xmalloc(n * 3 + 1);
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        bool ok = len > 0 && i + (size_t)len <= n;
        for (int k = 1; ok && k < len; k++) ok = (s[i + k] & 0xC0) == 0x80;
        if (ok && len == 2) ok = c >= 0xC2;
        if (ok && len == 3) {
            uint32_t cp = ((uint32_t)(c & 15) << 12) | ((uint32_t)(s[i + 1] & 63) << 6) | (s[i + 2] & 63);
            ok = cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF);
        }
        if (ok && len == 4) {
            uint32_t cp = ((uint32_t)(c & 7) << 18) | ((uint32_t)(s[i + 1] & 63) << 12) |
                          ((uint32_t)(s[i + 2] & 63) << 6) | (s[i + 3] & 63);
            ok = cp >= 0x10000 && cp <= 0x10FFFF;
        }
        if (ok && c != 0) {
            memcpy(out + o, s + i, (size_t)len);
            o += (size_t)len;
            i += (size_t)len;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    out[o] = 0;
    return out;
}

/* ---- state.json ------------------------------------------------------------------- */

int trun_write_state(trun *r, const char *status, const char *error, k3_err *err) {
    if (!r->writer) return K3_OK;
    json_t *s = json_object();
    json_object_set_new(s, "format", json_string("k3-run"));
    json_object_set_new(s, "version", json_integer(1));
    json_object_set_new(s, "status", json_string(status));
    json_object_set_new(s, "step", json_integer(r->start));
    json_object_set_new(s, "total_steps", json_integer(r->total));
    json_object_set_new(s, "stop_at", r->o.stop_at ? json_integer(r->o.stop_at) : json_null());
    json_object_set_new(s, "started_at", json_real(r->started));
    json_object_set_new(s, "updated_at", json_real(trun_wall()));
    json_object_set_new(s, "resumed_from", r->resumed ? json_integer(r->resumed_from) : json_null());
    json_object_set_new(s, "phase", json_string(r->phase));
    json_object_set_new(s, "pid", json_integer(getpid()));
    char host[256];
    if (gethostname(host, sizeof host) == 0) {
        host[sizeof host - 1] = 0;
        json_object_set_new(s, "hostname", json_string(host));
    }
    json_object_set_new(s, "params", json_integer((json_int_t)r->m.nw));
    json_object_set_new(s, "ranks", json_integer(r->ranks));
    json_t *cfg = json_loads(r->config_text, 0, NULL);
    json_object_set_new(s, "config", cfg ? cfg : json_null());
    if (r->o.config_path) json_object_set_new(s, "config_path", json_string(r->o.config_path));
    json_t *tr = json_loads(r->train_json, 0, NULL);
    json_object_set_new(s, "train", tr ? tr : json_null());
    json_object_set(s, "latest", r->latest ? r->latest : json_null());
    json_object_set(s, "latest_eval", r->latest_eval ? r->latest_eval : json_null());
    json_object_set_new(s, "best_val_loss", r->best_step >= 0 ? trun_jnum(r->best_loss) : json_null());
    json_object_set_new(s, "best_step", r->best_step >= 0 ? json_integer(r->best_step) : json_null());
    json_object_set_new(s, "checkpoint_step", r->ckpt_step >= 0 ? json_integer(r->ckpt_step) : json_null());
    if (error) json_object_set_new(s, "error", json_string(error));
    char *text = json_dumps(s, JSON_INDENT(1) | JSON_REAL_PRECISION(17)); /* times: see trun_append_line */
    json_decref(s);
    char *p = trun_path(r, "state.json");
    int rc = k3_write_file_atomic(p, text, strlen(text), err);
    free(p);
    free(text);
    return rc;
}

/* ---- the run directory ------------------------------------------------------------ */

/* On resume: keep only records with step <= the checkpoint's (rewritten
 * atomically), and rebuild the loss history from what is kept. */
static int trim_jsonl(trun *r, const char *name, bool history, k3_err *err) {
    char *p = trun_path(r, name);
    char *text;
    size_t len;
    struct stat st;
    if (stat(p, &st) != 0) { free(p); return K3_OK; }
    int rc = k3_read_file(p, &text, &len, err);
    if (rc) { free(p); return rc; }
    char *out = xmalloc(len + 1);
    size_t o = 0;
    char *s = text, *end = text + len;
    while (s < end) {
        char *nl = memchr(s, '\n', (size_t)(end - s));
        if (!nl) break; /* a partial last line is dropped */
        json_t *j = json_loadb(s, (size_t)(nl - s), 0, NULL);
        json_t *js = j ? json_object_get(j, "step") : NULL;
        if (js && json_integer_value(js) <= r->start) {
            memcpy(out + o, s, (size_t)(nl - s) + 1);
            o += (size_t)(nl - s) + 1;
            if (history) {
                json_t *tl = json_object_get(j, "train_loss"), *vl = json_object_get(j, "val_loss");
                if (tl) tplot_add_train(r, json_integer_value(js), json_is_number(tl) ? json_number_value(tl) : NAN);
                if (vl) tplot_add_eval(r, json_integer_value(js), json_is_number(vl) ? json_number_value(vl) : NAN);
            }
        }
        json_decref(j);
        s = nl + 1;
    }
    rc = k3_write_file_atomic(p, out, o, err);
    free(out);
    free(text);
    free(p);
    return rc;
}

/* Earlier versions sampled through a temporary export, and a run killed
 * while sampling left its k3-sample-PID-XXXXXX folder behind: sampling still
 * removes those whose PID no longer exists. */
void trun_remove_stale_samples(const char *tdir) {
    DIR *d = opendir(tdir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        if (strncmp(e->d_name, "k3-sample-", 10) != 0) continue;
        errno = 0;
        long pid = strtol(e->d_name + 10, &end, 10);
        if (errno || end == e->d_name + 10 || *end != '-' || !k3_pid_gone(pid)) continue;
        char *p = k3_path_join(tdir, e->d_name);
        k3_remove_flat_dir(p);
        free(p);
    }
    closedir(d);
}

static int open_fd(trun *r, const char *name, int *fd, k3_err *err) {
    char *p = trun_path(r, name);
    *fd = open(p, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    int rc = *fd < 0 ? k3_fail(err, K3_EXIT_RUNTIME, "%s: %s", p, strerror(errno)) : K3_OK;
    free(p);
    return rc;
}

/* The run directory: rank 0's alone, once every rank is known to run the
 * same job (a refused job leaves it as it was). */
int trun_open_dir(trun *r, k3_err *err) {
    const ttrain_opts *o = &r->o;
    int rc;
    if ((rc = k3_mkdir_p(o->output_dir, err))) return rc;
    if (!r->resumed) {
        char *p = trun_path(r, "latest.safetensors");
        struct stat st;
        bool exists = stat(p, &st) == 0;
        free(p);
        if (exists)
            return k3_fail(err, K3_EXIT_USAGE,
                           "%s: already holds a run (latest.safetensors); continue it with --resume %s/latest.safetensors "
                           "or choose another --output-dir",
                           o->output_dir, o->output_dir);
        /* a fresh run starts fresh files */
        const char *names[] = {"metrics.jsonl", "samples.jsonl"};
        for (int i = 0; i < 2; i++) {
            char *q = trun_path(r, names[i]);
            if ((rc = k3_write_file_atomic(q, "", 0, err))) { free(q); return rc; }
            free(q);
        }
    } else {
        if ((rc = trim_jsonl(r, "metrics.jsonl", true, err))) return rc;
        if ((rc = trim_jsonl(r, "samples.jsonl", false, err))) return rc;
    }
    if ((rc = open_fd(r, "metrics.jsonl", &r->metrics_fd, err))) return rc;
    if ((rc = open_fd(r, "samples.jsonl", &r->samples_fd, err))) return rc;
    return K3_OK;
}

/* ---- the training settings (train_json) --------------------------------------------- */

int trun_parse_train_json(trun *r, const char *text) {
    json_t *j = json_loads(text, 0, NULL);
    if (!j) return -1;
    if (!r->B) r->B = (int)json_integer_value(json_object_get(j, "batch_size"));
    if (!r->T) r->T = (int)json_integer_value(json_object_get(j, "seq_len"));
    if (!r->A) r->A = (int)json_integer_value(json_object_get(j, "grad_accum"));
    if (r->opt.c.lr == 0) r->opt.c.lr = json_real_value(json_object_get(j, "lr"));
    json_t *wd = json_object_get(j, "weight_decay");
    if (r->opt.c.weight_decay < 0 && json_is_number(wd)) r->opt.c.weight_decay = json_number_value(wd);
    if (!r->o.optimizer) {
        const char *o = json_string_value(json_object_get(j, "optimizer"));
        r->o.optimizer = o && strcmp(o, "adamw") == 0 ? 2 : 1;
    }
    if (!r->o.bf16) r->o.bf16 = json_is_true(json_object_get(j, "bf16")) ? 1 : 2;
    const char *init = json_string_value(json_object_get(j, "init_from"));
    if (init) {
        r->init_from = xstrdup(init);
        r->init_step = json_integer_value(json_object_get(j, "init_step"));
    }
    json_t *kc = json_object_get(j, "kda_chunk");
    if (r->o.kda_chunk == 0 && json_is_integer(kc))
        r->o.kda_chunk = json_integer_value(kc) > 0 ? (int)json_integer_value(kc) : -1;
    json_decref(j);
    return 0;
}

char *trun_make_train_json(const trun *r) {
    json_t *j = json_object();
    json_object_set_new(j, "batch_size", json_integer(r->B));
    json_object_set_new(j, "seq_len", json_integer(r->T));
    json_object_set_new(j, "grad_accum", json_integer(r->A));
    json_object_set_new(j, "tokens_per_step", json_integer((json_int_t)r->A * r->B * r->T));
    json_object_set_new(j, "lr", json_real(r->opt.c.lr));
    json_object_set_new(j, "min_lr_ratio", json_real(r->opt.c.min_lr_ratio));
    int64_t warm = (int64_t)ceil(r->opt.c.warmup_frac * (double)r->total);
    json_object_set_new(j, "warmup_steps", json_integer(warm < 1 ? 1 : warm));
    json_object_set_new(j, "weight_decay", json_real(r->opt.c.weight_decay));
    json_object_set_new(j, "grad_clip", json_real(r->opt.c.clip));
    json_object_set_new(j, "eval_interval", json_integer(r->o.eval_interval));
    json_object_set_new(j, "sample_interval", json_integer(r->o.skip_samples ? 0 : r->o.sample_interval));
    json_object_set_new(j, "seed", json_integer((json_int_t)r->seed));
    json_object_set_new(j, "optimizer", json_string(r->opt.c.muon ? "muon" : "adamw"));
    json_object_set_new(j, "threads", json_integer(omp_get_max_threads()));
    json_object_set_new(j, "bf16", json_boolean(r->m.bf16));
    json_object_set_new(j, "kda_chunk", json_integer(r->m.kda_chunk));
    if (r->init_from) {
        json_object_set_new(j, "init_from", json_string(r->init_from));
        json_object_set_new(j, "init_step", json_integer(r->init_step));
    }
    char *s = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(17));
    json_decref(j);
    return s;
}
