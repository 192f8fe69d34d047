// Multi-tensor fused Adam/AdamW.
//
// An optimizer step over many parameter tensors is memory bound; launching one kernel per
// tensor wastes most of the time in launch latency for the many small tensors (biases, norms).
// Here the host walks the tensor list once and cuts every tensor into fixed-size chunks of
// kChunkElements. Each CUDA block updates exactly one chunk. The block -> (tensor, chunk) map
// and the tensors' addresses and sizes travel in a LaunchTable passed *by value* as the kernel
// parameter (the device reads it from constant parameter memory, so no allocation, no copy and
// no synchronisation is needed). When the table runs out of tensor slots or block slots the
// host launches what it has and starts a new table; a tensor cut by such a flush simply
// appears again in the next table with its remaining chunks.
//
// Per element (fp32 arithmetic, gradients widened from bf16/f16 on load):
//   adamw_mode:  p *= 1 - lr*wd                 else:  g += wd*p
//   m = b1*m + (1-b1)*g
//   v = b2*v + (1-b2)*g*g
//   p -= (lr/bc1) * m / (sqrt(v)/bc2_sqrt + eps)
// which is torch.optim.AdamW (or Adam with L2 decay); bc1/bc2_sqrt are 1 without bias
// correction. Full-precision division and square root (nvcc's defaults) are kept.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fused_adam.h"

namespace deepshard::cuda {
namespace {

constexpr int kMaxTensorsPerLaunch = 48;
constexpr int kMaxBlocksPerLaunch = 320;
constexpr int64_t kChunkElements = 65536;
constexpr int kThreadsPerBlock = 512;
constexpr int kVector = 4;  // elements per thread per iteration on the vectorised path

// The scalars every element needs, rounded to float once on the host.
struct KernelScalars {
    float beta1;
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    float eps;
    float weight_decay;
    float decay;  // 1 - lr*wd in AdamW mode, 1 in L2 mode (an exact no-op)
    float step_size;        // lr / bias_correction1
    float bias_correction2_sqrt;
    bool l2_decay;  // Adam mode with wd != 0: g += wd*p (skipped otherwise: 0*inf would be NaN)
};

// The device-side table of one launch: tensor slots and the block -> (slot, chunk) map.
struct LaunchTable {
    float* param[kMaxTensorsPerLaunch];
    const void* grad[kMaxTensorsPerLaunch];
    float* exp_avg[kMaxTensorsPerLaunch];
    float* exp_avg_sq[kMaxTensorsPerLaunch];
    int64_t numel[kMaxTensorsPerLaunch];
    int32_t block_chunk[kMaxBlocksPerLaunch];
    uint8_t block_slot[kMaxBlocksPerLaunch];
};

// Kernel parameters are limited to 4 KiB on every architecture CUDA 13 supports by default.
static_assert(sizeof(LaunchTable) + sizeof(KernelScalars) <= 4000, "launch table too large");
static_assert(kMaxTensorsPerLaunch <= 256, "block_slot is a uint8_t");
static_assert(kChunkElements % kVector == 0, "chunks must keep vector alignment");

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

__device__ __forceinline__ void adam_element(float& p, float g, float& m, float& v,
                                             const KernelScalars& s) {
    if (s.l2_decay) g += s.weight_decay * p;
    p *= s.decay;
    m = s.beta1 * m + s.one_minus_beta1 * g;
    v = s.beta2 * v + s.one_minus_beta2 * g * g;
    const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
    p -= s.step_size * (m / denom);
}

template <typename G>
__device__ __forceinline__ void load_grads(const G* g, float (&out)[kVector]) {
    if constexpr (std::is_same_v<G, float>) {
        const float4 x = *reinterpret_cast<const float4*>(g);
        out[0] = x.x;
        out[1] = x.y;
        out[2] = x.z;
        out[3] = x.w;
    } else {
        static_assert(sizeof(G) * kVector == sizeof(uint2));
        const uint2 raw = *reinterpret_cast<const uint2*>(g);
        G halves[kVector];
        memcpy(halves, &raw, sizeof(raw));
#pragma unroll
        for (int k = 0; k < kVector; ++k) out[k] = widen(halves[k]);
    }
}

__device__ __forceinline__ bool aligned_to(const void* ptr, std::uintptr_t bytes) {
    return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

template <typename G>
__global__ void __launch_bounds__(kThreadsPerBlock)
    fused_adam_kernel(const __grid_constant__ LaunchTable table, const KernelScalars s) {
    const int slot = table.block_slot[blockIdx.x];
    const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kChunkElements;
    const int64_t remaining = table.numel[slot] - begin;
    const int64_t n = remaining < kChunkElements ? remaining : kChunkElements;
    float* p = table.param[slot] + begin;
    const G* g = static_cast<const G*>(table.grad[slot]) + begin;
    float* m = table.exp_avg[slot] + begin;
    float* v = table.exp_avg_sq[slot] + begin;

    int64_t scalar_from = 0;
    const bool vectorised = aligned_to(p, sizeof(float4)) && aligned_to(m, sizeof(float4)) &&
                            aligned_to(v, sizeof(float4)) && aligned_to(g, sizeof(G) * kVector);
    if (vectorised) {
        scalar_from = n / kVector * kVector;
        for (int64_t i = static_cast<int64_t>(threadIdx.x) * kVector; i < scalar_from;
             i += static_cast<int64_t>(blockDim.x) * kVector) {
            float4 p4 = *reinterpret_cast<float4*>(p + i);
            float4 m4 = *reinterpret_cast<float4*>(m + i);
            float4 v4 = *reinterpret_cast<float4*>(v + i);
            float g4[kVector];
            load_grads(g + i, g4);
            adam_element(p4.x, g4[0], m4.x, v4.x, s);
            adam_element(p4.y, g4[1], m4.y, v4.y, s);
            adam_element(p4.z, g4[2], m4.z, v4.z, s);
            adam_element(p4.w, g4[3], m4.w, v4.w, s);
            *reinterpret_cast<float4*>(p + i) = p4;
            *reinterpret_cast<float4*>(m + i) = m4;
            *reinterpret_cast<float4*>(v + i) = v4;
        }
    }
    // The unaligned case, and the last n % kVector elements of an aligned chunk.
    for (int64_t i = scalar_from + threadIdx.x; i < n; i += blockDim.x) {
        float pi = p[i];
        float mi = m[i];
        float vi = v[i];
        adam_element(pi, widen(g[i]), mi, vi, s);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
    }
}

void check(cudaError_t status, const char* what) {
    if (status != cudaSuccess) {
        throw std::runtime_error(std::string("deepshard fused_adam: ") + what + " failed: " +
                                 cudaGetErrorName(status) + " (" + cudaGetErrorString(status) +
                                 ")");
    }
}

// Makes `device` current for the enclosed launches and restores the caller's device after.
class DeviceGuard {
public:
    explicit DeviceGuard(int device) {
        check(cudaGetDevice(&previous_), "cudaGetDevice");
        if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
        current_ = device;
    }
    ~DeviceGuard() {
        if (previous_ != current_) cudaSetDevice(previous_);
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

private:
    int previous_ = 0;
    int current_ = 0;
};

KernelScalars kernel_scalars(const AdamStep& step) {
    const bool decoupled = step.adamw_mode;
    return KernelScalars{
        .beta1 = static_cast<float>(step.beta1),
        .beta2 = static_cast<float>(step.beta2),
        .one_minus_beta1 = static_cast<float>(1.0 - step.beta1),
        .one_minus_beta2 = static_cast<float>(1.0 - step.beta2),
        .eps = static_cast<float>(step.eps),
        .weight_decay = static_cast<float>(step.weight_decay),
        .decay = decoupled ? static_cast<float>(1.0 - step.lr * step.weight_decay) : 1.0F,
        .step_size = static_cast<float>(step.lr / step.bias_correction1),
        .bias_correction2_sqrt = static_cast<float>(step.bias_correction2_sqrt),
        .l2_decay = !decoupled && step.weight_decay != 0.0,
    };
}

// Fills launch tables tensor by tensor, chunk by chunk, and launches each full table.
template <typename G>
void launch_all(const KernelScalars& scalars, const TensorTable& tensors, cudaStream_t stream) {
    LaunchTable table{};
    int slots = 0;
    int blocks = 0;
    auto flush = [&] {
        if (blocks == 0) return;
        fused_adam_kernel<G><<<blocks, kThreadsPerBlock, 0, stream>>>(table, scalars);
        check(cudaGetLastError(), "launching fused_adam_kernel");
        slots = 0;
        blocks = 0;
    };
    for (size_t i = 0; i < tensors.params.size(); ++i) {
        const int64_t numel = tensors.numels[i];
        const int64_t chunks = (numel + kChunkElements - 1) / kChunkElements;
        for (int64_t chunk = 0; chunk < chunks; ++chunk) {
            if (chunk == 0 || slots == 0) {  // first chunk, or the table was just flushed
                if (slots == kMaxTensorsPerLaunch) flush();
                table.param[slots] = reinterpret_cast<float*>(tensors.params[i]);
                table.grad[slots] = reinterpret_cast<const void*>(tensors.grads[i]);
                table.exp_avg[slots] = reinterpret_cast<float*>(tensors.exp_avgs[i]);
                table.exp_avg_sq[slots] = reinterpret_cast<float*>(tensors.exp_avg_sqs[i]);
                table.numel[slots] = numel;
                ++slots;
            }
            table.block_slot[blocks] = static_cast<uint8_t>(slots - 1);
            table.block_chunk[blocks] = static_cast<int32_t>(chunk);
            if (++blocks == kMaxBlocksPerLaunch) flush();
        }
    }
    flush();
}

void validate(const TensorTable& tensors) {
    const size_t n = tensors.params.size();
    if (tensors.grads.size() != n || tensors.exp_avgs.size() != n ||
        tensors.exp_avg_sqs.size() != n || tensors.numels.size() != n) {
        throw std::invalid_argument(
            "deepshard fused_adam: params, grads, exp_avgs, exp_avg_sqs and numels must have "
            "the same length");
    }
    if (tensors.grad_type != GradType::f32 && tensors.grad_type != GradType::bf16 &&
        tensors.grad_type != GradType::f16) {
        throw std::invalid_argument("deepshard fused_adam: unknown gradient type code " +
                                    std::to_string(static_cast<int>(tensors.grad_type)));
    }
    constexpr int64_t kMaxNumel = static_cast<int64_t>(INT32_MAX) * kChunkElements;
    for (size_t i = 0; i < n; ++i) {
        if (tensors.numels[i] < 0 || tensors.numels[i] > kMaxNumel) {
            throw std::invalid_argument("deepshard fused_adam: tensor " + std::to_string(i) +
                                        " has an element count out of range: " +
                                        std::to_string(tensors.numels[i]));
        }
        if (tensors.numels[i] > 0 && (tensors.params[i] == 0 || tensors.grads[i] == 0 ||
                                      tensors.exp_avgs[i] == 0 || tensors.exp_avg_sqs[i] == 0)) {
            throw std::invalid_argument("deepshard fused_adam: tensor " + std::to_string(i) +
                                        " has a null data pointer");
        }
    }
}

}  // namespace

void fused_adam_step(const AdamStep& step, const TensorTable& tensors, int device,
                     std::uintptr_t stream) {
    validate(tensors);
    bool any_elements = false;
    for (const int64_t numel : tensors.numels) any_elements = any_elements || numel > 0;
    if (!any_elements) return;  // nothing to launch; do not even touch the device
    const KernelScalars scalars = kernel_scalars(step);
    const DeviceGuard guard(device);
    auto* cuda_stream = reinterpret_cast<cudaStream_t>(stream);
    switch (tensors.grad_type) {
        case GradType::f32:
            launch_all<float>(scalars, tensors, cuda_stream);
            break;
        case GradType::bf16:
            launch_all<__nv_bfloat16>(scalars, tensors, cuda_stream);
            break;
        case GradType::f16:
            launch_all<__half>(scalars, tensors, cuda_stream);
            break;
    }
}

int visible_device_count() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();  // clear the recorded error so the next launch check starts clean
        return 0;
    }
    return count;
}

std::string runtime_summary() {
    int runtime = 0;
    int driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    auto version = [](int v) {
        return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
    };
    std::string summary = "CUDA runtime " + version(runtime) + " (static)";
    if (driver == 0) return summary + ", no CUDA driver found";
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
        cudaGetLastError();
        return summary + ", driver " + version(driver) + ", no usable device (" +
               cudaGetErrorName(status) + ")";
    }
    return summary + ", driver " + version(driver) + ", " + std::to_string(count) + " device(s)";
}

}  // namespace deepshard::cuda
