/* runmem.c: budget flags, plan and run report for `k3 run` (runmem.h). */
#include "memory/runmem.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

void k3_runmem_args_init(k3_runmem_args *a) {
    memset(a, 0, sizeof *a);
    k3_stream_opts_init(&a->so);
    a->budget = k3_budget_default();
}

int k3_runmem_parse(k3_runmem_args *a, const char *cmd, int argc, char **argv, int *i, bool *used, k3_err *err) {
    const char *o = argv[*i];
    static const char *const with_value[] = {"--trunk", "--preset", "--trunk-gb", "--cache-gb", "--chunk",
                                             "--cache-policy", "--dump-cache-trace"};
    *used = false;
    if (!strcmp(o, "--list-presets")) {
        a->list_presets = true;
        *used = true;
        return K3_OK;
    }
    bool mine = false;
    for (size_t k = 0; k < sizeof with_value / sizeof *with_value; k++) mine |= !strcmp(o, with_value[k]);
    if (!mine) return K3_OK;
    *used = true;
    if (*i + 1 >= argc) return k3_fail(err, K3_EXIT_USAGE, "%s: %s needs a value", cmd, o);
    const char *v = argv[++*i];
    if (!strcmp(o, "--trunk")) {
        a->so.trunk_dir = v;
    } else if (!strcmp(o, "--preset")) {
        a->budget_given = true;
        return k3_budget_apply_preset(&a->budget, v, err);
    } else if (!strcmp(o, "--trunk-gb") || !strcmp(o, "--cache-gb")) {
        double g;
        if (k3_parse_gb(v, &g, err)) return k3_fail(err, K3_EXIT_USAGE, "%s: %s: '%s' is not a size in GB >= 0", cmd, o, v);
        if (o[2] == 't') a->budget.trunk_gb = g;
        else a->budget.cache_gb = g;
        a->budget.preset = NULL;
        a->budget_given = true;
    } else if (!strcmp(o, "--chunk")) {
        char *end;
        errno = 0;
        long c = strtol(v, &end, 10);
        if (errno || *end || c < 1 || c > 4096) return k3_fail(err, K3_EXIT_USAGE, "%s: --chunk: '%s' is not in 1..4096", cmd, v);
        a->so.chunk = (int)c;
    } else if (!strcmp(o, "--cache-policy")) {
        if (!strcmp(v, "lfu")) a->so.policy = XC_LFU;
        else if (!strcmp(v, "lru")) a->so.policy = XC_LRU;
        else return k3_fail(err, K3_EXIT_USAGE, "%s: --cache-policy: '%s' is not lfu or lru", cmd, v);
    } else {
        a->so.trace_dir = v;
    }
    return K3_OK;
}

typedef struct {
    bool prefill;
    int ntokens;
    double secs;
    uint64_t trunk_read, expert_read, requests, hits, resident;
} step_rec;

struct k3_runmem {
    k3_runmem_args a;
    k3_config cfg;
    k3_mem_plan *plan;
    st_index *ix;            /* a reference, until attached (then the stream's) */
    k3_trunk *trunk;         /* until attached */
    k3_stream *s;
    k3_stream_stats last;
    double t_last, t_attach;
    step_rec *steps;
    size_t nsteps, cap;
    int ntok;                /* decoded tokens so far */
    int nchunk;
};

int k3_runmem_begin(const k3_runmem_args *a, const k3_config *cfg, st_index *ix, int64_t max_pos, uint64_t mem_limit,
                    k3_runmem **out, k3_err *err) {
    *out = NULL;
    k3_runmem *rm = xcalloc(1, sizeof *rm);
    rm->a = *a;
    if (!a->budget_given) {
        int rc = k3_budget_apply_preset(&rm->a.budget, "auto", err);
        if (rc) rm->a.budget = k3_budget_default(); /* no /proc/meminfo: no limits */
    }
    rm->a.so.trunk_gb = rm->a.budget.trunk_gb;
    rm->a.so.cache_gb = rm->a.budget.cache_gb;
    rm->a.so.preset = rm->a.budget.preset;
    rm->a.so.mem_limit = mem_limit;
    rm->cfg = *cfg;
    rm->ix = st_retain(ix);
    int rc = K3_OK;
    if (rm->a.so.trunk_dir && (rc = k3_trunk_open(rm->a.so.trunk_dir, NULL, &rm->trunk, err))) goto fail;
    rm->plan = xmalloc(sizeof *rm->plan);
    if ((rc = k3_plan_make(&rm->cfg, rm->ix, rm->trunk, &rm->a.so, max_pos, rm->plan, err))) goto fail;
    *out = rm;
    return K3_OK;
fail:
    k3_runmem_free(rm);
    return rc;
}

int k3_runmem_attach(k3_runmem *rm, k3_model *m, k3_err *err) {
    int rc = k3_stream_open(&rm->cfg, rm->ix, rm->trunk, rm->plan, &rm->a.so, &rm->s, err);
    rm->ix = NULL; /* owned by the stream now (freed on failure too) */
    rm->trunk = NULL;
    if (rc) return rc;
    if ((rc = k3_stream_attach(rm->s, m, err))) return rc;
    rm->last = k3_stream_get_stats(rm->s);
    rm->t_attach = rm->t_last = k3_now();
    return K3_OK;
}

void k3_runmem_print_plan(const k3_runmem *rm, FILE *f) { k3_plan_print(rm->plan, &rm->a.so, f); }

int k3_runmem_chunk(const k3_runmem *rm) { return rm->plan->chunk; }

void k3_runmem_limit_chunk(k3_runmem *rm, int chunk) {
    k3_mem_plan *p = rm->plan;
    if (chunk < 1 || chunk >= p->chunk) return;
    p->chunk = chunk;
    p->total -= p->state.total;
    p->state = k3_state_size_chunk(&rm->cfg, chunk, p->max_pos);
    p->total += p->state.total;
}

const k3_weight_source *k3_runmem_source(k3_runmem *rm) { return rm->s ? k3_stream_source(rm->s) : NULL; }

static double mb(uint64_t b) { return (double)b / 1e6; }

void k3_runmem_step(k3_runmem *rm, bool prefill, int ntokens, FILE *f) {
    if (!rm->s) return;
    k3_stream_stats now = k3_stream_get_stats(rm->s);
    double t = k3_now();
    step_rec r = {.prefill = prefill, .ntokens = ntokens, .secs = t - rm->t_last,
                  .trunk_read = now.trunk_read - rm->last.trunk_read,
                  .expert_read = now.expert_read - rm->last.expert_read,
                  .requests = now.requests - rm->last.requests, .hits = now.hits - rm->last.hits,
                  .resident = now.resident_hits - rm->last.resident_hits};
    rm->last = now;
    rm->t_last = t;
    if (rm->nsteps == rm->cap) {
        rm->cap = rm->cap ? 2 * rm->cap : 64;
        rm->steps = xrealloc_array(rm->steps, rm->cap, sizeof *rm->steps);
    }
    rm->steps[rm->nsteps++] = r;
    if (!f) return;
    char what[64];
    if (prefill) snprintf(what, sizeof what, "prefill chunk %d (%d tokens)", ++rm->nchunk, ntokens);
    else snprintf(what, sizeof what, "token %d", ++rm->ntok);
    fprintf(f, "k3: %s: %.3f s, read %.1f MB (trunk %.1f, experts %.1f), experts %llu requested, %llu hits (%llu resident)\n",
            what, r.secs, mb(r.trunk_read + r.expert_read), mb(r.trunk_read), mb(r.expert_read),
            (unsigned long long)r.requests, (unsigned long long)r.hits, (unsigned long long)r.resident);
}

typedef struct {
    k3_stream_stats st;
    double run_s, io_s, gb_read, mbps_io, mbps_run;
    double hit_rate, resident_rate;
    uint64_t rss;
} summary;

static summary summarise(const k3_runmem *rm) {
    summary s = {0};
    if (!rm->s) return s;
    s.st = k3_stream_get_stats(rm->s);
    for (size_t i = 0; i < rm->nsteps; i++) s.run_s += rm->steps[i].secs;
    uint64_t bytes = s.st.trunk_read + s.st.expert_read;
    s.gb_read = (double)bytes / 1e9;
    s.io_s = s.st.disk_busy_s; /* trunk and expert reads overlap: their union */
    s.mbps_io = s.io_s > 0 ? (double)bytes / 1e6 / s.io_s : 0;
    s.mbps_run = s.run_s > 0 ? (double)bytes / 1e6 / s.run_s : 0;
    s.hit_rate = s.st.requests ? (double)s.st.hits / (double)s.st.requests : 0;
    s.resident_rate = s.st.requests ? (double)s.st.resident_hits / (double)s.st.requests : 0;
    s.rss = k3_peak_rss_bytes();
    return s;
}

k3_runmem_reads k3_runmem_decode_reads(const k3_runmem *rm) {
    k3_runmem_reads r = {0};
    for (size_t i = 0; i < rm->nsteps; i++) {
        const step_rec *x = &rm->steps[i];
        if (x->prefill) continue;
        r.calls++;
        r.requests += x->requests;
        r.disk += x->trunk_read + x->expert_read;
    }
    r.touched = r.calls * (rm->plan->layers_all + rm->plan->head_bytes) + r.requests * rm->plan->expert_buf;
    return r;
}

uint64_t k3_runmem_trunk_read(const k3_runmem *rm) { return rm->s ? k3_stream_get_stats(rm->s).trunk_read : 0; }

void k3_runmem_summary(const k3_runmem *rm, FILE *f) {
    if (!rm->s) return;
    summary s = summarise(rm);
    double run = s.run_s > 0 ? s.run_s : 1e-9;
    fprintf(f,
            "k3: experts: %llu requests, %llu hits (%.1f%%), %llu resident hits (%.1f%%), %llu reads, %llu evictions "
            "(%s cache of %lld)\n",
            (unsigned long long)s.st.requests, (unsigned long long)s.st.hits, 100 * s.hit_rate,
            (unsigned long long)s.st.resident_hits, 100 * s.resident_rate, (unsigned long long)s.st.misses,
            (unsigned long long)s.st.evictions, xc_policy_name(rm->a.so.policy), (long long)rm->plan->cache_experts);
    fprintf(f,
            "k3: read %.3f GB (trunk %.3f, experts %.3f) via %s%s: %.0f MB/s while reading, %.0f MB/s over %.3f s of "
            "forward calls\n",
            s.gb_read, (double)s.st.trunk_read / 1e9, (double)s.st.expert_read / 1e9, s.st.backend,
            s.st.direct ? " + O_DIRECT" : "", s.mbps_io, s.mbps_run, s.run_s);
    fprintf(f,
            "k3: I/O share of the forward time: trunk waits %.1f%% (trunk reads in flight %.1f%%), expert waits %.1f%%; "
            "disk busy %.1f%%\n",
            100 * s.st.trunk_stall_s / run, 100 * s.st.trunk_busy_s / run, 100 * s.st.expert_stall_s / run,
            100 * s.st.disk_busy_s / run);
    fprintf(f, "k3: peak RSS %.3f GB; plan %.3f GB + %.3f GB overhead\n", (double)s.rss / 1e9,
            (double)rm->plan->total / 1e9, (double)K3_PLAN_OVERHEAD / 1e9);
}

void k3_runmem_json(const k3_runmem *rm, json_t *o) {
    const k3_mem_plan *p = rm->plan;
    json_t *plan = json_object();
    json_object_set_new(plan, "preset", rm->a.so.preset ? json_string(rm->a.so.preset) : json_null());
    json_object_set_new(plan, "trunk_gb", json_real(rm->a.so.trunk_gb));
    json_object_set_new(plan, "cache_gb", json_real(rm->a.so.cache_gb));
    json_object_set_new(plan, "trunk_streamed", json_boolean(p->streamed));
    json_object_set_new(plan, "head_bytes", json_integer((json_int_t)p->head_bytes));
    json_object_set_new(plan, "pinned_layers", json_integer(p->pinned));
    json_object_set_new(plan, "pinned_bytes", json_integer((json_int_t)p->pinned_bytes));
    json_object_set_new(plan, "ring_slots", json_integer(p->ring_slots));
    json_object_set_new(plan, "ring_bytes", json_integer((json_int_t)p->ring_bytes));
    json_object_set_new(plan, "cache_experts", json_integer((json_int_t)p->cache_experts));
    json_object_set_new(plan, "batch_experts", json_integer(p->batch_experts));
    json_object_set_new(plan, "expert_buffer_bytes", json_integer((json_int_t)p->expert_buf));
    json_object_set_new(plan, "expert_bytes", json_integer((json_int_t)p->expert_bytes));
    json_object_set_new(plan, "chunk", json_integer(p->chunk));
    json_object_set_new(plan, "kda_state_bytes", json_integer((json_int_t)p->state.kda_bytes));
    json_object_set_new(plan, "mla_cache_bytes", json_integer((json_int_t)p->state.mla_bytes));
    json_object_set_new(plan, "scratch_bytes", json_integer((json_int_t)p->state.scratch_bytes));
    json_object_set_new(plan, "speculation_record_bytes", json_integer((json_int_t)p->pass_bytes));
    json_object_set_new(plan, "index_bytes", json_integer((json_int_t)p->index_bytes));
    json_object_set_new(plan, "total_bytes", json_integer((json_int_t)p->total));
    json_object_set_new(plan, "overhead_bytes", json_integer((json_int_t)K3_PLAN_OVERHEAD));
    json_t *mem = json_object();
    json_object_set_new(mem, "plan", plan);
    if (rm->s) {
        summary s = summarise(rm);
        json_t *sum = json_object();
        json_object_set_new(sum, "cache_policy", json_string(xc_policy_name(rm->a.so.policy)));
        json_object_set_new(sum, "cache_requests", json_integer((json_int_t)s.st.requests));
        json_object_set_new(sum, "cache_hits", json_integer((json_int_t)s.st.hits));
        json_object_set_new(sum, "resident_hits", json_integer((json_int_t)s.st.resident_hits));
        json_object_set_new(sum, "hit_rate", json_real(s.hit_rate));
        json_object_set_new(sum, "resident_hit_rate", json_real(s.resident_rate));
        json_object_set_new(sum, "expert_reads", json_integer((json_int_t)s.st.misses));
        json_object_set_new(sum, "evictions", json_integer((json_int_t)s.st.evictions));
        json_object_set_new(sum, "trunk_bytes_read", json_integer((json_int_t)s.st.trunk_read));
        json_object_set_new(sum, "expert_bytes_read", json_integer((json_int_t)s.st.expert_read));
        json_object_set_new(sum, "gb_read", json_real(s.gb_read));
        json_object_set_new(sum, "mb_per_s_while_reading", json_real(s.mbps_io));
        json_object_set_new(sum, "mb_per_s_over_run", json_real(s.mbps_run));
        json_object_set_new(sum, "forward_s", json_real(s.run_s));
        json_object_set_new(sum, "trunk_wait_s", json_real(s.st.trunk_stall_s));
        json_object_set_new(sum, "trunk_io_busy_s", json_real(s.st.trunk_busy_s));
        json_object_set_new(sum, "expert_wait_s", json_real(s.st.expert_stall_s));
        json_object_set_new(sum, "disk_busy_s", json_real(s.st.disk_busy_s));
        double run = s.run_s > 0 ? s.run_s : 1e-9;
        json_object_set_new(sum, "trunk_io_share", json_real(s.st.trunk_stall_s / run));
        json_object_set_new(sum, "expert_io_share", json_real(s.st.expert_stall_s / run));
        json_object_set_new(sum, "io_backend", json_string(s.st.backend));
        json_object_set_new(sum, "o_direct", json_boolean(s.st.direct));
        json_object_set_new(sum, "peak_rss_bytes", json_integer((json_int_t)s.rss));
        json_object_set_new(mem, "summary", sum);
        json_t *steps = json_array();
        for (size_t i = 0; i < rm->nsteps; i++) {
            const step_rec *r = &rm->steps[i];
            json_array_append_new(
                steps, json_pack("{s:s, s:i, s:f, s:I, s:I, s:I, s:I, s:I}", "kind", r->prefill ? "prefill" : "token",
                                 "tokens", r->ntokens, "s", r->secs, "trunk_bytes", (json_int_t)r->trunk_read,
                                 "expert_bytes", (json_int_t)r->expert_read, "requests", (json_int_t)r->requests,
                                 "hits", (json_int_t)r->hits, "resident_hits", (json_int_t)r->resident));
        }
        json_object_set_new(mem, "steps", steps);
    }
    json_object_set_new(o, "memory", mem);
}

void k3_runmem_free(k3_runmem *rm) {
    if (!rm) return;
    k3_stream_free(rm->s);
    k3_trunk_free(rm->trunk);
    st_close(rm->ix);
    free(rm->plan);
    free(rm->steps);
    free(rm);
}
