// Which SIMD path runs a step, and how a step is split over threads.
//
// The paths compiled into this build are those CMake defined DEEPSHARD_HAVE_<PATH> for; of those,
// the ones this CPU (and its OS) supports are usable, and the best usable one is active after
// load. `set_active_path` switches to another usable path (tests force each path this way).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace deepshard::cpu {

enum class Path : int { scalar = 0, avx2 = 1, avx512 = 2, neon = 3, sve = 4 };

const char* path_name(Path path);

// Paths compiled into this build, in order of preference (best last).
std::vector<Path> compiled_paths();

// Whether this CPU and OS can run `path` (compiled or not).
bool cpu_supports(Path path);

// The best path that is compiled and supported.
Path best_path();

Path active_path();

// Makes `name` the active path; throws std::invalid_argument when the name is unknown, the path
// is not compiled into this build, or this CPU cannot run it.
void set_active_path(const std::string& name);

// Runs one step over [0, numel) on the active path, split over up to `num_threads` threads
// (fewer for small sizes, which run on the calling thread).
void run_adam(const AdamArgs& args, const StepBuffers& buf, int64_t numel, int num_threads);
void run_lion(const LionArgs& args, const StepBuffers& buf, int64_t numel, int num_threads);

}  // namespace deepshard::cpu
