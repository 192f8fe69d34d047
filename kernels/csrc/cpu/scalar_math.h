// Scalar building blocks shared by every SIMD path: dtype conversions, the per-element Adam and
// Lion updates, and a dtype visitor that turns the runtime (param, grad, state, out) types into
// template arguments. Every element is widened to float on load, updated in float and rounded to
// its buffer's type on store, so a bf16/f16 parameter or moment sees fp32 math with one rounding
// per step, as DeepSpeedCPUAdam does.
//
// Every path computes exactly what these functions compute, operation for operation, so all paths
// give bit-identical results (the parity tests check that). Two rules follow:
//   * no fused multiply-add: every TU is compiled with -ffp-contract=off, and vector code uses a
//     separate mul and add where this file writes `a * b + c`;
//   * the step constants come from `AdamConsts`/`LionConsts` below, computed once in float.
// Conversions round to nearest even (like torch's `.to(torch.bfloat16)` / `.to(torch.float16)`)
// and keep NaN a NaN (quiet bit set, sign and top payload bits kept).
//
// Everything here sits in an anonymous namespace: each path TU is compiled with its own -march
// flags, and a shared inline/template definition with external linkage would let the linker keep
// one TU's copy (say the AVX-512 one) for all of them -- SIGILL on a CPU without AVX-512.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace deepshard::cpu {
namespace {  // internal linkage per TU, see above

inline uint32_t f32_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    return u;
}

inline float f32_from_bits(uint32_t u) {
    float x;
    std::memcpy(&x, &u, sizeof(x));
    return x;
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: quiet it, keep sign/payload
    }
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_f32(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0x1Fu) {
        return f32_from_bits(sign | 0x7F800000u | (mant << 13));
    }
    if (exp == 0) {
        if (mant == 0) {
            return f32_from_bits(sign);
        }
        uint32_t e = 113;  // subnormal: value = mant * 2^-24, renormalized
        while ((mant & 0x400u) == 0) {
            mant <<= 1;
            --e;
        }
        return f32_from_bits(sign | (e << 23) | ((mant & 0x3FFu) << 13));
    }
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) {
        return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // quiet NaN
    }
    if (a >= 0x477FF000u) {  // >= 65520 (and inf): rounds to infinity
        return static_cast<uint16_t>(sign | 0x7C00u);
    }
    if (a < 0x38800000u) {  // below 2^-14: half subnormal (units of 2^-24) or zero
        if (a < 0x33000000u) {
            return static_cast<uint16_t>(sign);  // below 2^-25 rounds to zero
        }
        uint32_t shift = 126u - (a >> 23);
        uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
        uint32_t r = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) {
            ++r;
        }
        return static_cast<uint16_t>(sign | r);
    }
    uint32_t r = a - 0x38000000u;  // rebias the exponent from 127 to 15
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
}

// Reads element i of a buffer of type T as float.
template <DType T>
inline float load_f32(const void* base, int64_t i) {
    if constexpr (T == DType::f32) {
        return static_cast<const float*>(base)[i];
    } else if constexpr (T == DType::bf16) {
        return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    } else {
        static_assert(T == DType::f16, "load_f32: f32, bf16 or f16");
        return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    }
}

// Writes x as element i of a buffer of type T (none: writes nothing).
template <DType T>
inline void store_f32(void* base, int64_t i, float x) {
    if constexpr (T == DType::f32) {
        static_cast<float*>(base)[i] = x;
    } else if constexpr (T == DType::bf16) {
        static_cast<uint16_t*>(base)[i] = f32_to_bf16(x);
    } else if constexpr (T == DType::f16) {
        static_cast<uint16_t*>(base)[i] = f32_to_f16(x);
    }
}

// The constants of one Adam step, in the float values every path uses.
struct AdamConsts {
    float decay;         // 1 - lr * weight_decay (AdamW mode)
    float weight_decay;  // L2 coefficient (Adam mode)
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float bias_correction2_sqrt;
    float eps;
    float step_size;  // lr / bias_correction1
    bool adamw_mode;
};

inline AdamConsts adam_consts(const AdamArgs& a) {
    AdamConsts c;
    c.decay = 1.0f - a.lr * a.weight_decay;
    c.weight_decay = a.weight_decay;
    c.beta1 = a.beta1;
    c.one_minus_beta1 = 1.0f - a.beta1;
    c.beta2 = a.beta2;
    c.one_minus_beta2 = 1.0f - a.beta2;
    c.bias_correction2_sqrt = a.bias_correction2_sqrt;
    c.eps = a.eps;
    c.step_size = a.lr / a.bias_correction1;
    c.adamw_mode = a.adamw_mode;
    return c;
}

// One Adam/AdamW element, in the order torch.optim.AdamW applies the operations:
//   AdamW: p = p * (1 - lr*wd)          Adam: g = g + wd * p
//   m = b1*m + (1-b1)*g ;  v = b2*v + ((1-b2)*g)*g
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps ;  p = p - ((lr / (1 - b1^t)) * m) / denom
inline void adam_scalar_element(const AdamConsts& c, float& p, float g, float& m, float& v) {
    if (c.adamw_mode) {
        p = p * c.decay;
    } else {
        g = g + c.weight_decay * p;
    }
    m = c.beta1 * m + c.one_minus_beta1 * g;
    v = c.beta2 * v + (c.one_minus_beta2 * g) * g;
    float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
    p = p - (c.step_size * m) / denom;
}

struct LionConsts {
    float decay;  // 1 - lr * weight_decay
    float lr;
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
};

inline LionConsts lion_consts(const LionArgs& a) {
    LionConsts c;
    c.decay = 1.0f - a.lr * a.weight_decay;
    c.lr = a.lr;
    c.beta1 = a.beta1;
    c.one_minus_beta1 = 1.0f - a.beta1;
    c.beta2 = a.beta2;
    c.one_minus_beta2 = 1.0f - a.beta2;
    return c;
}

// sign(x) as torch.sign computes it: +1, -1, else +0 (for +-0 and for NaN).
inline float sign_f32(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

// One Lion element: c = b1*m + (1-b1)*g ; p = p*(1 - lr*wd) - lr*sign(c) ; m = b2*m + (1-b2)*g.
inline void lion_scalar_element(const LionConsts& c, float& p, float g, float& m) {
    float update = c.beta1 * m + c.one_minus_beta1 * g;
    p = p * c.decay - c.lr * sign_f32(update);
    m = c.beta2 * m + c.one_minus_beta2 * g;
}

template <DType T>
using DTypeConstant = std::integral_constant<DType, T>;

// Calls f(DTypeConstant<G>{}) for the runtime type t (f32, bf16, f16, or none when allow_none).
template <bool AllowNone, class F>
inline void visit_dtype(DType t, F&& f) {
    switch (t) {
        case DType::f32:
            f(DTypeConstant<DType::f32>{});
            return;
        case DType::bf16:
            f(DTypeConstant<DType::bf16>{});
            return;
        case DType::f16:
            f(DTypeConstant<DType::f16>{});
            return;
        case DType::none:
            if constexpr (AllowNone) {
                f(DTypeConstant<DType::none>{});
            }
            return;
    }
}

// Calls f(param, grad, state, out) with one DTypeConstant each for the buffer types of `buf`, for
// the combinations `step_types_supported` accepts; the callers (bindings) refuse the others
// before a path runs, so they fall through and do nothing here.
template <class F>
inline void visit_step_types(const StepBuffers& buf, F&& f) {
    visit_dtype<false>(buf.param_type, [&](auto p) {
        constexpr DType P = decltype(p)::value;
        visit_dtype<false>(buf.grad_type, [&](auto g) {
            constexpr DType G = decltype(g)::value;
            visit_dtype<false>(buf.state, [&](auto s) {
                constexpr DType S = decltype(s)::value;
                visit_dtype<true>(buf.out, [&](auto o) {
                    if constexpr (step_types_supported(P, G, S, decltype(o)::value)) {
                        f(p, g, s, o);
                    }
                });
            });
        });
    });
}

// The scalar Adam loop for fixed types: the whole scalar path, and the tail of the vector paths.
template <DType P, DType G, DType S, DType O>
inline void adam_scalar_loop(const AdamConsts& c, const StepBuffers& b, int64_t begin,
                             int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        float p = load_f32<P>(b.param, i);
        float m = load_f32<S>(b.exp_avg, i);
        float v = load_f32<S>(b.exp_avg_sq, i);
        adam_scalar_element(c, p, load_f32<G>(b.grad, i), m, v);
        store_f32<P>(b.param, i, p);
        store_f32<S>(b.exp_avg, i, m);
        store_f32<S>(b.exp_avg_sq, i, v);
        store_f32<O>(b.param_out, i, p);
    }
}

template <DType P, DType G, DType S, DType O>
inline void lion_scalar_loop(const LionConsts& c, const StepBuffers& b, int64_t begin,
                             int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        float p = load_f32<P>(b.param, i);
        float m = load_f32<S>(b.exp_avg, i);
        lion_scalar_element(c, p, load_f32<G>(b.grad, i), m);
        store_f32<P>(b.param, i, p);
        store_f32<S>(b.exp_avg, i, m);
        store_f32<O>(b.param_out, i, p);
    }
}

// Runtime-typed entry points over [begin, end), for tails and for the scalar path.
inline void adam_scalar_range(const AdamArgs& args, const StepBuffers& buf, int64_t begin,
                              int64_t end) {
    const AdamConsts c = adam_consts(args);
    visit_step_types(buf, [&](auto p, auto g, auto s, auto o) {
        adam_scalar_loop<decltype(p)::value, decltype(g)::value, decltype(s)::value,
                         decltype(o)::value>(c, buf, begin, end);
    });
}

inline void lion_scalar_range(const LionArgs& args, const StepBuffers& buf, int64_t begin,
                              int64_t end) {
    const LionConsts c = lion_consts(args);
    visit_step_types(buf, [&](auto p, auto g, auto s, auto o) {
        lion_scalar_loop<decltype(p)::value, decltype(g)::value, decltype(s)::value,
                         decltype(o)::value>(c, buf, begin, end);
    });
}

}  // namespace
}  // namespace deepshard::cpu
