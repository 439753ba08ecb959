/* Tests for formats/safetensors: the peer's edge-case shards (values checked
 * against numpy/torch widening in tests/fixtures/formats/st_expect.json, made
 * by tools/gen_st_expect.py), and malformed files generated here, each of
 * which must be refused with the right code and a message naming the file. */
#include "harness.h"
#include "tjson.h"
#include "formats/safetensors.h"

#include <inttypes.h>
#include <malloc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PEER_ST "peer/st"

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(data, 1, n, f);
    fclose(f);
}

/* A safetensors file: 8-byte length, the header text, then ndata bytes of
 * pattern. hlen_override (if nonzero) is written instead of strlen(header). */
static void write_st(const char *path, const char *header, size_t ndata, uint64_t hlen_override) {
    size_t hl = strlen(header);
    size_t n = 8 + hl + ndata;
    unsigned char *b = malloc(n);
    uint64_t v = hlen_override ? hlen_override : hl;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
    memcpy(b + 8, header, hl);
    for (size_t i = 0; i < ndata; i++) b[8 + hl + i] = (unsigned char)(i * 7 + 1);
    write_bytes(path, b, n);
    free(b);
}

static char *outpath(const char *name) {
    static char buf[4][1024];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, sizeof buf[0], "%s/%s", t_outdir(), name);
    return p;
}

TEST(st_peer_two_shards_index) {
    st_index *ix = NULL;
    k3_err err = {0};
    int rc = st_open(t_fixture(PEER_ST), &ix, &err);
    CHECKF(rc == 0, "%s", err.msg);
    CHECK(st_nshards(ix) == 2);
    CHECK(st_count(ix) == 13); /* __metadata__ is not a tensor */
    CHECK(st_shard_at(ix, 0)->ntensors == 10 && st_shard_at(ix, 1)->ntensors == 3);
    CHECK(st_metadata(ix, 0, "format") && strcmp(st_metadata(ix, 0, "format"), "pt") == 0);
    CHECK(st_metadata(ix, 1, "format") == NULL);
    const st_tensor *t = st_find(ix, "scalar.f32");
    CHECK(t && t->rank == 0 && t->numel == 1 && t->nbytes == 4 && t->dtype == ST_F32);
    t = st_find(ix, "empty.f32");
    CHECK(t && t->rank == 2 && t->shape[0] == 0 && t->shape[1] == 8 && t->numel == 0 && t->nbytes == 0);
    t = st_find(ix, "rank4.u8");
    CHECK(t && t->rank == 4 && t->numel == 16);
    t = st_find(ix, "weird\\name.\"with\"quotes");
    CHECK(t && t->shard == 1 && t->numel == 3);
    CHECK(st_find(ix, "__metadata__") == NULL);
    CHECK(st_find(ix, "plain.f32") == NULL);
    /* absolute offsets: data_start + relative begin */
    t = st_find(ix, "plain.bf16.1d");
    CHECK(t && t->offset == st_shard_at(ix, 0)->data_start + 1024 && t->nbytes == 256);
    /* st_at is shard-then-offset order */
    for (size_t i = 1; i < st_count(ix); i++) {
        const st_tensor *a = st_at(ix, i - 1), *b = st_at(ix, i);
        CHECK(a->shard < b->shard || (a->shard == b->shard && a->offset <= b->offset));
    }
    st_close(ix);
}

/* Compares every float tensor, widened through mmap and through pread
 * (O_DIRECT on and off), against the independently computed bit patterns. */
TEST(st_peer_values_widen_exactly) {
    json_t *want = tj_load(t_repo("tests/fixtures/formats/st_expect.json"));
    CHECK(want);
    st_index *ix = NULL;
    k3_err err = {0};
    CHECKF(st_open(t_fixture(PEER_ST), &ix, &err) == 0, "%s", err.msg);
    int checked = 0;
    for (int direct = 0; direct < 2; direct++) {
        st_set_direct(ix, direct);
        const char *name;
        json_t *w;
        json_object_foreach(want, name, w) {
            const st_tensor *t = st_find(ix, name);
            CHECKF(t, "missing %s", name);
            json_t *bits = json_object_get(w, "f32_bits");
            if (!bits) {
                /* U8: raw bytes through st_read and st_data */
                const char *hex = json_string_value(json_object_get(w, "bytes"));
                CHECK(hex && strlen(hex) == 2 * t->nbytes);
                unsigned char *buf = malloc(t->nbytes + 1);
                CHECK(st_read(ix, t, buf, &err) == 0);
                const unsigned char *m = st_data(ix, t, &err);
                CHECK(m);
                for (size_t i = 0; i < t->nbytes; i++) {
                    unsigned v;
                    sscanf(hex + 2 * i, "%2x", &v);
                    CHECKF(buf[i] == v && m[i] == v, "%s byte %zu", name, i);
                }
                free(buf);
                continue;
            }
            size_t n = json_array_size(bits);
            CHECKF((int64_t)n == t->numel, "%s: %zu values, numel %lld", name, n, (long long)t->numel);
            float *f = malloc((n ? n : 1) * sizeof *f);
            CHECKF(st_read_f32(ix, t, f, &err) == 0, "%s", err.msg);
            const unsigned char *m = st_data(ix, t, &err);
            CHECK(m);
            for (size_t i = 0; i < n; i++) {
                uint32_t wb = (uint32_t)json_integer_value(json_array_get(bits, i)), gb, mb;
                memcpy(&gb, &f[i], 4);
                float mf;
                if (t->dtype == ST_F32) memcpy(&mf, m + 4 * i, 4);
                else {
                    uint16_t h;
                    memcpy(&h, m + 2 * i, 2);
                    mf = t->dtype == ST_BF16 ? k3_bf16_to_f32(h) : k3_f16_to_f32(h);
                }
                memcpy(&mb, &mf, 4);
                CHECKF(gb == wb && mb == wb, "%s[%zu]: pread 0x%08x mmap 0x%08x want 0x%08x", name, i, gb, mb, wb);
                checked++;
            }
            free(f);
        }
    }
    CHECK(checked > 500);
    st_close(ix);
    json_decref(want);
}

TEST(st_single_file_and_buffer_check) {
    st_index *ix = NULL;
    k3_err err = {0};
    const char *p = t_fixture(PEER_ST "/model-00002-of-00002.safetensors");
    char path[1024];
    snprintf(path, sizeof path, "%s", p);
    CHECKF(st_open(path, &ix, &err) == 0, "%s", err.msg);
    CHECK(st_count(ix) == 3 && st_nshards(ix) == 1);
    st_close(ix);
    char *data;
    size_t n;
    st_buffer_info a;
    CHECK(k3_read_file(path, &data, &n, &err) == 0);
    CHECK(st_check_buffer(data, n, "buf", false, &a, &err) == 0 && a.ntensors == 3);
    CHECK(st_check_buffer(data, n - 1, "buf", false, &a, &err) == K3_EXIT_DATA);
    free(data);
}

/* The fast scanner and jansson read the peer shards identically; the shard
 * with an escaped name is declined by the scanner and read by jansson. */
TEST(st_fast_scanner_agrees_with_jansson) {
    const char *files[2] = {PEER_ST "/model-00001-of-00002.safetensors", PEER_ST "/model-00002-of-00002.safetensors"};
    for (int i = 0; i < 2; i++) {
        char *data;
        size_t n;
        k3_err err = {0};
        CHECK(k3_read_file(t_fixture(files[i]), &data, &n, &err) == 0);
        st_buffer_info a, b;
        CHECKF(st_check_buffer(data, n, "f", false, &a, &err) == 0, "%s", err.msg);
        CHECKF(st_check_buffer(data, n, "f", true, &b, &err) == 0, "%s", err.msg);
        free(data);
        CHECK(a.ntensors == b.ntensors && a.digest == b.digest && a.nmeta == b.nmeta && !b.fast);
        CHECK(a.fast == (i == 0)); /* shard 2 holds weird\\name."with"quotes */
        CHECK(a.nmeta == (i == 0 ? 2 : 0));
    }
}

/* One malformed case: a directory holding just this file must be refused. */
typedef struct {
    const char *label, *header;
    size_t ndata;
    uint64_t hlen;
    int code;
    const char *msg;
} bad_case;

TEST(st_malformed_files_refused) {
    static const bad_case cases[] = {
        {"truncated_header", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 0, 500, K3_EXIT_DATA, "runs past the end"},
        {"hlen_past_eof", "{}", 0, 1ull << 40, K3_EXIT_DATA, "runs past the end"},
        {"hlen_tiny", "{}", 0, 1, K3_EXIT_DATA, "implausible header length"},
        {"bad_json", "{\"a\":{\"dtype\":\"F32\",\"sha", 0, 0, K3_EXIT_DATA, "bad safetensors header"},
        {"not_object", "[1,2,3]", 0, 0, K3_EXIT_DATA, "not a JSON object"},
        {"oob", "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, 0, K3_EXIT_DATA, "past the data section"},
        {"overlap", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, 0, K3_EXIT_DATA, "overlap"},
        {"gap", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, 0, K3_EXIT_DATA, "gap"},
        {"trailing", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, 0, K3_EXIT_DATA, "trailing bytes"},
        {"unknown_dtype", "{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[0,4]}}", 4, 0, K3_EXIT_DATA, "unknown dtype 'F8_E4M3'"},
        {"shape_mismatch", "{\"a\":{\"dtype\":\"BF16\",\"shape\":[3,3],\"data_offsets\":[0,16]}}", 16, 0, K3_EXIT_DATA, "needs 18"},
        {"rank9", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1, 0, K3_EXIT_DATA, "rank 9"},
        {"negative_dim", "{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}", 1, 0, K3_EXIT_DATA, "shape[0]"},
        {"overflow", "{\"a\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8, 0, K3_EXIT_DATA, "overflows"},
        {"reversed_offsets", "{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4, 0, K3_EXIT_DATA, "begin <= end"},
        {"extra_key", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1}}", 1, 0, K3_EXIT_DATA, "unexpected key 'x'"},
        {"dup_in_header", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2, 0, K3_EXIT_DATA, "duplicate"},
        {"non_utf8_name", "{\"a\xff\xfe\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, 0, K3_EXIT_DATA, "bad safetensors header"},
        {"lone_surrogate", "{\"a\\ud800\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, 0, K3_EXIT_DATA, "bad safetensors header"},
        {"meta_not_strings", "{\"__metadata__\":{\"k\":1}}", 0, 0, K3_EXIT_DATA, "__metadata__"},
    };
    for (size_t ii = 0; ii < 2 * sizeof cases / sizeof cases[0]; ii++) {
        size_t i = ii % (sizeof cases / sizeof cases[0]);
        setenv("K3_ST_JANSSON", ii >= sizeof cases / sizeof cases[0] ? "1" : "0", 1);
        const bad_case *c = &cases[i];
        char dir[1024], file[1100];
        snprintf(dir, sizeof dir, "%s/%s", t_outdir(), c->label);
        mkdir(dir, 0755);
        snprintf(file, sizeof file, "%s/model.safetensors", dir);
        write_st(file, c->header, c->ndata, c->hlen);
        st_index *ix = NULL;
        k3_err err = {0};
        int rc = st_open(dir, &ix, &err);
        CHECKF(rc == c->code, "%s: rc %d want %d (%s)", c->label, rc, c->code, err.msg);
        CHECKF(ix == NULL, "%s: index returned on error", c->label);
        CHECKF(strstr(err.msg, file) && strstr(err.msg, c->msg), "%s: message '%s' lacks file or '%s'",
               c->label, err.msg, c->msg);
        CHECKF(!strchr(err.msg, '\n'), "%s: multi-line message", c->label);
    }
    unsetenv("K3_ST_JANSSON");
}

TEST(st_zero_byte_file_missing_path_empty_dir) {
    k3_err err = {0};
    st_index *ix = NULL;
    char *d = outpath("zero");
    mkdir(d, 0755);
    char f[1100];
    snprintf(f, sizeof f, "%s/model.safetensors", d);
    write_bytes(f, "", 0);
    CHECK(st_open(d, &ix, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "0 bytes") && strstr(err.msg, f), "%s", err.msg);
    char *e = outpath("empty");
    mkdir(e, 0755);
    CHECK(st_open(e, &ix, &err) == K3_EXIT_USAGE);
    CHECKF(strstr(err.msg, "no *.safetensors"), "%s", err.msg);
    CHECK(st_open(outpath("does-not-exist"), &ix, &err) == K3_EXIT_USAGE);
    CHECK(ix == NULL);
}

static const char *SH1 = "{\"x\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}";
static const char *SH2 = "{\"y\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]}}";

static void two_shards(const char *dir, const char *h2) {
    mkdir(dir, 0755);
    char f[1100];
    snprintf(f, sizeof f, "%s/model-00001-of-000002.safetensors", dir);
    write_st(f, SH1, 2, 0);
    snprintf(f, sizeof f, "%s/model-00002-of-000002.safetensors", dir);
    write_st(f, h2, 3, 0);
}

static int open_with_index(const char *dir, const char *index_json, k3_err *err) {
    static int k;
    setenv("K3_ST_JANSSON", (k++ & 1) ? "1" : "0", 1); /* alternate the two parsers */
    char f[1100];
    snprintf(f, sizeof f, "%s/model.safetensors.index.json", dir);
    if (index_json) write_bytes(f, index_json, strlen(index_json));
    else unlink(f);
    st_index *ix = NULL;
    int rc = st_open(dir, &ix, err);
    st_close(ix);
    return rc;
}

TEST(st_duplicate_across_shards) {
    char *d = outpath("dup");
    two_shards(d, "{\"x\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]}}");
    k3_err err = {0};
    CHECK(open_with_index(d, NULL, &err) == K3_EXIT_DATA);
    CHECKF(strstr(err.msg, "'x' is also in") && strstr(err.msg, "model-00001-of-000002"), "%s", err.msg);
}

TEST(st_index_json_cross_checked) {
    char *d = outpath("ixj");
    two_shards(d, SH2);
    k3_err err = {0};
    const char *good = "{\"metadata\":{\"total_size\":5},\"weight_map\":{"
                       "\"x\":\"model-00001-of-000002.safetensors\",\"y\":\"model-00002-of-000002.safetensors\"}}";
    CHECKF(open_with_index(d, good, &err) == 0, "%s", err.msg);
    CHECKF(open_with_index(d, good, &err) == 0, "%s", err.msg);
    /* alt: the message of the other parser where the two word it differently */
    struct { const char *json, *msg, *alt; } bad[] = {
        {"{\"weight_map\":{\"x\":\"model-00001-of-000002.safetensors\",\"y\":\"model-00003-of-000002.safetensors\"}}", "not in the directory", NULL},
        {"{\"weight_map\":{\"x\":\"model-00001-of-000002.safetensors\",\"y\":\"model-00002-of-000002.safetensors\",\"z\":\"model-00002-of-000002.safetensors\"}}", "names tensor 'z'", NULL},
        {"{\"weight_map\":{\"x\":\"model-00002-of-000002.safetensors\",\"y\":\"model-00002-of-000002.safetensors\"}}", "maps 'x'", NULL},
        {"{\"weight_map\":{\"x\":\"model-00001-of-000002.safetensors\"}}", "does not list tensor 'y'", NULL},
        {"{\"metadata\":{\"total_size\":6},\"weight_map\":{\"x\":\"model-00001-of-000002.safetensors\",\"y\":\"model-00002-of-000002.safetensors\"}}", "total_size 6", NULL},
        {"{\"weight_map\":[]}", "no weight_map", NULL},
        {"{\"weight_map\":{", "bad JSON", NULL},
        {"{\"weight_map\":{\"x\":\"model-00001-of-000002.safetensors\",\"x\":\"model-00001-of-000002.safetensors\"}}", "lists tensor 'x' twice",
         "duplicate object key near '\"x\"'"},
    };
    for (size_t i = 0; i < 2 * sizeof bad / sizeof bad[0]; i++) {
        size_t j = i / 2;
        memset(&err, 0, sizeof err);
        int rc = open_with_index(d, bad[j].json, &err);
        CHECKF(rc == K3_EXIT_DATA, "case %zu: rc %d (%s)", i, rc, err.msg);
        CHECKF(strstr(err.msg, "model.safetensors.index.json") &&
                   (strstr(err.msg, bad[j].msg) || (bad[j].alt && strstr(err.msg, bad[j].alt))),
               "case %zu: %s", i, err.msg);
    }
}

/* pread at unaligned offsets across 4096-byte blocks, O_DIRECT on and off;
 * reads past the end of the file are refused. */
/* A directory (under the test's outdir) of one shard holding the U8 tensor
 * "a" of n pattern bytes, opened. */
static st_index *one_tensor_dir(const char *name, size_t n, k3_err *err) {
    char *d = outpath(name);
    mkdir(d, 0755);
    char f[1100], hdr[200];
    snprintf(f, sizeof f, "%s/model.safetensors", d);
    snprintf(hdr, sizeof hdr, "{\"a\":{\"dtype\":\"U8\",\"shape\":[%zu],\"data_offsets\":[0,%zu]}}", n, n);
    write_st(f, hdr, n, 0);
    st_index *ix = NULL;
    return st_open(d, &ix, err) == 0 ? ix : NULL;
}

TEST(st_pread_bounds_and_unaligned) {
    k3_err err = {0};
    /* 10000 bytes so O_DIRECT crosses several 4096 blocks at odd offsets */
    st_index *ix = one_tensor_dir("pr", 10000, &err);
    CHECKF(ix, "%s", err.msg);
    const st_tensor *t = st_find(ix, "a");
    unsigned char *buf = malloc(10000);
    for (int direct = 0; direct < 2; direct++) {
        st_set_direct(ix, direct);
        memset(buf, 0, 10000);
        CHECK(st_read(ix, t, buf, &err) == 0);
        for (size_t i = 0; i < 10000; i++) CHECKF(buf[i] == (unsigned char)(i * 7 + 1), "byte %zu", i);
        CHECK(st_pread(ix, 0, t->offset + 4093, buf, 5, &err) == 0);
        CHECK(buf[0] == (unsigned char)(4093 * 7 + 1) && buf[4] == (unsigned char)(4097 * 7 + 1));
        CHECK(st_pread(ix, 0, t->offset + 9999, buf, 2, &err) == K3_EXIT_DATA);
    }
    free(buf);
    st_close(ix);
}

/* One index shared by several owners (the engine's plan, streaming source
 * and model): each st_close drops one reference, and the index, its mapping
 * and its descriptors stay usable until the last (ASan sees a use after
 * free otherwise). */
TEST(st_retain_shares_until_last_close) {
    k3_err err = {0};
    st_index *ix = one_tensor_dir("rt", 5000, &err);
    CHECKF(ix, "%s", err.msg);
    CHECK(st_retain(ix) == ix && st_retain(ix) == ix);
    const st_tensor *t = st_find(ix, "a");
    const unsigned char *m = st_data(ix, t, &err);
    CHECK(m && m[4999] == (unsigned char)(4999 * 7 + 1));
    st_close(ix);
    st_close(ix);
    unsigned char b[3];
    CHECK(st_find(ix, "a") == t && m[10] == (unsigned char)(10 * 7 + 1));
    CHECK(st_pread(ix, 0, t->offset + 4095, b, 3, &err) == 0 && b[2] == (unsigned char)(4097 * 7 + 1));
    st_close(ix);
    CHECK(st_retain(NULL) == NULL);
}

/* Builds a one-tensor image with the given name as written in the JSON
 * (pad: trailing spaces, so that two spellings can have equal offsets). */
static int check_named_pad(const char *json_name, int pad, st_buffer_info *info, bool use_jansson) {
    char hdr[512];
    snprintf(hdr, sizeof hdr, "{\"%s\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}%*s", json_name,
             pad, "");
    size_t hl = strlen(hdr);
    unsigned char img[600] = {0};
    for (int i = 0; i < 8; i++) img[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(img + 8, hdr, hl);
    k3_err err = {0};
    return st_check_buffer(img, 8 + hl + 1, "named", use_jansson, info, &err);
}
static int check_named(const char *json_name, st_buffer_info *info, bool use_jansson) {
    return check_named_pad(json_name, 0, info, use_jansson);
}

/* The scanner takes plain ASCII names eight bytes at a time and declines any
 * name with an escape, DEL or a non-ASCII byte wherever it sits; jansson then
 * reads it, and an escaped name equals its plain spelling. */
TEST(st_scanner_declines_unusual_names) {
    st_buffer_info a, b;
    CHECK(check_named("abcdefghijklmnopqrstuvwxyz0123456789.weight", &a, false) == 0 && a.fast);
    for (int pos = 0; pos < 20; pos++) {
        char name[64];
        snprintf(name, sizeof name, "%.*s\x7f%s", pos, "abcdefghijklmnopqrstuvwxyz", "tail.weight");
        CHECKF(check_named(name, &a, false) == 0 && !a.fast, "DEL at %d", pos);
        CHECK(check_named(name, &b, true) == 0 && a.digest == b.digest);
        snprintf(name, sizeof name, "%.*s\\/%s", pos, "abcdefghijklmnopqrstuvwxyz", "tail.weight");
        CHECKF(check_named(name, &a, false) == 0 && !a.fast, "escape at %d", pos);
        snprintf(name, sizeof name, "%.*s/%s", pos, "abcdefghijklmnopqrstuvwxyz", "tail.weight");
        CHECKF(check_named_pad(name, 1, &b, false) == 0 && b.fast && a.digest == b.digest, "'\\/' == '/' at %d", pos);
        snprintf(name, sizeof name, "%.*s\xc3\xa9%s", pos, "abcdefghijklmnopqrstuvwxyz", "tail.weight");
        CHECKF(check_named(name, &a, false) == 0 && !a.fast, "UTF-8 at %d", pos);
        snprintf(name, sizeof name, "%.*s\t%s", pos, "abcdefghijklmnopqrstuvwxyz", "tail.weight");
        CHECKF(check_named(name, &a, false) == K3_EXIT_DATA, "raw tab at %d accepted", pos);
    }
}

/* A header need not list tensors in offset order; st_at still walks them
 * in offset order. */
TEST(st_header_out_of_offset_order) {
    char *d = outpath("order");
    mkdir(d, 0755);
    char f[1100];
    snprintf(f, sizeof f, "%s/model.safetensors", d);
    write_st(f, "{\"c\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[6,9]},"
                "\"b\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[2,6]},"
                "\"a\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[0,2]}}", 9, 0);
    st_index *ix = NULL;
    k3_err err = {0};
    CHECKF(st_open(d, &ix, &err) == 0, "%s", err.msg);
    CHECK(st_count(ix) == 3);
    CHECK(!strcmp(st_at(ix, 0)->name, "a") && !strcmp(st_at(ix, 1)->name, "b") && !strcmp(st_at(ix, 2)->name, "c"));
    CHECK(st_find(ix, "c") == st_at(ix, 2));
    st_close(ix);
}

TEST(st_write_roundtrips_through_the_reader) {
    char path[1024];
    snprintf(path, sizeof path, "%s/w.safetensors", t_outdir());
    float a[6] = {1, -2, 3.5f, 0, 1e-30f, 7};
    uint16_t b[3] = {0x3f80, 0xc000, 0x7f80}; /* bf16 1, -2, +inf */
    st_out_tensor ts[2] = {
        {.name = "a.weight", .dtype = ST_F32, .rank = 2, .shape = {2, 3}, .data = a, .nbytes = sizeof a},
        {.name = "b", .dtype = ST_BF16, .rank = 1, .shape = {3}, .data = b, .nbytes = sizeof b},
    };
    const char *md[2] = {"format", "pt"};
    k3_err err = {0};
    CHECKF(st_write(path, md, 1, ts, 2, &err) == 0, "%s", err.msg);
    st_index *ix;
    CHECKF(st_open(path, &ix, &err) == 0, "%s", err.msg);
    const st_tensor *t = st_find(ix, "b");
    CHECK(t && t->dtype == ST_BF16 && t->rank == 1 && t->shape[0] == 3);
    float got[3];
    CHECK(st_read_f32(ix, t, got, &err) == 0);
    CHECK(got[0] == 1.0f && got[1] == -2.0f && got[2] > 1e38f);
    t = st_find(ix, "a.weight");
    float ga[6];
    CHECK(t && st_read_f32(ix, t, ga, &err) == 0 && memcmp(ga, a, sizeof a) == 0);
    CHECK(st_metadata(ix, t->shard, "format") && !strcmp(st_metadata(ix, t->shard, "format"), "pt"));
    st_close(ix);
    /* a byte count that disagrees with the shape is refused, nothing written */
    ts[1].nbytes = 4;
    snprintf(path, sizeof path, "%s/bad.safetensors", t_outdir());
    CHECK(st_write(path, NULL, 0, ts, 2, &err) != 0);
    CHECK(strstr(err.msg, "tensor b") != NULL);
}

/* The scanner's 16-byte string steps and two-word integers: a bad byte at
 * every position of a long name sends it to jansson, and integers of every
 * length (leading zeros, 16+ digits, what follows them) read exactly as
 * jansson reads them, in a compact header and in a spaced one. */
TEST(st_scanner_blocks_and_integers_agree_with_jansson) {
    st_buffer_info a, b;
    static const char base[] = "language_model.model.layers.12.block_sparse_moe.experts.895.w3.weight_packed.x";
    for (int pos = 0; pos < (int)sizeof base - 1; pos++) {
        for (int k = 0; k < 3; k++) {
            char name[256];
            snprintf(name, sizeof name, "%.*s%s%s", pos, base, k == 0 ? "\x7f" : k == 1 ? "\\u0041" : "\xc3\xa9",
                     base + pos);
            CHECKF(check_named(name, &a, false) == 0 && !a.fast, "bad byte %d at %d", k, pos);
            CHECKF(check_named(name, &b, true) == 0 && a.digest == b.digest, "digest %d at %d", k, pos);
        }
        char name[256];
        snprintf(name, sizeof name, "%.*s", pos + 1, base);
        CHECKF(check_named(name, &a, false) == 0 && a.fast, "plain name of %d bytes", pos + 1);
    }
    /* integers: shape [n] of U8 with data_offsets [0, n], n of 1..20 digits */
    for (int nd = 1; nd <= 20; nd++)
        for (int var = 0; var < 4; var++) {
            char num[32], hdr[256];
            for (int i = 0; i < nd; i++) num[i] = (char)('0' + (i * 7 + 3) % 10);
            num[nd] = 0;
            if (var == 1) num[0] = '0';                  /* a leading zero */
            const char *sp = var == 2 ? " " : "";        /* spaced: the token path */
            const char *tail = var == 3 ? ".0" : "";     /* not an integer */
            snprintf(hdr, sizeof hdr, "{\"t\":{\"dtype\":\"U8\",\"shape\":[%s%s%s%s],\"data_offsets\":[0,%s%s]}}",
                     sp, num, tail, sp, num, tail);
            size_t hl = strlen(hdr);
            unsigned long long n = strtoull(num, NULL, 10);
            size_t dl = nd <= 4 ? (size_t)n : 0; /* a data section only where it can be small */
            unsigned char *img = calloc(1, 8 + hl + dl);
            for (int i = 0; i < 8; i++) img[i] = (unsigned char)((uint64_t)hl >> (8 * i));
            memcpy(img + 8, hdr, hl);
            k3_err e1 = {0}, e2 = {0};
            int r1 = st_check_buffer(img, 8 + hl + dl, "n", false, &a, &e1);
            int r2 = st_check_buffer(img, 8 + hl + dl, "n", true, &b, &e2);
            free(img);
            CHECKF((r1 == 0) == (r2 == 0), "%d digits var %d: %s / %s", nd, var, e1.msg, e2.msg);
            CHECKF(r1 != 0 || (a.digest == b.digest && a.ntensors == 1), "%d digits var %d", nd, var);
            if (var == 0 && nd <= 4) CHECKF(r1 == 0 && a.fast, "%d digits: %s", nd, e1.msg);
        }
}

/* The release-shaped index (pretty-printed, hundreds of entries, not in
 * shard order) goes through the one-pass reader in batches; a problem at any
 * entry is reported exactly as the general check words it, both ways. */
TEST(st_index_json_many_entries) {
    char *d = outpath("ixmany");
    mkdir(d, 0755);
    enum { N1 = 150, N2 = 61 };
    for (int sh = 0; sh < 2; sh++) {
        int n = sh ? N2 : N1;
        size_t cap = 64 + (size_t)n * 96, len = 0;
        char *h = malloc(cap);
        len += (size_t)snprintf(h + len, cap - len, "{");
        for (int i = 0; i < n; i++)
            len += (size_t)snprintf(h + len, cap - len, "%s\"s%d.layers.%03d.weight\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[%d,%d]}",
                                    i ? "," : "", sh, i, i, i + 1);
        snprintf(h + len, cap - len, "}");
        char f[1100];
        snprintf(f, sizeof f, "%s/model-0000%d-of-000002.safetensors", d, sh + 1);
        write_st(f, h, (size_t)n, 0);
        free(h);
    }
    /* entries in a scrambled order; variant v breaks one thing at entry 100 */
    const int total = N1 + N2;
    for (int v = 0; v < 7; v++) {
        size_t cap = 200 + (size_t)(total + 1) * 128, len = 0;
        char *j = malloc(cap);
        len += (size_t)snprintf(j + len, cap - len, "{\n  \"metadata\": {\n    \"total_size\": %d\n  },\n  \"weight_map\": {",
                                v == 4 ? total + 1 : total);
        int listed = 0;
        for (int k = 0; k < total; k++) {
            int idx = (k * 97) % total; /* 97 is prime to 211: a permutation */
            int sh = idx < N1 ? 0 : 1, i = sh ? idx - N1 : idx;
            if (v == 3 && k == 100) continue;                 /* one tensor not listed */
            int fsh = (v == 1 && k == 100) ? 1 - sh : sh;      /* the wrong shard */
            char name[64];
            snprintf(name, sizeof name, "s%d.layers.%03d.weight", sh, i);
            if (v == 2 && k == 100) snprintf(name, sizeof name, "nosuch.%d", k);
            if (v == 5 && k == 100) { /* entry 0's tensor again (in shard 1) */
                snprintf(name, sizeof name, "s0.layers.000.weight");
                fsh = 0;
            }
            len += (size_t)snprintf(j + len, cap - len, "%s\n    \"%s\": \"model-0000%d-of-00000%d.safetensors\"",
                                    listed++ ? "," : "", name, fsh + 1, v == 6 && k == 100 ? 3 : 2);
        }
        snprintf(j + len, cap - len, "\n  }\n}\n");
        static const char *const want[7] = {NULL, "but it is in", "names tensor 'nosuch.100'", "does not list tensor",
                                            "total_size", "twice", "not in the directory"};
        for (int rep = 0; rep < 2; rep++) {
            k3_err err = {0};
            int rc = open_with_index(d, j, &err);
            if (!want[v]) {
                CHECKF(rc == 0, "variant %d: %s", v, err.msg);
            } else if (v == 5 && strstr(err.msg, "bad JSON")) {
                CHECK(rc == K3_EXIT_DATA); /* jansson refuses the duplicate key itself */
            } else {
                CHECKF(rc == K3_EXIT_DATA && strstr(err.msg, want[v]) && strstr(err.msg, "model.safetensors.index.json"),
                       "variant %d: rc %d %s", v, rc, err.msg);
            }
        }
        free(j);
    }
    unsetenv("K3_ST_JANSSON");
}

/* Resident anonymous memory of this process (Linux), in bytes; 0 elsewhere. */
static uint64_t rss_anon(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    uint64_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "RssAnon: %" SCNu64, &kb) == 1) break;
    fclose(f);
    return kb * 1024;
}

/* The memory plan counts st_footprint for the checkpoint index, which at the
 * release's 497,220 tensors is ~100 MB: it must cover what an open really
 * keeps resident (the kernel's count is the reference), and not by a wide
 * margin. 160,000 tensors over 4 shards, opened by the parallel parser. */
TEST(st_footprint_covers_what_open_keeps) {
#ifdef __SANITIZE_ADDRESS__
    SKIP("ASan's allocator keeps freed memory (quarantine, shadow): resident growth is not the index's");
#endif
    if (!rss_anon()) SKIP("no /proc/self/status RssAnon");
    char *d = outpath("many");
    mkdir(d, 0755);
    enum { SHARDS = 4, PER = 40000 };
    for (int sh = 0; sh < SHARDS; sh++) {
        size_t cap = 64 + (size_t)PER * 112, len = 0;
        char *h = malloc(cap);
        CHECK(h != NULL);
        len += (size_t)snprintf(h + len, cap - len, "{");
        for (int i = 0; i < PER; i++)
            len += (size_t)snprintf(h + len, cap - len,
                                    "%s\"model.layers.%d.mlp.experts.%05d.down_proj.weight\":{\"dtype\":\"U8\",\"shape\":[1],"
                                    "\"data_offsets\":[%d,%d]}",
                                    i ? "," : "", sh, i, i, i + 1);
        snprintf(h + len, cap - len, "}");
        char f[1100];
        snprintf(f, sizeof f, "%s/model-0000%d-of-00000%d.safetensors", d, sh + 1, SHARDS);
        write_st(f, h, (size_t)PER, 0);
        free(h);
    }
    /* the threads the parser runs on exist before the baseline (their stacks are not the index's) */
    volatile int sink = 0;
#pragma omp parallel
    {
        sink += 1;
    }
    (void)sink;
    k3_err err = {0};
    st_index *ix = NULL;
    malloc_trim(0);
    uint64_t before = rss_anon();
    CHECKF(st_open(d, &ix, &err) == 0, "%s", err.msg);
    malloc_trim(0);
    uint64_t grew = rss_anon() - before, fp = st_footprint(ix);
    CHECK(st_count(ix) == (size_t)SHARDS * PER);
    /* 4 MiB for the allocator's own slack (glibc's arenas, the threads' header buffers) */
    CHECKF(grew <= fp + ((uint64_t)4 << 20), "open keeps %llu bytes resident, st_footprint says %llu", (unsigned long long)grew,
           (unsigned long long)fp);
    CHECKF(fp <= grew + ((uint64_t)32 << 20), "st_footprint %llu, resident growth only %llu",
           (unsigned long long)fp, (unsigned long long)grew);
    st_close(ix);
}
