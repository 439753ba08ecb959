/* cmd_dashboard.c: `k3 dashboard`, serve a live page for training runs. */
#include "cli/commands.h"
#include "web/dashboard.h"
#include "web/http.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

const char *const cmd_dashboard_help =
    "usage: k3 dashboard --run-dir DIR [--run-dir DIR ...] [--port N] [--host ADDR]\n"
    "                    [--stale-after SECONDS] [--request-timeout S]\n"
    "                    [--client-connections N] [--verbose]\n"
    "\n"
    "Serves a web page that follows training runs as they happen: step and ETA,\n"
    "status, train and validation loss, learning rate, tokens/s, peak memory,\n"
    "gradient norm, per-layer expert load, and the latest sample. The page polls\n"
    "every 2 s. It reads the files `k3 train --output-dir DIR` writes (state.json,\n"
    "metrics.jsonl, samples.jsonl; docs/run-dir.md) and never writes anything.\n"
    "\n"
    "  --run-dir DIR      a run directory, or a directory whose subdirectories are\n"
    "                     runs (new ones are picked up while serving); repeatable.\n"
    "                     An empty DIR is taken as a run that has not started yet\n"
    "  --port N           TCP port (default 8080; 0 picks a free one)\n"
    "  --host ADDR        address to listen on (default 127.0.0.1). The page has no\n"
    "                     authentication: any other address than loopback makes\n"
    "                     the runs readable from the network, with a warning\n"
    "  --stale-after S    a running run that has not updated state.json for S\n"
    "                     seconds (or 5 median steps, if longer; 5 times that in\n"
    "                     an evaluation, sample or checkpoint) is shown as stale\n"
    "                     (default 120)\n"
    "  --request-timeout S  a request's line and headers must arrive within S\n"
    "                     seconds of the connection opening; a slower client is\n"
    "                     disconnected (default 30)\n"
    "  --client-connections N  connections one client address may hold while\n"
    "                     their requests arrive (default 32; 256 in all), and as\n"
    "                     many being answered (128 in all); more are closed at once\n"
    "  --verbose          log every request to stderr\n"
    "\n"
    "Prints the page's address, then serves until Ctrl-C (SIGINT) or SIGTERM.\n"
    "Endpoints: / (the page), /api/runs, /api/state?run=NAME,\n"
    "/api/metrics?run=NAME&since=STEP, /api/samples?run=NAME, /files/NAME?run=NAME.\n";

#define MAX_DIRS 256

int cmd_dashboard(int argc, char **argv) {
    const char *dirs[MAX_DIRS];
    k3_dashboard_opts o = {.host = "127.0.0.1", .port = 8080, .dirs = dirs, .stale_after_s = 120};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
        if (!strcmp(a, "--run-dir")) {
            if (!has_val) return k3_usage_error("dashboard", "--run-dir needs a directory");
            if (o.ndirs == MAX_DIRS) return k3_usage_error("dashboard", "more than %d --run-dir", MAX_DIRS);
            dirs[o.ndirs++] = argv[++i];
        } else if (!strcmp(a, "--port")) {
            char *end;
            long v = has_val ? strtol(argv[i + 1], &end, 10) : -1;
            if (!has_val || *argv[i + 1] == 0 || *end || v < 0 || v > 65535)
                return k3_usage_error("dashboard", "--port needs an integer in [0, 65535]");
            o.port = (int)v;
            i++;
        } else if (!strcmp(a, "--host")) {
            if (!has_val || !*argv[i + 1]) return k3_usage_error("dashboard", "--host needs an address");
            o.host = argv[++i];
        } else if (!strcmp(a, "--stale-after")) {
            char *end;
            double v = has_val ? strtod(argv[i + 1], &end) : -1;
            if (!has_val || *argv[i + 1] == 0 || *end || !(v > 0 && v < 1e9))
                return k3_usage_error("dashboard", "--stale-after needs a positive number of seconds");
            o.stale_after_s = v;
            i++;
        } else if (!strcmp(a, "--request-timeout")) {
            double v;
            if (!has_val || !k3_parse_f64(argv[i + 1], &v) || !(v >= 0.5 && v <= 3600))
                return k3_usage_error("dashboard", "--request-timeout needs a number of seconds in [0.5, 3600]");
            o.request_timeout_s = v;
            i++;
        } else if (!strcmp(a, "--client-connections")) {
            int64_t v;
            if (!has_val || !k3_parse_i64(argv[i + 1], 1, 128, &v))
                return k3_usage_error("dashboard", "--client-connections needs an integer in [1, 128]");
            o.client_connections = (unsigned)v;
            i++;
        } else if (!strcmp(a, "--verbose")) {
            o.verbose = true;
        } else {
            return k3_usage_error("dashboard", "unknown argument '%s'", a);
        }
    }
    if (o.ndirs == 0) return k3_usage_error("dashboard", "--run-dir is required");

    /* before the server thread exists (http.h) */
    sigset_t stop;
    k3_http_block_stop_signals(&stop);

    k3_err err = {0};
    k3_dashboard *d;
    if (k3_dashboard_start(&o, &d, &err) != K3_OK) return k3_report(&err);
    if (!k3_http_is_loopback(o.host))
        fprintf(stderr,
                "k3 dashboard: warning: listening on %s, not loopback: anyone who can reach this "
                "machine can read these runs (the page has no authentication)\n", o.host);
    bool v6 = strchr(o.host, ':') != NULL;
    size_t n = k3_dashboard_nruns(d);
    printf("k3 dashboard: %zu run%s, http://%s%s%s:%d/ (Ctrl-C stops)\n", n, n == 1 ? "" : "s",
           v6 ? "[" : "", o.host, v6 ? "]" : "", k3_dashboard_port(d));
    fflush(stdout);

    int sig = k3_http_wait_stop(&stop);
    k3_dashboard_stop(d);
    printf("k3 dashboard: stopped (%s)\n", strsignal(sig));
    return K3_OK;
}
