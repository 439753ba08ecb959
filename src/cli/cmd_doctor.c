/* k3 doctor: what this machine can do for k3. Checks the build and CPU
 * features, sizes memory to a preset, measures the storage under a model
 * directory the way the engine reads it (large random O_DIRECT reads at queue
 * depth 1 and 16), and prints the next command to run. */
#include "cli/commands.h"
#include "kernels/kernels.h"
#include "memory/budget.h"
#include "memory/io.h"

#include <dirent.h>
#include <getopt.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *const cmd_doctor_help =
    "usage: k3 doctor [MODEL_DIR] [--seconds S]\n"
    "\n"
    "Checks the toolchain and CPU features k3 uses (AVX-512, AVX512_BF16, AVX2,\n"
    "FMA) and the kernel path in force (the best the CPU has, or K3_ISA=scalar,\n"
    "avx2 or avx512), the memory available and the preset it suggests, and,\n"
    "with MODEL_DIR, the read speed of the storage holding the model, measured\n"
    "as the engine reads:\n"
    "4 MiB random O_DIRECT reads at queue depth 1 and 16 from the model's\n"
    "largest shard (or from a scratch file written there when the shards are\n"
    "small). Ends with the exact command to run next.\n"
    "\n"
    "  --seconds S   time per storage measurement (default 1.5)\n";

#define BLOCK (4u << 20)


/* Random 4 MiB reads for `seconds` at the given depth; returns MB/s. */
static double measure(const char *path, uint64_t size, int depth, double seconds, const char **backend,
                      bool *direct, k3_err *err) {
    k3_io *io = k3_io_new(depth, true);
    int fd;
    if (k3_io_open(io, path, &fd, direct, err)) { k3_io_free(io); return -1; }
    *backend = k3_io_backend(io);
    uint64_t blocks = size / BLOCK;
    k3_io_req *reqs = xcalloc((size_t)depth, sizeof *reqs);
    for (int i = 0; i < depth; i++) reqs[i].buf = k3_dio_alloc(BLOCK);
    uint64_t seed = 0, bytes = 0; /* random block offsets from the common generator */
    double t0 = k3_now(), t = 0;
    int rc = K3_OK;
    while (t < seconds && rc == K3_OK) {
        for (int i = 0; i < depth; i++) {
            reqs[i].fd = fd;
            reqs[i].offset = (k3_rng_next(&seed) % blocks) * BLOCK;
            reqs[i].len = BLOCK;
        }
        rc = k3_io_read(io, reqs, (size_t)depth, err);
        bytes += (uint64_t)depth * BLOCK;
        t = k3_now() - t0;
    }
    for (int i = 0; i < depth; i++) free(reqs[i].buf);
    free(reqs);
    close(fd);
    k3_io_free(io);
    return rc ? -1 : (double)bytes / t / 1e6;
}

int cmd_doctor(int argc, char **argv) {
    static const struct option opts[] = {{"seconds", required_argument, 0, 's'}, {0, 0, 0, 0}};
    double seconds = 1.5;
    int o;
    optind = 1;
    opterr = 0;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (o == 's') {
            char *end;
            seconds = strtod(optarg, &end);
            if (*end || !(seconds > 0 && seconds <= 60)) return k3_usage_error("doctor", "bad --seconds '%s'", optarg);
        } else return k3_usage_error("doctor", "unknown option");
    }
    if (argc - optind > 1) return k3_usage_error("doctor", "at most one MODEL_DIR");
    const char *dir = optind < argc ? argv[optind] : NULL;
    if (dir) {
        struct stat st;
        if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
            fprintf(stderr, "k3: %s: not a directory\n", dir);
            return K3_EXIT_USAGE;
        }
    }

    printf("build      gcc %s, OpenMP %d threads (of %ld CPUs)\n", __VERSION__, omp_get_max_threads(),
           sysconf(_SC_NPROCESSORS_ONLN));
#if defined(__x86_64__)
    __builtin_cpu_init();
    bool avx512 = __builtin_cpu_supports("avx512f"), bf16 = __builtin_cpu_supports("avx512bf16"),
         fma = __builtin_cpu_supports("fma"), avx2 = __builtin_cpu_supports("avx2");
    printf("cpu        avx512f %s, avx512_bf16 %s, avx2 %s, fma %s\n", avx512 ? "yes" : "no", bf16 ? "yes" : "no",
           avx2 ? "yes" : "no", fma ? "yes" : "no");
#elif defined(__aarch64__)
    printf("cpu        arm64 (NEON and FMA are part of the architecture)\n");
#else
    printf("cpu        no SIMD path for this architecture\n");
#endif
    /* the path the kernels use (K3_ISA or the best), and the others this CPU
     * could run: every path gives the same bits, only the speed differs */
    char paths[64] = "";
    for (int i = 0; i < K_ISA_COUNT; i++)
        if (k_isa_available((k_isa)i)) {
            size_t l = strlen(paths);
            snprintf(paths + l, sizeof paths - l, "%s%s", l ? " " : "", k_isa_name((k_isa)i));
        }
    const char *why = getenv("K3_ISA") && *getenv("K3_ISA") ? "set by K3_ISA" : "the best available";
    printf("kernels    %s (%s; available: %s; all give the same bits)\n", k_path_name(), why, paths);
    char tg[256];
    k3_train_gemm_describe(tg, sizeof tg);
    printf("training   products: %s\n", tg);

    const char *bound;
    uint64_t avail = k3_mem_limit(0, &bound), cg_limit = 0;
    uint64_t cg = k3_cgroup_headroom("/proc/self/cgroup", "/proc/self/mountinfo", &cg_limit);
    k3_budget b = k3_budget_auto(avail);
    printf("memory     %.1f GB available (%s) -> --preset auto = trunk %.0f GB + expert cache %.0f GB\n",
           (double)avail / 1e9, bound, b.trunk_gb, b.cache_gb);
    if (cg != UINT64_MAX)
        printf("cgroup     memory limit %.2f GB, headroom %.2f GB\n", (double)cg_limit / 1e9, (double)cg / 1e9);

    k3_err err = {0};
    if (dir) {
        uint64_t size = 0;
        static char shard[4096];
        const char *path = k3_largest_shard(dir, shard, sizeof shard, &size) ? shard : NULL;
        char scratch[4200] = "";
        if (!path || size < 64ull * BLOCK) {
            /* small model: measure a scratch file on the same filesystem */
            snprintf(scratch, sizeof scratch, "%s/.k3-doctor-%ld", dir, (long)getpid());
            size = 256ull << 20;
            k3_atomic_file af;
            if (k3_atomic_open(&af, scratch, &err)) return k3_report(&err);
            char *buf = xcalloc(1, BLOCK);
            for (uint64_t w = 0; w < size; w += BLOCK) {
                for (size_t i = 0; i < BLOCK; i += 4096) buf[i] = (char)(w + i);
                if (k3_atomic_write(&af, buf, BLOCK, &err)) { free(buf); k3_atomic_abort(&af); return k3_report(&err); }
            }
            free(buf);
            if (k3_atomic_commit(&af, &err)) return k3_report(&err);
            path = scratch;
        }
        const char *backend = "";
        bool direct = false;
        double qd1 = measure(path, size, 1, seconds, &backend, &direct, &err);
        double qd16 = qd1 < 0 ? -1 : measure(path, size, 16, seconds, &backend, &direct, &err);
        if (scratch[0]) unlink(scratch);
        if (qd1 < 0 || qd16 < 0) return k3_report(&err);
        printf("storage    %s: %.0f MB/s at depth 1, %.0f MB/s at depth 16 (%s, %s)\n", dir, qd1, qd16,
               direct ? "O_DIRECT" : "buffered: O_DIRECT refused", backend);
        printf("\nnext: bin/k3 run %s --preset auto --prompt \"Once upon a time\"\n", dir);
    } else {
        printf("storage    not measured (give a MODEL_DIR)\n");
        printf("\nnext: bin/k3 doctor MODEL_DIR   (or: bin/k3 run models/default --prompt \"Once upon a time\")\n");
    }
    return K3_OK;
}
