/* One-pass AdamW over a contiguous range of parameters, for megaray's CPU optimizer shards.
 *
 * Reads every byte of its inputs once and writes every output once: the master weight
 * (fp32, or bf16 stored with stochastic rounding), the gradient (fp32 or bf16, scaled by the
 * clip coefficient), the two Adam moments (fp32, or bf16 rounded to nearest even) and,
 * when the host keeps one, the bf16 compute copy of an fp32 master (rounded to nearest even).
 *
 * The arithmetic is fixed and documented, so megaray.adamw's torch fallback reproduces it
 * bit for bit (every operation is a single IEEE float operation, compiled without
 * contraction into fused multiply-adds and without fast-math):
 *
 *   g  = G * grad_scale
 *   p  = P * decay                      decay = 1 - lr * weight_decay
 *   m  = m + b1c * (g - m)              b1c = 1 - beta1
 *   v  = v * beta2 + (b2c * g) * g      b2c = 1 - beta2
 *   p  = p - (step_size * m) / (sqrt(v) / bc2_sqrt + eps)
 *
 * with step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t), rounded to float by
 * the caller. Stochastic rounding of a bf16 master adds a 16-bit noise, a hash of
 * (sr_key + element offset in its unit), below the bf16 mantissa and truncates: the draw of
 * each element depends on its position in the unit and the step, never on how the unit was
 * cut into pieces or threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does. */
static inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;            /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline uint32_t mix32(uint32_t x) {    /* "lowbias32" integer hash */
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline uint16_t f32_to_bf16_sr(float f, uint32_t noise) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7f800000u) == 0x7f800000u) return f32_to_bf16_rne(f);   /* inf, NaN */
    return (uint16_t)((u + (noise & 0xffffu)) >> 16);
}

#define LOAD_F32(ptr, i) (((const float *)(ptr))[i])
#define LOAD_BF16(ptr, i) bf16_to_f32(((const uint16_t *)(ptr))[i])

/* One specialisation per (master, gradient, moments, compute copy) storage. */
#define ADAMW_KERNEL(NAME, LOAD_P, STORE_P, LOAD_G, LOAD_M, STORE_M, STORE_C)                   \
    static void NAME(void *P, void *C, const void *G, void *M, void *V, int64_t n,               \
                     float grad_scale, float decay, float b1c, float beta2, float b2c,            \
                     float step_size, float bc2_sqrt, float eps, uint32_t sr_key,                 \
                     uint32_t offset) {                                                           \
        (void)C; (void)sr_key; (void)offset;                                                      \
        for (int64_t i = 0; i < n; i++) {                                                         \
            float g = LOAD_G(G, i) * grad_scale;                                                  \
            float p = LOAD_P(P, i) * decay;                                                       \
            float m = LOAD_M(M, i);                                                               \
            float v = LOAD_M(V, i);                                                               \
            m = m + b1c * (g - m);                                                                \
            v = v * beta2 + (b2c * g) * g;                                                        \
            float denom = sqrtf(v) / bc2_sqrt + eps;                                              \
            p = p - (step_size * m) / denom;                                                      \
            STORE_P(P, i, p);                                                                     \
            STORE_M(M, i, m);                                                                     \
            STORE_M(V, i, v);                                                                     \
            STORE_C(C, i, p);                                                                     \
        }                                                                                         \
    }

#define STORE_F32(ptr, i, x) (((float *)(ptr))[i] = (x))
#define STORE_BF16(ptr, i, x) (((uint16_t *)(ptr))[i] = f32_to_bf16_rne(x))
#define STORE_BF16_SR(ptr, i, x) \
    (((uint16_t *)(ptr))[i] = f32_to_bf16_sr((x), mix32(sr_key + offset + (uint32_t)(i))))
#define STORE_NONE(ptr, i, x) ((void)0)

/* master fp32 */
ADAMW_KERNEL(k_f32_gf32_mf32, LOAD_F32, STORE_F32, LOAD_F32, LOAD_F32, STORE_F32, STORE_NONE)
ADAMW_KERNEL(k_f32_gf32_mf32_c, LOAD_F32, STORE_F32, LOAD_F32, LOAD_F32, STORE_F32, STORE_BF16)
ADAMW_KERNEL(k_f32_gbf16_mf32, LOAD_F32, STORE_F32, LOAD_BF16, LOAD_F32, STORE_F32, STORE_NONE)
ADAMW_KERNEL(k_f32_gbf16_mf32_c, LOAD_F32, STORE_F32, LOAD_BF16, LOAD_F32, STORE_F32, STORE_BF16)
ADAMW_KERNEL(k_f32_gf32_mbf16, LOAD_F32, STORE_F32, LOAD_F32, LOAD_BF16, STORE_BF16, STORE_NONE)
ADAMW_KERNEL(k_f32_gf32_mbf16_c, LOAD_F32, STORE_F32, LOAD_F32, LOAD_BF16, STORE_BF16, STORE_BF16)
ADAMW_KERNEL(k_f32_gbf16_mbf16, LOAD_F32, STORE_F32, LOAD_BF16, LOAD_BF16, STORE_BF16, STORE_NONE)
ADAMW_KERNEL(k_f32_gbf16_mbf16_c, LOAD_F32, STORE_F32, LOAD_BF16, LOAD_BF16, STORE_BF16, STORE_BF16)
/* master bf16 (stochastic rounding; never a separate compute copy) */
ADAMW_KERNEL(k_bf16_gf32_mf32, LOAD_BF16, STORE_BF16_SR, LOAD_F32, LOAD_F32, STORE_F32, STORE_NONE)
ADAMW_KERNEL(k_bf16_gbf16_mf32, LOAD_BF16, STORE_BF16_SR, LOAD_BF16, LOAD_F32, STORE_F32, STORE_NONE)
ADAMW_KERNEL(k_bf16_gf32_mbf16, LOAD_BF16, STORE_BF16_SR, LOAD_F32, LOAD_BF16, STORE_BF16, STORE_NONE)
ADAMW_KERNEL(k_bf16_gbf16_mbf16, LOAD_BF16, STORE_BF16_SR, LOAD_BF16, LOAD_BF16, STORE_BF16, STORE_NONE)

typedef void (*kernel_fn)(void *, void *, const void *, void *, void *, int64_t, float, float, float,
                          float, float, float, float, float, uint32_t, uint32_t);

/* flags: bit 0 master bf16, bit 1 gradient bf16, bit 2 moments bf16, bit 3 compute copy. */
static const kernel_fn KERNELS[16] = {
    k_f32_gf32_mf32, k_bf16_gf32_mf32, k_f32_gbf16_mf32, k_bf16_gbf16_mf32,
    k_f32_gf32_mbf16, k_bf16_gf32_mbf16, k_f32_gbf16_mbf16, k_bf16_gbf16_mbf16,
    k_f32_gf32_mf32_c, 0, k_f32_gbf16_mf32_c, 0,
    k_f32_gf32_mbf16_c, 0, k_f32_gbf16_mbf16_c, 0,
};

/* Returns 0, or -1 for a combination that does not exist (a bf16 master with a copy). */
int megaray_adamw(int flags, void *master, void *copy, const void *grad, void *m, void *v, int64_t n,
                  float grad_scale, float decay, float b1c, float beta2, float b2c, float step_size,
                  float bc2_sqrt, float eps, uint32_t sr_key, uint32_t offset) {
    if (flags < 0 || flags > 15 || KERNELS[flags] == 0) return -1;
    KERNELS[flags](master, copy, grad, m, v, n, grad_scale, decay, b1c, beta2, b2c, step_size,
                   bc2_sqrt, eps, sr_key, offset);
    return 0;
}

int megaray_adamw_version(void) { return 1; }
