/* k3 pack-trunk: rewrite a checkpoint's dense trunk into one streamable file. */
#include "cli/commands.h"
#include "memory/trunk.h"

#include <getopt.h>
#include <string.h>

const char *const cmd_pack_trunk_help =
    "usage: k3 pack-trunk MODEL_DIR TRUNK_DIR [--verify]\n"
    "\n"
    "Rewrites everything in MODEL_DIR except the routed experts (and the vision\n"
    "tower) into TRUNK_DIR/trunk.bin: one contiguous 4 KiB-aligned run per layer,\n"
    "plus one for the embeddings, head and final norms, so 'k3 run --trunk\n"
    "TRUNK_DIR' reads a whole layer with one aligned read. TRUNK_DIR/trunk.json\n"
    "indexes the runs with a CRC-32C each and the source checkpoint's identity.\n"
    "Atomic: both files appear only when complete; an interrupted pack leaves no\n"
    "trunk.json, and running the command again starts clean.\n"
    "\n"
    "  --verify   do not pack: re-read TRUNK_DIR and check every run's checksum\n"
    "             and every tensor's bytes against MODEL_DIR\n";

int cmd_pack_trunk(int argc, char **argv) {
    static const struct option opts[] = {{"verify", no_argument, 0, 'v'}, {0, 0, 0, 0}};
    bool verify = false;
    int o;
    optind = 1;
    opterr = 0;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (o == 'v') verify = true;
        else return k3_usage_error("pack-trunk", "unknown option");
    }
    if (argc - optind != 2) return k3_usage_error("pack-trunk", "expected MODEL_DIR and TRUNK_DIR");
    const char *model = argv[optind], *trunk = argv[optind + 1];
    k3_err err = {0};
    double t0 = k3_now();
    if (verify) {
        if (k3_trunk_verify(trunk, model, &err)) return k3_report(&err);
        fprintf(stderr, "k3: %s verified against %s (%.1f s)\n", trunk, model, k3_now() - t0);
        return K3_OK;
    }
    if (k3_trunk_pack(model, trunk, &err)) return k3_report(&err);
    k3_trunk *t;
    if (k3_trunk_open(trunk, NULL, &t, &err)) return k3_report(&err);
    uint64_t biggest = 0;
    for (int r = 0; r < t->nruns; r++)
        if (t->runs[r].bytes > biggest) biggest = t->runs[r].bytes;
    fprintf(stderr, "k3: packed %d runs, %.3f GB (largest run %.3f GB) into %s in %.1f s\n", t->nruns,
            (double)t->file_size / 1e9, (double)biggest / 1e9, t->bin_path, k3_now() - t0);
    k3_trunk_free(t);
    return K3_OK;
}
