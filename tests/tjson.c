/* tjson.c: see tjson.h. */
#include "tjson.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

json_t *tj_load(const char *path) {
    json_error_t e;
    json_t *j = json_load_file(path, JSON_DECODE_ANY, &e);
    if (!j) fprintf(stderr, "  %s:%d: %s\n", path, e.line, e.text);
    return j;
}

static int count(const json_t *node, size_t *n) {
    if (json_is_number(node)) { (*n)++; return 0; }
    if (!json_is_array(node)) return -1;
    size_t i; json_t *v;
    json_array_foreach(node, i, v) if (count(v, n)) return -1;
    return 0;
}

static void fill(const json_t *node, double *out, size_t *k) {
    if (json_is_number(node)) { out[(*k)++] = json_number_value(node); return; }
    size_t i; json_t *v;
    json_array_foreach(node, i, v) fill(v, out, k);
}

double *tj_doubles(const json_t *node, size_t *n) {
    size_t c = 0;
    if (!node || count(node, &c)) return NULL;
    double *d = malloc((c ? c : 1) * sizeof *d);
    if (!d) return NULL;
    size_t k = 0;
    fill(node, d, &k);
    *n = c;
    return d;
}

float *tj_floats(const json_t *node, size_t *n) {
    double *d = tj_doubles(node, n);
    if (!d) return NULL;
    float *f = malloc((*n ? *n : 1) * sizeof *f);
    if (f) for (size_t i = 0; i < *n; i++) f[i] = (float)d[i];
    free(d);
    return f;
}

int64_t *tj_ints(const json_t *node, size_t *n) {
    double *d = tj_doubles(node, n);
    if (!d) return NULL;
    int64_t *o = malloc((*n ? *n : 1) * sizeof *o);
    if (o) for (size_t i = 0; i < *n; i++) o[i] = (int64_t)d[i];
    free(d);
    return o;
}

double tj_num(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

long tj_close_rows(const float *got, const float *want, size_t n, size_t row, double atol,
                   double rtol, double *worst) {
    long bad = -1;
    double w = 0;
    if (row == 0) row = n;
    for (size_t r0 = 0; r0 < n; r0 += row) {
        size_t len = (r0 + row <= n) ? row : n - r0;
        double ss = 0;
        for (size_t i = 0; i < len; i++) ss += (double)want[r0 + i] * want[r0 + i];
        double rms = len ? sqrt(ss / (double)len) : 0;
        for (size_t i = 0; i < len; i++) {
            double a = want[r0 + i], d = fabs((double)got[r0 + i] - a);
            double bound = atol + rtol * fmax(fabs(a), rms);
            if (!(d <= bound) && bad < 0) bad = (long)(r0 + i);
            if (d / bound > w || isnan(d)) w = isnan(d) ? INFINITY : d / bound;
        }
    }
    if (worst) *worst = w;
    return bad;
}
