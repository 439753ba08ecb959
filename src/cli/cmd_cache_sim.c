/* k3 cache-sim: replay an expert request trace under LRU, LFU and Belady's
 * optimum at several capacities, so the cache size and policy are chosen from
 * data rather than guessed. */
#include "cli/commands.h"
#include "memory/cache.h"

#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

const char *const cmd_cache_sim_help =
    "usage: k3 cache-sim TRACE [--capacity N,N,...] [--capacity-gb G,G,...]\n"
    "                          [--expert-bytes B] [--json]\n"
    "\n"
    "Replays an expert request trace (written by 'k3 run --dump-cache-trace', or the\n"
    "peer engine's expert_trace.bin: int32 (layer, expert) pairs) through an expert\n"
    "cache under three policies and prints the hit rates per capacity:\n"
    "  lru     least recently used\n"
    "  lfu     least frequently used so far (k3's policy)\n"
    "  belady  the offline optimum (an upper bound no real cache reaches)\n"
    "A 'resident' hit was already in memory when its step began; a raw hit also\n"
    "counts experts read earlier in the same step.\n"
    "\n"
    "  --capacity N,...     capacities in experts\n"
    "  --capacity-gb G,...  capacities in GB (10^9 bytes), using --expert-bytes\n"
    "  --expert-bytes B     bytes per expert (default 17547264, Kimi K3's MXFP4 expert)\n"
    "  --json               one JSON object instead of the table\n"
    "Without a capacity, sweeps 1%..100% of the distinct experts in the trace.\n";

static int parse_list(const char *s, double **out, size_t *n) {
    size_t cap = 8, cnt = 0;
    double *v = xmalloc_array(cap, sizeof *v);
    const char *c = s;
    while (*c) {
        char *end;
        double x = strtod(c, &end);
        if (end == c || !(x >= 0) || !isfinite(x)) { free(v); return -1; }
        if (cnt == cap) v = xrealloc_array(v, cap *= 2, sizeof *v);
        v[cnt++] = x;
        c = end;
        if (*c == ',') c++;
        else if (*c) { free(v); return -1; }
    }
    if (cnt == 0) { free(v); return -1; }
    *out = v;
    *n = cnt;
    return 0;
}

int cmd_cache_sim(int argc, char **argv) {
    static const struct option opts[] = {
        {"capacity", required_argument, 0, 'c'},
        {"capacity-gb", required_argument, 0, 'g'},
        {"expert-bytes", required_argument, 0, 'b'},
        {"json", no_argument, 0, 'j'},
        {0, 0, 0, 0},
    };
    double *caps = NULL;
    size_t ncaps = 0;
    bool gb = false, json = false;
    double expert_bytes = 17547264.0;
    int o;
    optind = 1;
    opterr = 0;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 'c':
        case 'g':
            free(caps);
            if (parse_list(optarg, &caps, &ncaps))
                return k3_usage_error("cache-sim", "bad capacity list '%s'", optarg);
            gb = (o == 'g');
            break;
        case 'b': {
            char *end;
            expert_bytes = strtod(optarg, &end);
            if (*end || !(expert_bytes >= 1)) return k3_usage_error("cache-sim", "bad --expert-bytes '%s'", optarg);
            break;
        }
        case 'j': json = true; break;
        default: return k3_usage_error("cache-sim", "unknown option");
        }
    }
    if (optind != argc - 1) {
        free(caps);
        return k3_usage_error("cache-sim", "expected exactly one TRACE file");
    }
    const char *path = argv[optind];
    k3_err err = {0};
    xc_request *reqs;
    size_t n;
    if (xc_trace_read(path, &reqs, &n, &err)) { free(caps); return k3_report(&err); }

    /* distinct experts and steps, for the default sweep and the header */
    xcache *probe = xc_new(XC_LRU, n);
    for (size_t i = 0; i < n; i++) xc_request_one(probe, reqs[i].layer, reqs[i].expert, NULL, NULL);
    size_t distinct = xc_get_stats(probe).misses;
    xc_free(probe);
    int32_t steps = n ? reqs[n - 1].step - reqs[0].step + 1 : 0;

    size_t *cap_experts;
    if (!caps) {
        static const double pct[] = {1, 2, 5, 10, 20, 30, 50, 75, 100};
        ncaps = sizeof pct / sizeof pct[0];
        cap_experts = xmalloc_array(ncaps, sizeof *cap_experts);
        for (size_t i = 0; i < ncaps; i++) cap_experts[i] = (size_t)ceil(pct[i] / 100.0 * (double)distinct);
    } else {
        cap_experts = xmalloc_array(ncaps, sizeof *cap_experts);
        for (size_t i = 0; i < ncaps; i++)
            cap_experts[i] = gb ? (size_t)floor(caps[i] * 1e9 / expert_bytes) : (size_t)caps[i];
    }
    if (json)
        printf("{\"trace\":\"%s\",\"requests\":%zu,\"steps\":%d,\"distinct_experts\":%zu,\"expert_bytes\":%.0f,\"rows\":[",
               path, n, steps, distinct, expert_bytes);
    else
        printf("trace %s: %zu requests, %d steps, %zu distinct experts, %.2f MB per expert\n"
               "%10s %10s  %-17s %-17s %-17s\n", path, n, steps, distinct, expert_bytes / 1e6,
               "experts", "GB", "lru res/raw %", "lfu res/raw %", "belady res/raw %");
    for (size_t i = 0; i < ncaps; i++) {
        xc_stats s[3];
        for (int p = 0; p < 3; p++) s[p] = xc_simulate(reqs, n, (xc_policy)p, cap_experts[i]);
        double gbv = (double)cap_experts[i] * expert_bytes / 1e9;
        if (json) {
            printf("%s{\"capacity_experts\":%zu,\"capacity_gb\":%.3f", i ? "," : "", cap_experts[i], gbv);
            for (int p = 0; p < 3; p++)
                printf(",\"%s\":{\"hits\":%llu,\"resident_hits\":%llu,\"misses\":%llu,\"evictions\":%llu}",
                       xc_policy_name((xc_policy)p), (unsigned long long)s[p].hits,
                       (unsigned long long)s[p].resident_hits, (unsigned long long)s[p].misses,
                       (unsigned long long)s[p].evictions);
            printf("}");
        } else {
            printf("%10zu %10.2f ", cap_experts[i], gbv);
            for (int p = 0; p < 3; p++) {
                char cell[32];
                snprintf(cell, sizeof cell, "%5.1f / %5.1f", n ? 100.0 * (double)s[p].resident_hits / (double)n : 0.0,
                         n ? 100.0 * (double)s[p].hits / (double)n : 0.0);
                printf(" %-17s", cell);
            }
            printf("\n");
        }
    }
    if (json) printf("]}\n");
    free(caps);
    free(cap_experts);
    free(reqs);
    return K3_OK;
}
