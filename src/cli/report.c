/* report.c: how every command prints its one-line errors (commands.h). Kept
 * out of main.c so that commands also link into the test runner. */
#include "cli/commands.h"

#include <stdarg.h>

int k3_report(const k3_err *err) {
    fprintf(stderr, "k3: %s\n", err->msg[0] ? err->msg : "unknown error");
    return err->code ? err->code : K3_EXIT_RUNTIME;
}

int k3_usage_error(const char *cmd, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "k3: %s: %s (see 'k3 help %s')\n", cmd, msg, cmd);
    return K3_EXIT_USAGE;
}
