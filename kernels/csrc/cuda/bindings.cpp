// pybind11 surface of deepshard.kernels._cuda: raw device addresses in, nothing out.
//
// Compiled by the host C++ compiler (C++20); all CUDA runtime calls live in fused_adam.cu, and
// the runtime is linked statically, so importing this module needs no GPU driver -- only a
// launch does.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "fused_adam.h"

#ifndef DEEPSHARD_CUDA_ARCHS
#define DEEPSHARD_CUDA_ARCHS "unknown"
#endif

namespace py = pybind11;

namespace {

void fused_adam_step(const std::vector<std::uintptr_t>& params,
                     const std::vector<std::uintptr_t>& grads,
                     const std::vector<std::uintptr_t>& exp_avgs,
                     const std::vector<std::uintptr_t>& exp_avg_sqs,
                     const std::vector<int64_t>& numels, int32_t grad_type, double lr,
                     double beta1, double beta2, double eps, double weight_decay,
                     double bias_correction1, double bias_correction2_sqrt, bool adamw_mode,
                     int device, std::uintptr_t stream) {
    const deepshard::cuda::AdamStep step{
        .lr = lr,
        .beta1 = beta1,
        .beta2 = beta2,
        .eps = eps,
        .weight_decay = weight_decay,
        .bias_correction1 = bias_correction1,
        .bias_correction2_sqrt = bias_correction2_sqrt,
        .adamw_mode = adamw_mode,
    };
    const deepshard::cuda::TensorTable table{
        .params = params,
        .grads = grads,
        .exp_avgs = exp_avgs,
        .exp_avg_sqs = exp_avg_sqs,
        .numels = numels,
        .grad_type = static_cast<deepshard::cuda::GradType>(grad_type),
    };
    const py::gil_scoped_release release;
    deepshard::cuda::fused_adam_step(step, table, device, stream);
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
    m.doc() = "DeepShard CUDA ops: the multi-tensor fused Adam/AdamW step.";
    m.def("fused_adam_step", &fused_adam_step, py::arg("params"), py::arg("grads"),
          py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("numels"), py::arg("grad_type"),
          py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::arg("bias_correction1"),
          py::arg("bias_correction2_sqrt"), py::arg("adamw_mode"), py::arg("device"),
          py::arg("stream"),
          "Enqueues one fused Adam step over the given tensors on `stream` of `device`.");
    m.def("runtime_summary", &deepshard::cuda::runtime_summary,
          "One line on the bundled CUDA runtime and the driver/devices it sees.");
    m.def("visible_device_count", &deepshard::cuda::visible_device_count,
          "Number of CUDA devices the driver exposes (0 without a driver).");
    m.attr("cuda_architectures") = DEEPSHARD_CUDA_ARCHS;
}
