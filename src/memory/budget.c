/* budget.c: see budget.h. */
#include "memory/budget.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const k3_preset PRESETS[] = {
    {"laptop", 8, 5, 1.5, "8 GB machine: K3 head + one 2.3 GB ring slot, the rest streamed"},
    {"desktop", 32, 22, 6, "32 GB machine"},
    {"workstation", 128, 100, 20, "128 GB machine: most of the 109 GB K3 trunk resident"},
    {"server", 224, 115, 100, "224 GB machine: whole K3 trunk resident plus a large expert cache"},
    {"max", 0, -1, -1, "everything resident, no limits (small models)"},
    {"auto", 0, 0, 0, "sized from MemAvailable (or a cgroup limit's headroom if less): 85% of it, trunk first"},
};

const k3_preset *k3_presets(size_t *n) {
    *n = sizeof PRESETS / sizeof PRESETS[0];
    return PRESETS;
}

const k3_preset *k3_preset_find(const char *name) {
    size_t n;
    const k3_preset *p = k3_presets(&n);
    for (size_t i = 0; i < n; i++)
        if (!strcmp(p[i].name, name)) return &p[i];
    return NULL;
}

static void gb_cell(char *buf, size_t n, double v) {
    if (v < 0) snprintf(buf, n, "all");
    else snprintf(buf, n, "%g", v);
}

void k3_presets_print(FILE *f) {
    size_t n;
    const k3_preset *p = k3_presets(&n);
    fprintf(f, "%-12s %9s %9s  %s\n", "preset", "trunk GB", "cache GB", "for");
    for (size_t i = 0; i < n; i++) {
        char t[16], c[16];
        if (!strcmp(p[i].name, "auto")) {
            k3_budget b = k3_budget_auto(k3_mem_available_bytes());
            gb_cell(t, sizeof t, b.trunk_gb);
            gb_cell(c, sizeof c, b.cache_gb);
        } else {
            gb_cell(t, sizeof t, p[i].trunk_gb);
            gb_cell(c, sizeof c, p[i].cache_gb);
        }
        fprintf(f, "%-12s %9s %9s  %s\n", p[i].name, t, c, p[i].what);
    }
}

k3_budget k3_budget_default(void) { return (k3_budget){-1, -1, NULL}; }

k3_budget k3_budget_auto(uint64_t avail) {
    /* 85% of what is available; 3/4 of that to the trunk, the rest to the
     * expert cache (trunk first, see budget.h). Whole GB, at least 1 each. */
    double usable = 0.85 * (double)avail / 1e9;
    k3_budget b = {floor(usable * 0.75), floor(usable * 0.25), "auto"};
    if (b.trunk_gb < 1) b.trunk_gb = 1;
    if (b.cache_gb < 1) b.cache_gb = 1;
    return b;
}

int k3_budget_apply_preset(k3_budget *b, const char *name, k3_err *err) {
    const k3_preset *p = k3_preset_find(name);
    if (!p)
        return k3_fail(err, K3_EXIT_USAGE,
                       "--preset: unknown preset '%s' (laptop, desktop, workstation, server, max, auto)", name);
    if (!strcmp(name, "auto")) {
        uint64_t avail = k3_mem_available_bytes();
        if (!avail) return k3_fail(err, K3_EXIT_RUNTIME, "--preset auto: cannot read MemAvailable from /proc/meminfo");
        *b = k3_budget_auto(avail);
        return K3_OK;
    }
    b->trunk_gb = p->trunk_gb;
    b->cache_gb = p->cache_gb;
    b->preset = p->name;
    return K3_OK;
}

int k3_parse_gb(const char *s, double *gb, k3_err *err) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !(v >= 0) || !isfinite(v))
        return k3_fail(err, K3_EXIT_USAGE, "expected a size in GB, got '%s'", s);
    *gb = v;
    return K3_OK;
}
