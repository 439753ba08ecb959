/* cmd_verify.c: `k3 verify MODEL_DIR [--sha256 MANIFEST]`: checks a model
 * directory end to end without running it. Every shard's header is validated
 * again against the file as it is now (byte ranges inside the data section,
 * equal to dtype x shape, no overlaps), the config is checked against the
 * index, and every shard's SHA-256 (nettle) is computed with a progress bar:
 * compared with MANIFEST (the sha256sum format, "<hex>  <file>", file names
 * relative to MODEL_DIR), or, without one, written as a manifest (atomically)
 * for the next check. */
#include "cli/commands.h"
#include "formats/config.h"
#include "formats/safetensors.h"

#include <errno.h>
#include <nettle/sha2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *const cmd_verify_help =
    "usage: k3 verify MODEL_DIR [--sha256 MANIFEST] [--write FILE] [--quiet]\n"
    "\n"
    "Checks a model directory without running it:\n"
    "  - every shard's header against the file as it is now: each tensor's byte\n"
    "    range inside the data section and equal to dtype size x shape, no two\n"
    "    tensors overlapping, every dtype one k3 reads;\n"
    "  - config.json (when present) against the index: the embedding and head\n"
    "    shapes, MXFP4 expert dims;\n"
    "  - every shard's SHA-256, with a progress bar on a terminal.\n"
    "\n"
    "  --sha256 MANIFEST  compare with MANIFEST, in the format of sha256sum\n"
    "                     (\"<64 hex digits>  <file>\" per line, file relative to\n"
    "                     MODEL_DIR, '*' before the name allowed). Every shard\n"
    "                     must be listed; other listed files are checked too;\n"
    "                     a file listed twice with different digests is an\n"
    "                     error (exit 2)\n"
    "  --write FILE       without --sha256: where to write the manifest\n"
    "                     (default MODEL_DIR/SHA256SUMS), atomically\n"
    "  --quiet            only errors\n"
    "\n"
    "Without --sha256 the computed digests are written as a manifest, so that a\n"
    "later `k3 verify MODEL_DIR --sha256 MODEL_DIR/SHA256SUMS` (or sha256sum -c)\n"
    "checks the same files.\n"
    "\n"
    "exit codes: 0 ok, 1 I/O error, 2 usage or malformed manifest, 4 a check\n"
    "failed (digest mismatch, file missing or not listed, bad header or range)\n";

typedef struct {
    char *name;      /* relative to MODEL_DIR */
    char hex[65];
    bool seen;
} entry;

static bool is_hex64(const char *s) {
    for (int i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f') || (s[i] >= 'A' && s[i] <= 'F')))
            return false;
    return true;
}

static int read_manifest(const char *path, entry **out, size_t *n, k3_err *err) {
    char *text;
    size_t len;
    int rc = k3_read_file(path, &text, &len, err);
    if (rc) return rc;
    size_t cap = 16, cnt = 0;
    entry *es = xmalloc_array(cap, sizeof *es);
    size_t lineno = 0;
    for (char *line = text, *next; line && *line; line = next) {
        lineno++;
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        size_t l = strlen(line);
        if (l && line[l - 1] == '\r') line[--l] = 0;
        if (!l || line[0] == '#') continue;
        /* "<hex>  <name>" (text mode) or "<hex> *<name>" (binary mode) */
        if (l < 67 || !is_hex64(line) || line[64] != ' ' || (line[65] != ' ' && line[65] != '*') || !line[66]) {
            rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: not a sha256sum line (\"<64 hex digits>  <file>\")", path,
                         lineno);
            break;
        }
        if (cnt == cap) es = xrealloc_array(es, cap *= 2, sizeof *es);
        memcpy(es[cnt].hex, line, 64);
        es[cnt].hex[64] = 0;
        for (int i = 0; i < 64; i++)
            if (es[cnt].hex[i] >= 'A' && es[cnt].hex[i] <= 'F') es[cnt].hex[i] += 'a' - 'A';
        /* sha256sum -c checks every line: two digests for one file cannot
         * both match. The same line twice is harmless and checked once. */
        bool dup = false;
        for (size_t j = 0; j < cnt && !dup && !rc; j++) {
            if (strcmp(es[j].name, line + 66)) continue;
            if (strcmp(es[j].hex, es[cnt].hex))
                rc = k3_fail(err, K3_EXIT_USAGE, "%s:%zu: %s is listed again with another digest", path, lineno,
                             line + 66);
            dup = true;
        }
        if (rc) break;
        if (dup) continue;
        es[cnt].name = xstrdup(line + 66);
        es[cnt].seen = false;
        cnt++;
    }
    free(text);
    if (rc) {
        for (size_t i = 0; i < cnt; i++) free(es[i].name);
        free(es);
        return rc;
    }
    *out = es;
    *n = cnt;
    return K3_OK;
}

/* SHA-256 of a file as lowercase hex; the bar advances by its bytes. */
static int sha256_file(const char *path, char hex[65], k3_progress *pb, uint64_t *done, k3_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return k3_fail(err, errno == ENOENT ? K3_EXIT_DATA : K3_EXIT_RUNTIME, "%s: cannot open: %s", path,
                           strerror(errno));
    struct sha256_ctx c;
    sha256_init(&c);
    const size_t B = 4u << 20;
    uint8_t *buf = xmalloc(B);
    size_t got;
    while ((got = fread(buf, 1, B, f)) > 0) {
        sha256_update(&c, got, buf);
        *done += got;
        k3_progress_update(pb, *done);
    }
    int bad = ferror(f);
    int e = errno;
    fclose(f);
    free(buf);
    if (bad) return k3_fail(err, K3_EXIT_RUNTIME, "%s: read error: %s", path, strerror(e));
    uint8_t d[SHA256_DIGEST_SIZE];
    sha256_digest(&c, SHA256_DIGEST_SIZE, d);
    for (int i = 0; i < SHA256_DIGEST_SIZE; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
    return K3_OK;
}

static const char *base_name(const char *p) {
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

/* The header checks again, against the file size now (st_open checked them
 * when it indexed; a file may have changed since, and this is the report). */
static int check_ranges(st_index *ix, k3_err *err) {
    for (int s = 0; s < st_nshards(ix); s++) {
        const st_shard *sh = st_shard_at(ix, s);
        struct stat st;
        if (stat(sh->path, &st) != 0) return k3_fail(err, K3_EXIT_DATA, "%s: %s", sh->path, strerror(errno));
        if ((uint64_t)st.st_size != sh->file_size)
            return k3_fail(err, K3_EXIT_DATA, "%s: file changed size while being checked", sh->path);
    }
    uint64_t prev_end = 0;
    int prev_shard = -1;
    for (size_t i = 0; i < st_count(ix); i++) {
        const st_tensor *t = st_at(ix, i);
        const st_shard *sh = st_shard_at(ix, t->shard);
        if (t->shard != prev_shard) prev_end = sh->data_start, prev_shard = t->shard;
        if ((int)t->dtype < 0 || t->dtype >= ST_NDTYPES)
            return k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s' has an unknown dtype", sh->path, t->name);
        uint64_t want;
        if (!k3_mul_ok((uint64_t)t->numel, st_dtype_size(t->dtype), &want) || want != t->nbytes)
            return k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': %llu bytes for %s x %lld elements", sh->path, t->name,
                           (unsigned long long)t->nbytes, st_dtype_name(t->dtype), (long long)t->numel);
        if (t->offset < sh->data_start || t->offset + t->nbytes < t->offset || t->offset + t->nbytes > sh->file_size)
            return k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s': bytes [%llu, %llu) outside the data section [%llu, %llu)",
                           sh->path, t->name, (unsigned long long)t->offset, (unsigned long long)(t->offset + t->nbytes),
                           (unsigned long long)sh->data_start, (unsigned long long)sh->file_size);
        if (t->offset < prev_end)
            return k3_fail(err, K3_EXIT_DATA, "%s: tensor '%s' overlaps the tensor before it", sh->path, t->name);
        prev_end = t->offset + t->nbytes;
    }
    return K3_OK;
}

static int verify(const char *dir, const char *manifest, const char *write_to, bool quiet, k3_err *err) {
    char def[4200];
    if (!manifest && !write_to) {
        if (snprintf(def, sizeof def, "%s/SHA256SUMS", dir) >= (int)sizeof def)
            return k3_fail(err, K3_EXIT_USAGE, "%s: path too long", dir);
        write_to = def;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return k3_fail(err, K3_EXIT_USAGE, "%s: not a model directory", dir);
    int rc;
    if (write_to && (rc = k3_check_output_path(write_to, "--write", err))) return rc;
    entry *es = NULL;
    size_t nes = 0;
    if (manifest && (rc = read_manifest(manifest, &es, &nes, err))) return rc;
    st_index *ix = NULL;
    if ((rc = st_open(dir, &ix, err))) goto out;
    if ((rc = check_ranges(ix, err))) goto out;
    char cpath[4200];
    snprintf(cpath, sizeof cpath, "%s/config.json", dir);
    bool has_config = stat(cpath, &st) == 0;
    if (has_config) {
        k3_config cfg;
        if ((rc = k3_config_load(dir, &cfg, err))) goto out;
        if ((rc = k3_config_check_index(&cfg, ix, err))) goto out;
    }
    if (!quiet)
        printf("%s: %d shards, %zu tensors: byte ranges and dtypes ok%s\n", dir, st_nshards(ix), st_count(ix),
               has_config ? "; config matches the index" : "");

    /* what to hash: every shard, and whatever else the manifest lists */
    size_t nfiles = (size_t)st_nshards(ix);
    char **files = xcalloc(nfiles + nes + 1, sizeof *files);
    for (int s = 0; s < st_nshards(ix); s++) files[s] = xstrdup(base_name(st_shard_at(ix, s)->path));
    for (size_t i = 0; i < nes; i++) {
        bool shard = false;
        for (size_t s = 0; s < (size_t)st_nshards(ix) && !shard; s++) shard = !strcmp(files[s], es[i].name);
        if (!shard) files[nfiles++] = xstrdup(es[i].name);
    }
    uint64_t total = 0, done = 0;
    for (size_t f = 0; f < nfiles; f++) {
        char *p = k3_path_join(dir, files[f]);
        if (stat(p, &st) == 0) total += (uint64_t)st.st_size;
        free(p);
    }
    k3_progress pb;
    k3_progress_start(&pb, "sha256", total, true);
    if (quiet) pb.enabled = false;
    char (*hex)[65] = xcalloc(nfiles ? nfiles : 1, sizeof *hex);
    for (size_t f = 0; f < nfiles && !rc; f++) {
        char *p = k3_path_join(dir, files[f]);
        rc = sha256_file(p, hex[f], &pb, &done, err);
        free(p);
    }
    if (!rc) k3_progress_finish(&pb);
    size_t checked = 0;
    if (!rc && manifest) {
        for (size_t f = 0; f < nfiles && !rc; f++) {
            entry *e = NULL;
            for (size_t i = 0; i < nes && !e; i++)
                if (!strcmp(es[i].name, files[f])) e = &es[i];
            if (!e) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s/%s: shard is not in the manifest %s", dir, files[f], manifest);
                break;
            }
            if (strcmp(e->hex, hex[f]) != 0) {
                rc = k3_fail(err, K3_EXIT_DATA, "%s/%s: sha256 %s, the manifest says %s", dir, files[f], hex[f], e->hex);
                break;
            }
            checked++;
        }
        if (!rc && !quiet)
            printf("%s: sha256 of %zu files (%s) matches %s\n", dir, checked, k3_size_str(total), manifest);
    } else if (!rc) {
        size_t cap = nfiles * 80 + 16, o = 0;
        for (size_t f = 0; f < nfiles; f++) cap += strlen(files[f]);
        char *text = xmalloc(cap);
        for (size_t f = 0; f < nfiles; f++) o += (size_t)snprintf(text + o, cap - o, "%s  %s\n", hex[f], files[f]);
        rc = k3_write_file_atomic(write_to, text, o, err);
        free(text);
        if (!rc && !quiet)
            printf("%s: sha256 of %zu shards (%s) written to %s\n", dir, nfiles, k3_size_str(total), write_to);
    }
    for (size_t f = 0; f < nfiles; f++) free(files[f]);
    free(files);
    free(hex);
out:
    st_close(ix);
    for (size_t i = 0; i < nes; i++) free(es[i].name);
    free(es);
    return rc;
}

int cmd_verify(int argc, char **argv) {
    const char *dir = NULL, *manifest = NULL, *write_to = NULL;
    bool quiet = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--sha256") || !strcmp(a, "--write")) {
            if (i + 1 >= argc) return k3_usage_error("verify", "%s needs a value", a);
            if (!strcmp(a, "--sha256")) manifest = argv[++i];
            else write_to = argv[++i];
        } else if (!strcmp(a, "--quiet")) {
            quiet = true;
        } else if (a[0] == '-' && a[1]) {
            return k3_usage_error("verify", "unknown option '%s'", a);
        } else if (dir) {
            return k3_usage_error("verify", "unexpected argument '%s'", a);
        } else {
            dir = a;
        }
    }
    if (!dir) return k3_usage_error("verify", "no MODEL_DIR given");
    if (manifest && write_to) return k3_usage_error("verify", "--sha256 checks, --write writes: give one");
    k3_err err = {0};
    int rc = verify(dir, manifest, write_to, quiet, &err);
    return rc ? k3_report(&err) : K3_OK;
}
