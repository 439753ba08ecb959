/* tengine.h: opening an engine in a unit test as the command line would.
 * The flags are those k3 run takes (e.g. "--cache-gb", "0.0002", "--chunk",
 * "3"), parsed by the engine's own parser, so a test's budget means what it
 * means to a user. Every flag must be the engine's: one that is not fails
 * the open with a message naming it. */
#ifndef K3_TESTS_TENGINE_H
#define K3_TESTS_TENGINE_H

#include "engine/engine.h"

/* flags: a NULL-terminated list. pass_tokens: the ids of a verifying pass the
 * plan holds (speculation), 0 for none. */
int t_engine_open(const char *model_dir, const char *const *flags, int64_t max_pos, int pass_tokens, k3_engine **e,
                  k3_err *err);

#endif
