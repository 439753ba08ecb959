/* omp_stub.c: the fuzz builds compile without OpenMP (its pragmas are
 * ignored); these answer the OpenMP calls the linked sources make, for one
 * thread. */
int omp_get_max_threads(void);
int omp_in_parallel(void);
int omp_get_max_threads(void) { return 1; }
int omp_in_parallel(void) { return 0; }
