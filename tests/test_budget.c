/* Budget presets and the auto sizing rule. */
#include "harness.h"
#include "memory/budget.h"

#include <string.h>

TEST(budget_presets_apply_and_later_wins) {
    k3_budget b = k3_budget_default();
    CHECK(b.trunk_gb < 0 && b.cache_gb < 0);
    k3_err err = {0};
    CHECK(k3_budget_apply_preset(&b, "laptop", &err) == 0);
    CHECK(b.trunk_gb == 5 && b.cache_gb == 1.5);
    CHECK(k3_budget_apply_preset(&b, "server", &err) == 0);
    CHECK(b.trunk_gb == 115 && b.cache_gb == 100 && !strcmp(b.preset, "server"));
    CHECK(k3_budget_apply_preset(&b, "huge", &err) == K3_EXIT_USAGE);
    CHECK(strstr(err.msg, "huge") != NULL);
}

TEST(budget_auto_gives_trunk_first) {
    k3_budget b = k3_budget_auto(100ull * 1000 * 1000 * 1000);
    /* 85 GB usable: 63 trunk + 21 cache (whole GB, floor) */
    CHECKF(b.trunk_gb == 63 && b.cache_gb == 21, "%g %g", b.trunk_gb, b.cache_gb);
    b = k3_budget_auto(0);
    CHECK(b.trunk_gb == 1 && b.cache_gb == 1);
}

TEST(budget_parse_gb) {
    double g;
    k3_err err = {0};
    CHECK(k3_parse_gb("1.5", &g, &err) == 0 && g == 1.5);
    CHECK(k3_parse_gb("x", &g, &err) == K3_EXIT_USAGE);
    CHECK(k3_parse_gb("-2", &g, &err) == K3_EXIT_USAGE);
    CHECK(k3_parse_gb("", &g, &err) == K3_EXIT_USAGE);
}
