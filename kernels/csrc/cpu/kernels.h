// The contract between the CPU optimizer kernels and their callers.
//
// Each SIMD path (scalar, avx2, avx512 on x86; neon, sve on aarch64) lives in its own translation
// unit compiled with its own -march flags, and implements the functions below over one half-open
// element range [begin, end). Threading and dispatch (which path runs, chosen at load time by CPU
// feature detection, overridable) are done by the caller, so every path is a plain loop that can
// be tested on its own -- also outside Python, e.g. cross-compiled and run under qemu-user.
//
// Pointers are raw (no libtorch link); the Python side passes tensor data pointers.
#pragma once

#include <cstdint>

namespace deepshard::cpu {

// Element types of the tensors an optimizer step reads and writes.
enum class DType : int32_t { f32 = 0, bf16 = 1, f16 = 2, none = 3 };

// Step-dependent scalars, computed once per step by the caller.
struct AdamArgs {
    float lr;
    float beta1;
    float beta2;
    float eps;
    float weight_decay;
    float bias_correction1;       // 1 - beta1^step, or 1 when bias correction is off
    float bias_correction2_sqrt;  // sqrt(1 - beta2^step), or 1 when bias correction is off
    bool adamw_mode;              // true: decoupled weight decay (AdamW); false: L2 added to grad
};

struct LionArgs {
    float lr;
    float beta1;
    float beta2;
    float weight_decay;  // decoupled, like AdamW
};

// The flat buffers of one step. Every path computes in fp32: it widens what it loads, updates,
// and rounds what it stores back to the buffer's type (nearest even). `param`, `exp_avg` and
// `exp_avg_sq` (unused by Lion) are updated in place; `grad` is f32, bf16 or f16 whatever the
// parameter's type; `param_out`, when `out` is not none, receives the updated parameters as
// bf16/f16 (a low-precision copy of an fp32 master). `step_types_supported` says which
// (param, state, out) combinations exist.
struct StepBuffers {
    void* param;
    DType param_type;
    const void* grad;
    DType grad_type;
    void* exp_avg;
    void* exp_avg_sq;
    DType state;
    void* param_out;
    DType out;
};

// The buffer types a step runs with (callers refuse the rest before a path runs):
//   param f32  : state f32 or bf16, out none/bf16/f16 (ZeRO offload's fp32 master copy);
//   param bf16 : state f32 or bf16, out none (DeepSpeedCPUAdam's 16-bit parameters);
//   param f16  : state f32 or f16,  out none;
// and for each, a grad of f32, bf16 or f16. A 16-bit parameter is its own low-precision copy,
// so it takes no `param_out`.
constexpr bool step_types_supported(DType param, DType grad, DType state, DType out) {
    if (grad == DType::none || state == DType::none || out == DType::f32) {
        return false;
    }
    switch (param) {
        case DType::f32:
            return state != DType::f16;
        case DType::bf16:
            return state != DType::f16 && out == DType::none;
        case DType::f16:
            return state != DType::bf16 && out == DType::none;
        case DType::none:
            return false;
    }
    return false;
}

// One function per SIMD path; each processes elements [begin, end).
void adam_scalar(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);
void adam_avx2(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);
void adam_avx512(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);
void adam_neon(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);
void adam_sve(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);

void lion_scalar(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);
void lion_avx2(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);
void lion_avx512(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);
void lion_neon(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);
void lion_sve(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end);

}  // namespace deepshard::cpu
