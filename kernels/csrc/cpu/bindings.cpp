// Python bindings of the CPU optimizer steps. Tensors arrive as raw data pointers (ints) with a
// dtype code and an element count: the Python side (deepshard.kernels) validates the tensors, so
// the extension needs no libtorch link. The GIL is released while a step runs.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "dispatch.h"
#include "kernels.h"

namespace py = pybind11;
using deepshard::cpu::DType;

namespace {

const char* dtype_name(DType t) {
    switch (t) {
        case DType::f32:
            return "float32";
        case DType::bf16:
            return "bfloat16";
        case DType::f16:
            return "float16";
        case DType::none:
            return "none";
    }
    return "?";
}

DType dtype_code(int code, const char* what) {
    if (code < 0 || code > static_cast<int>(DType::none)) {
        throw std::invalid_argument(std::string("unknown dtype code ") + std::to_string(code) +
                                    " for " + what + " (0 f32, 1 bf16, 2 f16, 3 none)");
    }
    return static_cast<DType>(code);
}

void* ptr(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

// The Python side checks the tensors first; this refuses a type combination no path implements
// (the paths would silently do nothing), in case the module is called directly.
deepshard::cpu::StepBuffers buffers(std::uintptr_t param, int param_type, std::uintptr_t grad,
                                    int grad_type, std::uintptr_t exp_avg,
                                    std::uintptr_t exp_avg_sq, int state,
                                    std::uintptr_t param_out, int out) {
    deepshard::cpu::StepBuffers b;
    b.param = ptr(param);
    b.param_type = dtype_code(param_type, "param");
    b.grad = ptr(grad);
    b.grad_type = dtype_code(grad_type, "grad");
    b.exp_avg = ptr(exp_avg);
    b.exp_avg_sq = ptr(exp_avg_sq);
    b.state = dtype_code(state, "optimizer state");
    b.param_out = ptr(param_out);
    b.out = dtype_code(out, "param_out");
    if (!deepshard::cpu::step_types_supported(b.param_type, b.grad_type, b.state, b.out)) {
        throw std::invalid_argument(
            std::string("unsupported buffer types: param ") + dtype_name(b.param_type) +
            ", grad " + dtype_name(b.grad_type) + ", state " + dtype_name(b.state) +
            ", param_out " + dtype_name(b.out) +
            "; see step_types_supported in csrc/cpu/kernels.h for the combinations");
    }
    return b;
}

void adam_step(std::uintptr_t param, int param_type, std::uintptr_t grad, int grad_type,
               std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, int state,
               std::uintptr_t param_out, int out, int64_t numel, float lr, float beta1,
               float beta2, float eps, float weight_decay, float bias_correction1,
               float bias_correction2_sqrt, bool adamw_mode, int num_threads) {
    auto buf =
        buffers(param, param_type, grad, grad_type, exp_avg, exp_avg_sq, state, param_out, out);
    deepshard::cpu::AdamArgs args{lr,           beta1,           beta2,
                                  eps,          weight_decay,    bias_correction1,
                                  bias_correction2_sqrt, adamw_mode};
    py::gil_scoped_release release;
    deepshard::cpu::run_adam(args, buf, numel, num_threads);
}

void lion_step(std::uintptr_t param, int param_type, std::uintptr_t grad, int grad_type,
               std::uintptr_t exp_avg, int state, std::uintptr_t param_out, int out,
               int64_t numel, float lr, float beta1, float beta2, float weight_decay,
               int num_threads) {
    auto buf = buffers(param, param_type, grad, grad_type, exp_avg, 0, state, param_out, out);
    deepshard::cpu::LionArgs args{lr, beta1, beta2, weight_decay};
    py::gil_scoped_release release;
    deepshard::cpu::run_lion(args, buf, numel, num_threads);
}

py::tuple names(const std::vector<deepshard::cpu::Path>& paths) {
    py::tuple out(paths.size());
    for (size_t i = 0; i < paths.size(); ++i) {
        out[i] = py::str(deepshard::cpu::path_name(paths[i]));
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
    using namespace deepshard::cpu;
    m.doc() = "DeepShard CPU optimizer kernels (Adam/AdamW, Lion) with runtime SIMD dispatch.";
    m.def("compiled_paths", [] { return names(compiled_paths()); },
          "SIMD paths compiled into this build, best last.");
    m.def(
        "supported_paths",
        [] {
            std::vector<Path> usable;
            for (Path path : compiled_paths()) {
                if (cpu_supports(path)) {
                    usable.push_back(path);
                }
            }
            return names(usable);
        },
        "Compiled SIMD paths this CPU can run, best last.");
    m.def("best_path", [] { return std::string(path_name(best_path())); });
    m.def("active_path", [] { return std::string(path_name(active_path())); });
    m.def("set_path", &set_active_path, py::arg("name"),
          "Makes `name` the active path; ValueError when not compiled or not supported.");
    m.def("adam_step", &adam_step, py::arg("param"), py::arg("param_type"), py::arg("grad"),
          py::arg("grad_type"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("state"),
          py::arg("param_out"), py::arg("out"), py::arg("numel"), py::arg("lr"),
          py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
          py::arg("bias_correction1"), py::arg("bias_correction2_sqrt"), py::arg("adamw_mode"),
          py::arg("num_threads"));
    m.def("lion_step", &lion_step, py::arg("param"), py::arg("param_type"), py::arg("grad"),
          py::arg("grad_type"), py::arg("exp_avg"), py::arg("state"), py::arg("param_out"),
          py::arg("out"), py::arg("numel"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("weight_decay"), py::arg("num_threads"));
}
