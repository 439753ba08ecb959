/* budget.h: memory budgets and presets.
 *
 * A run's memory has two knobs: how much of the dense trunk stays resident
 * (--trunk-gb; the rest streams through ring slots) and how many routed
 * experts the cache keeps (--cache-gb). Presets name common machines; `auto`
 * sizes from MemAvailable, or from the headroom under a memory cgroup limit
 * when that is less (k3_mem_available_bytes). At a fixed total, trunk-first was measured faster
 * than cache-first on the real model (1.69x at 128 GB), because a resident
 * trunk layer is used by every token while a cached expert rarely is; the
 * presets and `auto` therefore give memory to the trunk first. */
#ifndef K3_MEMORY_BUDGET_H
#define K3_MEMORY_BUDGET_H

#include "util/common.h"

typedef struct {
    const char *name;
    double total_gb;  /* the machine size the preset targets (documentation) */
    double trunk_gb;  /* resident trunk; < 0 means unlimited (all resident) */
    double cache_gb;  /* routed-expert cache; < 0 means unlimited */
    const char *what;
} k3_preset;

const k3_preset *k3_presets(size_t *n);
const k3_preset *k3_preset_find(const char *name);
void k3_presets_print(FILE *f);

typedef struct {
    double trunk_gb, cache_gb; /* < 0: unlimited */
    const char *preset;        /* name of the last preset applied, or NULL */
} k3_budget;

/* The default budget (unlimited: everything resident). */
k3_budget k3_budget_default(void);
/* Applies a preset by name to b ("auto" reads MemAvailable). */
int k3_budget_apply_preset(k3_budget *b, const char *name, k3_err *err);
/* Sizes an `auto` budget for a given amount of available memory. */
k3_budget k3_budget_auto(uint64_t available_bytes);
/* Parses a size in GB (decimal, > 0). */
int k3_parse_gb(const char *s, double *gb, k3_err *err);

#endif
