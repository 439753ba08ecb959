/* libFuzzer harness for the safetensors header parser.
 *
 * Input: two bytes (little-endian) giving the data-section length, then the
 * header text. The harness lays out a file image (8-byte length, header,
 * zeroed data) and validates it twice: through the fast scanner (with its
 * jansson fallback) and through jansson alone. Both must agree: the same
 * verdict, and for an accepted header the same tensors (count and a digest of
 * names, dtypes, shapes, offsets and metadata). A refusal must be exit code 4
 * with a one-line message. Anything else aborts, which libFuzzer reports. */
#include "formats/safetensors.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    size_t dlen = (size_t)data[0] | (size_t)data[1] << 8, hlen = size - 2;
    size_t n = 8 + hlen + dlen;
    unsigned char *img = calloc(1, n);
    if (!img) return 0;
    for (int i = 0; i < 8; i++) img[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    memcpy(img + 8, data + 2, hlen);
    k3_err e1 = {0}, e2 = {0};
    st_buffer_info a, b;
    int r1 = st_check_buffer(img, n, "fuzz", false, &a, &e1);
    int r2 = st_check_buffer(img, n, "fuzz", true, &b, &e2);
    free(img);
    if ((r1 == 0) != (r2 == 0)) abort();
    if (r1 && (r1 != K3_EXIT_DATA || r2 != K3_EXIT_DATA)) abort();
    if (r1 && (strchr(e1.msg, '\n') || strchr(e2.msg, '\n') || strncmp(e1.msg, "fuzz", 4))) abort();
    if (!r1 && (a.ntensors != b.ntensors || a.digest != b.digest || a.nmeta != b.nmeta)) abort();
    return 0;
}
