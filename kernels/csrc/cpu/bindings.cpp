#include <pybind11/pybind11.h>

PYBIND11_MODULE(_cpu, m) {
    m.doc() = "DeepShard CPU kernels (scaffold)";
    m.def("compiled_paths", []() { return pybind11::make_tuple("scalar"); });
}
