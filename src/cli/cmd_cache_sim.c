/* k3 cache-sim: replay an expert request trace under LRU, LFU and Belady's
 * optimum at several capacities, so the cache size and policy are chosen from
 * data rather than guessed. */
#include "cli/commands.h"
#include "dist/expert_par.h"
#include "formats/config.h"
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
    "Without a capacity, sweeps 1%..100% of the distinct experts in the trace.\n"
    "\n"
    "Expert placement for 'mpirun -np R k3 run --expert-placement FILE' (instead of\n"
    "the sweep):\n"
    "  --placement R        spread each layer's experts over R ranks so that every\n"
    "                       rank serves about as many of the trace's requests and\n"
    "                       holds at most ceil(experts / R) of them\n"
    "  --model MODEL_DIR    the model the trace came from (its layer and expert counts)\n"
    "  --placement-out FILE where to write it (JSON; docs/mpi.md)\n";

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
        {"placement", required_argument, 0, 'p'},
        {"model", required_argument, 0, 'm'},
        {"placement-out", required_argument, 0, 'o'},
        {0, 0, 0, 0},
    };
    double *caps = NULL;
    size_t ncaps = 0;
    bool gb = false, json = false;
    long ranks = 0;
    const char *model = NULL, *place_out = NULL;
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
        case 'p': {
            char *end;
            ranks = strtol(optarg, &end, 10);
            if (*end || ranks < 1 || ranks > 65536) return k3_usage_error("cache-sim", "--placement: '%s' is not a rank count", optarg);
            break;
        }
        case 'm': model = optarg; break;
        case 'o': place_out = optarg; break;
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
    if ((ranks || model || place_out) && (!ranks || !model || !place_out)) {
        free(caps);
        return k3_usage_error("cache-sim", "--placement, --model and --placement-out go together");
    }
    if (xc_trace_read(path, &reqs, &n, &err)) { free(caps); return k3_report(&err); }
    if (ranks) {
        free(caps);
        k3_config c;
        int rc = k3_config_load(model, &c, &err);
        if (!rc && ranks > c.num_experts)
            rc = k3_fail(&err, K3_EXIT_USAGE, "--placement %ld: the model has %d routed experts per layer", ranks,
                         c.num_experts);
        k3_placement p = {0}, q = {0};
        if (!rc) {
            k3_placement_from_trace((int)ranks, c.num_layers, c.num_experts, reqs, n, &p);
            k3_placement_contiguous((int)ranks, c.num_layers, c.num_experts, &q);
            rc = k3_placement_save(&p, place_out, &err);
        }
        if (!rc)
            printf("placement for %ld ranks written to %s: the busiest rank serves %.3fx the mean of the trace's %zu "
                   "requests (contiguous: %.3fx); per step and layer the busiest rank computes %.3f experts on "
                   "average (contiguous: %.3f)\n",
                   ranks, place_out, k3_placement_imbalance(&p, reqs, n), n, k3_placement_imbalance(&q, reqs, n),
                   k3_placement_step_load(&p, reqs, n), k3_placement_step_load(&q, reqs, n));
        k3_placement_free(&p);
        k3_placement_free(&q);
        free(reqs);
        return rc ? k3_report(&err) : K3_OK;
    }

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
