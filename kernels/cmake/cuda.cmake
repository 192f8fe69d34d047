# The optional CUDA module deepshard.kernels._cuda (multi-tensor fused Adam), included by
# CMakeLists.txt. It is built only when a CUDA compiler is found (nvcc on PATH, or CUDACXX /
# CMAKE_CUDA_COMPILER); without one the package installs without it and Python uses the
# pure-torch twin.
#
# Knobs:
#   CMAKE_CUDA_ARCHITECTURES (cmake var) or DEEPSHARD_CUDA_ARCHS (env), e.g. "90" or "80;90;100"
#       default "80;90": Ampere and Hopper machine code, plus their PTX (a plain number means
#       both in CMake), which the driver compiles for newer GPUs.
#   DEEPSHARD_BUILD_CUDA=OFF (cmake var or env): skip the module even when nvcc is present.
#
# The CUDA runtime is linked statically, so importing the module on a machine without a GPU
# driver succeeds (only a launch needs one) and no libcudart has to match torch's.

if(DEFINED ENV{DEEPSHARD_BUILD_CUDA} AND NOT DEFINED DEEPSHARD_BUILD_CUDA)
  set(DEEPSHARD_BUILD_CUDA "$ENV{DEEPSHARD_BUILD_CUDA}")
endif()
if(DEFINED DEEPSHARD_BUILD_CUDA AND NOT DEEPSHARD_BUILD_CUDA)
  message(STATUS "deepshard-kernels: DEEPSHARD_BUILD_CUDA is off; _cuda not built")
  return()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "deepshard-kernels: no CUDA compiler found; _cuda not built (torch twin used)")
  return()
endif()

# Must be decided before enable_language(), which would otherwise pick the compiler's default.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
  if(DEFINED ENV{DEEPSHARD_CUDA_ARCHS} AND NOT "$ENV{DEEPSHARD_CUDA_ARCHS}" STREQUAL "")
    set(CMAKE_CUDA_ARCHITECTURES "$ENV{DEEPSHARD_CUDA_ARCHS}")
  else()
    set(CMAKE_CUDA_ARCHITECTURES "80;90")
  endif()
endif()

enable_language(CUDA)
# CMake learnt nvcc's C++20 flag only in 3.26; teach older ones (Debian 12 ships 3.25). nvcc >= 12
# accepts -std=c++20.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION
   AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_COMPILE_FEATURES "cuda_std_20")
  list(APPEND CMAKE_CUDA_COMPILE_FEATURES "cuda_std_20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)

pybind11_add_module(_cuda csrc/cuda/bindings.cpp csrc/cuda/fused_adam.cu)
set_target_properties(_cuda PROPERTIES
  CXX_STANDARD 20
  CXX_STANDARD_REQUIRED ON
  CUDA_STANDARD 20
  CUDA_STANDARD_REQUIRED ON
  CUDA_RUNTIME_LIBRARY Static
)
string(REPLACE ";" "," _deepshard_arch_list "${CMAKE_CUDA_ARCHITECTURES}")
target_compile_definitions(_cuda PRIVATE DEEPSHARD_CUDA_ARCHS="${_deepshard_arch_list}")
install(TARGETS _cuda DESTINATION deepshard/kernels)
message(STATUS "deepshard-kernels: _cuda for CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}")
