// The AVX-512 path (F/BW/VL): 16 floats per vector, two vectors per iteration, one pass over
// memory. bf16 is converted with integer bit operations (round to nearest even, NaN kept quiet)
// rather than the AVX512_BF16 instructions, which not every AVX-512 CPU has and which flush
// denormals; fp16 uses the AVX-512F vcvtph2ps/vcvtps2ph. The operation order is that of
// scalar_math.h (no FMA), so results equal the scalar path's bit for bit; the tail (fewer than 32
// elements) runs the scalar loop itself.
#include <immintrin.h>

#include "kernels.h"
#include "scalar_math.h"

namespace deepshard::cpu {
namespace {

constexpr int64_t kBlock = 32;  // elements per loop iteration (two zmm vectors)

template <DType T>
inline __m512 load16(const void* base, int64_t i) {
    if constexpr (T == DType::f32) {
        return _mm512_loadu_ps(static_cast<const float*>(base) + i);
    } else {
        __m256i h = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
        if constexpr (T == DType::bf16) {
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        } else {
            return _mm512_cvtph_ps(h);
        }
    }
}

inline __m256i f32_to_bf16_16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet_nan));
}

template <DType T>
inline void store16(void* base, int64_t i, __m512 x) {
    if constexpr (T == DType::f32) {
        _mm512_storeu_ps(static_cast<float*>(base) + i, x);
    } else if constexpr (T != DType::none) {
        __m256i h;
        if constexpr (T == DType::bf16) {
            h = f32_to_bf16_16(x);
        } else {
            h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), h);
    }
}

struct AdamVec {
    __m512 decay, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2;
    __m512 bias_correction2_sqrt, eps, step_size;
    explicit AdamVec(const AdamConsts& c)
        : decay(_mm512_set1_ps(c.decay)),
          weight_decay(_mm512_set1_ps(c.weight_decay)),
          beta1(_mm512_set1_ps(c.beta1)),
          one_minus_beta1(_mm512_set1_ps(c.one_minus_beta1)),
          beta2(_mm512_set1_ps(c.beta2)),
          one_minus_beta2(_mm512_set1_ps(c.one_minus_beta2)),
          bias_correction2_sqrt(_mm512_set1_ps(c.bias_correction2_sqrt)),
          eps(_mm512_set1_ps(c.eps)),
          step_size(_mm512_set1_ps(c.step_size)) {}
};

template <bool AdamW, DType P, DType G, DType S, DType O>
inline void adam16(const AdamVec& k, const StepBuffers& b, int64_t i) {
    __m512 p = load16<P>(b.param, i);
    __m512 g = load16<G>(b.grad, i);
    __m512 m = load16<S>(b.exp_avg, i);
    __m512 v = load16<S>(b.exp_avg_sq, i);
    if constexpr (AdamW) {
        p = _mm512_mul_ps(p, k.decay);
    } else {
        g = _mm512_add_ps(g, _mm512_mul_ps(k.weight_decay, p));
    }
    m = _mm512_add_ps(_mm512_mul_ps(k.beta1, m), _mm512_mul_ps(k.one_minus_beta1, g));
    v = _mm512_add_ps(_mm512_mul_ps(k.beta2, v), _mm512_mul_ps(_mm512_mul_ps(k.one_minus_beta2, g), g));
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), k.bias_correction2_sqrt), k.eps);
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(k.step_size, m), denom));
    store16<P>(b.param, i, p);
    store16<S>(b.exp_avg, i, m);
    store16<S>(b.exp_avg_sq, i, v);
    store16<O>(b.param_out, i, p);
}

template <bool AdamW, DType P, DType G, DType S, DType O>
void adam_loop(const AdamConsts& c, const StepBuffers& b, int64_t begin, int64_t end) {
    const AdamVec k(c);
    int64_t i = begin;
    for (; i + kBlock <= end; i += kBlock) {
        adam16<AdamW, P, G, S, O>(k, b, i);
        adam16<AdamW, P, G, S, O>(k, b, i + 16);
    }
    adam_scalar_loop<P, G, S, O>(c, b, i, end);
}

template <DType P, DType G, DType S, DType O>
inline void lion16(const LionConsts& c, const StepBuffers& b, int64_t i) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 minus_one = _mm512_set1_ps(-1.0f);
    __m512 p = load16<P>(b.param, i);
    __m512 g = load16<G>(b.grad, i);
    __m512 m = load16<S>(b.exp_avg, i);
    __m512 u = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(c.beta1), m),
                             _mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta1), g));
    __m512 sign = _mm512_setzero_ps();
    sign = _mm512_mask_mov_ps(sign, _mm512_cmp_ps_mask(u, sign, _CMP_GT_OQ), one);
    sign = _mm512_mask_mov_ps(sign, _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ),
                              minus_one);
    p = _mm512_sub_ps(_mm512_mul_ps(p, _mm512_set1_ps(c.decay)),
                      _mm512_mul_ps(_mm512_set1_ps(c.lr), sign));
    m = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(c.beta2), m),
                      _mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta2), g));
    store16<P>(b.param, i, p);
    store16<S>(b.exp_avg, i, m);
    store16<O>(b.param_out, i, p);
}

template <DType P, DType G, DType S, DType O>
void lion_loop(const LionConsts& c, const StepBuffers& b, int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kBlock <= end; i += kBlock) {
        lion16<P, G, S, O>(c, b, i);
        lion16<P, G, S, O>(c, b, i + 16);
    }
    lion_scalar_loop<P, G, S, O>(c, b, i, end);
}

}  // namespace

void adam_avx512(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
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

void lion_avx512(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
    const LionConsts c = lion_consts(args);
    visit_step_types(buf, [&](auto p, auto g, auto s, auto o) {
        lion_loop<decltype(p)::value, decltype(g)::value, decltype(s)::value, decltype(o)::value>(
            c, buf, begin, end);
    });
}

}  // namespace deepshard::cpu
