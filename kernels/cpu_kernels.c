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

typedef int32_t i32x16 __attribute__((vector_size(64)));

/* AVX2 + FMA without AVX-512: a 16-lane value is two of the 16 ymm registers, so code that keeps
 * many of them live (the attention's 16-key blocks, the matmul blocks) is written for it apart */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AVX2_ONLY 1
#else
#define AVX2_ONLY 0
#endif

static inline v16 load16(const float *p) { return *(const v16u *)p; }

static inline v16 select16(i32x16 mask, v16 a, v16 b) { return (v16)(((i32x16)a & mask) | ((i32x16)b & ~mask)); }

/* exp_f of 16 lanes at once: the same float operations, lane by lane, so the same values */
static inline v16 exp16(v16 x) {
    x = select16(x < -87.3f, (v16){0} - 87.3f, select16(x > 88.3f, (v16){0} + 88.3f, x));
    v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = (v16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v16 y = p * (r * r) + r + 1.0f;
    i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
    return y * (v16)e;
}

/* x[t] = exp_f(x[t] - mx) for t < n */
static inline void exp_shifted(float *x, int64_t n, float mx) {
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) *(v16u *)(x + t) = exp16(load16(x + t) - mx);
    for (; t < n; t++) x[t] = exp_f(x[t] - mx);
}

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

/* ---- SiLU(gate) * up: gu [rows, 2n] = [gate | up] -> out [rows, n] -------------------------
 * In pieces of SILU_PIECE columns (a verified tree's few rows still spread over the threads), 16
 * lanes at a time through exp16, which computes exp_f's values lane by lane. */
#define SILU_PIECE 512
void silu_mul(const void *gu, int gu_bf16, void *out, int out_bf16, int64_t rows, int64_t n, int nthreads) {
    const int64_t pieces = (n + SILU_PIECE - 1) / SILU_PIECE;
#pragma omp parallel num_threads(threads_for(nthreads, rows * n, 4096))
    {
        float g[SILU_PIECE], u[SILU_PIECE];
#pragma omp for schedule(static)
        for (int64_t it = 0; it < rows * pieces; it++) {
            const int64_t r = it / pieces, c0 = (it % pieces) * SILU_PIECE;
            const int64_t w = n - c0 < SILU_PIECE ? n - c0 : SILU_PIECE;
            to_f32(gu, gu_bf16, r * 2 * n + c0, w, g);
            to_f32(gu, gu_bf16, r * 2 * n + n + c0, w, u);
            int64_t c = 0;
            for (; c + 16 <= w; c += 16) {
                const v16 x = load16(g + c);
                *(v16u *)(g + c) = (x / (1.0f + exp16(-x))) * load16(u + c);
            }
            for (; c < w; c++) g[c] = (g[c] / (1.0f + exp_f(-g[c]))) * u[c];
            from_f32(g, w, out, out_bf16, r * n + c0);
        }
    }
}

/* ---- IEEE half precision: the fp16 KV cache and the quantized weights' fp16 scales -------------
 * Conversions are exact one way (half -> float) and round to nearest even the other, in hardware
 * (AVX-512, F16C) or in the scalar code below, which computes the same values. */
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* half -> float (normal, subnormal, zero, inf, NaN) */
static inline float half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp != 0) u = sign | ((exp + 112) << 23) | (man << 13);
    else {
        float f = (float)man * 5.9604644775390625e-08f;   /* man * 2^-24 */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float -> half, round to nearest even (overflow -> inf, NaN -> quiet NaN) */
static inline uint16_t f32_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);          /* >= 65520: rounds to inf */
    if (ax < 0x38800000u) {                                            /* below 2^-14: subnormal or 0 */
        float a;
        memcpy(&a, &ax, 4);
        float r = (a * 16777216.0f + 8388608.0f) - 8388608.0f;         /* a * 2^24 to the nearest even */
        return (uint16_t)(sign | (uint32_t)r);
    }
    uint32_t h = (ax - 0x38000000u) >> 13, rem = ax & 0x1fffu;         /* rebias; 13 bits to round off */
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

#if defined(__AVX512F__)
static inline v16 load_half16(const uint16_t *p) { return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void store_half16(uint16_t *p, v16 x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__F16C__)
static inline v16 load_half16(const uint16_t *p) {
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    v16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
}
static inline void store_half16(uint16_t *p, v16 x) {
    __m256 lo, hi;
    memcpy(&lo, &x, 32);
    memcpy(&hi, (char *)&x + 32, 32);
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
static inline v16 load_half16(const uint16_t *p) {
    v16 r;
    for (int i = 0; i < 16; i++) r[i] = half_to_f32(p[i]);
    return r;
}
static inline void store_half16(uint16_t *p, v16 x) {
    for (int i = 0; i < 16; i++) p[i] = f32_to_half(x[i]);
}
#endif

/* n floats into a KV cache row at `offset` (elements): fp16 (kv_f16) or fp32 */
static inline void store_kv(void *cache, int kv_f16, int64_t offset, const float *src, int64_t n) {
    if (!kv_f16) {
        memcpy((float *)cache + offset, src, sizeof(float) * n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + offset;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store_half16(dst + i, load16(src + i));
    for (; i < n; i++) dst[i] = f32_to_half(src[i]);
}

/* ---- RoPE of q and k; k and v into the cache ---------------------------------------------------
 * qkv [rows, (H + 2 Hkv) D] -> q_out [rows, H, D]; k (rotated) and v to k_cache / v_cache
 * [slots, Hkv, D] at slots[row]. cos / sin_signed [rows, D]: y = x * cos + roll(x, D/2) * sin_signed.
 */
void rope_cache(const void *qkv, int qkv_bf16, const float *cos, const float *sin_signed, const int64_t *slots,
                float *q_out, void *k_cache, void *v_cache, int kv_f16, int64_t rows, int64_t H, int64_t Hkv,
                int64_t D, int nthreads) {
    int64_t width = (H + 2 * Hkv) * D, half = D / 2;
#pragma omp parallel num_threads(threads_for(nthreads, rows * width, 16384))
    {
        float *x = (float *)malloc(sizeof(float) * (width + D)), *k = x + width;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            to_f32(qkv, qkv_bf16, r * width, width, x);
            const float *c = cos + r * D, *s = sin_signed + r * D;
            for (int64_t h = 0; h < H + Hkv; h++) {
                float *dst = h < H ? q_out + (r * H + h) * D : k;
                const float *xh = x + h * D;
                for (int64_t d = 0; d < half; d++) dst[d] = xh[d] * c[d] + xh[d + half] * s[d];
                for (int64_t d = half; d < D; d++) dst[d] = xh[d] * c[d] + xh[d - half] * s[d];
                if (h >= H) store_kv(k_cache, kv_f16, (slots[r] * Hkv + (h - H)) * D, k, D);
            }
            store_kv(v_cache, kv_f16, slots[r] * Hkv * D, x + (H + Hkv) * D, Hkv * D);
        }
        free(x);
    }
}

/* Scores of one query head against keys `keys` (slots; row stride `stride` elements), scaled, into
 * e; returns their max. Specialised for head_dim 64 and 128 (the query in registers), for an fp32
 * (`f`) and an fp16 (`h`) cache. */
/* a[0..15] each folded in hsum16's tree at once: lane j of the result is hsum16(a[j]), bit for bit
 * (level by level the same pairs: lanes l and l+8, then l and l+4, l and l+2, l and l+1) */
static inline v16 hsum16x16(const v16 *a) {
    v16 r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++)
        r1[i] = __builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
              + __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        r2[i] = __builtin_shufflevector(r1[i], r1[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
              + __builtin_shufflevector(r1[i], r1[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        r3[i] = __builtin_shufflevector(r2[i], r2[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
              + __builtin_shufflevector(r2[i], r2[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(r3[0], r3[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + __builtin_shufflevector(r3[0], r3[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

/* keys in blocks of 16, their folds done together (`hsum16x16`); the last < 16 one by one, with the
 * same values */
#define SCORES(CH, SFX, T)                                                                             \
    static inline float scores_##CH##SFX(const float *q, const T *k, const int32_t *keys, int64_t n,  \
                                         int64_t stride, float scale, float *e) {                     \
        v16 qa[CH];                                                                                    \
        for (int c = 0; c < CH; c++) qa[c] = load16(q + 16 * c);                                       \
        int64_t t = 0;                                                                                 \
        for (; t + 16 <= n; t += 16) {                                                                 \
            v16 acc[16];                                                                               \
            _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++) {                                    \
                const T *row = k + (int64_t)keys[t + j] * stride;                                      \
                acc[j] = qa[0] * load16##SFX(row);                                                     \
                _Pragma("GCC unroll 8") for (int c = 1; c < CH; c++) acc[j] += qa[c] * load16##SFX(row + 16 * c); \
            }                                                                                          \
            *(v16u *)(e + t) = hsum16x16(acc) * scale;                                                 \
        }                                                                                              \
        for (; t < n; t++) {                                                                           \
            const T *row = k + (int64_t)keys[t] * stride;                                              \
            v16 acc = qa[0] * load16##SFX(row);                                                        \
            _Pragma("GCC unroll 8") for (int c = 1; c < CH; c++) acc += qa[c] * load16##SFX(row + 16 * c); \
            e[t] = hsum16(acc) * scale;                                                                \
        }                                                                                              \
        float mx = -INFINITY;                                                                          \
        for (t = 0; t < n; t++) mx = e[t] > mx ? e[t] : mx;                                            \
        return mx;                                                                                     \
    }
#define load16f load16
#define load16h load_half16
#if AVX2_ONLY
/* The same per lane with AVX2 intrinsics, a 16-lane value as two ymm registers (lanes 0-7, 8-15):
 * gcc's lowering of the 16-lane vectors to AVX2 went through the stack at every step. Products and
 * adds stay separate (no FMA), and the fold is hsum16's tree, so the numbers are those above. */
static inline __m256 load8f(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8h(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline float hsum_2x8(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);                                                /* l + (l + 8) */
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* l + (l + 4) */
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));           /* s4[0] + s4[2], s4[1] + s4[3] */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#define SCORES_AVX2(CH, SFX, T)                                                                        \
    static inline float scores_##CH##SFX(const float *q, const T *k, const int32_t *keys, int64_t n,  \
                                         int64_t stride, float scale, float *e) {                     \
        __m256 qa[2 * CH];                                                                             \
        for (int c = 0; c < 2 * CH; c++) qa[c] = _mm256_loadu_ps(q + 8 * c);                           \
        float mx = -INFINITY;                                                                          \
        for (int64_t t = 0; t < n; t++) {                                                              \
            const T *row = k + (int64_t)keys[t] * stride;                                              \
            __m256 lo = _mm256_mul_ps(qa[0], load8##SFX(row)), hi = _mm256_mul_ps(qa[1], load8##SFX(row + 8)); \
            _Pragma("GCC unroll 8") for (int c = 1; c < CH; c++) {                                     \
                lo = _mm256_add_ps(lo, _mm256_mul_ps(qa[2 * c], load8##SFX(row + 16 * c)));            \
                hi = _mm256_add_ps(hi, _mm256_mul_ps(qa[2 * c + 1], load8##SFX(row + 16 * c + 8)));    \
            }                                                                                          \
            e[t] = hsum_2x8(lo, hi) * scale;                                                           \
            mx = e[t] > mx ? e[t] : mx;                                                                \
        }                                                                                              \
        return mx;                                                                                     \
    }
SCORES_AVX2(4, f, float)
SCORES_AVX2(8, f, float)
SCORES_AVX2(4, h, uint16_t)
SCORES_AVX2(8, h, uint16_t)
#else
SCORES(4, f, float)
SCORES(8, f, float)
SCORES(4, h, uint16_t)
SCORES(8, h, uint16_t)
#endif

/* any head_dim: an fp16 row is widened to fp32 first */
static inline float scores_any(const float *q, const void *k, int kv_f16, const int32_t *keys, int64_t n,
                               int64_t stride, int64_t D, float scale, float *e, float *row) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        if (kv_f16) {
            const uint16_t *src = (const uint16_t *)k + (int64_t)keys[t] * stride;
            for (int64_t d = 0; d < D; d++) row[d] = half_to_f32(src[d]);
        }
        e[t] = dot(q, kv_f16 ? row : (const float *)k + (int64_t)keys[t] * stride, D) * scale;
        mx = e[t] > mx ? e[t] : mx;
    }
    return mx;
}

/* acc[d] = sum over t, in order, of p[t] * v[keys[t]][d] */
#define WSUM(CH, SFX, T)                                                                                \
    static inline void wsum_##CH##SFX(const float *p, const T *v, const int32_t *keys, int64_t n,       \
                                      int64_t stride, float *acc) {                                     \
        v16 a[CH];                                                                                      \
        for (int c = 0; c < CH; c++) a[c] = (v16){0};                                                   \
        for (int64_t t = 0; t < n; t++) {                                                               \
            const T *row = v + (int64_t)keys[t] * stride;                                               \
            _Pragma("GCC unroll 8") for (int c = 0; c < CH; c++) a[c] += p[t] * load16##SFX(row + 16 * c); \
        }                                                                                               \
        for (int c = 0; c < CH; c++) *(v16u *)(acc + 16 * c) = a[c];                                    \
    }
#if AVX2_ONLY
#define WSUM_AVX2(CH, SFX, T)                                                                           \
    static inline void wsum_##CH##SFX(const float *p, const T *v, const int32_t *keys, int64_t n,       \
                                      int64_t stride, float *acc) {                                     \
        __m256 a[2 * CH];                                                                               \
        for (int c = 0; c < 2 * CH; c++) a[c] = _mm256_setzero_ps();                                    \
        for (int64_t t = 0; t < n; t++) {                                                               \
            const T *row = v + (int64_t)keys[t] * stride;                                               \
            const __m256 pt = _mm256_set1_ps(p[t]);                                                     \
            _Pragma("GCC unroll 16") for (int c = 0; c < 2 * CH; c++)                                   \
                a[c] = _mm256_add_ps(a[c], _mm256_mul_ps(pt, load8##SFX(row + 8 * c)));                 \
        }                                                                                               \
        for (int c = 0; c < 2 * CH; c++) _mm256_storeu_ps(acc + 8 * c, a[c]);                           \
    }
WSUM_AVX2(4, f, float)
WSUM_AVX2(8, f, float)
WSUM_AVX2(4, h, uint16_t)
WSUM_AVX2(8, h, uint16_t)
#else
WSUM(4, f, float)
WSUM(8, f, float)
WSUM(4, h, uint16_t)
WSUM(8, h, uint16_t)
#endif

static inline void wsum_any(const float *p, const void *v, int kv_f16, const int32_t *keys, int64_t n,
                            int64_t stride, int64_t D, float *acc) {
    memset(acc, 0, sizeof(float) * D);
    for (int64_t t = 0; t < n; t++) {
        if (kv_f16) {
            const uint16_t *row = (const uint16_t *)v + (int64_t)keys[t] * stride;
            for (int64_t d = 0; d < D; d++) acc[d] += p[t] * half_to_f32(row[d]);
        } else {
            const float *row = (const float *)v + (int64_t)keys[t] * stride;
            for (int64_t d = 0; d < D; d++) acc[d] += p[t] * row[d];
        }
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
 *
 * A row's visible keys, listed in context order, are cut into chunks of ATTN_CHUNK. Each chunk is a
 * work item (every query head: the chunk's cache rows are read in order, one kv head's keys into L1
 * for its G query heads), so one decode row spreads over the threads; each chunk c leaves, per query
 * head, its max m_c, its sum l_c = sum e^(s - m_c)
 * and acc_c = sum e^(s - m_c) v, and the row's output is
 *     sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c,   M = max_c m_c,
 * with the chunks added in order. The chunks depend only on the row's key list, so a row's output
 * stays the same bit for bit whatever else is in the call.
 */
#define ATTN_CHUNK 64

typedef struct {
    int32_t row, chunk;
} attn_item;

typedef struct {
    int64_t seq, open, keys, first_chunk;   /* its sequence, the end of its causal part, its key count */
} attn_row;

/* slots of the keys at list indices c0 .. c1 - 1 of row i of sequence b (see above) */
static int64_t chunk_keys(int64_t c0, int64_t c1, int64_t open, const int32_t *table, int64_t bs,
                          const uint8_t *mask_row, int64_t m, int64_t ctx, int32_t *keys) {
    int64_t n = 0, j = c0;
    for (; j < c1 && j < open; j++) keys[n++] = table[j / bs] * (int32_t)bs + (int32_t)(j % bs);
    if (n < c1 - c0 && m > 0) {
        int64_t seen = open;                  /* list index of the next visible tree key */
        for (int64_t u = 0; u < m && n < c1 - c0; u++) {
            if (!mask_row[u]) continue;
            if (seen++ < c0) continue;
            int64_t pos = ctx - m + u;
            keys[n++] = table[pos / bs] * (int32_t)bs + (int32_t)(pos % bs);
        }
    }
    return n;
}

void paged_attention(const float *q, const void *k_cache, const void *v_cache, int kv_f16, void *out, int out_bf16,
                     int64_t num_seqs, const int32_t *cu_q, const int32_t *context_lens, const int32_t *block_tables,
                     int64_t table_width, int64_t block_size, const int32_t *mask_offsets, const int32_t *mask_widths,
                     const uint8_t *mask_data, int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    int64_t T = cu_q[num_seqs], G = H / Hkv, work = 0, items = 0;
    attn_row *rows = (attn_row *)malloc(sizeof(attn_row) * (T > 0 ? T : 1));
    for (int64_t b = 0; b < num_seqs; b++) {
        int64_t qlen = cu_q[b + 1] - cu_q[b], ctx = context_lens[b], m = mask_widths[b];
        for (int64_t r = cu_q[b]; r < cu_q[b + 1]; r++) {
            int64_t i = r - cu_q[b], open = m == 0 ? ctx - qlen + i + 1 : ctx - m, n = open;
            if (m > 0) {
                const uint8_t *row = mask_data + mask_offsets[b] + i * m;
                for (int64_t u = 0; u < m; u++) n += row[u] != 0;
            }
            rows[r] = (attn_row){b, open, n, items};
            items += (n + ATTN_CHUNK - 1) / ATTN_CHUNK;
            work += n;
        }
    }
    attn_item *item = (attn_item *)malloc(sizeof(attn_item) * (items > 0 ? items : 1));
    /* per chunk and query head: m, l, acc[D] */
    float *part = (float *)malloc(sizeof(float) * (items > 0 ? items : 1) * H * (D + 2));
    for (int64_t r = 0, k = 0; r < T; r++)
        for (int64_t c = 0; c * ATTN_CHUNK < rows[r].keys; c++) item[k++] = (attn_item){(int32_t)r, (int32_t)c};
    int nt = threads_for(nthreads, work * H * D, 1 << 14);
#pragma omp parallel num_threads(nt)
    {
        int32_t keys[ATTN_CHUNK];
        float e[ATTN_CHUNK];
        float *row = (float *)malloc(sizeof(float) * D);   /* a widened key (scores_any), then an output row */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t r = item[it].row, c = item[it].chunk;
            const int64_t b = rows[r].seq, open = rows[r].open, total = rows[r].keys;
            const int64_t i = r - cu_q[b], ctx = context_lens[b], m = mask_widths[b];
            const int64_t c0 = c * ATTN_CHUNK, c1 = c0 + ATTN_CHUNK < total ? c0 + ATTN_CHUNK : total;
            const int64_t n = chunk_keys(c0, c1, open, block_tables + b * table_width, block_size,
                                         m > 0 ? mask_data + mask_offsets[b] + i * m : NULL, m, ctx, keys);
            const int64_t es = kv_f16 ? 2 : 4, st = Hkv * D;
            for (int64_t h = 0; h < H; h++) {
                const int64_t kvh = h / G;
                const void *kh = (const char *)k_cache + kvh * D * es, *vh = (const char *)v_cache + kvh * D * es;
                const float *qg = q + (r * H + h) * D;
                float *pg = part + (it * H + h) * (D + 2), mx;
                if (kv_f16)
                    mx = D == 64 ? scores_4h(qg, kh, keys, n, st, scale, e)
                       : D == 128 ? scores_8h(qg, kh, keys, n, st, scale, e)
                       : scores_any(qg, kh, 1, keys, n, st, D, scale, e, row);
                else
                    mx = D == 64 ? scores_4f(qg, kh, keys, n, st, scale, e)
                       : D == 128 ? scores_8f(qg, kh, keys, n, st, scale, e)
                       : scores_any(qg, kh, 0, keys, n, st, D, scale, e, row);
                exp_shifted(e, n, mx);
                if (D == 64) kv_f16 ? wsum_4h(e, vh, keys, n, st, pg + 2) : wsum_4f(e, vh, keys, n, st, pg + 2);
                else if (D == 128) kv_f16 ? wsum_8h(e, vh, keys, n, st, pg + 2) : wsum_8f(e, vh, keys, n, st, pg + 2);
                else wsum_any(e, vh, kv_f16, keys, n, st, D, pg + 2);
                pg[0] = mx;
                pg[1] = sum16(e, n);
            }
        }
        /* each row and query head: its chunks combined in order */
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < T * H; rh++) {
            const int64_t r = rh / H, h = rh % H;
            const int64_t chunks = (rows[r].keys + ATTN_CHUNK - 1) / ATTN_CHUNK;
            const float *p0 = part + (rows[r].first_chunk * H + h) * (D + 2);
            const int64_t step = H * (D + 2);              /* from one chunk's entry to the next's */
            const float *o = p0 + 2;                       /* one chunk: its own sums */
            float mx = -INFINITY, sum = chunks ? p0[1] : 0.0f;
            if (chunks > 1) {
                for (int64_t c = 0; c < chunks; c++) mx = p0[c * step] > mx ? p0[c * step] : mx;
                for (int64_t d = 0; d < D; d++) row[d] = 0.0f;
                sum = 0.0f;
                for (int64_t c = 0; c < chunks; c++) {
                    const float *pc = p0 + c * step, w = exp_f(pc[0] - mx);
                    sum += w * pc[1];
                    for (int64_t d = 0; d < D; d++) row[d] += w * pc[2 + d];
                }
                o = row;
            }
            float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (int64_t d = 0; d < D; d++) store(out, out_bf16, rh * D + d, chunks ? o[d] * inv : 0.0f);
        }
        free(row);
    }
    free(part);
    free(item);
    free(rows);
}

/* ---- a layer's attention in one call: RoPE and the cache write, then paged attention ------------ */
void rope_cache_attention(const void *qkv, int qkv_bf16, const float *cos, const float *sin_signed,
                          const int64_t *slots, void *k_cache, void *v_cache, int kv_f16, void *out, int out_bf16,
                          int64_t num_seqs, const int32_t *cu_q, const int32_t *context_lens,
                          const int32_t *block_tables, int64_t table_width, int64_t block_size,
                          const int32_t *mask_offsets, const int32_t *mask_widths, const uint8_t *mask_data,
                          int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    int64_t T = cu_q[num_seqs];
    float *q = (float *)malloc(sizeof(float) * (T > 0 ? T : 1) * H * D);
    rope_cache(qkv, qkv_bf16, cos, sin_signed, slots, q, k_cache, v_cache, kv_f16, T, H, Hkv, D, nthreads);
    paged_attention(q, k_cache, v_cache, kv_f16, out, out_bf16, num_seqs, cu_q, context_lens, block_tables, table_width,
                    block_size, mask_offsets, mask_widths, mask_data, H, Hkv, D, scale, nthreads);
    free(q);
}

/* ---- Weight-only quantized matmuls: y[M, N] = x[M, K] @ W^T, W int4 per group or int8 per row ------
 * The weights are packed in tiles of 16 output rows (kernels/cpu.py `pack_int4` / `pack_int8`):
 *   int4: codes [N/16][K/2][16] bytes, byte [t][j][i] = q[16t+i][2j] | q[16t+i][2j+1] << 4, and per
 *         tile and group of 32 inputs 16 scales then 16 offsets in fp16 ([N/16][K/32][2][16]);
 *         w[n][k] = q[n][k] * s[n][k/32] + z[n][k/32] in fp32, rounded once (a GGUF Q4_1 block's
 *         d q + m exactly: d q is exact in fp32);
 *   int8: codes [N/16][K][16] (int8), w[n][k] = q[n][k] * s[n], the row scale (fp32) applied to the sum.
 * One step of k widens 16 codes of a tile to fp32 once and multiplies them into every row of the
 * block (a broadcast fused multiply-add per row), so verifying a tree of M rows reads and widens the
 * weights once per block of up to 12 rows instead of once per row. Each output is one chain over k
 * in order, y = fma(x[k], w[k], y), whatever the block, the tiles beside it or the thread: a row's
 * result does not depend on the other rows in the call (the file's invariant). Threads split the
 * output tiles evenly.
 */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
#if defined(__AVX512F__)
#include <immintrin.h>
static inline i32x16 widen_u8(const uint8_t *p) { return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline i32x16 widen_i8(const int8_t *p) { return (i32x16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
static inline i32x16 join_i(__m256i lo, __m256i hi) {
    i32x16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
}
static inline i32x16 widen_u8(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return join_i(_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}
static inline i32x16 widen_i8(const int8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return join_i(_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
#else
static inline i32x16 widen_u8(const uint8_t *p) { return __builtin_convertvector(*(const u8x16 *)p, i32x16); }
static inline i32x16 widen_i8(const int8_t *p) { return __builtin_convertvector(*(const i8x16 *)p, i32x16); }
#endif

#if defined(__AVX512F__)
#define QMM_WIDE 1          /* 32 vector registers: big blocks */
#define QMM_MAX_ROWS 12     /* rows per block (fp32 activations) */
#define QMM_MAX_ROWS_A8 8   /* rows per block (int8 activations: an integer and a float accumulator each) */
#define QMM_MAX_ROWS_Q8 QMM_MAX_ROWS
#else
#define QMM_WIDE 0          /* 16 registers of half a 16-lane vector: small blocks */
#define QMM_MAX_ROWS 4
#if AVX2_ONLY
#define QMM_MAX_ROWS_A8 5   /* int8 activations: 16-bit sums in registers, float sums in L1 */
#define QMM_MAX_ROWS_Q8 6   /* int8 weights: 12 accumulators, the widened codes and a broadcast */
#else
#define QMM_MAX_ROWS_A8 4
#define QMM_MAX_ROWS_Q8 QMM_MAX_ROWS
#endif
#endif
#define QMM_MAX_TILES 8     /* tiles of 16 outputs per step */
#define QMM_CHUNK 8         /* tiles whose weights every row block reads while they are in cache */

#if AVX2_ONLY
/* AVX2 + FMA without AVX-512: the int4, int8 and int4 x int8 blocks in 8-lane intrinsics (each
 * 16-output tile as two halves), because gcc's lowering of the 16-lane generic vectors to AVX2
 * measured 5-10x slower at one row (it went through memory between the halves). The operations per
 * output are the same -- w = fma(q, s, z) or the widened code, then y = fma(x[k], w, y) in order
 * over k; exact integer sums for int8 activations -- so the numbers are bit for bit the generic code's. */
static inline __m256i widen8_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256i widen8_i8(const int8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

static inline __attribute__((always_inline)) void q4_block_avx2(const float *x, int64_t ldx, const int M,
                                                                const int NT, const uint8_t *codes,
                                                                const uint16_t *sz, int64_t K, float *y,
                                                                int64_t ldy) {
    __m256 acc[QMM_MAX_ROWS][2][2];
    const int64_t G = K / 32, tile_codes = K * 8, tile_sz = G * 32;
    const __m256i low = _mm256_set1_epi32(15);
#pragma GCC unroll 4
    for (int m = 0; m < M; m++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) acc[m][t][0] = acc[m][t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 s[2][2], z[2][2];
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) {
            const uint16_t *p = sz + t * tile_sz + g * 32;
            s[t][0] = load8h(p), s[t][1] = load8h(p + 8), z[t][0] = load8h(p + 16), z[t][1] = load8h(p + 24);
        }
        for (int j = 0; j < 16; j++) {
            const int64_t k = g * 32 + 2 * j;
#pragma GCC unroll 2
            for (int t = 0; t < NT; t++) {
                const uint8_t *c = codes + t * tile_codes + (k / 2) * 16;
                __m256 lo[2], hi[2];
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i q = widen8_u8(c + 8 * h);
                    lo[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low)), s[t][h], z[t][h]);
                    hi[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), s[t][h], z[t][h]);
                }
#pragma GCC unroll 4
                for (int m = 0; m < M; m++) {
                    const __m256 a = _mm256_broadcast_ss(x + m * ldx + k), b = _mm256_broadcast_ss(x + m * ldx + k + 1);
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++)
                        acc[m][t][h] = _mm256_fmadd_ps(b, hi[h], _mm256_fmadd_ps(a, lo[h], acc[m][t][h]));
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; m++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + m * ldy + 16 * t + 8 * h, acc[m][t][h]);
}

static inline __attribute__((always_inline)) void q8_block_avx2(const float *x, int64_t ldx, const int M,
                                                                const int NT, const int8_t *codes,
                                                                const float *scale, int64_t K, float *y,
                                                                int64_t ldy) {
    const int64_t tile_codes = K * 16;
    __m256 acc[QMM_MAX_ROWS_Q8][2][2];
#pragma GCC unroll 6
    for (int m = 0; m < M; m++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) acc[m][t][0] = acc[m][t][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) {
            const int8_t *c = codes + t * tile_codes + k * 16;
            const __m256 w0 = _mm256_cvtepi32_ps(widen8_i8(c)), w1 = _mm256_cvtepi32_ps(widen8_i8(c + 8));
#pragma GCC unroll 6
            for (int m = 0; m < M; m++) {
                const __m256 a = _mm256_broadcast_ss(x + m * ldx + k);
                acc[m][t][0] = _mm256_fmadd_ps(a, w0, acc[m][t][0]);
                acc[m][t][1] = _mm256_fmadd_ps(a, w1, acc[m][t][1]);
            }
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < M; m++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(y + m * ldy + 16 * t + 8 * h,
                                 _mm256_mul_ps(acc[m][t][h], _mm256_loadu_ps(scale + 16 * t + 8 * h)));
}
#endif

static inline __attribute__((always_inline)) void q4_block(const float *x, int64_t ldx, const int M, const int NT,
                                                           const uint8_t *codes, const uint16_t *sz, int64_t K,
                                                           float *y, int64_t ldy) {
#if AVX2_ONLY
    q4_block_avx2(x, ldx, M, NT, codes, sz, K, y, ldy);
#else
    v16 acc[QMM_MAX_ROWS][QMM_MAX_TILES];
    const int64_t G = K / 32, tile_codes = K * 8, tile_sz = G * 32;
#pragma GCC unroll 12
    for (int m = 0; m < M; m++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[m][t] = (v16){0};
    for (int64_t g = 0; g < G; g++) {
        v16 s[QMM_MAX_TILES], z[QMM_MAX_TILES];
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            s[t] = load_half16(sz + t * tile_sz + g * 32);
            z[t] = load_half16(sz + t * tile_sz + g * 32 + 16);
        }
        for (int j = 0; j < 16; j++) {
            const int64_t k = g * 32 + 2 * j;
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                i32x16 q = widen_u8(codes + t * tile_codes + (k / 2) * 16);
                v16 lo = __builtin_convertvector(q & 15, v16) * s[t] + z[t];
                v16 hi = __builtin_convertvector(q >> 4, v16) * s[t] + z[t];
#pragma GCC unroll 12
                for (int m = 0; m < M; m++) {
                    acc[m][t] = x[m * ldx + k] * lo + acc[m][t];
                    acc[m][t] = x[m * ldx + k + 1] * hi + acc[m][t];
                }
            }
        }
    }
#pragma GCC unroll 12
    for (int m = 0; m < M; m++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) *(v16u *)(y + m * ldy + 16 * t) = acc[m][t];
#endif
}

static inline __attribute__((always_inline)) void q8_block(const float *x, int64_t ldx, const int M, const int NT,
                                                           const int8_t *codes, const float *scale, int64_t K,
                                                           float *y, int64_t ldy) {
#if AVX2_ONLY
    q8_block_avx2(x, ldx, M, NT, codes, scale, K, y, ldy);
#else
    v16 acc[QMM_MAX_ROWS][QMM_MAX_TILES];
    const int64_t tile_codes = K * 16;
#pragma GCC unroll 12
    for (int m = 0; m < M; m++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[m][t] = (v16){0};
    for (int64_t k = 0; k < K; k++) {
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            v16 w = __builtin_convertvector(widen_i8(codes + t * tile_codes + k * 16), v16);
#pragma GCC unroll 12
            for (int m = 0; m < M; m++) acc[m][t] = x[m * ldx + k] * w + acc[m][t];
        }
    }
#pragma GCC unroll 12
    for (int m = 0; m < M; m++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) *(v16u *)(y + m * ldy + 16 * t) = acc[m][t] * load16(scale + 16 * t);
#endif
}

/* int4 weights times int8 activations (kind 5; `pack_int4_a8`): per row and group of 32 inputs the
 * activations are x ~= dx * qx, qx int8 = round(x / dx), dx = max |x| / 127, with sx = dx * sum(qx)
 * (`quantize_rows_q8`), and per group
 *     y += (s dx) * sum_k q[k] qx[k] + z sx              (the integer sum exact, then two FMAs)
 * which is llama.cpp's Q4_1 x Q8_1 dot product. The codes of a tile and group are 4 blocks of 64
 * bytes, block j's lane i holding q[16t+i][8j + b] (low nibble) and q[16t+i][8j + 4 + b] (high) in
 * byte b = 0..3: one u8 x s8 dot-product instruction per 4 inputs and row (AVX-512 VNNI). */
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef int8_t i8x64 __attribute__((vector_size(64)));

static inline i32x16 dot_u8_s8(i32x16 acc, u8x64 w, const int8_t *x4) {
#if defined(__AVX512VNNI__)
    int32_t xs;
    memcpy(&xs, x4, 4);
    return (i32x16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(xs));
#else
    typedef uint32_t u32x16 __attribute__((vector_size(64)));
    u32x16 lanes;
    memcpy(&lanes, &w, 64);      /* lane i's 4 bytes: the codes of its 4 inputs, byte b the b-th */
    for (int b = 0; b < 4; b++) acc += (i32x16)((lanes >> (8 * b)) & 0xff) * (int32_t)x4[b];
    return acc;
#endif
}

#if AVX2_ONLY
/* AVX2: the u8 x s8 products of a group summed in 16-bit lanes (maddubs adds pairs, at most
 * 2 * 15 * 127 in magnitude; eight of them, the group's 32 inputs, at most 30,480: exact), then
 * pairs of those into 32 bits once per group: the same exact integer sums as four inputs at a time.
 * The float sums of the block live in `acc` (L1) between groups, so the registers hold the 16-bit
 * sums of every row and the unpacked codes of one half tile, and a block takes up to 5 rows. */
static inline __attribute__((always_inline)) void q4a8_block_avx2(const int8_t *qx, const float *dx,
                                                                  const float *sx, int M, int NT,
                                                                  const uint8_t *codes, const uint16_t *sz,
                                                                  int64_t K, float *y, int64_t ldy) {
    float acc[QMM_MAX_ROWS_A8][2][16] __attribute__((aligned(32)));
    const int64_t G = K / 32, tile_codes = K * 8, tile_sz = G * 32;
    const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 5
    for (int m = 0; m < M; m++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++) _mm256_store_ps(acc[m][t] + 8 * h, _mm256_setzero_ps());
    for (int64_t g = 0; g < G; g++) {
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) {
            const uint8_t *c = codes + t * tile_codes + g * 4 * 64;
            const uint16_t *p = sz + t * tile_sz + g * 32;
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256i isum[QMM_MAX_ROWS_A8];
#pragma GCC unroll 5
                for (int m = 0; m < M; m++) isum[m] = _mm256_setzero_si256();
#pragma GCC unroll 1
                for (int j = 0; j < 4; j++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(c + j * 64 + 32 * h));
                    const __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
#pragma GCC unroll 5
                    for (int m = 0; m < M; m++) {
                        int32_t xl, xh;
                        memcpy(&xl, qx + m * K + g * 32 + 8 * j, 4);
                        memcpy(&xh, qx + m * K + g * 32 + 8 * j + 4, 4);
                        const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)),
                                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
                        isum[m] = _mm256_add_epi16(isum[m], d);
                    }
                }
                const __m256 s = load8h(p + 8 * h), z = load8h(p + 16 + 8 * h);
#pragma GCC unroll 5
                for (int m = 0; m < M; m++) {
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[m], ones));
                    __m256 a = _mm256_load_ps(acc[m][t] + 8 * h);
                    a = _mm256_fmadd_ps(f, _mm256_mul_ps(s, _mm256_set1_ps(dx[m * G + g])), a);
                    a = _mm256_fmadd_ps(z, _mm256_set1_ps(sx[m * G + g]), a);
                    _mm256_store_ps(acc[m][t] + 8 * h, a);
                }
            }
        }
    }
#pragma GCC unroll 5
    for (int m = 0; m < M; m++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + m * ldy + 16 * t + 8 * h, _mm256_load_ps(acc[m][t] + 8 * h));
}
#endif

static inline __attribute__((always_inline)) void q4a8_block(const int8_t *qx, const float *dx, const float *sx,
                                                             int M, int NT, const uint8_t *codes, const uint16_t *sz,
                                                             int64_t K, float *y, int64_t ldy) {
#if AVX2_ONLY
    q4a8_block_avx2(qx, dx, sx, M, NT, codes, sz, K, y, ldy);
#else
    v16 acc[QMM_MAX_ROWS_A8][QMM_MAX_TILES];
    const int64_t G = K / 32, tile_codes = K * 8, tile_sz = G * 32;
#pragma GCC unroll 8
    for (int m = 0; m < M; m++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[m][t] = (v16){0};
    for (int64_t g = 0; g < G; g++) {
        i32x16 isum[QMM_MAX_ROWS_A8][QMM_MAX_TILES];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) isum[m][t] = (i32x16){0};
        for (int j = 0; j < 4; j++) {
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                u8x64 w;
                memcpy(&w, codes + t * tile_codes + (g * 4 + j) * 64, 64);
                const u8x64 lo = w & 15, hi = w >> 4;
#pragma GCC unroll 8
                for (int m = 0; m < M; m++) {
                    isum[m][t] = dot_u8_s8(isum[m][t], lo, qx + m * K + g * 32 + 8 * j);
                    isum[m][t] = dot_u8_s8(isum[m][t], hi, qx + m * K + g * 32 + 8 * j + 4);
                }
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const v16 s = load_half16(sz + t * tile_sz + g * 32), z = load_half16(sz + t * tile_sz + g * 32 + 16);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                acc[m][t] = __builtin_convertvector(isum[m][t], v16) * (s * dx[m * G + g]) + acc[m][t];
                acc[m][t] = z * sx[m * G + g] + acc[m][t];
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) *(v16u *)(y + m * ldy + 16 * t) = acc[m][t];
#endif
}

/* x [M, K] -> qx int8 [M, K], dx and sx fp32 [M, K / 32] (the q4a8 kernel's activations, above):
 * qx = sign(v) floor(|v| + 1/2) for v = x / dx (in fp32: round half away from zero, as llama.cpp's
 * Q8_1 up to the last bit of v) */
static void quantize_rows_q8(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *qx, float *dx, float *sx) {
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + m * ldx + g * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) {
                const float a = fabsf(xg[i]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t q[32], sum = 0;
            for (int i = 0; i < 32; i++) {
                const float v = xg[i] * id;
                const int32_t r = (int32_t)(fabsf(v) + 0.5f);
                q[i] = v < 0.0f ? -r : r;
            }
            for (int i = 0; i < 32; i++) {
                qx[m * K + g * 32 + i] = (int8_t)q[i];
                sum += q[i];
            }
            dx[m * G + g] = d;
            sx[m * G + g] = d * (float)sum;
        }
}

/* the instances: for a block of M rows up to 8 / M tiles a step (at least 8 chains in flight for one
 * row, few enough accumulators for the registers); M and NT constants in each, so the accumulators
 * live in registers */
#define QMM_CALL(M, NT)                                                                                  \
    do {                                                                                                 \
        if (kind == 4 && M <= QMM_MAX_ROWS) q4_block(x, ldx, M, NT, (const uint8_t *)codes, (const uint16_t *)scales, K, y, ldy); \
        else if (kind == 8 && M <= QMM_MAX_ROWS_Q8) q8_block(x, ldx, M, NT, (const int8_t *)codes, (const float *)scales, K, y, ldy); \
        else if (kind == 5 && M <= QMM_MAX_ROWS_A8)                                                      \
            q4a8_block(a8->qx, a8->dx, a8->sx, M, NT, (const uint8_t *)codes, (const uint16_t *)scales, K, y, ldy); \
    } while (0)
typedef struct { const int8_t *qx; const float *dx, *sx; } a8_rows;
static void qmm_step(int kind, const float *x, int64_t ldx, const a8_rows *a8, int M, int NT, const void *codes,
                     const void *scales, int64_t K, float *y, int64_t ldy) {
    switch (NT * 16 + M) {
    case 2 * 16 + 1: QMM_CALL(1, 2); break;
    case 2 * 16 + 2: QMM_CALL(2, 2); break;
    case 1 * 16 + 1: QMM_CALL(1, 1); break;
    case 1 * 16 + 2: QMM_CALL(2, 1); break;
    case 1 * 16 + 3: QMM_CALL(3, 1); break;
    case 1 * 16 + 4: QMM_CALL(4, 1); break;
#if AVX2_ONLY
    case 1 * 16 + 5: QMM_CALL(5, 1); break;    /* int8 activations and int8 weights */
    case 1 * 16 + 6: QMM_CALL(6, 1); break;    /* int8 weights (QMM_MAX_ROWS_Q8) */
#endif
#if QMM_WIDE
    case 8 * 16 + 1: QMM_CALL(1, 8); break;
    case 4 * 16 + 1: QMM_CALL(1, 4); break;
    case 4 * 16 + 2: QMM_CALL(2, 4); break;
    case 2 * 16 + 3: QMM_CALL(3, 2); break;
    case 2 * 16 + 4: QMM_CALL(4, 2); break;
    case 2 * 16 + 5: QMM_CALL(5, 2); break;
    case 2 * 16 + 6: QMM_CALL(6, 2); break;
    case 2 * 16 + 7: QMM_CALL(7, 2); break;
    case 2 * 16 + 8: QMM_CALL(8, 2); break;
    case 2 * 16 + 9: QMM_CALL(9, 2); break;
    case 2 * 16 + 10: QMM_CALL(10, 2); break;
    case 2 * 16 + 11: QMM_CALL(11, 2); break;
    case 2 * 16 + 12: QMM_CALL(12, 2); break;
    case 1 * 16 + 5: QMM_CALL(5, 1); break;
    case 1 * 16 + 6: QMM_CALL(6, 1); break;
    case 1 * 16 + 7: QMM_CALL(7, 1); break;
    case 1 * 16 + 8: QMM_CALL(8, 1); break;
    case 1 * 16 + 9: QMM_CALL(9, 1); break;
    case 1 * 16 + 10: QMM_CALL(10, 1); break;
    case 1 * 16 + 11: QMM_CALL(11, 1); break;
    case 1 * 16 + 12: QMM_CALL(12, 1); break;
#endif
    }
}

/* tiles per step for a block of M rows: enough independent chains, few enough accumulators for the
 * registers (32 vectors with AVX-512; with AVX2 a 16-lane vector is two of its 16 registers) */
static inline int qmm_tiles(int kind, int M) {
#if QMM_WIDE
    if (kind == 5) return M == 1 ? 8 : (M == 2 ? 4 : (M <= 4 ? 2 : 1));
    return M == 1 ? 8 : (M == 2 ? 4 : 2);
#else
    /* int4 x int8 (kind 5): two rows take one tile a step, as three do -- measured 10 % faster than two
     * tiles on a 2-core AVX2 EPYC (the layer stack's matmuls, interleaved, median of 40) */
    return M <= (kind == 5 ? 1 : 2) ? 2 : 1;
#endif
}

/* kind 4 (int4 weights, fp32 activations), 8 (int8 weights) or 5 (int4 weights, int8 activations);
 * x [M, K] fp32 (row stride ldx), y [M, N] fp32 (row stride ldy); N a multiple of 16, K of 32
 * (int4). Returns 0, or -1 when scratch memory could not be had. */
static int quant_matmul_body(int kind, const float *x, int64_t ldx, const void *codes, const void *scales, float *y,
                             int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t max_rows = kind == 5 ? QMM_MAX_ROWS_A8 : (kind == 8 ? QMM_MAX_ROWS_Q8 : QMM_MAX_ROWS);
    const int64_t tiles = N / 16, blocks = (M + max_rows - 1) / max_rows;
    const int64_t tile_codes = kind == 8 ? K * 16 : K * 8;             /* bytes */
    const int64_t tile_scales = kind == 8 ? 64 : (K / 32) * 64;        /* bytes */
    int8_t *scratch = NULL;
    a8_rows a8 = {0};
    if (kind == 5) {
        scratch = malloc(M * K + 2 * sizeof(float) * M * (K / 32) + 64);
        if (!scratch) return -1;
        float *f = (float *)(scratch + ((M * K + 63) / 64) * 64);
        quantize_rows_q8(x, ldx, M, K, scratch, f, f + M * (K / 32));
        a8 = (a8_rows){scratch, f, f + M * (K / 32)};
    }
#pragma omp parallel num_threads(threads_for(nthreads, tiles * K * (M < 4 ? M : 4), 4096))
    {
        int nth = 1, me = 0;
#ifdef _OPENMP
        nth = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
        const int64_t t0 = tiles * me / nth, t1 = tiles * (me + 1) / nth;
        for (int64_t c = t0; c < t1; c += QMM_CHUNK) {
            const int64_t c1 = c + QMM_CHUNK < t1 ? c + QMM_CHUNK : t1;
            for (int64_t b = 0; b < blocks; b++) {
                /* rows split evenly over the blocks: 13 rows are 7 + 6, not 12 + 1 */
                const int64_t r0 = b * M / blocks, r1 = (b + 1) * M / blocks;
                const int rows = (int)(r1 - r0);
                const a8_rows a8b = {a8.qx + r0 * K, a8.dx + r0 * (K / 32), a8.sx + r0 * (K / 32)};
                for (int64_t t = c; t < c1;) {
                    int step = qmm_tiles(kind, rows);
                    while (t + step > c1) step /= 2;
                    qmm_step(kind, x + r0 * ldx, ldx, &a8b, rows, step, (const char *)codes + t * tile_codes,
                             (const char *)scales + t * tile_scales, K, y + r0 * ldy + t * 16, ldy);
                    t += step;
                }
            }
        }
    }
    free(scratch);
    return 0;
}
#pragma GCC pop_options

/* ---- decoder layers in one call ----------------------------------------------------------------
 * A run of Llama decoder layers whose four projections are all native quantized weights (no bias),
 * each layer the calls that kernels/cpu.py makes one by one (engine.model.DecoderLayer.forward_native):
 *     x = rms_norm(h [+= delta])           qkv = x W_qkv^T     attn = rope_cache_attention(qkv)
 *     x = rms_norm(h += attn W_o^T)        delta = silu_mul(x W_gu^T) W_down^T
 * with the residual stream h + delta carried between layers (delta written to `delta` at the end;
 * has_delta: whether `delta` holds one on entry). The same functions, so the same numbers, minus
 * the per-call overhead of ~8 calls a layer from Python.
 */
typedef struct {
    const float *input_norm, *post_norm;
    const void *codes[4], *scales[4];     /* qkv, o, gate_up, down */
    int64_t kind[4], n[4];
    void *k_cache, *v_cache;
} layer_params;

/* Phase timers (built with -DSPECSERVE_PHASE_TIMES: kernels/cpu.py under SPECSERVE_CPU_PHASE_TIMES=1,
 * for `specserve bench step`): seconds spent in [0] the layer stack's matmuls, [1] its attention
 * (RoPE, cache write, attention), [2] the rest of it (norms, SiLU, scratch), [3] matmuls called
 * alone (the LM head). `phase_times` reads and resets them; all 0 in a normal build. */
static double phase_seconds[4];
static int in_layer_stack;

static double now_seconds(void) {
#ifdef _OPENMP
    return omp_get_wtime();
#else
    return 0.0;
#endif
}

int phase_times(double *out) {
    for (int i = 0; i < 4; i++) { out[i] = phase_seconds[i]; phase_seconds[i] = 0.0; }
#ifdef SPECSERVE_PHASE_TIMES
    return 1;
#else
    return 0;
#endif
}

int quant_matmul(int kind, const float *x, int64_t ldx, const void *codes, const void *scales, float *y,
                 int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
#ifdef SPECSERVE_PHASE_TIMES
    const double t0 = now_seconds();
    const int rc = quant_matmul_body(kind, x, ldx, codes, scales, y, ldy, M, N, K, nthreads);
    phase_seconds[in_layer_stack ? 0 : 3] += now_seconds() - t0;
    return rc;
#else
    return quant_matmul_body(kind, x, ldx, codes, scales, y, ldy, M, N, K, nthreads);
#endif
}

int decoder_layers(const layer_params *layers, int64_t num_layers, float *h, float *delta, int has_delta, int64_t T,
                   int64_t hidden, int64_t inter, int64_t H, int64_t Hkv, int64_t D, float eps, float scale,
                   const float *cos, const float *sin_signed, const int64_t *slots, int64_t num_seqs,
                   const int32_t *cu_q, const int32_t *context_lens, const int32_t *block_tables, int64_t table_width,
                   int64_t block_size, const int32_t *mask_offsets, const int32_t *mask_widths,
                   const uint8_t *mask_data, int kv_f16, int nthreads, float *captured,
                   const int64_t *capture_slot, int64_t num_slots) {
    /* captured (may be NULL): [T, num_slots, hidden]; after layer l with capture_slot[l] >= 0, row t's
     * slot capture_slot[l] gets h + delta, the residual stream the next layer's norm reads */
    const int64_t nqkv = (H + 2 * Hkv) * D;
    float *x = malloc(sizeof(float) * T * (hidden + nqkv + H * D + 3 * inter + hidden));
    if (!x) return -1;
    float *qkv = x + T * hidden, *attn = qkv + T * nqkv, *gu = attn + T * H * D, *act = gu + T * 2 * inter;
    float *o = act + T * inter;
    int rc = 0;
#ifdef SPECSERVE_PHASE_TIMES
    const double start = now_seconds(), matmuls = phase_seconds[0], attention = phase_seconds[1];
    in_layer_stack = 1;
#endif
    for (int64_t l = 0; l < num_layers && rc == 0; l++) {
        const layer_params *p = layers + l;
        if (has_delta) rms_norm(delta, 0, h, h, p->input_norm, x, 0, T, hidden, eps, nthreads);
        else rms_norm(h, 0, NULL, NULL, p->input_norm, x, 0, T, hidden, eps, nthreads);
        rc |= quant_matmul((int)p->kind[0], x, hidden, p->codes[0], p->scales[0], qkv, nqkv, T, nqkv, hidden, nthreads);
#ifdef SPECSERVE_PHASE_TIMES
        const double t_attn = now_seconds();
#endif
        rope_cache_attention(qkv, 0, cos, sin_signed, slots, p->k_cache, p->v_cache, kv_f16, attn, 0, num_seqs, cu_q,
                             context_lens, block_tables, table_width, block_size, mask_offsets, mask_widths,
                             mask_data, H, Hkv, D, scale, nthreads);
#ifdef SPECSERVE_PHASE_TIMES
        phase_seconds[1] += now_seconds() - t_attn;
#endif
        rc |= quant_matmul((int)p->kind[1], attn, H * D, p->codes[1], p->scales[1], o, hidden, T, hidden, H * D,
                           nthreads);
        rms_norm(o, 0, h, h, p->post_norm, x, 0, T, hidden, eps, nthreads);
        rc |= quant_matmul((int)p->kind[2], x, hidden, p->codes[2], p->scales[2], gu, 2 * inter, T, 2 * inter, hidden,
                           nthreads);
        silu_mul(gu, 0, act, 0, T, inter, nthreads);
        rc |= quant_matmul((int)p->kind[3], act, inter, p->codes[3], p->scales[3], delta, hidden, T, hidden, inter,
                           nthreads);
        has_delta = 1;
        if (captured && capture_slot[l] >= 0) {
            for (int64_t t = 0; t < T; t++) {
                float *dst = captured + (t * num_slots + capture_slot[l]) * hidden;
                const float *a = h + t * hidden, *b = delta + t * hidden;
                for (int64_t i = 0; i < hidden; i++) dst[i] = a[i] + b[i];
            }
        }
    }
    free(x);
#ifdef SPECSERVE_PHASE_TIMES
    in_layer_stack = 0;
    phase_seconds[2] += now_seconds() - start - (phase_seconds[0] - matmuls) - (phase_seconds[1] - attention);
#endif
    return rc;
}

/* ---- after the forward: greedy tree verification and the accepted path's KV commit ------------
 *
 * On the CPU a host read costs nothing, so the walks that the torch references (engine/verify.py,
 * kernels/kv_compact.py) express as ~40 tensor operations over [T, N, N] relations run here as the
 * loops they describe: microseconds instead of a millisecond per step. */

/* `engine.verify.verify_greedy_batched_reference`'s result for T trees padded to N nodes
 * (`tree.pack_trees`: parents[i] < i, roots first, -1 for a root and for padding), rows of
 * `BatchVerifyResult.stacked()`: [path (D+1) | tokens (D+1) | accepted | root | alternates (W-1)].
 * Each root's walk moves from a node into its first child (lowest index) whose token is the
 * target's argmax at the node, until none is; the longest walk wins, ties to the lowest root; the
 * bonus token is the argmax at its end. argmax: [T, N] with row stride `stride_a`. */
void verify_greedy(const int64_t *tokens, const int64_t *parents, int64_t N, const int64_t *num_nodes,
                   const int64_t *num_roots, const int64_t *argmax, int64_t stride_a, int64_t T, int64_t D,
                   int64_t W, int64_t *out) {
    const int64_t d1 = D + 1, width = 2 * d1 + 2 + (W - 1);
    int64_t *walk = malloc(2 * d1 * sizeof(int64_t)), *best = walk + d1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t *tok = tokens + t * N, *par = parents + t * N, *am = argmax + t * stride_a;
        const int64_t n = num_nodes[t] < N ? num_nodes[t] : N, roots = num_roots[t];
        int64_t best_len = -1, best_root = 0, bonus = 0;
        for (int64_t r = 0; r < roots && r < n; r++) {
            int64_t cur = r, len = 0, want = am[cur];
            walk[0] = r;
            while (len < D) {
                int64_t next = -1;
                for (int64_t j = cur + 1; j < n; j++)
                    if (par[j] == cur && tok[j] == want) { next = j; break; }
                if (next < 0) break;
                walk[++len] = cur = next;
                want = am[cur];
            }
            if (len > best_len) {
                memcpy(best, walk, (len + 1) * sizeof(int64_t));
                best_len = len, best_root = r, bonus = want;
            }
        }
        int64_t *row = out + t * width;
        for (int64_t k = 0; k < width; k++) row[k] = -1;
        if (best_len < 0) { row[2 * d1] = 0; row[2 * d1 + 1] = 0; continue; }   /* no node: nothing to walk */
        for (int64_t k = 0; k <= best_len; k++) row[k] = best[k];
        for (int64_t k = 0; k < best_len; k++) row[d1 + k] = tok[best[k + 1]];
        row[d1 + best_len] = bonus;
        row[2 * d1] = best_len;
        row[2 * d1 + 1] = best_root;
    }
    free(walk);
}

/* `kernels.kv_compact.compact_tree_kv`: sequence t's accepted path (node indices, increasing) moves
 * from position prefix[t] + paths[t, i] to prefix[t] + i, for i < path_lens[t], in every one of the
 * `planes` (K and V of each layer) of the cache. Strides in bytes: `plane_stride` between planes,
 * `slot_stride` between slots; a slot's row is `row_bytes` contiguous bytes. Pairs are moved in
 * increasing i, each read before the next is written (the overlap argument of kv_compact.py);
 * identity pairs (a path that is the chain's prefix) move nothing. */
void compact_tree_kv(char *kv, int64_t planes, int64_t plane_stride, int64_t slot_stride, int64_t row_bytes,
                     const void *tables, int tables_i32, int64_t table_stride, int64_t table_width,
                     int64_t block_size, const int64_t *prefix, const int64_t *paths, int64_t path_stride,
                     const int64_t *path_lens, int64_t T, int64_t P) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t n = path_lens[t] < P ? path_lens[t] : P;
        for (int64_t i = 0; i < n; i++) {
            const int64_t node = paths[t * path_stride + i];
            if (node < 0 || node == i) continue;
            int64_t slot[2];
            for (int s = 0; s < 2; s++) {
                const int64_t pos = prefix[t] + (s ? i : node);
                int64_t blk = pos / block_size;
                blk = blk < 0 ? 0 : blk >= table_width ? table_width - 1 : blk;
                const int64_t b = tables_i32 ? ((const int32_t *)tables)[t * table_stride + blk]
                                             : ((const int64_t *)tables)[t * table_stride + blk];
                slot[s] = b * block_size + pos % block_size;
            }
            for (int64_t p = 0; p < planes; p++)
                memmove(kv + p * plane_stride + slot[1] * slot_stride, kv + p * plane_stride + slot[0] * slot_stride,
                        row_bytes);
        }
    }
}
