// Host-side contract of the multi-tensor fused Adam/AdamW CUDA kernel.
//
// Plain C++20 (no CUDA header), so the pybind11 bindings compile with the host compiler alone;
// everything that touches the CUDA runtime lives in fused_adam.cu. Tensors are raw device
// addresses: the Python side passes `tensor.data_ptr()` values, the element counts, and the
// caller's stream (`torch.cuda.current_stream().cuda_stream`), so this library never links
// libtorch.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace deepshard::cuda {

// Element type of the gradients; the values match deepshard::cpu::DType.
enum class GradType : int32_t { f32 = 0, bf16 = 1, f16 = 2 };

// The scalars of one optimizer step, in double as Python computes them; the kernel receives
// them rounded once to float (step size and decay factor are combined in double first).
struct AdamStep {
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    double bias_correction1;       // 1 - beta1^step, or 1 without bias correction
    double bias_correction2_sqrt;  // sqrt(1 - beta2^step), or 1 without bias correction
    bool adamw_mode;               // true: decoupled decay (p *= 1 - lr*wd); false: g += wd*p
};

// The tensors of one launch group: element i of every span describes the same parameter.
// `params`, `exp_avgs` and `exp_avg_sqs` are fp32; `grads` are of type `grad_type`. All live
// on `device` and hold `numels[i]` contiguous elements.
struct TensorTable {
    std::span<const std::uintptr_t> params;
    std::span<const std::uintptr_t> grads;
    std::span<const std::uintptr_t> exp_avgs;
    std::span<const std::uintptr_t> exp_avg_sqs;
    std::span<const int64_t> numels;
    GradType grad_type;
};

// Updates every tensor of `table` in place with as few launches as the launch table allows,
// enqueued on `stream` (a cudaStream_t as an integer; 0 is the legacy default stream) of
// `device`. Returns once the launches are enqueued. Throws std::invalid_argument on
// inconsistent input and std::runtime_error on a CUDA error.
void fused_adam_step(const AdamStep& step, const TensorTable& table, int device,
                     std::uintptr_t stream);

// One line on the CUDA runtime this module carries and the driver/devices it sees; never throws.
std::string runtime_summary();

// Number of CUDA devices the driver exposes (0 without a driver); never throws.
int visible_device_count();

}  // namespace deepshard::cuda
