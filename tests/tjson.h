/* tjson.h: small helpers for reading JSON test fixtures (jansson). */
#ifndef K3_TESTS_TJSON_H
#define K3_TESTS_TJSON_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* Loads a JSON file; on failure prints why and returns NULL. */
json_t *tj_load(const char *path);
/* Flattens a (possibly nested) array of numbers into a malloc'd float array.
 * Returns NULL if node is not an array of numbers; *n gets the count. */
float *tj_floats(const json_t *node, size_t *n);
double *tj_doubles(const json_t *node, size_t *n);
int64_t *tj_ints(const json_t *node, size_t *n);
/* obj[key] as a number (NaN if missing). */
double tj_num(const json_t *obj, const char *key);
/* Normwise comparison used for the peer fixtures: every element must satisfy
 * |got - want| <= atol + rtol * max(|want|, rms(row of want)). Returns the
 * index of the first violation, or -1 when all pass. row is the row length
 * (n when there is one row). worst gets the largest |d| / bound ratio. */
long tj_close_rows(const float *got, const float *want, size_t n, size_t row, double atol,
                   double rtol, double *worst);

#endif
