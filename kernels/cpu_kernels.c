/* The CPU step's native kernels: a decoder layer's element-wise parts and paged tree attention.
 *
 * Built at first use by kernels/cpu.py with the machine's C compiler (-O3 -march=native -fopenmp
 * -ffp-contract=off) and called through ctypes; kernels/cpu.py holds each one's torch reference.
 *
 * Every output row is computed from its own input row alone, by the same sequence of float
 * operations whatever else is in the call (how many rows, which sequences, which threads):
 *   - reductions (RMSNorm's sum of squares, a query-key dot product) add in 16 fixed lanes folded
 *     in a fixed tree;
 *   - attention lists a row's visible keys in context order and computes from that list alone;
 *   - no fused multiply-add is contracted implicitly (-ffp-contract=off), so vectorised and scalar
 *     code of one loop round alike.
 * So a draft-tree row verified among other rows computes, bit for bit, what the same token
 * computes decoded alone (its visible keys are the same values in the same order), and greedy
 * speculation reproduces plain decoding exactly even where activations are rounded to bf16.
 *
 * Activations: `*_bf16` flags say whether a buffer holds bf16 (uint16) or fp32 values; the maths
 * is fp32. The KV cache, queries and weights are fp32.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, NaN -> quiet NaN: torch's float -> bfloat16 conversion */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void store(void *p, int bf16, int64_t i, float v) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* exp(x) for x in [-87.3, 88.3] (clamped outside), within 2 ulp: Cephes' expf polynomial */
static inline float exp_f(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    /* round to nearest: adding and taking back 1.5 * 2^23 leaves no fraction (|x log2 e| < 2^22) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return y * s;
}

/* 16 floats as one value: gcc lowers it to whatever vectors the CPU has (AVX-512, or AVX2 halves) */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));   /* for unaligned loads */
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load16(const float *p) { return *(const v16u *)p; }

/* the 16 lanes of a folded in a fixed tree */
static inline float hsum16(v16 a) {
    v8 s8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* sum of a[i] * b[i] in 16 fixed lanes, folded in a fixed tree */
static inline float dot(const float *a, const float *b, int64_t n) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += load16(a + i) * load16(b + i);
    float tail = 0.0f;
    for (; i < n; i++) tail += a[i] * b[i];
    return hsum16(acc) + tail;
}

/* sum of x[0 .. n-1] in 16 fixed lanes (x[t] into lane t % 16), folded in a fixed tree */
static inline float sum16(const float *x, int64_t n) {
    v16 acc = {0};
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES) acc += load16(x + t);
    float tail = 0.0f;
    for (; t < n; t++) tail += x[t];
    return hsum16(acc) + tail;
}

static inline int threads_for(int nthreads, int64_t work, int64_t per_thread) {
    int64_t t = work / per_thread;
    if (t < 1) t = 1;
    return t < nthreads ? (int)t : nthreads;
}

/* n values of a bf16 or fp32 buffer to fp32, and back (the dtype test outside the loops, so each
 * loop vectorises) */
static void to_f32(const void *src, int bf16, int64_t offset, int64_t n, float *dst) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)src + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(p[i]);
    } else {
        memcpy(dst, (const float *)src + offset, sizeof(float) * n);
    }
}

static void from_f32(const float *src, int64_t n, void *dst, int bf16, int64_t offset) {
    if (bf16) {
        uint16_t *p = (uint16_t *)dst + offset;
        for (int64_t i = 0; i < n; i++) p[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)dst + offset, src, sizeof(float) * n);
    }
}

/* ---- RMSNorm, with the residual add before it ------------------------------------------------
 * h = x + residual (when residual is given; written to h_out), out = w * (h * rsqrt(mean(h²) + eps)),
 * the product (h * rsqrt) rounded to fp32 before the weight as torch's reference rounds.
 */
void rms_norm(const void *x, int x_bf16, const float *residual, float *h_out, const float *w,
              void *out, int out_bf16, int64_t rows, int64_t cols, float eps, int nthreads) {
#pragma omp parallel num_threads(threads_for(nthreads, rows * cols, 16384))
    {
        float *h = (float *)malloc(sizeof(float) * 2 * cols), *y = h + cols;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            to_f32(x, x_bf16, r * cols, cols, h);
            if (residual) {
                const float *res = residual + r * cols;
                for (int64_t c = 0; c < cols; c++) h[c] = h[c] + res[c];
                memcpy(h_out + r * cols, h, sizeof(float) * cols);
            }
            float inv = 1.0f / sqrtf(dot(h, h, cols) / (float)cols + eps);
            for (int64_t c = 0; c < cols; c++) y[c] = w[c] * (h[c] * inv);
            from_f32(y, cols, out, out_bf16, r * cols);
        }
        free(h);
    }
}

/* ---- SiLU(gate) * up: gu [rows, 2n] = [gate | up] -> out [rows, n] ------------------------- */
void silu_mul(const void *gu, int gu_bf16, void *out, int out_bf16, int64_t rows, int64_t n, int nthreads) {
#pragma omp parallel num_threads(threads_for(nthreads, rows * n, 8192))
    {
        float *g = (float *)malloc(sizeof(float) * 2 * n), *u = g + n;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            to_f32(gu, gu_bf16, r * 2 * n, 2 * n, g);
            for (int64_t c = 0; c < n; c++) g[c] = (g[c] / (1.0f + exp_f(-g[c]))) * u[c];
            from_f32(g, n, out, out_bf16, r * n);
        }
        free(g);
    }
}

/* ---- RoPE of q and k; k and v into the cache ---------------------------------------------------
 * qkv [rows, (H + 2 Hkv) D] -> q_out [rows, H, D]; k (rotated) and v to k_cache / v_cache
 * [slots, Hkv, D] at slots[row]. cos / sin_signed [rows, D]: y = x * cos + roll(x, D/2) * sin_signed.
 */
void rope_cache(const void *qkv, int qkv_bf16, const float *cos, const float *sin_signed, const int64_t *slots,
                float *q_out, float *k_cache, float *v_cache, int64_t rows, int64_t H, int64_t Hkv, int64_t D,
                int nthreads) {
    int64_t width = (H + 2 * Hkv) * D, half = D / 2;
#pragma omp parallel num_threads(threads_for(nthreads, rows * width, 16384))
    {
        float *x = (float *)malloc(sizeof(float) * width);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            to_f32(qkv, qkv_bf16, r * width, width, x);
            const float *c = cos + r * D, *s = sin_signed + r * D;
            for (int64_t h = 0; h < H + Hkv; h++) {
                float *dst = h < H ? q_out + (r * H + h) * D : k_cache + (slots[r] * Hkv + (h - H)) * D;
                const float *xh = x + h * D;
                for (int64_t d = 0; d < half; d++) dst[d] = xh[d] * c[d] + xh[d + half] * s[d];
                for (int64_t d = half; d < D; d++) dst[d] = xh[d] * c[d] + xh[d - half] * s[d];
            }
            memcpy(v_cache + slots[r] * Hkv * D, x + (H + Hkv) * D, sizeof(float) * Hkv * D);
        }
        free(x);
    }
}

/* Scores of one query head against keys `keys` (slots; row stride `stride` floats), scaled, into
 * e; returns their max. Specialised for head_dim 64 and 128 (the query in registers). */
#define SCORES(CH)                                                                                     \
    static inline float scores_##CH(const float *q, const float *k, const int32_t *keys, int64_t n,   \
                                    int64_t stride, float scale, float *e) {                          \
        v16 qa[CH];                                                                                    \
        for (int c = 0; c < CH; c++) qa[c] = load16(q + 16 * c);                                       \
        float mx = -INFINITY;                                                                          \
        for (int64_t t = 0; t < n; t++) {                                                              \
            const float *row = k + (int64_t)keys[t] * stride;                                          \
            v16 acc = qa[0] * load16(row);                                                             \
            _Pragma("GCC unroll 8") for (int c = 1; c < CH; c++) acc += qa[c] * load16(row + 16 * c); \
            e[t] = hsum16(acc) * scale;                                                                \
            mx = e[t] > mx ? e[t] : mx;                                                                \
        }                                                                                              \
        return mx;                                                                                     \
    }
SCORES(4)
SCORES(8)

static inline float scores_any(const float *q, const float *k, const int32_t *keys, int64_t n, int64_t stride,
                               int64_t D, float scale, float *e) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        e[t] = dot(q, k + (int64_t)keys[t] * stride, D) * scale;
        mx = e[t] > mx ? e[t] : mx;
    }
    return mx;
}

/* acc[d] = sum over t, in order, of p[t] * v[keys[t]][d] */
#define WSUM(CH)                                                                                        \
    static inline void wsum_##CH(const float *p, const float *v, const int32_t *keys, int64_t n,        \
                                 int64_t stride, float *acc) {                                          \
        v16 a[CH];                                                                                      \
        for (int c = 0; c < CH; c++) a[c] = (v16){0};                                                   \
        for (int64_t t = 0; t < n; t++) {                                                               \
            const float *row = v + (int64_t)keys[t] * stride;                                           \
            _Pragma("GCC unroll 8") for (int c = 0; c < CH; c++) a[c] += p[t] * load16(row + 16 * c);  \
        }                                                                                               \
        for (int c = 0; c < CH; c++) *(v16u *)(acc + 16 * c) = a[c];                                    \
    }
WSUM(4)
WSUM(8)

static inline void wsum_any(const float *p, const float *v, const int32_t *keys, int64_t n, int64_t stride,
                            int64_t D, float *acc) {
    memset(acc, 0, sizeof(float) * D);
    for (int64_t t = 0; t < n; t++) {
        const float *row = v + (int64_t)keys[t] * stride;
        for (int64_t d = 0; d < D; d++) acc[d] += p[t] * row[d];
    }
}

/* ---- paged tree attention ----------------------------------------------------------------------
 * The metadata of engine/attention.py, packed for kernels: sequence b owns query rows
 * cu_q[b] .. cu_q[b+1]-1; with q = its rows, ctx = context_lens[b], m = mask_widths[b], row i sees
 * key position j < ctx when
 *     m == 0 (causal):  j <= ctx - q + i
 *     m > 0:            j < ctx - m  or  mask_data[mask_offsets[b] + i * m + (j - (ctx - m))]
 * Position j lives in slot block_tables[b, j / bs] * bs + j % bs. q [T, H, D] -> out [T, H * D];
 * query head h reads kv head h / (H / Hkv).
 */
void paged_attention(const float *q, const float *k_cache, const float *v_cache, void *out, int out_bf16,
                     int64_t num_seqs, const int32_t *cu_q, const int32_t *context_lens, const int32_t *block_tables,
                     int64_t table_width, int64_t block_size, const int32_t *mask_offsets, const int32_t *mask_widths,
                     const uint8_t *mask_data, int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    int64_t T = cu_q[num_seqs], G = H / Hkv, max_ctx = 1, work = 0;
    int32_t *seq_of = (int32_t *)malloc(sizeof(int32_t) * (T > 0 ? T : 1));
    for (int64_t b = 0; b < num_seqs; b++) {
        for (int64_t r = cu_q[b]; r < cu_q[b + 1]; r++) seq_of[r] = (int32_t)b;
        if (context_lens[b] > max_ctx) max_ctx = context_lens[b];
        work += (int64_t)(cu_q[b + 1] - cu_q[b]) * context_lens[b];
    }
    int nt = threads_for(nthreads, work * H * D, 1 << 17);
#pragma omp parallel num_threads(nt)
    {
        int32_t *keys = (int32_t *)malloc(sizeof(int32_t) * max_ctx);
        float *e = (float *)malloc(sizeof(float) * G * max_ctx);
        float *acc = (float *)malloc(sizeof(float) * G * D);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < T * Hkv; item++) {
            int64_t r = item / Hkv, kvh = item % Hkv, b = seq_of[r];
            int64_t i = r - cu_q[b], qlen = cu_q[b + 1] - cu_q[b], ctx = context_lens[b], m = mask_widths[b];
            const int32_t *table = block_tables + b * table_width;
            /* the visible keys' slots, in context order */
            int64_t n = 0, open = m == 0 ? ctx - qlen + i + 1 : ctx - m;
            for (int64_t j0 = 0; j0 < open; j0 += block_size) {
                int32_t base = table[j0 / block_size] * (int32_t)block_size;
                int64_t lim = open - j0 < block_size ? open - j0 : block_size;
                for (int64_t u = 0; u < lim; u++) keys[n++] = base + (int32_t)u;
            }
            if (m > 0) {
                const uint8_t *row = mask_data + mask_offsets[b] + i * m;
                for (int64_t j = ctx - m; j < ctx; j++)
                    if (row[j - (ctx - m)]) keys[n++] = table[j / block_size] * (int32_t)block_size + (int32_t)(j % block_size);
            }
            const float *kh = k_cache + kvh * D, *vh = v_cache + kvh * D;
            for (int64_t g = 0; g < G; g++) {
                int64_t o = (r * H + kvh * G + g) * D;
                float *eg = e + g * max_ctx, *a = acc + g * D;
                float mx = D == 64 ? scores_4(q + o, kh, keys, n, Hkv * D, scale, eg)
                         : D == 128 ? scores_8(q + o, kh, keys, n, Hkv * D, scale, eg)
                         : scores_any(q + o, kh, keys, n, Hkv * D, D, scale, eg);
                for (int64_t t = 0; t < n; t++) eg[t] = exp_f(eg[t] - mx);
                if (D == 64) wsum_4(eg, vh, keys, n, Hkv * D, a);
                else if (D == 128) wsum_8(eg, vh, keys, n, Hkv * D, a);
                else wsum_any(eg, vh, keys, n, Hkv * D, D, a);
                float sum = sum16(eg, n);
                float inv = n ? 1.0f / sum : 0.0f;
                for (int64_t d = 0; d < D; d++) store(out, out_bf16, o + d, a[d] * inv);
            }
        }
        free(keys);
        free(e);
        free(acc);
    }
    free(seq_of);
}

/* ---- a layer's attention in one call: RoPE and the cache write, then paged attention ------------ */
void rope_cache_attention(const void *qkv, int qkv_bf16, const float *cos, const float *sin_signed,
                          const int64_t *slots, float *k_cache, float *v_cache, void *out, int out_bf16,
                          int64_t num_seqs, const int32_t *cu_q, const int32_t *context_lens,
                          const int32_t *block_tables, int64_t table_width, int64_t block_size,
                          const int32_t *mask_offsets, const int32_t *mask_widths, const uint8_t *mask_data,
                          int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    int64_t T = cu_q[num_seqs];
    float *q = (float *)malloc(sizeof(float) * (T > 0 ? T : 1) * H * D);
    rope_cache(qkv, qkv_bf16, cos, sin_signed, slots, q, k_cache, v_cache, T, H, Hkv, D, nthreads);
    paged_attention(q, k_cache, v_cache, out, out_bf16, num_seqs, cu_q, context_lens, block_tables, table_width,
                    block_size, mask_offsets, mask_widths, mask_data, H, Hkv, D, scale, nthreads);
    free(q);
}
