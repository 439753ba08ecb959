/* test_dashboard.c: the dashboard's run-directory reader and its name checks.
 * (The HTTP side is tested against the real binary in tests/cli/test_dashboard.sh.) */
#include "harness.h"
#include "web/dashboard.h"
#include "web/http.h"

#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int open_outdir(void) { return open(t_outdir(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); }

static void write_at(const char *name, const char *text, const char *mode) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", t_outdir(), name);
    FILE *f = fopen(path, mode);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

TEST(dashboard_jsonl_partial_last_line) {
    int dfd = open_outdir();
    CHECK(dfd >= 0);
    write_at("m.jsonl", "{\"kind\":\"train\",\"step\":1,\"time\":10.5,\"train_loss\":3.5}\n{\"kind\":\"eval\",\"st", "w");
    k3_jsonl j = {.name = "m.jsonl"};
    k3_err err = {0};
    CHECK(k3_jsonl_refresh(&j, dfd, &err) == K3_OK);
    CHECKF(j.n == 1, "n=%zu", j.n);
    CHECK(j.recs[0].step == 1 && j.recs[0].kind == 't' && j.recs[0].time == 10.5);
    CHECK(strstr(j.recs[0].json, "\"train_loss\":3.5") != NULL);
    write_at("m.jsonl", "ep\":1,\"val_loss\":2.0}\n", "a");
    CHECK(k3_jsonl_refresh(&j, dfd, &err) == K3_OK);
    CHECKF(j.n == 2, "n=%zu", j.n);
    CHECK(j.recs[1].kind == 'e' && j.recs[1].step == 1);
    CHECK(j.bad_lines == 0);
    /* nothing new: nothing changes */
    CHECK(k3_jsonl_refresh(&j, dfd, &err) == K3_OK);
    CHECK(j.n == 2);
    k3_jsonl_free(&j);
    close(dfd);
}

TEST(dashboard_jsonl_bad_lines_and_kinds) {
    int dfd = open_outdir();
    CHECK(dfd >= 0);
    write_at("m.jsonl",
             "not json\n"
             "[1,2]\n"
             "{\"step\":-1}\n"
             "{\"step\":\"3\"}\n"
             "\n"
             "{\"step\":2,\"train_loss\":1}\r\n"
             "{\"step\":3,\"val_loss\":1}\n"
             "{\"step\":4,\"text\":\"hi\"}\n"
             "{\"step\":5,\"kind\":\"other\"}\n"
             "{\"step\":6,\"expert_load\":[{\"layer\":0}],\"kind\":\"train\"}\n",
             "w");
    k3_jsonl j = {.name = "m.jsonl", .strip_loads = true};
    k3_err err = {0};
    CHECK(k3_jsonl_refresh(&j, dfd, &err) == K3_OK);
    CHECKF(j.bad_lines == 4, "bad=%zu", j.bad_lines);
    CHECKF(j.n == 5, "n=%zu", j.n);
    CHECK(j.recs[0].kind == 't' && j.recs[1].kind == 'e' && j.recs[2].kind == 's' && j.recs[3].kind == '?');
    CHECK(strstr(j.recs[4].json, "expert_load") == NULL);
    k3_jsonl_free(&j);
    close(dfd);
}

TEST(dashboard_jsonl_replaced_truncated_missing) {
    int dfd = open_outdir();
    CHECK(dfd >= 0);
    write_at("m.jsonl", "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n", "w");
    k3_jsonl j = {.name = "m.jsonl"};
    k3_err err = {0};
    CHECK(k3_jsonl_refresh(&j, dfd, &err) == K3_OK && j.n == 3);
    /* replaced by rename (a resumed run): a new inode, read from the start */
    write_at("m.tmp", "{\"step\":1,\"x\":9}\n", "w");
    CHECK(renameat(dfd, "m.tmp", dfd, "m.jsonl") == 0);
    CHECK(k3_jsonl_refresh(&j, dfd, &err) == K3_OK);
    CHECKF(j.n == 1 && strstr(j.recs[0].json, "\"x\":9"), "n=%zu", j.n);
    /* truncated in place and rewritten shorter */
    write_at("m.jsonl", "{\"step\":7}\n", "w");
    CHECK(k3_jsonl_refresh(&j, dfd, &err) == K3_OK);
    CHECKF(j.n == 1 && j.recs[0].step == 7, "n=%zu", j.n);
    /* removed: empty, not an error */
    CHECK(unlinkat(dfd, "m.jsonl", 0) == 0);
    CHECK(k3_jsonl_refresh(&j, dfd, &err) == K3_OK && j.n == 0 && !j.exists);
    k3_jsonl_free(&j);
    close(dfd);
}

TEST(dashboard_jsonl_refuses_symlink_and_directory) {
    int dfd = open_outdir();
    CHECK(dfd >= 0);
    write_at("real.jsonl", "{\"step\":1}\n", "w");
    unlinkat(dfd, "link.jsonl", 0);
    CHECK(symlinkat("real.jsonl", dfd, "link.jsonl") == 0);
    k3_jsonl j = {.name = "link.jsonl"};
    k3_err err = {0};
    CHECK(k3_jsonl_refresh(&j, dfd, &err) != K3_OK);
    CHECK(strstr(err.msg, "symbolic link") != NULL);
    CHECK(j.n == 0);
    mkdirat(dfd, "dir.jsonl", 0755);
    k3_jsonl d = {.name = "dir.jsonl"};
    CHECK(k3_jsonl_refresh(&d, dfd, &err) != K3_OK);
    CHECK(strstr(err.msg, "not a regular file") != NULL);
    k3_jsonl_free(&j);
    k3_jsonl_free(&d);
    close(dfd);
}

TEST(dashboard_jsonl_overlong_line_skipped) {
    int dfd = open_outdir();
    CHECK(dfd >= 0);
    char path[1024];
    snprintf(path, sizeof path, "%s/big.jsonl", t_outdir());
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs("{\"step\":1}\n{\"step\":2,\"pad\":\"", f);
    for (int i = 0; i < (9 << 20) / 64; i++) fputs("0123456789012345678901234567890123456789012345678901234567890123", f);
    fputs("\"}\n{\"step\":3}\n", f);
    fclose(f);
    k3_jsonl j = {.name = "big.jsonl"};
    k3_err err = {0};
    CHECK(k3_jsonl_refresh(&j, dfd, &err) == K3_OK);
    CHECKF(j.n == 2 && j.recs[0].step == 1 && j.recs[1].step == 3, "n=%zu", j.n);
    CHECK(j.bad_lines == 1);
    k3_jsonl_free(&j);
    close(dfd);
}

TEST(dashboard_file_names) {
    CHECK(strcmp(k3_dashboard_file_type("loss.svg"), "image/svg+xml") == 0);
    CHECK(k3_dashboard_file_type("state.json") != NULL);
    CHECK(k3_dashboard_file_type("metrics.jsonl") != NULL);
    static const char *const refused[] = {
        "", ".", "..", "../state.json", "a/b.json", "/etc/passwd", ".hidden.txt", "x..json",
        "latest.safetensors", "noext", "a b.txt", "a%2e.txt", "a\\b.txt", "state.json.tmp.123",
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        CHECKF(k3_dashboard_file_type(refused[i]) == NULL, "accepted '%s'", refused[i]);
}

TEST(dashboard_loopback) {
    CHECK(k3_http_is_loopback("127.0.0.1"));
    CHECK(k3_http_is_loopback("127.1.2.3"));
    CHECK(k3_http_is_loopback("::1"));
    CHECK(k3_http_is_loopback("localhost"));
    CHECK(k3_http_is_loopback("LOCALHOST"));
    CHECK(!k3_http_is_loopback("0.0.0.0"));
    CHECK(!k3_http_is_loopback("::"));
    CHECK(!k3_http_is_loopback("10.0.0.1"));
    CHECK(!k3_http_is_loopback("example.com"));
    CHECK(!k3_http_is_loopback("128.0.0.1"));
}
