/* The three CBLAS entry points MLX's Linux CPU backend takes from the process's global symbol
 * scope (cblas_sgemm, cblas_dgemm, cblas_cgemm), forwarded to the OpenBLAS of the PyPI wheel
 * scipy-openblas32, whose symbols carry a "scipy_" prefix so that they never clash with another
 * BLAS. machine/blas.py loads that library globally first, then this one globally, both before
 * MLX: MLX then binds its GEMMs here instead of to its bundled reference BLAS. The prefixed
 * names are left undefined at link time and resolve, when this library is loaded, to the
 * OpenBLAS loaded just before it. Integer arguments are 32-bit (the wheel's LP64 interface). */

typedef int order_t;
typedef int transpose_t;

void scipy_cblas_sgemm(order_t, transpose_t, transpose_t, int, int, int, float, const float *, int,
                       const float *, int, float, float *, int);
void scipy_cblas_dgemm(order_t, transpose_t, transpose_t, int, int, int, double, const double *, int,
                       const double *, int, double, double *, int);
void scipy_cblas_cgemm(order_t, transpose_t, transpose_t, int, int, int, const void *, const void *, int,
                       const void *, int, const void *, void *, int);

void cblas_sgemm(order_t order, transpose_t ta, transpose_t tb, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(order_t order, transpose_t ta, transpose_t tb, int m, int n, int k, double alpha,
                 const double *a, int lda, const double *b, int ldb, double beta, double *c, int ldc) {
    scipy_cblas_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(order_t order, transpose_t ta, transpose_t tb, int m, int n, int k, const void *alpha,
                 const void *a, int lda, const void *b, int ldb, const void *beta, void *c, int ldc) {
    scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
