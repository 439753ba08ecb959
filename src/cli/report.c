/* report.c: how every command prints its one-line errors (commands.h). Kept
 * out of main.c so that commands also link into the test runner. */
#include "cli/commands.h"

#include <stdarg.h>

#include "dist/dist.h"

/* Under mpirun the line is kept for k3_dist_finish, which prints one line for
 * the whole job (dist.h). */
int k3_report(const k3_err *err) {
    int code = err->code ? err->code : K3_EXIT_RUNTIME;
    const char *msg = err->msg[0] ? err->msg : "unknown error";
    if (!k3_dist_defer_error(code, msg)) fprintf(stderr, "k3: %s\n", msg);
    return code;
}

int k3_usage_error(const char *cmd, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char line[1024];
    snprintf(line, sizeof line, "%s: %s (see 'k3 help %s')", cmd, msg, cmd);
    if (!k3_dist_defer_error(K3_EXIT_USAGE, line)) fprintf(stderr, "k3: %s\n", line);
    return K3_EXIT_USAGE;
}
