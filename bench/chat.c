/* bench/chat.c: time to first token of a multi-turn conversation with the
 * state cache (src/session) against re-prefilling the whole history, measured
 * in one run.
 *
 *   bin/bench_chat MODEL_DIR [--turns T] [--user U] [--reply R] [--reps K] [--threads N] [--grid G]
 *
 * A conversation of T turns (default 10): each turn appends a user message of
 * U ids (default 48) to the history and "generates" a reply of R ids
 * (default 32, decoded token by token, teacher forced with fixed pseudo-random
 * ids so both modes see the same sequence). Mode "cache": one session over a
 * state cache (1 GB); each turn's prompt is the whole history and the session
 * feeds only what it has not seen. Mode "cold": the state is reset and the
 * whole history prefilled every turn. Time to first token = the prompt's
 * prefill + the first argmax, wall seconds. The two modes' logits are
 * compared bit for bit at every turn (a mismatch is reported and exits 1).
 * The conversation is run K times (default 3, a fresh cache each time) and
 * each turn's best time is kept, which time slicing on a shared machine
 * inflates least. Prints one line per turn and the 2nd / 5th / 10th-turn
 * summary. Not a test. */
#include "bench.h"
#include "model/model.h"
#include "session/session.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    const char *dir = NULL;
    int turns = 10, user = 48, reply = 32, threads = 0, grid = 0, reps = 3;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--turns") && i + 1 < argc) turns = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--user") && i + 1 < argc) user = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reply") && i + 1 < argc) reply = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--grid") && i + 1 < argc) grid = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else dir = NULL, i = argc;
    }
    if (!dir || turns < 1 || user < 1 || reply < 1 || threads < 0 || grid < 0 || reps < 1) {
        fprintf(stderr, "usage: bench_chat MODEL_DIR [--turns T] [--user U] [--reply R] [--reps K] [--threads N] "
                        "[--grid G]\n");
        return 2;
    }
    if (threads > 0) omp_set_num_threads(threads);
    k3_err err = {0};
    k3_model *m;
    if (k3_model_open(dir, NULL, &m, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    const k3_config *c = k3_model_config(m);
    int V = c->vocab_size, total = turns * (user + reply);
    int32_t *conv = xmalloc_array((size_t)total, sizeof *conv);
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < total; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        conv[i] = (int32_t)(x % (uint64_t)V);
    }
    k3_state *sa, *sb;
    if (k3_state_new(m, total, &sa, &err) || k3_state_new(m, total, &sb, &err)) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    k3_state_cache *sc = k3_state_cache_new(c, 1000000000ull, grid);
    k3_session *s = k3_session_new(m, sa, sc);
    float *la = xmalloc_array((size_t)V, sizeof *la), *lb = xmalloc_array((size_t)V, sizeof *lb);
    double *tc = xmalloc_array((size_t)turns, sizeof *tc), *tr = xmalloc_array((size_t)turns, sizeof *tr);
    printf("conversation of %d turns (user %d + reply %d ids each), %d layers, vocab %d, %d threads, kernels %s\n",
           turns, user, reply, c->num_layers, V, omp_get_max_threads(), k_path_name());
    printf("snapshot: %llu B + %llu B per position; state cache grid %d\n",
           (unsigned long long)k3_state_snapshot_bytes(c, 0), (unsigned long long)(k3_state_row_floats(c) * 4),
           k3_state_cache_get_stats(sc).grid);
    int bad = 0;
    size_t *reu = xcalloc((size_t)turns, sizeof *reu);
    for (int t = 0; t < turns; t++) tc[t] = tr[t] = 1e30;
    for (int r = 0; r < reps && !err.code; r++) {
        k3_state_cache_clear(sc);
        k3_session_reset(s);
        for (int t = 0; t < turns; t++) {
            size_t n = (size_t)t * (user + reply) + (size_t)user; /* history + the new message */
            /* cache: the session's prefill, then the first token */
            double t0 = k3_now();
            if (k3_session_prefill(s, conv, n, la, &reu[t], &err)) break;
            volatile int first = k3_argmax(la, V);
            double dt = k3_now() - t0;
            if (dt < tc[t]) tc[t] = dt;
            /* cold: everything again on a fresh state */
            t0 = k3_now();
            k3_state_reset(sb);
            if (k3_forward(m, sb, conv, (int)n, lb, false, &err)) break;
            first = k3_argmax(lb, V);
            (void)first;
            dt = k3_now() - t0;
            if (dt < tr[t]) tr[t] = dt;
            if (memcmp(la, lb, (size_t)V * sizeof *la)) {
                printf("turn %d: logits differ between the modes\n", t + 1);
                bad = 1;
            }
            /* the reply, decoded token by token (teacher forced) */
            for (int i = 0; i < reply && !err.code; i++) k3_session_feed(s, conv + n + i, 1, la, &err);
            if (err.code) break;
            k3_session_snapshot(s);
        }
    }
    for (int t = 0; t < turns && !err.code; t++)
        printf("turn %2d: prompt %5d ids, reused %5zu; ttft cache %.4f s, cold %.4f s, ratio %.1fx\n", t + 1,
               t * (user + reply) + user, reu[t], tc[t], tr[t], tr[t] / (tc[t] > 0 ? tc[t] : 1e-9));
    free(reu);
    if (err.code) {
        fprintf(stderr, "k3: %s\n", err.msg);
        return err.code;
    }
    printf("ttft ratio (cold / cache):");
    static const int at[3] = {2, 5, 10};
    for (int k = 0; k < 3; k++)
        if (at[k] <= turns)
            printf(" turn %d %.1fx (%.4f s vs %.4f s)%s", at[k], tr[at[k] - 1] / (tc[at[k] - 1] > 0 ? tc[at[k] - 1] : 1e-9),
                   tc[at[k] - 1], tr[at[k] - 1], k < 2 && at[k + 1] <= turns ? ";" : "");
    printf("\n");
    k3_session_free(s);
    k3_state_cache_free(sc);
    k3_state_free(sa);
    k3_state_free(sb);
    free(la);
    free(lb);
    free(tc);
    free(tr);
    free(conv);
    k3_model_free(m);
    return bad;
}
