/* Decode attention read in place from the paged KV pool (chatpipe.model.cpu_kernel builds and loads it).

   One query per row (a decode step). Each row's keys are positions 0 .. lengths[r] - 1 of its block
   table; the query sits at the last. Nothing is gathered: every (row, kv head) reads its keys and
   values straight from their blocks, so a step reads each key once instead of copying every row's
   keys, padded to the longest row, into a buffer that a matmul then reads again.

   q, out:   [rows, heads, dim]                 float32, contiguous
   k, v:     [kv_heads, blocks, block_size, dim] one layer of the pool, float32, contiguous
   tables:   [rows, table_width]                each row's blocks (int64)
   lengths:  [rows]                             each row's keys (int64)
   window:   keys a query attends, itself included (<= 0: all)
   threads:  OpenMP threads (torch.get_num_threads())
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* Keys first .. length - 1 of one row and head, walked block by block (one division a block, not a key). */
static inline __attribute__((always_inline)) void one_head(const float *q, const float *k, const float *v, const int64_t *table, int64_t first,
                     int64_t length, int64_t block_size, int64_t dim, float scale, float *scores, float *out) {
    float top = -INFINITY;
    for (int64_t j = first; j < length;) {
        const int64_t end = (j / block_size + 1) * block_size < length ? (j / block_size + 1) * block_size : length;
        const float *kb = k + (table[j / block_size] * block_size - j / block_size * block_size) * dim;
        for (; j < end; j++) {
            const float s = dot(q, kb + j * dim, dim) * scale;
            scores[j - first] = s;
            top = s > top ? s : top;
        }
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < length - first; j++) {
        scores[j] = expf(scores[j] - top);
        sum += scores[j];
    }
    for (int64_t d = 0; d < dim; d++) out[d] = 0.0f;
    const float inv = 1.0f / sum;
    for (int64_t j = first; j < length;) {
        const int64_t end = (j / block_size + 1) * block_size < length ? (j / block_size + 1) * block_size : length;
        const float *vb = v + (table[j / block_size] * block_size - j / block_size * block_size) * dim;
        for (; j < end; j++) {
            const float p = scores[j - first] * inv;
            const float *vj = vb + j * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) out[d] += p * vj[d];
        }
    }
}

void paged_decode_attention(const float *q, const float *k, const float *v, const int64_t *tables,
                            const int64_t *lengths, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t blocks, int64_t block_size, int64_t table_width, int64_t max_length,
                            int64_t window, float scale, float *out, int64_t threads) {
    const int64_t group = heads / kv_heads;
    const int64_t per_head = blocks * block_size * dim;  /* one kv head's part of the layer */
    /* the caller's torch thread count: OpenMP's own default is per thread, and a Python thread that
       never set it (a server's decode thread, a rollout role) would get every core */
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_length > 0 ? max_length : 1));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * kv_heads; i++) {
            const int64_t r = i / kv_heads, h = i % kv_heads, length = lengths[r];
            const int64_t first = window > 0 && length > window ? length - window : 0;
            for (int64_t g = 0; g < group; g++) {
                const int64_t head = h * group + g;
                const float *qh = q + (r * heads + head) * dim;
                float *oh = out + (r * heads + head) * dim;
                const int64_t *table = tables + r * table_width;
                if (dim == 64 && block_size == 16)  /* the common shapes, with the loops' bounds known */
                    one_head(qh, k + h * per_head, v + h * per_head, table, first, length, 16, 64, scale, scores, oh);
                else
                    one_head(qh, k + h * per_head, v + h * per_head, table, first, length, block_size, dim, scale,
                             scores, oh);
            }
        }
        free(scores);
    }
}
