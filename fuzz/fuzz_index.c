/* libFuzzer harness for the model.safetensors.index.json cross-check.
 *
 * Input: the text of an index file. The harness keeps two small shards in a
 * scratch directory (made once: tensors "a" and "b.weight" in the first, "c"
 * in the second, 6 tensor bytes), writes the input there as the index file
 * and opens the directory twice: the usual way (the one-pass strict reader
 * with batched lookups, the general reader behind it) and with
 * K3_ST_JANSSON=1 (jansson and the general check alone). Both must give the
 * same verdict, with the same exit code; a refusal must be one line naming
 * the index file. Anything else aborts, which libFuzzer reports. */
#include "formats/safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char dir[512], ipath[600];

static void setup(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/k3-fuzz-index-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) abort();
    snprintf(ipath, sizeof ipath, "%s/model.safetensors.index.json", dir);
    static const unsigned char bytes[6] = {1, 2, 3, 4, 5, 6};
    st_out_tensor s1[2] = {{"a", ST_U8, 1, {2}, bytes, 2}, {"b.weight", ST_U8, 1, {1}, bytes, 1}};
    st_out_tensor s2[1] = {{"c", ST_U8, 1, {3}, bytes, 3}};
    char p[700];
    k3_err err = {0};
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    if (st_write(p, NULL, 0, s1, 2, &err)) abort();
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    if (st_write(p, NULL, 0, s2, 1, &err)) abort();
}

static int open_once(bool jansson, k3_err *err) {
    setenv("K3_ST_JANSSON", jansson ? "1" : "0", 1);
    st_index *ix = NULL;
    int rc = st_open(dir, &ix, err);
    if (rc == 0) {
        if (!ix || st_count(ix) != 3) abort();
        st_close(ix);
    } else if (ix) {
        abort();
    }
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!dir[0]) setup();
    FILE *f = fopen(ipath, "wb");
    if (!f) abort();
    if (size && fwrite(data, 1, size, f) != size) abort();
    if (fclose(f)) abort();
    k3_err e1 = {0}, e2 = {0};
    int r1 = open_once(false, &e1);
    int r2 = open_once(true, &e2);
    if (r1 != r2) abort();
    if (r1 && (strchr(e1.msg, '\n') || strchr(e2.msg, '\n') || !strstr(e1.msg, "model.safetensors.index.json")))
        abort();
    return 0;
}
