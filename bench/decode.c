/* bench_decode: prefill and decode throughput of a resident model directory at
 * each thread count, with the weight bytes one decoded token reads, the GB/s
 * that implies, and a STREAM-like read-bandwidth probe taken in the same run
 * (so the ratio to the machine's limit is visible).
 *
 *   bin/bench_decode MODEL_DIR [--prompt N] [--gen N] [--threads 1,2] [--probe-mb MB] [--chunk N]
 *                    [--json FILE]
 *
 * --chunk: positions per forward pass (k3_model_opts.prefill_chunk; default
 * K3_PREFILL_CHUNK, 256).
 * --batch B1,B2,..: also decode B sequences together (each its own prompt and
 * state, one token each per pass: k3_forward_batch, as k3 serve --parallel
 * does), at the first --threads count; aggregate tok/s and the ratio to B 1.
 * --json: also write every figure of the tables to FILE (atomically), for
 * bench/report.sh; the printed tables are the same with or without it.
 *
 * Build a checkpoint with tools/gen_checkpoint.py (e.g. --preset mid, 627 MB,
 * 96 MXFP4 experts). Not a test: numbers depend on the machine and its load. */
#include "bench.h"
#include "kernels/kernels.h"
#include "model/source.h"

#include <jansson.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Multiply-adds of one token at position pos: every matrix it multiplies
 * (k experts per MoE layer, lm_head only when logits are asked for), the KDA
 * state update (u = S^T k, S += k d^T, o = S^T q: 3 H D^2) and MLA attention
 * over pos+1 cached latents (scores and the weighted sum: H (2 r_kv + d_r)). */
static double mat_macs(const k3_mat *w) { return (double)w->rows * (double)w->cols; }
static double token_macs(const k3_model *m, double pos, bool head) {
    const k3_config *c = k3_model_config(m);
    double t = head ? (double)c->vocab_size * c->hidden_size : 0;
    for (int L = 0; L < c->num_layers; L++) {
        const k3_layer_w *w = k3_model_layer(m, L);
        if (!w) continue; /* opened without resident layers */
        if (w->kind == 'K') {
            const k3_kda_w *k = &w->kda;
            t += mat_macs(&k->q) + mat_macs(&k->k) + mat_macs(&k->v) + mat_macs(&k->g) + mat_macs(&k->b) +
                 mat_macs(&k->f_a) + mat_macs(&k->f_b) + mat_macs(&k->o);
            t += 3.0 * c->kda_heads * (double)c->kda_head_dim * c->kda_head_dim;
        } else {
            const k3_mla_w *a = &w->mla;
            t += mat_macs(&a->q_a) + mat_macs(&a->q_b) + mat_macs(&a->kv_a) + mat_macs(&a->kv_b) +
                 mat_macs(&a->g) + mat_macs(&a->o);
            t += (pos + 1) * c->mla_heads * (2.0 * c->kv_lora_rank + c->qk_rope_dim);
        }
        if (w->dense) {
            t += mat_macs(&w->mlp.gate) + mat_macs(&w->mlp.up) + mat_macs(&w->mlp.down);
        } else {
            const k3_moe_w *e = &w->moe;
            t += mat_macs(&e->router) + mat_macs(&e->down) + mat_macs(&e->up) + mat_macs(&e->shared.gate) +
                 mat_macs(&e->shared.up) + mat_macs(&e->shared.down);
            t += (double)c->experts_per_token * 3.0 * c->latent_dim * c->moe_inter;
        }
    }
    return t;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* B sequences decoded together, one token each per pass, every sequence with
 * its own random prompt: the median pass time over ng passes. */
static int batch_decode(k3_model *m, const char *blist, int threads, int np, int ng, k3_err *err) {
    const k3_config *c = k3_model_config(m);
    const int V = c->vocab_size;
    omp_set_num_threads(threads);
    printf("\nbatched decode (%d threads; B sequences after their own %d-token prompts, one token each per pass,\n"
           "median pass of %d)\n%-5s %10s %12s %12s\n", threads, np, ng, "B", "ms/pass", "tok/s", "x of B=1");
    double base = 0;
    for (const char *p = blist; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) {
        int B = atoi(p);
        if (B < 1 || B > 256) return k3_fail(err, 2, "--batch: %d is not in 1..256", B);
        k3_state **st = xcalloc((size_t)B, sizeof *st);
        int32_t *ids = xmalloc_array((size_t)B * (size_t)np, sizeof *ids), *next = xmalloc_array((size_t)B, sizeof *next);
        float *lg = xmalloc_array((size_t)B * (size_t)V, sizeof *lg);
        double *dt = xmalloc_array((size_t)ng, sizeof *dt);
        uint64_t x = 0x9E3779B97F4A7C15ull;
        int rc = K3_OK;
        for (int q = 0; q < B && !rc; q++) {
            for (int i = 0; i < np; i++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                ids[(size_t)q * np + i] = (int32_t)(x % (uint64_t)V);
            }
            rc = k3_state_new(m, np + ng + 8, &st[q], err);
            if (!rc) rc = k3_forward(m, st[q], ids + (size_t)q * np, np, lg + (size_t)q * V, false, err);
        }
        for (int g = 0; g < ng && !rc; g++) {
            for (int q = 0; q < B; q++) next[q] = k3_argmax(lg + (size_t)q * V, V);
            double t0 = k3_now();
            rc = k3_forward_batch(m, st, B, next, lg, err);
            dt[g] = k3_now() - t0;
        }
        if (!rc) {
            qsort(dt, (size_t)ng, sizeof *dt, cmp_double);
            double ms = 1e3 * dt[ng / 2], tps = B / dt[ng / 2];
            if (base == 0) base = tps;
            printf("%-5d %10.3f %12.1f %11.2fx\n", B, ms, tps, tps / base);
        }
        for (int q = 0; q < B; q++) k3_state_free(st[q]);
        free(st), free(ids), free(next), free(lg), free(dt);
        if (rc) return rc;
    }
    return K3_OK;
}

int main(int argc, char **argv) {
    const char *dir = NULL, *tlist = "1,2", *json_path = NULL, *blist = NULL;
    int np = 64, ng = 32, probe_mb = 1024, chunk = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--prompt") && i + 1 < argc) np = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--gen") && i + 1 < argc) ng = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) tlist = argv[++i];
        else if (!strcmp(argv[i], "--probe-mb") && i + 1 < argc) probe_mb = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc) chunk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) blist = argv[++i];
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else {
            fprintf(stderr, "usage: bench_decode MODEL_DIR [--prompt N] [--gen N] [--threads 1,2] [--probe-mb MB] [--chunk N] "
                            "[--batch 1,2,4,8] [--json FILE]\n");
            return 2;
        }
    }
    if (!dir || np < 1 || ng < 2 || probe_mb < 16) {
        fprintf(stderr, "usage: bench_decode MODEL_DIR [--prompt N] [--gen N>=2] [--threads 1,2] [--probe-mb MB>=16] [--chunk N] "
                        "[--json FILE]\n");
        return 2;
    }
    int threads[16], nt = 0;
    for (const char *p = tlist; *p && nt < 16;) {
        threads[nt++] = atoi(p);
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }

    k3_err err = {0};
    k3_model *m;
    k3_model_opts mo = {.prefill_chunk = chunk};
    if (k3_model_open(dir, &mo, &m, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size;
    uint64_t bpt = k3_model_bytes_per_token(m);
    printf("model %s: %d layers, hidden %d, %d experts (top-%d), weights %.1f MB resident, %.1f MB read per decoded token\n",
           dir, c->num_layers, c->hidden_size, c->num_experts, c->experts_per_token,
           k3_model_weight_bytes(m) / 1e6, bpt / 1e6);
    printf("kernels: %s\n", k_path_name());

    size_t n = (size_t)probe_mb * 1024 * 1024 / sizeof(float);
    float *a = xmalloc_array(n, sizeof *a);
    for (size_t i = 0; i < n; i++) a[i] = (float)(i & 1023) * 1e-3f;

    int32_t *ids = xmalloc_array((size_t)np + ng, sizeof *ids);
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < np; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[i] = (int32_t)(x % (uint64_t)V);
    }
    float *lg = xmalloc_array((size_t)V, sizeof *lg);
    double *dt = xmalloc_array((size_t)ng, sizeof *dt);

    double pf_macs = 0;
    for (int i = 0; i < np; i++) pf_macs += token_macs(m, i, i == np - 1);
    double *dec_wall = xcalloc((size_t)nt, sizeof *dec_wall), *dec_cpu = xcalloc((size_t)nt, sizeof *dec_cpu);
    printf("\ndecode (%d tokens after a %d-token prompt; best token, median token, CPU time per token)\n", ng, np);
    printf("%-7s %9s %9s | %9s %9s %9s %8s | %10s %9s %8s\n", "threads", "probe", "probe", "best", "median",
           "best", "% of", "CPU ms", "CPU-rate", "% of");
    printf("%-7s %9s %9s | %9s %9s %9s %8s | %10s %9s %8s\n", "", "GB/s", "CPU GB/s", "tok/s", "tok/s", "GB/s",
           "probe", "per token", "GB/s", "CPU prb");
    struct { double pre_wall, pre_cpu; } *pf = xcalloc((size_t)nt, sizeof *pf);
    json_t *jdec = json_array();
    for (int ti = 0; ti < nt; ti++) {
        int t = threads[ti];
        omp_set_num_threads(t);
        double bw, bwc;
        probe_read_gbs(a, n, t, &bw, &bwc);
        k3_state *s;
        if (k3_state_new(m, np + ng + 8, &s, &err)) {
            fprintf(stderr, "k3: %s\n", err.msg);
            return err.code;
        }
        /* warm-up: touch the trunk and some experts once (page cache, first-touch) */
        if (k3_forward(m, s, ids, np < 8 ? np : 8, lg, false, &err)) goto fail;
        k3_state_reset(s);
        double t0 = k3_now(), c0 = bench_cpu_now();
        if (k3_forward(m, s, ids, np, lg, false, &err)) goto fail;
        double t1 = k3_now(), c1 = bench_cpu_now();
        pf[ti].pre_wall = t1 - t0;
        pf[ti].pre_cpu = c1 - c0;
        for (int g = 0; g < ng; g++) {
            double tt = k3_now();
            ids[np + g] = k3_argmax(lg, V);
            if (k3_forward(m, s, &ids[np + g], 1, lg, false, &err)) goto fail;
            dt[g] = k3_now() - tt;
        }
        double c2 = bench_cpu_now();
        k3_state_free(s);
        /* A token reads every weight once, so the best token time is the one
         * least disturbed by other processes on a shared machine: the figure
         * set beside the best probe. The median says how typical it was. The
         * CPU rate (bytes / (CPU time / threads)) beside the probe's CPU rate
         * is the comparison that time slicing by other processes disturbs least. */
        qsort(dt, (size_t)ng, sizeof *dt, cmp_double);
        double dec = 1.0 / dt[0], med = 1.0 / dt[ng / 2], gbs = dec * (double)bpt / 1e9;
        double cpt = (c2 - c1) / ng, cgbs = (double)bpt / (cpt / t) / 1e9;
        dec_wall[ti] = dec;
        dec_cpu[ti] = cgbs;
        printf("%-7d %9.1f %9.1f | %9.2f %9.2f %9.2f %7.0f%% | %10.1f %9.2f %7.0f%%\n", t, bw, bwc, dec, med, gbs,
               100 * gbs / bw, 1e3 * cpt, cgbs, 100 * cgbs / bwc);
        json_array_append_new(jdec, json_pack("{s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f}", "threads", t,
                                              "probe_gbs", bw, "probe_cpu_gbs", bwc, "best_tokens_per_s", dec,
                                              "median_tokens_per_s", med, "best_gbs", gbs,
                                              "cpu_ms_per_token", 1e3 * cpt, "cpu_gbs", cgbs));
        continue;
    fail:
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    printf("\nprefill (%d-token prompt, one call, chunks of %d; %.2f GFLOP = 2 x multiply-adds incl. attention)\n", np,
           chunk > 0 ? chunk : K3_PREFILL_CHUNK, 2 * pf_macs / 1e9);
    double peak = bench_fma_peak_gflops();
    printf("%-7s %10s %10s %10s %12s %12s %10s\n", "threads", "tok/s", "GFLOP/s", "% of peak", "CPU s",
           "GFLOP/CPU-s", "% of peak");
    for (int ti = 0; ti < nt; ti++) {
        double g = 2 * pf_macs / pf[ti].pre_wall / 1e9, gc = 2 * pf_macs / pf[ti].pre_cpu / 1e9;
        printf("%-7d %10.1f %10.1f %9.0f%% %12.3f %12.1f %9.0f%%\n", threads[ti], np / pf[ti].pre_wall, g,
               peak > 0 ? 100 * g / (peak * threads[ti]) : 0, pf[ti].pre_cpu, gc, peak > 0 ? 100 * gc / peak : 0);
    }
    printf("FMA peak: %.1f GFLOP/s per core (FMA chains on the kernel path in force, CPU time)\n", peak);
    if (blist && batch_decode(m, blist, threads[0], np, ng, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    if (json_path) {
        json_t *jpf = json_array();
        for (int ti = 0; ti < nt; ti++)
            json_array_append_new(jpf, json_pack("{s:i, s:f, s:f, s:f, s:f, s:f}", "threads", threads[ti],
                                                 "wall_s", pf[ti].pre_wall, "cpu_s", pf[ti].pre_cpu,
                                                 "tokens_per_s", np / pf[ti].pre_wall,
                                                 "gflops", 2 * pf_macs / pf[ti].pre_wall / 1e9,
                                                 "gflops_per_cpu_s", 2 * pf_macs / pf[ti].pre_cpu / 1e9));
        json_t *o = json_pack("{s:s, s:i, s:i, s:i, s:i, s:I, s:I, s:s, s:i, s:i, s:i, s:i, s:f, s:f, s:o, s:o}",
                              "model", dir, "layers", c->num_layers, "hidden", c->hidden_size, "experts",
                              c->num_experts, "experts_per_token", c->experts_per_token, "weight_bytes",
                              (json_int_t)k3_model_weight_bytes(m), "bytes_per_token", (json_int_t)bpt, "kernels",
                              k_path_name(), "prompt", np, "gen", ng, "chunk", chunk > 0 ? chunk : K3_PREFILL_CHUNK, "probe_mb",
                              probe_mb, "prefill_gflop", 2 * pf_macs / 1e9, "fma_peak_gflops_per_core", peak,
                              "decode", jdec, "prefill", jpf);
        jdec = NULL;
        char *txt = o ? json_dumps(o, JSON_INDENT(1) | JSON_REAL_PRECISION(6)) : NULL;
        json_decref(o);
        if (!txt || k3_write_file_atomic(json_path, txt, strlen(txt), &err)) {
            fprintf(stderr, "k3: %s\n", txt ? err.msg : "bench_decode: cannot build the JSON report");
            free(txt);
            return 1;
        }
        free(txt);
    }
    json_decref(jdec);
    printf("\n(decode GB/s = tok/s x %.1f MB of weights per token; %% of probe = that / the read-bandwidth probe\n"
           " taken at the same thread count just before; CPU columns divide CPU time by the thread count)\n",
           bpt / 1e6);
    free(pf);
    free(dec_wall);
    free(dec_cpu);
    free(lg);
    free(dt);
    free(ids);
    free(a);
    k3_model_free(m);
    return 0;
}
