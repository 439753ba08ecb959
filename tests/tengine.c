#include "tengine.h"

int t_engine_open(const char *model_dir, const char *const *flags, int64_t max_pos, int pass_tokens, k3_engine **e,
                  k3_err *err) {
    k3_engine_opts o;
    k3_engine_opts_init(&o);
    int argc = 1;
    while (flags[argc - 1]) argc++;
    char *argv[32];
    if (argc > 31) return k3_fail(err, K3_EXIT_USAGE, "t_engine_open: %d flags, at most 30", argc - 1);
    argv[0] = "test";
    for (int i = 1; i < argc; i++) argv[i] = (char *)flags[i - 1];
    argv[argc] = NULL;
    for (int i = 1; i < argc; i++) {
        bool used = false;
        int rc = k3_engine_parse_flag(&o, "test", argc, argv, &i, &used, err);
        if (rc) return rc;
        if (!used) return k3_fail(err, K3_EXIT_USAGE, "t_engine_open: '%s' is not an engine flag", argv[i]);
    }
    o.model_dir = model_dir;
    o.max_pos = max_pos;
    o.mem.so.pass_tokens = pass_tokens;
    return k3_engine_open(&o, e, err);
}
