// The NEON path (AArch64 Advanced SIMD, baseline armv8-a): 4 floats per vector, two vectors per
// iteration, one pass over memory. Like every path it computes what scalar_math.h computes,
// operation for operation -- a separate multiply and add where it writes `a * b + c` (the TU is
// compiled with -ffp-contract=off, so vmulq/vaddq are not fused into fmla) -- and so matches the
// scalar path bit for bit. Conversions:
//   * bf16 -> f32 is a 16-bit left shift; f32 -> bf16 rounds to nearest even with integer ops
//     and keeps NaN a quiet NaN (sign and top payload bits kept), like f32_to_bf16;
//   * f16 <-> f32 uses FCVTL/FCVTN (base AArch64), which round to nearest even under the
//     default FPCR and quiet NaNs keeping their top payload bits, as f32_to_f16 does.
// The tail (fewer than 8 elements) runs the scalar loop.
#include <arm_neon.h>

#include "kernels.h"
#include "scalar_math.h"

namespace deepshard::cpu {
namespace {

constexpr int64_t kBlock = 8;  // elements per loop iteration (two q registers)

template <DType T>
inline float32x4_t load4(const void* base, int64_t i) {
    if constexpr (T == DType::f32) {
        return vld1q_f32(static_cast<const float*>(base) + i);
    } else {
        const uint16x4_t h = vld1_u16(static_cast<const uint16_t*>(base) + i);
        if constexpr (T == DType::bf16) {
            return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
        } else {
            return vcvt_f32_f16(vreinterpret_f16_u16(h));
        }
    }
}

inline uint16x4_t f32_to_bf16_4(float32x4_t x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t high = vshrq_n_u32(u, 16);
    const uint32x4_t lsb = vandq_u32(high, vdupq_n_u32(1));
    const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb), 16);
    const uint32x4_t quiet_nan = vorrq_u32(high, vdupq_n_u32(0x0040));
    const uint32x4_t is_number = vceqq_f32(x, x);  // all ones unless NaN
    // Every lane holds a value <= 0xFFFF, so narrowing keeps it whole.
    return vmovn_u32(vbslq_u32(is_number, rounded, quiet_nan));
}

template <DType T>
inline void store4(void* base, int64_t i, float32x4_t x) {
    if constexpr (T == DType::f32) {
        vst1q_f32(static_cast<float*>(base) + i, x);
    } else if constexpr (T != DType::none) {
        uint16x4_t h;
        if constexpr (T == DType::bf16) {
            h = f32_to_bf16_4(x);
        } else {
            h = vreinterpret_u16_f16(vcvt_f16_f32(x));
        }
        vst1_u16(static_cast<uint16_t*>(base) + i, h);
    }
}

struct AdamVec {
    float32x4_t decay, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2;
    float32x4_t bias_correction2_sqrt, eps, step_size;
    explicit AdamVec(const AdamConsts& c)
        : decay(vdupq_n_f32(c.decay)),
          weight_decay(vdupq_n_f32(c.weight_decay)),
          beta1(vdupq_n_f32(c.beta1)),
          one_minus_beta1(vdupq_n_f32(c.one_minus_beta1)),
          beta2(vdupq_n_f32(c.beta2)),
          one_minus_beta2(vdupq_n_f32(c.one_minus_beta2)),
          bias_correction2_sqrt(vdupq_n_f32(c.bias_correction2_sqrt)),
          eps(vdupq_n_f32(c.eps)),
          step_size(vdupq_n_f32(c.step_size)) {}
};

template <bool AdamW, DType P, DType G, DType S, DType O>
inline void adam4(const AdamVec& k, const StepBuffers& b, int64_t i) {
    float32x4_t p = load4<P>(b.param, i);
    float32x4_t g = load4<G>(b.grad, i);
    float32x4_t m = load4<S>(b.exp_avg, i);
    float32x4_t v = load4<S>(b.exp_avg_sq, i);
    if constexpr (AdamW) {
        p = vmulq_f32(p, k.decay);
    } else {
        g = vaddq_f32(g, vmulq_f32(k.weight_decay, p));
    }
    m = vaddq_f32(vmulq_f32(k.beta1, m), vmulq_f32(k.one_minus_beta1, g));
    v = vaddq_f32(vmulq_f32(k.beta2, v), vmulq_f32(vmulq_f32(k.one_minus_beta2, g), g));
    const float32x4_t denom = vaddq_f32(vdivq_f32(vsqrtq_f32(v), k.bias_correction2_sqrt), k.eps);
    p = vsubq_f32(p, vdivq_f32(vmulq_f32(k.step_size, m), denom));
    store4<P>(b.param, i, p);
    store4<S>(b.exp_avg, i, m);
    store4<S>(b.exp_avg_sq, i, v);
    store4<O>(b.param_out, i, p);
}

template <bool AdamW, DType P, DType G, DType S, DType O>
void adam_loop(const AdamConsts& c, const StepBuffers& b, int64_t begin, int64_t end) {
    const AdamVec k(c);
    int64_t i = begin;
    for (; i + kBlock <= end; i += kBlock) {
        adam4<AdamW, P, G, S, O>(k, b, i);
        adam4<AdamW, P, G, S, O>(k, b, i + 4);
    }
    adam_scalar_loop<P, G, S, O>(c, b, i, end);
}

struct LionVec {
    float32x4_t decay, lr, beta1, one_minus_beta1, beta2, one_minus_beta2;
    explicit LionVec(const LionConsts& c)
        : decay(vdupq_n_f32(c.decay)),
          lr(vdupq_n_f32(c.lr)),
          beta1(vdupq_n_f32(c.beta1)),
          one_minus_beta1(vdupq_n_f32(c.one_minus_beta1)),
          beta2(vdupq_n_f32(c.beta2)),
          one_minus_beta2(vdupq_n_f32(c.one_minus_beta2)) {}
};

// sign_f32 lane-wise: +1 where x > 0, -1 where x < 0, +0 elsewhere (zeros and NaN).
inline float32x4_t sign4(float32x4_t x) {
    const float32x4_t zero = vdupq_n_f32(0.0f);
    const float32x4_t negative = vbslq_f32(vcltq_f32(x, zero), vdupq_n_f32(-1.0f), zero);
    return vbslq_f32(vcgtq_f32(x, zero), vdupq_n_f32(1.0f), negative);
}

template <DType P, DType G, DType S, DType O>
inline void lion4(const LionVec& k, const StepBuffers& b, int64_t i) {
    float32x4_t p = load4<P>(b.param, i);
    const float32x4_t g = load4<G>(b.grad, i);
    float32x4_t m = load4<S>(b.exp_avg, i);
    const float32x4_t update = vaddq_f32(vmulq_f32(k.beta1, m), vmulq_f32(k.one_minus_beta1, g));
    p = vsubq_f32(vmulq_f32(p, k.decay), vmulq_f32(k.lr, sign4(update)));
    m = vaddq_f32(vmulq_f32(k.beta2, m), vmulq_f32(k.one_minus_beta2, g));
    store4<P>(b.param, i, p);
    store4<S>(b.exp_avg, i, m);
    store4<O>(b.param_out, i, p);
}

template <DType P, DType G, DType S, DType O>
void lion_loop(const LionConsts& c, const StepBuffers& b, int64_t begin, int64_t end) {
    const LionVec k(c);
    int64_t i = begin;
    for (; i + kBlock <= end; i += kBlock) {
        lion4<P, G, S, O>(k, b, i);
        lion4<P, G, S, O>(k, b, i + 4);
    }
    lion_scalar_loop<P, G, S, O>(c, b, i, end);
}

}  // namespace

void adam_neon(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
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

void lion_neon(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
    const LionConsts c = lion_consts(args);
    visit_step_types(buf, [&](auto p, auto g, auto s, auto o) {
        lion_loop<decltype(p)::value, decltype(g)::value, decltype(s)::value, decltype(o)::value>(
            c, buf, begin, end);
    });
}

}  // namespace deepshard::cpu
