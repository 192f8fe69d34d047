// Parity driver for the ARM optimizer paths, cross-compiled for aarch64 and run under qemu-user
// by kernels/tests/test_arm_paths_under_qemu.py (it also runs on a real ARM machine).
//
//   arm_paths_driver neon|sve [--expect-sve-bits N]
//
// For every optimizer mode (AdamW, Adam with L2 decay, either without bias correction, Lion),
// every buffer type combination the kernels take (`step_types_supported` in kernels.h: an f32
// param with state f32/bf16 and param_out none/bf16/f16, a bf16 param with state f32/bf16, an
// f16 param with state f32/f16; each with grad f32/bf16/f16)
// and a list of sizes around the vector lengths plus 1'000'003, it runs 10 steps twice from the
// same start: once with the scalar path over [0, n), once with the path under test over
// [0, cut) and [cut, n) (an odd cut, so the ranges start unaligned, as thread slices do). The
// paths promise bit-identical results (no FMA contraction anywhere, same operation order; see
// csrc/cpu/scalar_math.h), so every output buffer is compared byte for byte. The data holds
// NaN, infinities, zeros, tiny and huge values, to exercise the rounding and NaN handling of
// the bf16/f16 conversions. Exits 1 with a message naming the first mismatch.
#include <sys/prctl.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "kernels.h"

using deepshard::cpu::AdamArgs;
using deepshard::cpu::DType;
using deepshard::cpu::LionArgs;
using deepshard::cpu::StepBuffers;

namespace {

constexpr int kSteps = 10;
constexpr int64_t kBigSize = 1'000'003;
// Every buffer holds kGuard elements past n that no path may touch (compared like the rest).
constexpr int64_t kGuard = 67;

enum class Mode { adamw, adam_l2, adamw_no_bias_correction, lion };
constexpr Mode kModes[] = {Mode::adamw, Mode::adam_l2, Mode::adamw_no_bias_correction, Mode::lion};

const char* mode_name(Mode mode) {
    switch (mode) {
        case Mode::adamw:
            return "adamw";
        case Mode::adam_l2:
            return "adam-l2";
        case Mode::adamw_no_bias_correction:
            return "adamw-no-bias-correction";
        case Mode::lion:
            return "lion";
    }
    return "?";
}

const char* dtype_name(DType t) {
    switch (t) {
        case DType::f32:
            return "f32";
        case DType::bf16:
            return "bf16";
        case DType::f16:
            return "f16";
        case DType::none:
            return "none";
    }
    return "?";
}

size_t dtype_bytes(DType t) { return t == DType::f32 ? 4 : (t == DType::none ? 0 : 2); }

// splitmix64: a fixed, portable stream of pseudo-random numbers.
struct Random {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    float uniform(float lo, float hi) {  // in [lo, hi)
        return lo + (hi - lo) * static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
    }
};

// Narrows to bf16/f16 by truncation: any bit pattern is a valid input for the paths, and the
// driver must not depend on the conversions it is testing.
void fill(std::vector<uint8_t>& out, DType t, const std::vector<float>& values) {
    out.assign(values.size() * dtype_bytes(t), 0);
    for (size_t i = 0; i < values.size(); ++i) {
        uint32_t bits;
        std::memcpy(&bits, &values[i], 4);
        if (t == DType::f32) {
            std::memcpy(out.data() + 4 * i, &bits, 4);
        } else if (t == DType::bf16) {
            const uint16_t h = static_cast<uint16_t>(bits >> 16);
            std::memcpy(out.data() + 2 * i, &h, 2);
        } else {  // f16: a random half bit pattern derived from the float, NaN/inf included
            const uint16_t h = static_cast<uint16_t>((bits >> 16) ^ (bits & 0xFFFFu));
            std::memcpy(out.data() + 2 * i, &h, 2);
        }
    }
}

// `total` values of magnitude below `scale`, with the special cases the conversions and the sign
// must get right placed inside the first `live` (the elements the paths update).
std::vector<float> values(Random& rng, int64_t total, int64_t live, float scale) {
    std::vector<float> v(static_cast<size_t>(total));
    for (auto& x : v) x = rng.uniform(-scale, scale);
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              0.0f,
                              -0.0f,
                              1e-30f,
                              -3e-39f,  // an f32 subnormal
                              7e4f,     // beyond f16's range
                              65519.0f,
                              -1e30f};
    for (size_t k = 0; k < std::size(specials); ++k) {
        v[static_cast<size_t>((live / 2 + static_cast<int64_t>(k)) % live)] = specials[k];
    }
    return v;
}

struct Case {
    Mode mode;
    DType param, grad, state, out;
    int64_t n;
};

struct State {
    std::vector<uint8_t> param, exp_avg, exp_avg_sq, param_out;
};

// The start of every case of size n (plus the guard) with a parameter of type `param` and
// moments of type `state`; each case adds its own param_out.
State initial_state(int64_t n, DType param, DType state) {
    Random rng{0x5EED0000ull + static_cast<uint64_t>(n) * 16 + static_cast<uint64_t>(param) * 4 +
               static_cast<uint64_t>(state)};
    State s;
    fill(s.param, param, values(rng, n + kGuard, n, 1.0f));
    fill(s.exp_avg, state, values(rng, n + kGuard, n, 0.01f));
    std::vector<float> second = values(rng, n + kGuard, n, 1e-4f);
    for (auto& x : second) x = std::fabs(x);  // a second moment is never negative
    fill(s.exp_avg_sq, state, second);
    return s;
}

// The gradients of steps 1..kSteps for size n and type `grad`, shared by every case using them.
std::vector<std::vector<uint8_t>> step_grads(int64_t n, DType grad) {
    Random rng{0x6AAD0000ull + static_cast<uint64_t>(n) * 4 + static_cast<uint64_t>(grad)};
    std::vector<std::vector<uint8_t>> grads(kSteps);
    for (auto& g : grads) fill(g, grad, values(rng, n + kGuard, n, 0.05f));
    return grads;
}

using AdamFn = void (*)(const AdamArgs&, const StepBuffers&, int64_t, int64_t);
using LionFn = void (*)(const LionArgs&, const StepBuffers&, int64_t, int64_t);

struct PathFns {
    AdamFn adam;
    LionFn lion;
};

// Runs kSteps steps of `c` on `s` with `fns`, each step over the given [begin, end) slices.
void run_steps(const Case& c, State& s, const std::vector<std::vector<uint8_t>>& grads,
               const PathFns& fns, const std::vector<int64_t>& cuts) {
    for (int step = 1; step <= kSteps; ++step) {
        const StepBuffers buf{s.param.data(),
                              c.param,
                              grads[static_cast<size_t>(step - 1)].data(),
                              c.grad,
                              s.exp_avg.data(),
                              s.exp_avg_sq.data(),
                              c.state,
                              c.out == DType::none ? nullptr : s.param_out.data(),
                              c.out};
        for (size_t k = 0; k + 1 < cuts.size(); ++k) {
            if (c.mode == Mode::lion) {
                fns.lion(LionArgs{1e-3f, 0.9f, 0.99f, 0.1f}, buf, cuts[k], cuts[k + 1]);
            } else {
                const bool corrected = c.mode != Mode::adamw_no_bias_correction;
                const double b1 = 0.9, b2 = 0.999;
                const AdamArgs args{
                    1e-3f,
                    static_cast<float>(b1),
                    static_cast<float>(b2),
                    1e-8f,
                    0.01f,
                    corrected ? static_cast<float>(1.0 - std::pow(b1, step)) : 1.0f,
                    corrected ? static_cast<float>(std::sqrt(1.0 - std::pow(b2, step))) : 1.0f,
                    c.mode != Mode::adam_l2,
                };
                fns.adam(args, buf, cuts[k], cuts[k + 1]);
            }
        }
    }
}

// Whether the element at `p` of type `t` (f32, bf16 or f16) is a NaN.
bool is_nan(const uint8_t* p, DType t) {
    if (t == DType::f32) {
        uint32_t u;
        std::memcpy(&u, p, 4);
        return (u & 0x7FFFFFFFu) > 0x7F800000u;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    return t == DType::bf16 ? (h & 0x7FFFu) > 0x7F80u : (h & 0x7FFFu) > 0x7C00u;
}

// Compares one buffer element by element: bit for bit, except that any NaN equals any NaN.
// Which of two NaN operands an instruction returns depends on their order, and the compiler
// may commute a multiply or add differently in scalar and vector code (IEEE 754 does not fix
// the payload of the result); f16 signaling NaNs are quieted by FCVT but not by the scalar
// widening. NaN-ness itself must match. Prints the first differing element.
bool same(const char* what, const std::vector<uint8_t>& want, const std::vector<uint8_t>& got,
          DType t) {
    if (want == got) return true;
    const size_t bytes = dtype_bytes(t);
    for (size_t i = 0; i < want.size(); i += bytes) {
        const uint8_t* a_ptr = want.data() + i;
        const uint8_t* b_ptr = got.data() + i;
        if (std::memcmp(a_ptr, b_ptr, bytes) == 0 || (is_nan(a_ptr, t) && is_nan(b_ptr, t))) {
            continue;
        }
        uint32_t a = 0, b = 0;
        std::memcpy(&a, a_ptr, bytes);
        std::memcpy(&b, b_ptr, bytes);
        std::fprintf(stderr, "  %s[%zu]: scalar 0x%0*x, path 0x%0*x\n", what, i / bytes,
                     static_cast<int>(2 * bytes), a, static_cast<int>(2 * bytes), b);
        return false;
    }
    return true;
}

bool check_case(const Case& c, const State& start, const std::vector<std::vector<uint8_t>>& grads,
                const PathFns& scalar, const PathFns& path, const char* path_name) {
    State want = start;
    want.param_out.assign(static_cast<size_t>(c.n + kGuard) * dtype_bytes(c.out), 0xA5);
    State got = want;
    run_steps(c, want, grads, scalar, {0, c.n});
    const int64_t cut = c.n < 3 ? c.n : (c.n / 3) | 1;
    run_steps(c, got, grads, path, {0, cut, c.n});

    bool ok = same("param", want.param, got.param, c.param);
    ok = same("exp_avg", want.exp_avg, got.exp_avg, c.state) && ok;
    if (c.mode != Mode::lion) {
        ok = same("exp_avg_sq", want.exp_avg_sq, got.exp_avg_sq, c.state) && ok;
    }
    if (c.out != DType::none) ok = same("param_out", want.param_out, got.param_out, c.out) && ok;
    if (!ok) {
        std::fprintf(stderr,
                     "MISMATCH: %s path differs from the scalar path after %d steps: mode=%s "
                     "param=%s grad=%s state=%s out=%s n=%lld\n",
                     path_name, kSteps, mode_name(c.mode), dtype_name(c.param),
                     dtype_name(c.grad), dtype_name(c.state), dtype_name(c.out),
                     static_cast<long long>(c.n));
    }
    return ok;
}

// The cases run at kBigSize: every mode, param, grad, state and out type at least once. Small
// sizes run every combination; the large one mainly proves long loops and 64-bit offsets, and
// running all 120 combinations there would take minutes under emulation.
bool in_big_subset(const Case& c) {
    const Case subset[] = {
        {Mode::adamw, DType::f32, DType::f32, DType::f32, DType::none, kBigSize},
        {Mode::adamw, DType::f32, DType::bf16, DType::bf16, DType::bf16, kBigSize},
        {Mode::adam_l2, DType::f32, DType::f16, DType::f32, DType::f16, kBigSize},
        {Mode::adamw_no_bias_correction, DType::f32, DType::bf16, DType::f32, DType::f16,
         kBigSize},
        {Mode::lion, DType::f32, DType::f16, DType::bf16, DType::bf16, kBigSize},
        {Mode::lion, DType::f32, DType::f32, DType::f32, DType::none, kBigSize},
        {Mode::adamw, DType::bf16, DType::bf16, DType::f32, DType::none, kBigSize},
        {Mode::adam_l2, DType::f16, DType::f16, DType::f16, DType::none, kBigSize},
        {Mode::lion, DType::bf16, DType::f32, DType::bf16, DType::none, kBigSize},
    };
    for (const Case& k : subset) {
        if (k.mode == c.mode && k.param == c.param && k.grad == c.grad && k.state == c.state &&
            k.out == c.out) {
            return true;
        }
    }
    return false;
}

// The SVE vector length in bits the kernel gives this process, or 0 without SVE.
int sve_bits() {
#ifdef PR_SVE_GET_VL
    const int vl = prctl(PR_SVE_GET_VL, 0, 0, 0, 0);
    return vl < 0 ? 0 : 8 * (vl & PR_SVE_VL_LEN_MASK);
#else
    return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s neon|sve [--expect-sve-bits N]\n", argv[0]);
        return 2;
    }
    const std::string path_name = argv[1];
    int expect_bits = 0;
    if (argc == 4 && std::string(argv[2]) == "--expect-sve-bits") expect_bits = std::atoi(argv[3]);

    const PathFns scalar{deepshard::cpu::adam_scalar, deepshard::cpu::lion_scalar};
    PathFns path{};
    if (path_name == "neon") {
        path = {deepshard::cpu::adam_neon, deepshard::cpu::lion_neon};
    } else if (path_name == "sve") {
        const int bits = sve_bits();
        std::printf("SVE vector length: %d bits\n", bits);
        if (bits == 0) {
            std::fprintf(stderr, "FAIL: this CPU has no SVE (under qemu: -cpu max,sve128=on)\n");
            return 1;
        }
        if (expect_bits != 0 && bits != expect_bits) {
            std::fprintf(stderr, "FAIL: expected a %d-bit SVE vector length, got %d\n",
                         expect_bits, bits);
            return 1;
        }
        path = {deepshard::cpu::adam_sve, deepshard::cpu::lion_sve};
    } else {
        std::fprintf(stderr, "unknown path %s (neon or sve)\n", path_name.c_str());
        return 2;
    }

    // Around every vector length (4 lanes at 128-bit up to 16 at 512-bit, 8-element NEON
    // blocks), the sizes the task names, and one large odd size.
    const int64_t sizes[] = {1,  3,  4,  5,  7,  8,  9,   15,   16,      17,
                             31, 32, 33, 63, 64, 65, 127, 1000, kBigSize};
    const DType types[] = {DType::f32, DType::bf16, DType::f16};
    const DType outs[] = {DType::none, DType::bf16, DType::f16};
    int cases = 0;
    int failures = 0;
    for (const int64_t n : sizes) {
        for (const DType g : types) {
            const auto step_grad = step_grads(n, g);
            for (const DType p : types) {
                for (const DType s : types) {
                    if (!deepshard::cpu::step_types_supported(p, g, s, DType::none)) continue;
                    const State start = initial_state(n, p, s);
                    for (const DType o : outs) {
                        if (!deepshard::cpu::step_types_supported(p, g, s, o)) continue;
                        for (const Mode mode : kModes) {
                            const Case c{mode, p, g, s, o, n};
                            if (n == kBigSize && !in_big_subset(c)) continue;
                            ++cases;
                            failures += check_case(c, start, step_grad, scalar, path,
                                                   path_name.c_str())
                                            ? 0
                                            : 1;
                        }
                    }
                }
            }
        }
    }
    if (failures != 0) {
        std::fprintf(stderr, "FAIL: %d of %d cases differ from the scalar path\n", failures, cases);
        return 1;
    }
    std::printf("OK: %s path matches the scalar path bit for bit (NaN payloads aside) in %d "
                "cases of %d steps\n",
                path_name.c_str(), cases, kSteps);
    return 0;
}
