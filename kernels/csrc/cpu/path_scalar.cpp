// The portable path: the scalar loops of scalar_math.h, compiled for the baseline ISA. It is the
// reference every SIMD path must match bit for bit, and the path of last resort.
#include "kernels.h"
#include "scalar_math.h"

namespace deepshard::cpu {

void adam_scalar(const AdamArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
    adam_scalar_range(args, buf, begin, end);
}

void lion_scalar(const LionArgs& args, const StepBuffers& buf, int64_t begin, int64_t end) {
    lion_scalar_range(args, buf, begin, end);
}

}  // namespace deepshard::cpu
