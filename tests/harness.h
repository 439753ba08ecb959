/* harness.h: the unit-test frame. Each TEST registers itself at start-up; the
 * runner forks one process per test (a crash fails that test, not the run) and
 * ends with "N passed, N failed, N skipped".
 *
 *   TEST(rmsnorm_matches_peer) {
 *       CHECK(x == 1);
 *       CHECKF(err < tol, "row %d: err %g", r, err);
 *   }
 *
 * Paths: t_fixture("peer/ops/rmsnorm.json") is tests/fixtures/peer/ops/rmsnorm.json,
 * or, for a fixture committed compressed as REL.gz, its copy unpacked once into
 * tests/out/fixtures/REL; t_repo("configs/...") resolves inside the repository
 * root; t_shared("docs/...") inside ../shared (or $K3_SHARED), only for the few
 * checks whose input may not be committed, which SKIP without it (t_have);
 * t_outdir() is a scratch directory for this test (tests/out/<test name>).
 * A test that starts threads of its own begins with NEEDS_THREADS(): where
 * the environment says threads cannot run (K3_TEST_NO_THREADS holds the
 * reason, as under an emulator that stalls on them) it skips with that reason. */
#ifndef K3_TEST_HARNESS_H
#define K3_TEST_HARNESS_H

#include <stdbool.h>
#include <stdio.h>

typedef void (*t_fn)(void);
void t_register(const char *name, const char *file, t_fn fn);
void t_fail_at(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void t_skip(const char *reason);
/* t_fixture, t_shared and t_repo return a static buffer ring: valid for a few calls */
const char *t_fixture(const char *rel);
const char *t_shared(const char *rel);
bool t_have(const char *path); /* the file exists */
const char *t_repo(const char *rel);
const char *t_outdir(void);
const char *t_no_threads(void); /* K3_TEST_NO_THREADS, or NULL */

#define TEST(name)                                                       \
    static void name(void);                                              \
    __attribute__((constructor)) static void t_reg_##name(void) {        \
        t_register(#name, __FILE__, name);                               \
    }                                                                    \
    static void name(void)

#define CHECK(cond)                                                      \
    do {                                                                 \
        if (!(cond)) { t_fail_at(__FILE__, __LINE__, "%s", #cond); return; } \
    } while (0)

#define CHECKF(cond, ...)                                                \
    do {                                                                 \
        if (!(cond)) { t_fail_at(__FILE__, __LINE__, __VA_ARGS__); return; } \
    } while (0)

#define SKIP(reason) do { t_skip(reason); return; } while (0)

#define NEEDS_THREADS()                                                  \
    do {                                                                 \
        if (t_no_threads()) SKIP(t_no_threads());                        \
    } while (0)

#endif
