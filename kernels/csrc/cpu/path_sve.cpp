// The SVE path (armv8.2-a+sve), vector-length agnostic: one loop step covers svcntw() floats
// (4 at 128-bit, 16 at 512-bit vectors), and the governing predicate from svwhilelt switches
// off the lanes past `end`, so the last partial vector needs no scalar tail. Loads of inactive
// lanes are suppressed and stores to them skipped, so nothing outside [begin, end) is touched.
//
// Like every path it computes what scalar_math.h computes, operation for operation: a separate
// multiply and add where that file writes `a * b + c` (the TU is compiled with
// -ffp-contract=off, so svmul/svadd are not fused into fmla/fmad), hence bit-identical results.
// 16-bit data travels in the low half of each 32-bit lane (ld1h/st1h with .S elements):
//   * bf16 -> f32 is a 16-bit left shift; f32 -> bf16 rounds to nearest even with integer ops
//     and keeps NaN a quiet NaN, like f32_to_bf16;
//   * f16 <-> f32 uses FCVT, which rounds to nearest even under the default FPCR and quiets
//     NaNs keeping their top payload bits, as f32_to_f16 does.
#include <arm_sve.h>

#include "kernels.h"
#include "scalar_math.h"

namespace deepshard::cpu {
namespace {

template <DType T>
inline svfloat32_t load(svbool_t pg, const void* base, int64_t i) {
    if constexpr (T == DType::f32) {
        return svld1_f32(pg, static_cast<const float*>(base) + i);
    } else {
        const svuint32_t h = svld1uh_u32(pg, static_cast<const uint16_t*>(base) + i);
        if constexpr (T == DType::bf16) {
            return svreinterpret_f32_u32(svlsl_n_u32_x(pg, h, 16));
        } else {
            return svcvt_f32_f16_x(pg, svreinterpret_f16_u32(h));
        }
    }
}

inline svuint32_t f32_to_bf16_lanes(svbool_t pg, svfloat32_t x) {
    const svuint32_t u = svreinterpret_u32_f32(x);
    const svuint32_t high = svlsr_n_u32_x(pg, u, 16);
    const svuint32_t lsb = svand_n_u32_x(pg, high, 1);
    const svuint32_t rounded =
        svlsr_n_u32_x(pg, svadd_u32_x(pg, svadd_n_u32_x(pg, u, 0x7FFF), lsb), 16);
    const svuint32_t quiet_nan = svorr_n_u32_x(pg, high, 0x0040);
    return svsel_u32(svcmpuo_f32(pg, x, x), quiet_nan, rounded);
}

template <DType T>
inline void store(svbool_t pg, void* base, int64_t i, svfloat32_t x) {
    if constexpr (T == DType::f32) {
        svst1_f32(pg, static_cast<float*>(base) + i, x);
    } else if constexpr (T != DType::none) {
        svuint32_t h;
        if constexpr (T == DType::bf16) {
            h = f32_to_bf16_lanes(pg, x);
        } else {
            h = svreinterpret_u32_f16(svcvt_f16_f32_x(pg, x));
        }
        svst1h_u32(pg, static_cast<uint16_t*>(base) + i, h);  // the low 16 bits of each lane
    }
}

template <bool AdamW, DType P, DType G, DType S, DType O>
void adam_loop(const AdamConsts& c, const StepBuffers& b, int64_t begin, int64_t end) {
    const int64_t lanes = static_cast<int64_t>(svcntw());
    for (int64_t i = begin; i < end; i += lanes) {
        const svbool_t pg = svwhilelt_b32_s64(i, end);
        svfloat32_t p = load<P>(pg, b.param, i);
        svfloat32_t g = load<G>(pg, b.grad, i);
        svfloat32_t m = load<S>(pg, b.exp_avg, i);
        svfloat32_t v = load<S>(pg, b.exp_avg_sq, i);
        if constexpr (AdamW) {
            p = svmul_n_f32_x(pg, p, c.decay);
        } else {
            g = svadd_f32_x(pg, g, svmul_n_f32_x(pg, p, c.weight_decay));
        }
        m = svadd_f32_x(pg, svmul_n_f32_x(pg, m, c.beta1), svmul_n_f32_x(pg, g, c.one_minus_beta1));
        v = svadd_f32_x(pg, svmul_n_f32_x(pg, v, c.beta2),
                        svmul_f32_x(pg, svmul_n_f32_x(pg, g, c.one_minus_beta2), g));
        const svfloat32_t denom = svadd_n_f32_x(
            pg, svdiv_n_f32_x(pg, svsqrt_f32_x(pg, v), c.bias_correction2_sqrt), c.eps);
        p = svsub_f32_x(pg, p, svdiv_f32_x(pg, svmul_n_f32_x(pg, m, c.step_size), denom));
        store<P>(pg, b.param, i, p);
        store<S>(pg, b.exp_avg, i, m);
        store<S>(pg, b.exp_avg_sq, i, v);
        store<O>(pg, b.param_out, i, p);
    }
}

// sign_f32 lane-wise: +1 where x > 0, -1 where x < 0, +0 elsewhere (zeros and NaN).
inline svfloat32_t sign_lanes(svbool_t pg, svfloat32_t x) {
    const svfloat32_t zero = svdup_n_f32(0.0f);
    const svfloat32_t negative = svsel_f32(svcmplt_n_f32(pg, x, 0.0f), svdup_n_f32(-1.0f), zero);
    return svsel_f32(svcmpgt_n_f32(pg, x, 0.0f), svdup_n_f32(1.0f), negative);
}

template <DType P, DType G, DType S, DType O>
void lion_loop(const LionConsts& c, const StepBuffers& b, int64_t begin, int64_t end) {
    const int64_t lanes = static_cast<int64_t>(svcntw());
    for (int64_t i = begin; i < end; i += lanes) {
        const svbool_t pg = svwhilelt_b32_s64(i, end);
        svfloat32_t p = load<P>(pg, b.param, i);
        const svfloat32_t g = load<G>(pg, b.grad, i);
        svfloat32_t m = load<S>(pg, b.exp_avg, i);
        const svfloat32_t update =
            svadd_f32_x(pg, svmul_n_f32_x(pg, m, c.beta1), svmul_n_f32_x(pg, g, c.one_minus_beta1));
        p = svsub_f32_x(pg, svmul_n_f32_x(pg, p, c.decay),
                        svmul_n_f32_x(pg, sign_lanes(pg, update), c.lr));
        m = svadd_f32_x(pg, svmul_n_f32_x(pg, m, c.beta2), svmul_n_f32_x(pg, g, c.one_minus_beta2));
        store<P>(pg, b.param, i, p);
        store<S>(pg, b.exp_avg, i, m);
        store<O>(pg, b.param_out, i, p);
    }
}

}  // namespace

void adam_sve(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
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

void lion_sve(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
    const LionConsts c = lion_consts(args);
    visit_step_types(buf, [&](auto p, auto g, auto s, auto o) {
        lion_loop<decltype(p)::value, decltype(g)::value, decltype(s)::value, decltype(o)::value>(
            c, buf, begin, end);
    });
}

}  // namespace deepshard::cpu
