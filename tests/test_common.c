/* Tests for util/common: 16-bit float conversions against exhaustive
 * properties, atomic writes, id parsing. */
#include "harness.h"
#include "util/common.h"

#include <math.h>
#include <string.h>
#include <stdlib.h>
#include <errno.h>
#include <stdio.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

TEST(bf16_roundtrip_all_patterns) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = k3_bf16_to_f32((uint16_t)h);
        if (isnan(f)) continue;
        CHECKF(k3_f32_to_bf16(f) == h, "bf16 0x%04x -> %g -> 0x%04x", h, f, k3_f32_to_bf16(f));
    }
}

TEST(f16_roundtrip_all_patterns) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = k3_f16_to_f32((uint16_t)h);
        if (isnan(f)) continue;
        CHECKF(k3_f32_to_f16(f) == h, "f16 0x%04x -> %g -> 0x%04x", h, f, k3_f32_to_f16(f));
    }
    /* known values from the IEEE 754 binary16 definition */
    CHECK(k3_f16_to_f32(0x0001) == 0x1p-24f);
    CHECK(k3_f16_to_f32(0x3c00) == 1.0f);
    CHECK(k3_f16_to_f32(0x7bff) == 65504.0f);
    CHECK(isinf(k3_f16_to_f32(0x7c00)));
}

TEST(bf16_rounds_to_nearest_even) {
    /* 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0) */
    CHECK(k3_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);
    CHECK(k3_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);
}

TEST(atomic_write_replaces_whole_file) {
    char path[1024];
    snprintf(path, sizeof path, "%s/f.txt", t_outdir());
    k3_err err = {0};
    CHECK(k3_write_file_atomic(path, "first", 5, &err) == 0);
    CHECK(k3_write_file_atomic(path, "second!", 7, &err) == 0);
    char *d; size_t n;
    CHECK(k3_read_file(path, &d, &n, &err) == 0);
    CHECK(n == 7 && memcmp(d, "second!", 7) == 0);
    free(d);
}

TEST(parse_ids_rejects_garbage) {
    int32_t *ids; size_t n; k3_err err = {0};
    CHECK(k3_parse_ids("1,2, 3", 10, &ids, &n, &err) == 0);
    CHECK(n == 3 && ids[2] == 3);
    free(ids);
    CHECK(k3_parse_ids("1,x", 10, &ids, &n, &err) == K3_EXIT_USAGE);
    CHECK(k3_parse_ids("10", 10, &ids, &n, &err) == K3_EXIT_USAGE);
    CHECK(k3_parse_ids("-1", 10, &ids, &n, &err) == K3_EXIT_USAGE);
}

/* The fast CRC-32C (three interleaved chains, combined by a shift table)
 * against a bit-at-a-time reference written here, over lengths around the
 * block sizes, odd alignments and split updates. */
static uint32_t crc_bitwise(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1)));
    }
    return ~crc;
}

TEST(crc32c_matches_bitwise_reference) {
    size_t cap = 3 * 4096 * 5 + 100;
    uint8_t *buf = malloc(cap);
    uint64_t seed = 12345;
    for (size_t i = 0; i < cap; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        buf[i] = (uint8_t)(seed >> 56);
    }
    const size_t lens[] = {0, 1, 7, 8, 4095, 4096, 12287, 12288, 12289, 24576, 24583, 3 * 4096 * 5};
    for (size_t a = 0; a < 4; a++)
        for (size_t j = 0; j < sizeof lens / sizeof lens[0]; j++) {
            size_t n = lens[j];
            uint32_t want = crc_bitwise(0x1234u * (uint32_t)a, buf + a, n);
            CHECKF(k3_crc32c(0x1234u * (uint32_t)a, buf + a, n) == want, "offset %zu length %zu", a, n);
            /* in two updates, split inside a block */
            size_t h = n / 3 + 5 < n ? n / 3 + 5 : n;
            uint32_t c = k3_crc32c(0x1234u * (uint32_t)a, buf + a, h);
            CHECKF(k3_crc32c(c, buf + a + h, n - h) == want, "split offset %zu length %zu", a, n);
        }
    free(buf);
}

TEST(crc32c_known_values) {
    /* the CRC-32C check value from RFC 3720 (iSCSI) / the Rocksoft catalogue:
     * "123456789" -> 0xE3069283; 32 zero bytes -> 0x8A9136AA (RFC 3720 B.4) */
    CHECK(k3_crc32c(0, "123456789", 9) == 0xE3069283u);
    uint8_t z[32] = {0};
    CHECK(k3_crc32c(0, z, 32) == 0x8A9136AAu);
    /* chunked feeding equals one pass */
    uint32_t c = k3_crc32c(0, "1234", 4);
    CHECK(k3_crc32c(c, "56789", 5) == 0xE3069283u);
}

TEST(fnv1a64_known_values) {
    /* FNV-1a 64 reference values (Fowler/Noll/Vo test suite) */
    CHECK(k3_fnv1a64(K3_FNV_OFFSET, "", 0) == 0xcbf29ce484222325ULL);
    CHECK(k3_fnv1a64(K3_FNV_OFFSET, "a", 1) == 0xaf63dc4c8601ec8cULL);
    CHECK(k3_fnv1a64(K3_FNV_OFFSET, "foobar", 6) == 0x85944171f73967e8ULL);
}

TEST(size_str_picks_the_unit) {
    CHECK(strcmp(k3_size_str(0), "0 B") == 0);
    CHECK(strcmp(k3_size_str(999), "999 B") == 0);
    CHECK(strcmp(k3_size_str(1000), "1.00 kB") == 0);
    CHECK(strcmp(k3_size_str(25400), "25.4 kB") == 0);
    CHECK(strcmp(k3_size_str(1234567), "1.23 MB") == 0);
    CHECK(strcmp(k3_size_str(999999), "1.00 MB") == 0); /* rounds into the next unit, not "1000 kB" */
    CHECK(strcmp(k3_size_str(3500000000ull), "3.50 GB") == 0);
    CHECK(strcmp(k3_size_str(1560936091448ull), "1.56 TB") == 0);
    /* eight results may be held at once */
    const char *a = k3_size_str(1), *b = k3_size_str(2000);
    CHECK(strcmp(a, "1 B") == 0 && strcmp(b, "2.00 kB") == 0);
}

TEST(path_join_one_separator) {
    const char *cases[][3] = {{"a", "b", "a/b"}, {"a/", "b", "a/b"}, {"/", "b", "/b"}, {"", "b", "b"},
                              {"x/y//", "z.json", "x/y//z.json"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *p = k3_path_join(cases[i][0], cases[i][1]);
        CHECK(strcmp(p, cases[i][2]) == 0);
        free(p);
    }
}

/* A killed writer's PID: a child that has exited and been reaped names no
 * process; this process and a live child never count as gone. */
TEST(pid_gone_only_for_dead_processes) {
    CHECK(!k3_pid_gone((int64_t)getpid()));
    CHECK(!k3_pid_gone(0) && !k3_pid_gone(-5) && !k3_pid_gone((int64_t)INT32_MAX + 1));
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t c = fork();
    if (c == 0) { /* waits until the parent closes the pipe */
        char b;
        close(fds[1]);
        (void)!read(fds[0], &b, 1);
        _exit(0);
    }
    CHECK(c > 0);
    close(fds[0]);
    CHECK(!k3_pid_gone((int64_t)c)); /* alive */
    close(fds[1]);
    CHECK(waitpid(c, NULL, 0) == c);
    CHECK(k3_pid_gone((int64_t)c)); /* exited and reaped */
}

TEST(remove_flat_dir_removes_files_and_dir) {
    char tmpl[] = "/tmp/k3-flat-XXXXXX";
    CHECK(mkdtemp(tmpl) != NULL);
    for (int i = 0; i < 3; i++) {
        char name[16];
        snprintf(name, sizeof name, "f%d", i);
        char *p = k3_path_join(tmpl, name);
        FILE *f = fopen(p, "w");
        CHECK(f != NULL);
        fputs("x", f);
        fclose(f);
        free(p);
    }
    k3_remove_flat_dir(tmpl);
    struct stat st;
    CHECK(stat(tmpl, &st) != 0 && errno == ENOENT);
    k3_remove_flat_dir(tmpl); /* already gone: nothing to do, no crash */
}

TEST(parse_size_binary_units) {
    uint64_t v = 0;
    CHECK(k3_parse_size("4096", &v) && v == 4096);
    CHECK(k3_parse_size("64K", &v) && v == 65536);
    CHECK(k3_parse_size("8M", &v) && v == 8388608);
    CHECK(k3_parse_size("1.5G", &v) && v == 1610612736);
    CHECK(k3_parse_size("2tb", &v) && v == 2199023255552ull);
    CHECK(k3_parse_size("512MB", &v) && v == 536870912);
    CHECK(!k3_parse_size("", &v));
    CHECK(!k3_parse_size("K", &v));
    CHECK(!k3_parse_size("12Q", &v));
    CHECK(!k3_parse_size("8GiB", &v));
    CHECK(!k3_parse_size("-1", &v));
    CHECK(!k3_parse_size("nan", &v));
    CHECK(!k3_parse_size("20000000T", &v)); /* past 2^64 bytes */
}

TEST(parse_f64_whole_finite) {
    double v = 0;
    CHECK(k3_parse_f64("0.9", &v) && v == 0.9);
    CHECK(k3_parse_f64("-2", &v) && v == -2.0);
    CHECK(k3_parse_f64("1e-3", &v) && v == 1e-3);
    CHECK(!k3_parse_f64("", &v));
    CHECK(!k3_parse_f64("0.9x", &v));
    CHECK(!k3_parse_f64("inf", &v));
    CHECK(!k3_parse_f64("nan", &v));
    CHECK(!k3_parse_f64("1e999", &v));
}

/* A fake /proc/self/cgroup, /proc/self/mountinfo and cgroup tree under dir. */
static void cg_put(const char *dir, const char *rel, const char *text) {
    char *p = k3_path_join(dir, rel);
    char *d = xstrdup(p);
    *strrchr(d, '/') = 0;
    k3_err err = {0};
    CHECK(k3_mkdir_p(d, &err) == 0);
    FILE *f = fopen(p, "w");
    CHECK(f != NULL);
    fputs(text, f);
    fclose(f);
    free(d);
    free(p);
}

static uint64_t cg_headroom(const char *dir, uint64_t *limit) {
    char *c = k3_path_join(dir, "cgroup"), *m = k3_path_join(dir, "mountinfo");
    uint64_t h = k3_cgroup_headroom(c, m, limit);
    free(c);
    free(m);
    return h;
}

TEST(cgroup_headroom_v1_ancestors_and_v2) {
    char tmpl[] = "/tmp/k3-cg-XXXXXX";
    CHECK(mkdtemp(tmpl) != NULL);
    char mi[1024];
    /* v1 memory at TMP/v1 (options before "-" vary: one optional field here),
     * v2 at TMP/v2; another controller's mount must be ignored */
    snprintf(mi, sizeof mi,
             "33 30 0:30 / %s/cpu rw,relatime - cgroup cgroup rw,cpu\n"
             "34 30 0:31 / %s/v1 rw,relatime shared:9 - cgroup cgroup rw,memory\n"
             "40 30 0:37 / %s/v2 rw,relatime - cgroup2 cgroup2 rw\n",
             tmpl, tmpl, tmpl);
    cg_put(tmpl, "mountinfo", mi);
    cg_put(tmpl, "cgroup", "3:cpu:/a\n4:memory:/a/b\n0::/x/y\n");
    cg_put(tmpl, "cpu/a/memory.limit_in_bytes", "1000\n"); /* not the memory controller */
    uint64_t lim = 1;
    CHECK(cg_headroom(tmpl, &lim) == UINT64_MAX && lim == 0); /* no limit files at all */

    /* v1: the group itself unlimited, its parent limited to 2 GB with 1.5 GB
     * used of which 0.5 GB inactive file cache: 1 GB headroom */
    cg_put(tmpl, "v1/a/b/memory.limit_in_bytes", "9223372036854771712\n");
    cg_put(tmpl, "v1/a/b/memory.usage_in_bytes", "100\n");
    cg_put(tmpl, "v1/a/memory.limit_in_bytes", "2000000000\n");
    cg_put(tmpl, "v1/a/memory.usage_in_bytes", "1500000000\n");
    cg_put(tmpl, "v1/a/memory.stat", "cache 7\ninactive_file 1\ntotal_inactive_file 500000000\n");
    cg_put(tmpl, "v1/memory.limit_in_bytes", "9223372036854771712\n");
    uint64_t h = cg_headroom(tmpl, &lim);
    CHECKF(h == 1000000000ull && lim == 2000000000ull, "%llu %llu", (unsigned long long)h, (unsigned long long)lim);

    /* v2: "max" at the group, 3 GB at its parent with 2.5 GB used: 0.5 GB wins */
    cg_put(tmpl, "v2/x/y/memory.max", "max\n");
    cg_put(tmpl, "v2/x/memory.max", "3000000000\n");
    cg_put(tmpl, "v2/x/memory.current", "2500000000\n");
    cg_put(tmpl, "v2/x/memory.stat", "anon 1\nfile 2\n");
    h = cg_headroom(tmpl, &lim);
    CHECKF(h == 500000000ull && lim == 3000000000ull, "%llu", (unsigned long long)h);

    /* usage above the limit is no headroom, not a wrap to 2^64 */
    cg_put(tmpl, "v2/x/memory.current", "3500000000\n");
    CHECK(cg_headroom(tmpl, &lim) == 0);
    /* garbage in a limit file: that group reads as unlimited, the v1 parent still binds */
    cg_put(tmpl, "v2/x/memory.max", "lots\n");
    CHECK(cg_headroom(tmpl, &lim) == 1000000000ull);
    /* a missing /proc file: no limit known */
    char *nope = k3_path_join(tmpl, "nope");
    CHECK(k3_cgroup_headroom(nope, nope, &lim) == UINT64_MAX);
    free(nope);
}

TEST(cgroup_headroom_container_mount_root) {
    char tmpl[] = "/tmp/k3-cg-XXXXXX";
    CHECK(mkdtemp(tmpl) != NULL);
    char mi[1024];
    /* a container sees its own group at the mount point: the mount's root
     * (/docker/abc) is the group's path, and the path has an escaped space */
    snprintf(mi, sizeof mi, "40 30 0:37 /docker/abc %s/c\\040g rw - cgroup2 cgroup2 rw,nsdelegate\n", tmpl);
    cg_put(tmpl, "mountinfo", mi);
    cg_put(tmpl, "cgroup", "0::/docker/abc/job\n");
    cg_put(tmpl, "c g/job/memory.max", "4000000000\n");
    cg_put(tmpl, "c g/job/memory.current", "1000000000\n");
    cg_put(tmpl, "c g/job/memory.stat", "inactive_file 250000000\nactive_file 9\n");
    cg_put(tmpl, "c g/memory.max", "8000000000\n");
    cg_put(tmpl, "c g/memory.current", "1000000000\n");
    uint64_t lim = 0, h = cg_headroom(tmpl, &lim);
    CHECKF(h == 3250000000ull && lim == 4000000000ull, "%llu", (unsigned long long)h);
    /* a path outside the mount's root (another cgroup namespace): the mount itself */
    cg_put(tmpl, "cgroup", "0::/elsewhere\n");
    h = cg_headroom(tmpl, &lim);
    CHECKF(h == 7000000000ull && lim == 8000000000ull, "%llu", (unsigned long long)h);
}

TEST(crc32c_zeros_equals_fed_zeros) {
    size_t big = 3 * 4096 * 7 + 13;
    uint8_t *z = xcalloc(big, 1);
    static const size_t lens[] = {0, 1, 7, 8, 63, 4095, 4096, 3 * 4096 + 5};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++)
        for (uint32_t c = 0; c < 3; c++) {
            uint32_t start = c * 0x9e3779b9u;
            CHECKF(k3_crc32c_zeros(start, lens[i]) == k3_crc32c(start, z, lens[i]), "len %zu", lens[i]);
        }
    CHECK(k3_crc32c_zeros(5, big) == k3_crc32c(5, z, big));
    /* a hole between data: crc(A, zeros, B) */
    const char *a = "head", *b = "tail";
    uint32_t want = k3_crc32c(k3_crc32c(k3_crc32c(0, a, 4), z, 1000), b, 4);
    CHECK(k3_crc32c(k3_crc32c_zeros(k3_crc32c(0, a, 4), 1000), b, 4) == want);
    free(z);
}
