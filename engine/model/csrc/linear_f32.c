/* y = x W^T (+ bias) in float32 on AVX2/FMA CPUs, for the CPU engine's linear layers.
 *
 * Why not oneDNN/MKL: at decode batch sizes (1-16 rows) they stream the weights well
 * below the speed of a plain read of them on one core; this kernel comes much closer,
 * beats oneDNN up to 16 rows and matches it on prefill-sized inputs (figures:
 * docs/benchmarks/2026-11-30-cpu-kernels.md).
 *
 * W is packed once at load time into panels of NR = 16 output columns, each K-major:
 * panels[p][k][j] = W[p*16 + j][k] (zero past N). A micro-kernel keeps a block of up to
 * MR = 6 rows x 16 columns of y in 12 AVX registers and, for each k, broadcasts one x
 * value per row against two vectors of the panel: the panel streams through once per
 * block, sequentially, which the hardware prefetcher follows.
 *
 * Every output is summed over k in order, one FMA per k, whatever the blocking (a
 * K-chunk resumes from the partial sums it stored), so results do not depend on M, on
 * the thread count or on which path ran.
 *
 * Small M (decode): one pass, x read in place. Large M (prefill): K is cut into chunks
 * of KC so a panel's chunk (16 KiB) stays in L1 while every row block passes over it
 * (the weights stream from memory once per call, however large), and each K-chunk of x
 * is first copied into row-block-major order, so the broadcasts of a block are
 * sequential instead of MR strided streams.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 16
#define MR 6
#define KC 256
#define SMALL_M 24      /* up to this many rows, no K chunks and no packing */

#define ACC(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
#define RESUME(i) if (mr > i) { c##i##0 = _mm256_loadu_ps(y + i * ldy); \
                                c##i##1 = _mm256_loadu_ps(y + i * ldy + 8); }
#define FMA(i) if (mr > i) { \
        __m256 b = _mm256_broadcast_ss(packed ? x + k * MR + i : x + i * ldx + k); \
        c##i##0 = _mm256_fmadd_ps(b, w0, c##i##0); c##i##1 = _mm256_fmadd_ps(b, w1, c##i##1); }
#define STORE(i) if (mr > i) { _mm256_storeu_ps(y + i * ldy, c##i##0); \
                               _mm256_storeu_ps(y + i * ldy + 8, c##i##1); }

/* y[0:mr, 0:16] (+)= x[0:mr, 0:kc] . panel[0:kc, 0:16]. x is either rows of stride ldx
 * or, when packed, [kc][MR]. mr, packed and resume are constants in each instance. */
static inline __attribute__((always_inline)) void block(
        int mr, int packed, int resume, int64_t kc, const float *x, int64_t ldx,
        const float *panel, float *y, int64_t ldy) {
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5)
    if (resume) { RESUME(0) RESUME(1) RESUME(2) RESUME(3) RESUME(4) RESUME(5) }
    for (int64_t k = 0; k < kc; k++) {
        __m256 w0 = _mm256_loadu_ps(panel + k * NR), w1 = _mm256_loadu_ps(panel + k * NR + 8);
        FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

typedef void (*block_fn)(int64_t, const float *, int64_t, const float *, float *, int64_t);
#define INSTANCE(m, p, r) static void block_##m##_##p##_##r(int64_t kc, const float *x, int64_t ldx, \
        const float *panel, float *y, int64_t ldy) { block(m, p, r, kc, x, ldx, panel, y, ldy); }
#define INSTANCES(p, r) INSTANCE(1, p, r) INSTANCE(2, p, r) INSTANCE(3, p, r) \
                        INSTANCE(4, p, r) INSTANCE(5, p, r) INSTANCE(6, p, r)
INSTANCES(0, 0) INSTANCES(0, 1) INSTANCES(1, 0) INSTANCES(1, 1)
#define TABLE(p, r) {0, block_1_##p##_##r, block_2_##p##_##r, block_3_##p##_##r, \
                     block_4_##p##_##r, block_5_##p##_##r, block_6_##p##_##r}
static const block_fn BLOCKS[2][2][MR + 1] = {{TABLE(0, 0), TABLE(0, 1)}, {TABLE(1, 0), TABLE(1, 1)}};

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* x [M, K] (row stride ldx) -> out [ceil(M/MR)][kc][MR], zero rows past M. */
static void pack_rows(const float *x, int64_t ldx, int64_t m, int64_t kc, float *out) {
    for (int64_t m0 = 0; m0 < m; m0 += MR, out += kc * MR)
        for (int64_t i = 0; i < MR; i++)
            for (int64_t k = 0; k < kc; k++)
                out[k * MR + i] = m0 + i < m ? x[(m0 + i) * ldx + k] : 0.f;
}

/* Rows [0, m) of y's full panels, over k in [k0, k0 + kc); x is x's rows at column k0. */
static void full_panels(int64_t m, int64_t full, int64_t N, int64_t K, int64_t k0, int64_t kc,
                        const float *x, int64_t ldx, const float *xp, const float *panels, float *y,
                        int threads) {
    int packed = xp != NULL, resume = k0 > 0;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < full; p++) {
        const float *panel = panels + (p * K + k0) * NR;
        for (int64_t m0 = 0; m0 < m; m0 += MR) {
            int mr = (int)min64(MR, m - m0);
            const float *rows = packed ? xp + m0 * kc : x + m0 * ldx;
            BLOCKS[packed][resume][mr](kc, rows, ldx, panel, y + m0 * N + p * NR, N);
        }
    }
}

/* threads: the caller's (torch's) count; an OpenMP default would be per calling thread
 * and, in a thread torch has not set up, every core. */
void linear_f32(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                const float *panels, const float *bias, float *y, int threads) {
    int64_t full = N / NR;
    float *xp = NULL;
    if (M > SMALL_M)  /* bytes: a multiple of the alignment, as aligned_alloc requires */
        xp = aligned_alloc(64, (size_t)(M + MR - 1) / MR * MR * KC * sizeof(float));
    if (xp == NULL) {
        full_panels(M, full, N, K, 0, K, x, ldx, NULL, panels, y, threads);
    } else {
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            int64_t kc = min64(KC, K - k0);
            pack_rows(x + k0, ldx, M, kc, xp);
            full_panels(M, full, N, K, k0, kc, NULL, ldx, xp, panels, y, threads);
        }
        free(xp);
    }
    if (N % NR) {  /* the last, partial panel: into a scratch block, then its valid columns */
        float scratch[MR * NR];
        const float *panel = panels + full * K * NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int mr = (int)min64(MR, M - m0);
            BLOCKS[0][0][mr](K, x + m0 * ldx, ldx, panel, scratch, NR);
            for (int i = 0; i < mr; i++)
                memcpy(y + (m0 + i) * N + full * NR, scratch + i * NR, (N % NR) * sizeof(float));
        }
    }
    if (bias != NULL)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++)
                y[m * N + n] += bias[n];
}
