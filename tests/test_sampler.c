/* test_sampler.c: k3_sample draws the same ids, bit for bit, as the sampler
 * it replaced, which sorted the whole vocabulary with qsort each token. That
 * sampler is kept below as the reference; both run on random logits (smooth,
 * peaked, flat and with many tied probabilities) over vocabularies from 1 id
 * to the Kimi 163,840, under every filter and their combinations, with many
 * seeds, and must agree on every draw. */
#include "harness.h"
#include "model/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the reference: the whole order by qsort ---------------------------- */
static const float *ref_sort_p;
static int ref_by_prob_desc(const void *a, const void *b) {
    int i = *(const int *)a, j = *(const int *)b;
    if (ref_sort_p[i] != ref_sort_p[j]) return ref_sort_p[i] > ref_sort_p[j] ? -1 : 1;
    return i - j;
}

static int ref_sample(const k3_sampler *cfg, uint64_t *rng, float *probs, int *order, const float *logits) {
    int V = cfg->n;
    if (cfg->temperature <= 0) return k3_argmax(logits, V);
    int best = k3_argmax(logits, V);
    double mx = logits[best], sum = 0;
    for (int i = 0; i < V; i++) {
        double e = exp(((double)logits[i] - mx) / cfg->temperature);
        probs[i] = (float)e;
        sum += e;
    }
    for (int i = 0; i < V; i++) probs[i] = (float)(probs[i] / sum);
    for (int i = 0; i < V; i++) order[i] = i;
    ref_sort_p = probs;
    qsort(order, (size_t)V, sizeof *order, ref_by_prob_desc);
    int keep = V;
    if (cfg->top_k > 0 && cfg->top_k < keep) keep = cfg->top_k;
    if (cfg->min_p > 0) {
        float floor_p = cfg->min_p * probs[order[0]];
        int k = 1;
        while (k < keep && probs[order[k]] >= floor_p) k++;
        keep = k;
    }
    if (cfg->top_p > 0 && cfg->top_p < 1) {
        double cum = 0;
        int k = 0;
        while (k < keep) {
            cum += probs[order[k++]];
            if (cum >= cfg->top_p) break;
        }
        keep = k;
    }
    double total = 0;
    for (int k = 0; k < keep; k++) total += probs[order[k]];
    double r = k3_rng_unit(rng) * total, cum = 0;
    for (int k = 0; k < keep; k++) {
        cum += probs[order[k]];
        if (r < cum) return order[k];
    }
    return order[keep - 1];
}

/* ---- random logits ------------------------------------------------------ */
static double gauss(uint64_t *s) {
    double u1 = (k3_rng_next(s) >> 11) * 0x1p-53 + 0x1p-54, u2 = k3_rng_unit(s);
    return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

/* shape 0: N(0, scale); 1: a few peaks over a low floor; 2: quantised to
 * steps of 0.25 (many exactly tied probabilities); 3: all equal but one */
static void fill_logits(float *lg, int V, int shape, double scale, uint64_t *s) {
    for (int i = 0; i < V; i++) {
        double x = gauss(s) * scale;
        if (shape == 1) x = (k3_rng_next(s) % 97 == 0) ? 10 + gauss(s) : gauss(s) - 20;
        if (shape == 2) x = floor(x * 4) / 4;
        if (shape == 3) x = i == V / 3 ? 1 : 0;
        lg[i] = (float)x;
    }
}

/* One setting: `draws` draws on fresh logits each, new sampler against the
 * reference with the same seed. Returns the index of the first draw that
 * differs, or -1. */
static int compare_setting(int V, int shape, double scale, float temp, int top_k, float top_p, float min_p,
                           uint64_t seed, int draws, int *got, int *want) {
    k3_sampler sp;
    k3_sampler_init(&sp, V, temp, top_k, top_p, min_p, seed);
    float *lg = malloc((size_t)V * sizeof *lg), *probs = malloc((size_t)V * sizeof *probs);
    int *order = malloc((size_t)V * sizeof *order);
    uint64_t rng = seed, ls = seed * 31 + 7;
    int bad = -1;
    for (int d = 0; d < draws && bad < 0; d++) {
        fill_logits(lg, V, shape, scale, &ls);
        *got = k3_sample(&sp, lg);
        *want = ref_sample(&sp, &rng, probs, order, lg);
        if (*got != *want || rng != sp.rng) bad = d;
    }
    free(lg);
    free(probs);
    free(order);
    k3_sampler_free(&sp);
    return bad;
}

TEST(sampler_matches_full_sort_reference) {
    static const int vocab[] = {1, 2, 3, 7, 64, 1000, 1025, 5000};
    static const double scales[] = {0.01, 1, 4, 40};
    static const float temps[] = {0.01f, 0.3f, 0.7f, 1.0f, 2.5f, 100.0f};
    static const float top_ps[] = {1.0f, 0.9f, 0.5f, 1e-6f, 0.999999f, 0.99999994f};
    static const float min_ps[] = {0, 0.05f, 1e-12f, 1e-20f, 1.0f};
    uint64_t s = 12345;
    int n = 0, fails = 0;
    for (int iter = 0; iter < 1500; iter++) {
        int V = vocab[k3_rng_next(&s) % 8];
        int shape = (int)(k3_rng_next(&s) % 4);
        double scale = scales[k3_rng_next(&s) % 4];
        float temp = temps[k3_rng_next(&s) % 6];
        int ks[] = {0, 0, 1, 2, 5, 50, 1024, 1025, V - 1, V, V + 5};
        int top_k = ks[k3_rng_next(&s) % 11];
        if (top_k < 0) top_k = 0;
        float top_p = top_ps[k3_rng_next(&s) % 6], min_p = min_ps[k3_rng_next(&s) % 5];
        uint64_t seed = k3_rng_next(&s);
        int got, want;
        int d = compare_setting(V, shape, scale, temp, top_k, top_p, min_p, seed, 6, &got, &want);
        n++;
        if (d >= 0 && fails++ < 5)
            CHECKF(0, "V %d shape %d scale %g T %g top-k %d top-p %.9g min-p %g seed %llu: draw %d gave %d, the "
                      "full sort %d", V, shape, scale, (double)temp, top_k, (double)top_p, (double)min_p,
                   (unsigned long long)seed, d, got, want);
    }
    CHECKF(fails == 0, "%d of %d settings differ", fails, n);
}

/* The Kimi vocabulary, where the prefix the sampler orders is a small part of
 * it under top-p and min-p, and all of it at a plain temperature. */
TEST(sampler_matches_full_sort_reference_kimi_vocab) {
    static const struct { float temp; int top_k; float top_p, min_p; } set[] = {
        {1.0f, 0, 1.0f, 0},     {0.7f, 0, 0.9f, 0},   {1.0f, 50, 1.0f, 0},  {1.0f, 0, 1.0f, 0.05f},
        {0.9f, 40, 0.95f, 0.02f}, {1.5f, 2000, 1.0f, 0}, {0.2f, 0, 0.999f, 0}, {1.0f, 0, 1.0f, 1e-30f},
    };
    for (int i = 0; i < (int)(sizeof set / sizeof set[0]); i++)
        for (int shape = 0; shape < 3; shape++) {
            int got, want;
            int d = compare_setting(163840, shape, shape == 0 ? 3.0 : 1.0, set[i].temp, set[i].top_k, set[i].top_p,
                                    set[i].min_p, 1000 + (uint64_t)i * 7 + (uint64_t)shape, 2, &got, &want);
            CHECKF(d < 0, "setting %d shape %d: draw %d gave %d, the full sort %d", i, shape, d, got, want);
        }
}
