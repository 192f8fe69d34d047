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

// The flat buffers of one step. `param` is fp32 and updated in place; `grad` is f32/bf16/f16;
// the moments are both f32 or both bf16 (`state` says which) and are updated in place;
// `param_out`, when `out` is not none, receives the updated parameters as bf16/f16.
struct StepBuffers {
    float* param;
    const void* grad;
    DType grad_type;
    void* exp_avg;
    void* exp_avg_sq;  // unused by Lion
    DType state;
    void* param_out;
    DType out;
};

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
