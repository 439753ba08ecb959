/* commands.h: every `k3` subcommand. main.c dispatches from one table; each
 * command lives in its own src/cli/cmd_<name>.c and defines
 *     int cmd_<name>(int argc, char **argv);   argv[0] is the command name
 *     const char *const cmd_<name>_help;       full --help text
 * returning an exit code (common.h). The declarations are weak so that a build
 * without a command still links; main.c then refuses it with a clear error. */
#ifndef K3_CLI_COMMANDS_H
#define K3_CLI_COMMANDS_H

#include <stdio.h>

#define K3_DECLARE_COMMAND(name)                                   \
    __attribute__((weak)) int cmd_##name(int argc, char **argv);   \
    __attribute__((weak)) extern const char *const cmd_##name##_help

K3_DECLARE_COMMAND(inspect);
K3_DECLARE_COMMAND(tokenize);
K3_DECLARE_COMMAND(detokenize);
K3_DECLARE_COMMAND(run);
K3_DECLARE_COMMAND(pack_trunk);
K3_DECLARE_COMMAND(cache_sim);
K3_DECLARE_COMMAND(doctor);
K3_DECLARE_COMMAND(prepare);
K3_DECLARE_COMMAND(train);
K3_DECLARE_COMMAND(export);
K3_DECLARE_COMMAND(dashboard);
K3_DECLARE_COMMAND(chat);
K3_DECLARE_COMMAND(serve);
K3_DECLARE_COMMAND(eval);
K3_DECLARE_COMMAND(verify);

/* The error printer every command uses: "k3: <msg>\n" on stderr. */
#include "util/common.h"
int k3_report(const k3_err *err);  /* prints err->msg, returns err->code */
/* Usage error helper: prints "k3 <cmd>: <msg> (see 'k3 help <cmd>')", returns 2. */
int k3_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
