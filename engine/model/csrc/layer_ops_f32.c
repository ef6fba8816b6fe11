/* The elementwise glue of a decoder layer in float32 on CPU, one call each instead of a
 * dozen torch ops: residual add + RMSNorm, rotary embedding in place, SiLU-and-mul.
 *
 * Why: at decode batch sizes each torch op costs its dispatch for a few hundred floats
 * of work, and the ~35 of them a layer were a sizeable share of the demo model's step
 * on one core (docs/benchmarks/2026-11-30-cpu-kernels.md).
 *
 * Numerics follow transformers' float32 ops: every product and sum is rounded on its
 * own (this file is built with -ffp-contract=off, so no FMA merges them), the norm's
 * weight multiplies after the normalisation, and the rotation is x*cos + rotate_half(x)*sin.
 * What differs: the sum of squares is accumulated in double (torch: float lanes), and
 * exp is the 8-lane polynomial below (torch: SLEEF's); both within an ulp or two.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* h = x + residual (stored to residual_out), or h = x when residual is NULL;
 * out = weight * (h * (1 / sqrt(mean(h^2) + eps))). Rows of cols floats. */
void add_rms_norm_f32(int64_t rows, int64_t cols, const float *x, int64_t ldx,
                      const float *residual, int64_t ldr, const float *weight, float eps,
                      float *out, float *residual_out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int64_t t = 0; t < rows; t++) {
        const float *h = x + t * ldx;
        if (residual != NULL) {
            float *sum = residual_out + t * cols;
            const float *r = residual + t * ldr;
            for (int64_t c = 0; c < cols; c++)
                sum[c] = h[c] + r[c];
            h = sum;
        }
        double squares = 0.0;
        for (int64_t c = 0; c < cols; c++)
            squares += (double)(h[c] * h[c]);
        float inv = 1.0f / sqrtf((float)(squares / (double)cols) + eps);
        float *o = out + t * cols;
        for (int64_t c = 0; c < cols; c++)
            o[c] = weight[c] * (h[c] * inv);
    }
}

static void rotate(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] + (-x2) * sin[i];
        x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
    }
}

/* q [T, hq, dim] and k [T, hk, dim] (unit last stride) rotated in place by the tables
 * cos, sin [table_rows, dim] (row stride ld_table) at positions[t]. Returns the number
 * of positions outside [0, table_rows); then nothing is rotated. */
int64_t rotary_f32(int64_t tokens, int64_t hq, int64_t hk, int64_t dim,
                   float *q, int64_t q_token, int64_t q_head, float *k, int64_t k_token, int64_t k_head,
                   const float *cos, const float *sin, int64_t ld_table, int64_t table_rows,
                   const int64_t *positions, int threads) {
    int64_t bad = 0;
    for (int64_t t = 0; t < tokens; t++)
        bad += positions[t] < 0 || positions[t] >= table_rows;
    if (bad)
        return bad;
    #pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * ld_table, *s = sin + positions[t] * ld_table;
        for (int64_t h = 0; h < hq; h++)
            rotate(q + t * q_token + h * q_head, c, s, dim / 2);
        for (int64_t h = 0; h < hk; h++)
            rotate(k + t * k_token + h * k_head, c, s, dim / 2);
    }
    return 0;
}

/* e^x for 8 floats: e^x = 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by
 * a degree-6 polynomial (Cephes' coefficients), 2^n built in the exponent bits. Within
 * an ulp on [-87.3, 88.3], where x is clamped; past 88.72 +inf, as expf; below -87.3 0,
 * not expf's subnormals (which no sum with 1 can see); NaN stays NaN. libm's scalar
 * expf was a fifth of a decode step. */
static inline __m256 exp8(__m256 in) {
    /* max/min return their second operand when either is NaN: `in` second keeps a NaN. */
    __m256 x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), in));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);   /* ln 2 in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(in, _mm256_set1_ps(88.7228f), _CMP_GT_OQ));
    return _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(in, _mm256_set1_ps(-87.3f), _CMP_LT_OQ));
}

/* out [T, n] = silu(gate) * up for rows [gate | up] of 2n floats (row stride ld). */
void silu_and_mul_f32(int64_t rows, int64_t n, const float *gate_up, int64_t ld, float *out,
                      int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 16)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * ld, *u = g + n;
        float *o = out + t * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 gi = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi));
            __m256 silu = _mm256_div_ps(gi, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < n; i++)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
