/* Paged decode attention on CPU: one query token per sequence, read straight from
 * the block-major KV cache (float32, or fp8 widened through a 256-entry table) in a
 * single pass (online softmax).
 *
 * Plain torch has to gather a sequence's blocks into new memory before it can
 * multiply, which moves the KV bytes three times; decode on CPU is bound by exactly
 * those bytes. Here each (sequence, KV head) reads its K and V once and keeps the
 * query heads that share the KV head (GQA) together, so every load serves all of them.
 *
 * Built and loaded by engine/attention/cpu_decode.py (which checks every shape and
 * stride); no Python or torch headers, so it compiles in about a second.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_QUERY_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 128

/* Unaligned 8-float vectors: GCC lowers them to AVX2/FMA or to SSE pairs. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float dot(const float *a, const float *b, int n) {
    v8 acc0 = {0}, acc1 = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += *(const v8 *)(a + i) * *(const v8 *)(b + i);
        acc1 += *(const v8 *)(a + i + 8) * *(const v8 *)(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) acc0 += *(const v8 *)(a + i) * *(const v8 *)(b + i);
    acc0 += acc1;
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += acc0[j];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i += 8) *(v8 *)(y + i) += a * *(const v8 *)(x + i);
}

/* One head's head_dim values: a float32 cache's own, or an fp8 cache's bytes widened
 * through `lut` (every byte's value) into buf. Widening once per token and head
 * serves all the query heads that share the KV head. */
static inline const float *load_row(const char *p, const float *lut, float *buf, int n) {
    if (!lut) return (const float *)p;
    const uint8_t *b = (const uint8_t *)p;
    for (int i = 0; i < n; i++) buf[i] = lut[b[i]];
    return buf;
}

static inline void scale_vec(float *y, float a, int n) {
    for (int i = 0; i < n; i += 8) *(v8 *)(y + i) *= a;
}

/* One sequence, KV heads [h0, h1): each with `groups` query vectors, against
 * `seq_len` cached tokens, or only their last `window` (window > 0: a sliding-window
 * layer; blocks wholly before the window are never read, they may be freed).
 * Heads go inside the block loop, so one block's K (then V) of all these heads is
 * read together; in the engine's layout each head's is one
 * contiguous run of n * head_dim elements. q, out: [h1 - h0, groups, head_dim].
 * Strides are in bytes here; lut is NULL for a float32 cache. */
static void attend(float *out, const float *q, const char *cache, const float *lut, int h0, int h1,
                   const int32_t *block_table, int32_t seq_len, int32_t window, int64_t s_block,
                   int64_t s_kv, int64_t s_slot, int64_t s_head, int groups, int head_dim,
                   int block_size, float scale, float softcap) {
    int heads = (h1 - h0) * groups;  /* query heads handled here */
    float acc[MAX_QUERY_HEADS * MAX_HEAD_DIM];
    float p[MAX_QUERY_HEADS * MAX_BLOCK_SIZE];
    float m[MAX_QUERY_HEADS], l[MAX_QUERY_HEADS];
    float buf[MAX_HEAD_DIM];
    memset(acc, 0, sizeof(float) * heads * head_dim);
    for (int j = 0; j < heads; j++) { m[j] = -INFINITY; l[j] = 0.0f; }

    int num_blocks = (seq_len + block_size - 1) / block_size;
    int start = window > 0 && seq_len > window ? seq_len - window : 0;
    for (int b = start / block_size; b < num_blocks; b++) {
        const char *k = cache + (int64_t)block_table[b] * s_block;
        const char *v = k + s_kv;
        /* Slots past the end of the last block, or before the window in its first,
         * may hold anything, even NaN: never read. */
        int n = seq_len - b * block_size;
        if (n > block_size) n = block_size;
        int t0 = start > b * block_size ? start - b * block_size : 0;
        for (int t = t0; t < n; t++)
            for (int h = h0; h < h1; h++) {
                const float *kr = load_row(k + t * s_slot + h * s_head, lut, buf, head_dim);
                for (int g = 0; g < groups; g++) {
                    int j = (h - h0) * groups + g;
                    float x = dot(q + j * head_dim, kr, head_dim) * scale;
                    /* Gemma 2's logit soft-capping: cap * tanh(x / cap), before the softmax. */
                    p[j * block_size + t] = softcap > 0.0f ? softcap * tanhf(x / softcap) : x;
                }
            }
        for (int j = 0; j < heads; j++) {
            float *pj = p + j * block_size;
            float block_max = pj[t0];
            for (int t = t0 + 1; t < n; t++) block_max = pj[t] > block_max ? pj[t] : block_max;
            if (block_max > m[j]) {  /* rescale what was accumulated under the old max */
                float alpha = expf(m[j] - block_max);
                l[j] *= alpha;
                scale_vec(acc + j * head_dim, alpha, head_dim);
                m[j] = block_max;
            }
            for (int t = t0; t < n; t++) {
                pj[t] = expf(pj[t] - m[j]);
                l[j] += pj[t];
            }
        }
        for (int t = t0; t < n; t++)
            for (int h = h0; h < h1; h++) {
                const float *vr = load_row(v + t * s_slot + h * s_head, lut, buf, head_dim);
                for (int g = 0; g < groups; g++) {
                    int j = (h - h0) * groups + g;
                    axpy(acc + j * head_dim, p[j * block_size + t], vr, head_dim);
                }
            }
    }
    for (int j = 0; j < heads; j++)
        for (int d = 0; d < head_dim; d++) out[j * head_dim + d] = acc[j * head_dim + d] / l[j];
}

/* out[r] = attention of query[rows[r]] over the cache blocks in block_tables[r]
 * (seq_lens[r] tokens; window > 0: only their last `window`; softcap > 0: scores
 * soft-capped), for r in
 * [0, num_rows). Query and out rows are
 * [num_kv_heads * groups, head_dim], contiguous. `cache` is one layer's view:
 * cache + block*s_block + kv*s_kv + slot*s_slot + head*s_head (in elements of
 * elem_size bytes: 4, float32; or 1, fp8 with lut giving each byte's value), dims contiguous;
 * any strides (the engine's head stride spans all layers of a block's head).
 * Work is split into `head_splits` parts per row (1 unless rows are too few to keep
 * every thread busy); the caller keeps (num_kv_heads / head_splits) * groups within
 * MAX_QUERY_HEADS. `threads` is the caller's (torch's) count: OpenMP's default is per
 * calling thread and, in a thread torch has not set up, every core. */
void paged_decode_attention(float *out, const float *query, const int64_t *rows,
                            int64_t q_row_stride, const char *cache, int elem_size, const float *lut,
                            int64_t s_block, int64_t s_kv, int64_t s_slot, int64_t s_head,
                            const int32_t *block_tables, int64_t bt_stride,
                            const int32_t *seq_lens, int32_t window, int num_rows, int num_kv_heads,
                            int groups, int head_dim, int block_size, float scale, float softcap,
                            int head_splits, int threads) {
    s_block *= elem_size; s_kv *= elem_size; s_slot *= elem_size; s_head *= elem_size;
    int64_t items = (int64_t)num_rows * head_splits;
    int64_t head_span = (int64_t)groups * head_dim;
    int per_split = (num_kv_heads + head_splits - 1) / head_splits;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t it = 0; it < items; it++) {
        int64_t r = it / head_splits;
        int h0 = (int)(it % head_splits) * per_split;
        int h1 = h0 + per_split < num_kv_heads ? h0 + per_split : num_kv_heads;
        if (h0 >= h1) continue;
        attend(out + r * num_kv_heads * head_span + h0 * head_span,
               query + rows[r] * q_row_stride + h0 * head_span, cache, lut, h0, h1,
               block_tables + r * bt_stride, seq_lens[r], window, s_block, s_kv, s_slot, s_head,
               groups, head_dim, block_size, scale, softcap);
    }
}
