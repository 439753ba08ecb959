/* test_train_speed.c: the fast compute modes of the trainer against their
 * references: the chunkwise KDA forward/backward against the recurrent form
 * with BPTT (every parameter gradient of a model, several chunk lengths, mild
 * and extreme decays), and the opt-in BF16 mode against F32. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "harness.h"
#include "train/tinternal.h"

static uint64_t rs = 0x2545F4914F6CDD1Dull;
static float frand(void) { /* uniform in [-1, 1) */
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (float)((double)(rs >> 11) / 4503599627370496.0 - 1.0);
}

static bool build(tmodel *m) {
    k3_config c;
    k3_err err = {0};
    if (k3_config_load("tests/fixtures/train/grad-config.json", &c, &err) || tm_build(m, &c, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return false;
    }
    tm_init(m, 11);
    for (size_t i = 0; i < m->nw; i++) m->w[i] += 0.05f * frand();
    return true;
}

/* Loss, logits and every gradient of one micro-batch in the model's mode. */
static double run(tmodel *m, const int32_t *tok, int B, int T, float *logits, float *grad) {
    memset(m->g, 0, sizeof(float) * m->nw);
    double loss = tm_forward(m, tok, B, T);
    memcpy(logits, m->logits, sizeof(float) * (size_t)B * T * m->cfg.vocab_size);
    tm_backward(m, 1.0f / (float)(B * T));
    memcpy(grad, m->g, sizeof(float) * m->nw);
    return loss;
}

/* Normwise relative error of each parameter's gradient; the worst one. */
static double worst_grad(const tmodel *m, const float *a, const float *b, int *which) {
    double worst = 0;
    for (int i = 0; i < m->np; i++) {
        const tparam *p = &m->params[i];
        double d = 0, n = 0;
        for (size_t j = 0; j < p->numel; j++) {
            double x = a[p->off + j], y = b[p->off + j];
            d += (x - y) * (x - y);
            n += y * y;
        }
        double r = sqrt(d) / (sqrt(n) + 1e-12);
        if (r > worst) { worst = r; *which = i; }
    }
    return worst;
}

TEST(train_kda_chunked_matches_recurrent) {
    tmodel m;
    CHECK(build(&m));
    enum { B = 2, T = 37 };
    int32_t tok[B * (T + 1)];
    for (int i = 0; i < B * (T + 1); i++) tok[i] = (int32_t)((i * 7 + 3) % m.cfg.vocab_size);
    const size_t NL = (size_t)B * T * m.cfg.vocab_size;
    float *l0 = xmalloc_array(NL, sizeof(float)), *l1 = xmalloc_array(NL, sizeof(float));
    float *g0 = xmalloc_array(m.nw, sizeof(float)), *g1 = xmalloc_array(m.nw, sizeof(float));
    for (int decay = 0; decay < 2; decay++) {
        if (decay) {
            /* push every decay toward the lower bound: g = -5 sigmoid(e^A (z + dt)) */
            for (int i = 0; i < m.np; i++) {
                const char *n = m.params[i].name;
                size_t L = strlen(n);
                float v = 0;
                if (L > 7 && !strcmp(n + L - 7, "dt_bias")) v = 6.0f;
                else if (L > 5 && !strcmp(n + L - 5, "A_log")) v = 1.0f;
                else continue;
                for (size_t j = 0; j < m.params[i].numel; j++) m.w[m.params[i].off + j] = v;
            }
        }
        m.kda_chunk = 0;
        double ref = run(&m, tok, B, T, l0, g0);
        const int chunks[] = {16, 5, 1, 64};
        for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
            m.kda_chunk = chunks[c];
            double got = run(&m, tok, B, T, l1, g1);
            double dl = 0, nl = 0;
            for (size_t i = 0; i < NL; i++) {
                dl += ((double)l1[i] - l0[i]) * ((double)l1[i] - l0[i]);
                nl += (double)l0[i] * l0[i];
            }
            int which = 0;
            double wg = worst_grad(&m, g1, g0, &which);
            printf("decay %s, chunk %d: loss rel %.2e, logits %.2e, worst gradient %.2e (%s)\n",
                   decay ? "strong" : "init", chunks[c], fabs(got - ref) / ref, sqrt(dl / nl), wg,
                   m.params[which].name);
            CHECK(fabs(got - ref) <= 1e-6 * ref);
            CHECK(sqrt(dl / nl) < 1e-6);
            CHECKF(wg < 1e-5, "chunk %d: gradient %s differs by %.2e", chunks[c], m.params[which].name, wg);
            CHECK(isfinite(got));
        }
    }
    free(l0); free(l1); free(g0); free(g1);
    tm_free(&m);
}

/* BF16 mode: gradients within BF16 rounding of F32 ones, and a 30-step AdamW
 * run whose loss curve stays close to the F32 curve while both fall. */
TEST(train_bf16_mode_tracks_f32) {
    tmodel m;
    CHECK(build(&m));
    enum { B = 2, T = 24, STEPS = 30 };
    const int V = m.cfg.vocab_size;
    int32_t tok[B * (T + 1)];
    float *w0 = xmalloc_array(m.nw, sizeof(float));
    memcpy(w0, m.w, sizeof(float) * m.nw);
    const size_t NL = (size_t)B * T * V;
    float *lg = xmalloc_array(NL, sizeof(float)), *g32 = xmalloc_array(m.nw, sizeof(float));
    float *g16 = xmalloc_array(m.nw, sizeof(float));
    /* a learnable stream: short repeating phrases with a per-row offset */
    for (int b = 0; b < B; b++)
        for (int t = 0; t <= T; t++) tok[b * (T + 1) + t] = (int32_t)((b * 3 + (t % 6) * 5) % V);
    m.bf16 = false;
    run(&m, tok, B, T, lg, g32);
    m.bf16 = true;
    run(&m, tok, B, T, lg, g16);
    int which = 0;
    double gerr = worst_grad(&m, g16, g32, &which);
    double gtot = 0, gd = 0;
    for (size_t i = 0; i < m.nw; i++) {
        gtot += (double)g32[i] * g32[i];
        gd += ((double)g16[i] - g32[i]) * ((double)g16[i] - g32[i]);
    }
    printf("bf16 vs f32 gradient: all parameters %.2e, worst tensor %.2e (%s)\n", sqrt(gd / gtot), gerr,
           m.params[which].name);
    CHECK(sqrt(gd / gtot) < 3e-2);
    CHECK(sqrt(gd / gtot) > 1e-5); /* the mode is really on */
    double curve[2][STEPS];
    for (int mode = 0; mode < 2; mode++) {
        memcpy(m.w, w0, sizeof(float) * m.nw);
        m.bf16 = mode == 1;
        topt_cfg oc;
        topt_defaults(&oc);
        oc.muon = false;
        oc.total_steps = STEPS;
        topt opt;
        topt_init(&opt, &m, &oc);
        for (int s = 0; s < STEPS; s++) {
            curve[mode][s] = run(&m, tok, B, T, lg, g32) / (B * T);
            memcpy(m.g, g32, sizeof(float) * m.nw);
            topt_step(&opt, &m, NULL);
        }
        topt_free(&opt);
    }
    double worst = 0;
    for (int s = 0; s < STEPS; s++) {
        double r = fabs(curve[1][s] - curve[0][s]) / curve[0][s];
        if (r > worst) worst = r;
    }
    printf("loss f32 %.4f -> %.4f, bf16 %.4f -> %.4f, worst relative gap %.2e\n", curve[0][0],
           curve[0][STEPS - 1], curve[1][0], curve[1][STEPS - 1], worst);
    CHECK(curve[0][STEPS - 1] < 0.8 * curve[0][0]); /* measured 0.69 */
    CHECK(curve[1][STEPS - 1] < 0.8 * curve[1][0]);
    CHECK(worst < 0.02); /* measured 4e-3 */
    free(w0); free(lg); free(g32); free(g16);
    tm_free(&m);
}
