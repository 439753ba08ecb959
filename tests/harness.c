/* harness.c: registry and runner for tests/harness.h. */
#include "harness.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>

#define MAX_TESTS 4096
#define EXIT_SKIP 77

static struct { const char *name, *file; t_fn fn; } tests[MAX_TESTS];
static int ntests;
static const char *current;

void t_register(const char *name, const char *file, t_fn fn) {
    if (ntests == MAX_TESTS) { fprintf(stderr, "harness: too many tests\n"); exit(2); }
    tests[ntests].name = name;
    tests[ntests].file = file;
    tests[ntests].fn = fn;
    ntests++;
}

static int failed_flag;

void t_fail_at(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "  %s:%d: ", file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    failed_flag = 1;
}

static bool no_fork; /* --no-fork: tests run in the runner's process */
static int skipped_flag;

void t_skip(const char *reason) {
    fprintf(stderr, "  skipped: %s\n", reason);
    fflush(NULL);
    if (no_fork) { skipped_flag = 1; return; } /* SKIP returns from the test */
    _exit(EXIT_SKIP);
}

static const char *ring(const char *a, const char *b) {
    static char bufs[8][4096];
    static int i;
    char *d = bufs[i++ & 7];
    int n = snprintf(d, 4096, "%s/%s", a, b);
    if (n < 0 || n >= 4096) { /* a cut path would name another file */
        fprintf(stderr, "harness: path %s/%s is longer than 4095 bytes\n", a, b);
        exit(1);
    }
    return d;
}

const char *t_shared(const char *rel) {
    const char *root = getenv("K3_SHARED");
    return ring(root ? root : "../shared", rel);
}

const char *t_repo(const char *rel) { return ring(".", rel); }

bool t_have(const char *path) { return access(path, F_OK) == 0; }

const char *t_no_threads(void) {
    const char *why = getenv("K3_TEST_NO_THREADS");
    return why && *why ? why : NULL;
}

static void mkdirs_for(const char *path) { /* every folder above path */
    char d[4096];
    snprintf(d, sizeof d, "%s", path);
    for (char *s = d + 1; *s; s++)
        if (*s == '/') { *s = 0; mkdir(d, 0755); *s = '/'; }
}

/* gzip -dc GZ > TMP, then rename TMP to OUT: a run killed half way, or two
 * test binaries unpacking at once, never leave a partial file under OUT. */
static bool gunzip_to(const char *gz, const char *out) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", out, (int)getpid());
    mkdirs_for(out);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return false;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, 1);
        execlp("gzip", "gzip", "-dc", "--", gz, (char *)NULL);
        _exit(127);
    }
    close(fd);
    int st = 0;
    bool ok = pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    if (ok) ok = rename(tmp, out) == 0;
    if (!ok) {
        fprintf(stderr, "  harness: cannot unpack %s (gzip)\n", gz);
        unlink(tmp);
    }
    return ok;
}

const char *t_fixture(const char *rel) {
    const char *plain = ring("tests/fixtures", rel);
    if (t_have(plain)) return plain;
    char gz[4200];
    snprintf(gz, sizeof gz, "%s.gz", plain);
    struct stat zs, os;
    if (stat(gz, &zs) != 0) return plain; /* the caller's open fails and says which file */
    const char *out = ring("tests/out/fixtures", rel);
    if (stat(out, &os) == 0 && os.st_mtime >= zs.st_mtime) return out;
    return gunzip_to(gz, out) ? out : plain;
}

const char *t_outdir(void) {
    static char d[1024];
    mkdir("tests/out", 0755);
    snprintf(d, sizeof d, "tests/out/%s", current ? current : "unknown");
    mkdir(d, 0755);
    return d;
}

static int cmp(const void *a, const void *b) {
    const typeof(tests[0]) *x = a, *y = b;
    int c = strcmp(x->file, y->file);
    return c ? c : strcmp(x->name, y->name);
}

/* Arguments: filters (run the tests whose name or file contains any of
 * them; "=NAME" matches one name exactly), and
 *   --list     print the names of the selected tests, run nothing;
 *   --no-fork  run the selected tests in this process, one after the other
 *              (no crash isolation: for emulators whose fork hangs, such as
 *              qemu-user here; scripts/test-arm64 runs one test per process).
 * No filter selects every test. */
int main(int argc, char **argv) {
    qsort(tests, (size_t)ntests, sizeof tests[0], cmp);
    bool list = false;
    int nfilt = 0;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--list")) list = true;
        else if (!strcmp(argv[a], "--no-fork")) no_fork = true;
        else argv[1 + nfilt++] = argv[a];
    }
    int pass = 0, fail = 0, skip = 0;
    for (int i = 0; i < ntests; i++) {
        if (nfilt > 0) {
            int hit = 0;
            for (int a = 1; a <= nfilt; a++)
                if (argv[a][0] == '=' ? !strcmp(tests[i].name, argv[a] + 1)
                                      : strstr(tests[i].name, argv[a]) || strstr(tests[i].file, argv[a]))
                    hit = 1;
            if (!hit) continue;
        }
        if (list) {
            printf("%s\n", tests[i].name);
            continue;
        }
        current = tests[i].name;
        fflush(NULL);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (no_fork) {
            failed_flag = skipped_flag = 0;
            tests[i].fn();
            fflush(NULL);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
            const char *verdict = failed_flag ? "FAIL" : skipped_flag ? "SKIP" : "PASS";
            if (failed_flag) fail++;
            else if (skipped_flag) skip++;
            else pass++;
            printf("%s %s (%.2fs)\n", verdict, tests[i].name, s);
            fflush(stdout);
            continue;
        }
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); return 2; }
        if (pid == 0) {
            failed_flag = 0;
            tests[i].fn();
            fflush(NULL);
            _exit(failed_flag ? 1 : 0);
        }
        int st = 0;
        waitpid(pid, &st, 0);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        const char *verdict;
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0) { verdict = "PASS"; pass++; }
        else if (WIFEXITED(st) && WEXITSTATUS(st) == EXIT_SKIP) { verdict = "SKIP"; skip++; }
        else {
            verdict = "FAIL"; fail++;
            if (WIFSIGNALED(st)) fprintf(stderr, "  killed by signal %d\n", WTERMSIG(st));
        }
        printf("%s %s (%.2fs)\n", verdict, tests[i].name, s);
        fflush(stdout);
    }
    if (list) return 0;
    printf("%d passed, %d failed, %d skipped\n", pass, fail, skip);
    return fail ? 1 : 0;
}
