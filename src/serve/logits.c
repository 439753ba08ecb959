/* logits.c: what a request asks to be done to the logits before sampling
 * (penalties, logit_bias) and the log-probabilities it asks back (serve.h). */
#include "serve/serve.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static void push(int32_t **v, size_t *n, size_t *cap, int32_t id) {
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        *v = xrealloc_array(*v, *cap, sizeof **v);
    }
    (*v)[(*n)++] = id;
}

void k3_logit_proc_init(k3_logit_proc *p, const k3_serve_req *r, int vocab, const int32_t *prompt, size_t n) {
    memset(p, 0, sizeof *p);
    p->r = r;
    p->vocab = vocab;
    p->on = r->repetition_penalty != 1.0f || r->presence_penalty != 0.0f || r->frequency_penalty != 0.0f ||
            r->nbias > 0;
    if (!p->on) return;
    p->work = xmalloc_array((size_t)vocab, sizeof *p->work);
    p->mark = xcalloc((size_t)vocab, 1);
    p->count = xcalloc((size_t)vocab, sizeof *p->count);
    for (size_t i = 0; i < n; i++) {
        int32_t id = prompt[i];
        if (id < 0 || id >= vocab || (p->mark[id] & 1)) continue;
        p->mark[id] |= 1;
        push(&p->rep, &p->nrep, &p->crep, id);
    }
}

void k3_logit_proc_accept(k3_logit_proc *p, int32_t id) {
    if (!p->on || id < 0 || id >= p->vocab) return;
    if (!(p->mark[id] & 1)) push(&p->rep, &p->nrep, &p->crep, id);
    if (!(p->mark[id] & 2)) push(&p->gen, &p->ngen, &p->cgen, id);
    p->mark[id] |= 3;
    p->count[id]++;
}

const float *k3_logit_proc_apply(k3_logit_proc *p, const float *logits) {
    if (!p->on) return logits;
    const k3_serve_req *r = p->r;
    float *w = p->work;
    memcpy(w, logits, (size_t)p->vocab * sizeof *w);
    if (r->repetition_penalty != 1.0f) {
        float rp = r->repetition_penalty;
        for (size_t i = 0; i < p->nrep; i++) {
            float *x = &w[p->rep[i]];
            *x = *x > 0 ? *x / rp : *x * rp;
        }
    }
    if (r->presence_penalty != 0.0f || r->frequency_penalty != 0.0f)
        for (size_t i = 0; i < p->ngen; i++) {
            int32_t id = p->gen[i];
            w[id] -= r->frequency_penalty * (float)p->count[id] + r->presence_penalty;
        }
    for (size_t i = 0; i < r->nbias; i++)
        if (r->bias_ids[i] < p->vocab) w[r->bias_ids[i]] += r->bias[i];
    return w;
}

void k3_logit_proc_free(k3_logit_proc *p) {
    free(p->work);
    free(p->mark);
    free(p->count);
    free(p->rep);
    free(p->gen);
    memset(p, 0, sizeof *p);
}

float k3_logprobs(const float *logits, int vocab, int32_t id, int k, k3_logprob *top) {
    double lse = k3_log_sum_exp(logits, vocab);
    if (k > K3_SERVE_MAX_LOGPROBS) k = K3_SERVE_MAX_LOGPROBS;
    if (k > vocab) k = vocab;
    /* insertion into a short sorted list: strictly larger moves up, so the
     * lower id stays first among equals */
    int have = 0;
    for (int i = 0; i < vocab && k > 0; i++) {
        float x = logits[i];
        if (have == k && !(x > top[k - 1].logprob)) continue;
        int at = have < k ? have++ : k - 1;
        while (at > 0 && x > top[at - 1].logprob) {
            top[at] = top[at - 1];
            at--;
        }
        top[at].id = i;
        top[at].logprob = x;
    }
    for (int i = 0; i < k; i++) top[i].logprob = (float)((double)top[i].logprob - lse);
    return (float)((double)logits[id] - lse);
}
