// The AVX2 path (with F16C for fp16; compiled with FMA available but, like every path, using a
// separate mul and add so results equal the scalar path's bit for bit): 8 floats per vector, two
// vectors per iteration, one pass over memory. bf16 is converted with integer bit operations
// (round to nearest even, NaN kept quiet). The tail (fewer than 16 elements) runs the scalar loop.
#include <immintrin.h>

#include "kernels.h"
#include "scalar_math.h"

namespace deepshard::cpu {
namespace {

constexpr int64_t kBlock = 16;  // elements per loop iteration (two ymm vectors)

template <DType T>
inline __m256 load8(const void* base, int64_t i) {
    if constexpr (T == DType::f32) {
        return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    } else {
        __m128i h = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
        if constexpr (T == DType::bf16) {
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
            return _mm256_cvtph_ps(h);
        }
    }
}

inline __m128i f32_to_bf16_8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256i r = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet_nan), nan));
    // Every lane holds a value <= 0xFFFF, so the saturating pack is a plain narrowing.
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <DType T>
inline void store8(void* base, int64_t i, __m256 x) {
    if constexpr (T == DType::f32) {
        _mm256_storeu_ps(static_cast<float*>(base) + i, x);
    } else if constexpr (T != DType::none) {
        __m128i h;
        if constexpr (T == DType::bf16) {
            h = f32_to_bf16_8(x);
        } else {
            h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), h);
    }
}

struct AdamVec {
    __m256 decay, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2;
    __m256 bias_correction2_sqrt, eps, step_size;
    explicit AdamVec(const AdamConsts& c)
        : decay(_mm256_set1_ps(c.decay)),
          weight_decay(_mm256_set1_ps(c.weight_decay)),
          beta1(_mm256_set1_ps(c.beta1)),
          one_minus_beta1(_mm256_set1_ps(c.one_minus_beta1)),
          beta2(_mm256_set1_ps(c.beta2)),
          one_minus_beta2(_mm256_set1_ps(c.one_minus_beta2)),
          bias_correction2_sqrt(_mm256_set1_ps(c.bias_correction2_sqrt)),
          eps(_mm256_set1_ps(c.eps)),
          step_size(_mm256_set1_ps(c.step_size)) {}
};

template <bool AdamW, DType P, DType G, DType S, DType O>
inline void adam8(const AdamVec& k, const StepBuffers& b, int64_t i) {
    __m256 p = load8<P>(b.param, i);
    __m256 g = load8<G>(b.grad, i);
    __m256 m = load8<S>(b.exp_avg, i);
    __m256 v = load8<S>(b.exp_avg_sq, i);
    if constexpr (AdamW) {
        p = _mm256_mul_ps(p, k.decay);
    } else {
        g = _mm256_add_ps(g, _mm256_mul_ps(k.weight_decay, p));
    }
    m = _mm256_add_ps(_mm256_mul_ps(k.beta1, m), _mm256_mul_ps(k.one_minus_beta1, g));
    v = _mm256_add_ps(_mm256_mul_ps(k.beta2, v),
                      _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, g), g));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), k.bias_correction2_sqrt), k.eps);
    p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(k.step_size, m), denom));
    store8<P>(b.param, i, p);
    store8<S>(b.exp_avg, i, m);
    store8<S>(b.exp_avg_sq, i, v);
    store8<O>(b.param_out, i, p);
}

template <bool AdamW, DType P, DType G, DType S, DType O>
void adam_loop(const AdamConsts& c, const StepBuffers& b, int64_t begin, int64_t end) {
    const AdamVec k(c);
    int64_t i = begin;
    for (; i + kBlock <= end; i += kBlock) {
        adam8<AdamW, P, G, S, O>(k, b, i);
        adam8<AdamW, P, G, S, O>(k, b, i + 8);
    }
    adam_scalar_loop<P, G, S, O>(c, b, i, end);
}

template <DType P, DType G, DType S, DType O>
inline void lion8(const LionConsts& c, const StepBuffers& b, int64_t i) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 p = load8<P>(b.param, i);
    __m256 g = load8<G>(b.grad, i);
    __m256 m = load8<S>(b.exp_avg, i);
    __m256 u = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(c.beta1), m),
                             _mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta1), g));
    __m256 sign = _mm256_blendv_ps(zero, _mm256_set1_ps(1.0f), _mm256_cmp_ps(u, zero, _CMP_GT_OQ));
    sign = _mm256_blendv_ps(sign, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(u, zero, _CMP_LT_OQ));
    p = _mm256_sub_ps(_mm256_mul_ps(p, _mm256_set1_ps(c.decay)),
                      _mm256_mul_ps(_mm256_set1_ps(c.lr), sign));
    m = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(c.beta2), m),
                      _mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta2), g));
    store8<P>(b.param, i, p);
    store8<S>(b.exp_avg, i, m);
    store8<O>(b.param_out, i, p);
}

template <DType P, DType G, DType S, DType O>
void lion_loop(const LionConsts& c, const StepBuffers& b, int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kBlock <= end; i += kBlock) {
        lion8<P, G, S, O>(c, b, i);
        lion8<P, G, S, O>(c, b, i + 8);
    }
    lion_scalar_loop<P, G, S, O>(c, b, i, end);
}

}  // namespace

void adam_avx2(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
    const AdamConsts c = adam_consts(args);
    visit_step_types(buf, [&](auto p, auto g, auto s, auto o) {
        constexpr DType P = decltype(p)::value, G = decltype(g)::value;
        constexpr DType S = decltype(s)::value, O = decltype(o)::value;
        if (c.adamw_mode) {
            adam_loop<true, P, G, S, O>(c, buf, begin, end);
        } else {
            adam_loop<false, P, G, S, O>(c, buf, begin, end);
        }
    });
}

void lion_avx2(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
    const LionConsts c = lion_consts(args);
    visit_step_types(buf, [&](auto p, auto g, auto s, auto o) {
        lion_loop<decltype(p)::value, decltype(g)::value, decltype(s)::value, decltype(o)::value>(
            c, buf, begin, end);
    });
}

}  // namespace deepshard::cpu
