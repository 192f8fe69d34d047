#include "dispatch.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#if defined(_MSC_VER)
#include <intrin.h>
#else
#include <cpuid.h>
#endif
#endif

#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace deepshard::cpu {
namespace {

// Elements a thread must get before a step is split at all: below ~1 MB of traffic per thread,
// waking a worker costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;
// Unit of work handed to a thread: 64Ki elements (256 KiB of each fp32 stream), a multiple of
// every vector width and of whole cache lines for every dtype.
constexpr int64_t kBlock = 1 << 16;

#if defined(__x86_64__) || defined(_M_X64)
struct CpuidRegs {
    uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
};

CpuidRegs cpuid(uint32_t leaf, uint32_t subleaf) {
    CpuidRegs r;
#if defined(_MSC_VER)
    int out[4];
    __cpuidex(out, static_cast<int>(leaf), static_cast<int>(subleaf));
    r = {static_cast<uint32_t>(out[0]), static_cast<uint32_t>(out[1]),
         static_cast<uint32_t>(out[2]), static_cast<uint32_t>(out[3])};
#else
    if (__get_cpuid_max(0, nullptr) >= leaf) {
        __cpuid_count(leaf, subleaf, r.eax, r.ebx, r.ecx, r.edx);
    }
#endif
    return r;
}

// XCR0: which register states the OS saves on context switch.
uint64_t xcr0() {
#if defined(_MSC_VER)
    return _xgetbv(0);
#else
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return (static_cast<uint64_t>(edx) << 32) | eax;
#endif
}

bool bit(uint32_t value, int index) { return ((value >> index) & 1u) != 0; }

bool x86_avx2() {
    CpuidRegs l1 = cpuid(1, 0);
    // OSXSAVE, AVX, FMA, F16C; then the OS must save XMM and YMM state.
    if (!(bit(l1.ecx, 27) && bit(l1.ecx, 28) && bit(l1.ecx, 12) && bit(l1.ecx, 29))) {
        return false;
    }
    if ((xcr0() & 0x6u) != 0x6u) {
        return false;
    }
    return bit(cpuid(7, 0).ebx, 5);  // AVX2
}

bool x86_avx512() {
    if (!x86_avx2()) {
        return false;
    }
    // The OS must also save opmask, ZMM0-15 upper halves and ZMM16-31 (XCR0 bits 5-7).
    if ((xcr0() & 0xE6u) != 0xE6u) {
        return false;
    }
    CpuidRegs l7 = cpuid(7, 0);
    return bit(l7.ebx, 16) && bit(l7.ebx, 30) && bit(l7.ebx, 31);  // F, BW, VL
}
#endif

using AdamFn = void (*)(const AdamArgs&, const StepBuffers&, int64_t, int64_t);
using LionFn = void (*)(const LionArgs&, const StepBuffers&, int64_t, int64_t);

struct PathFns {
    AdamFn adam;
    LionFn lion;
};

PathFns path_fns(Path path) {
    switch (path) {
#if defined(DEEPSHARD_HAVE_AVX2)
        case Path::avx2:
            return {adam_avx2, lion_avx2};
#endif
#if defined(DEEPSHARD_HAVE_AVX512)
        case Path::avx512:
            return {adam_avx512, lion_avx512};
#endif
#if defined(DEEPSHARD_HAVE_NEON)
        case Path::neon:
            return {adam_neon, lion_neon};
#endif
#if defined(DEEPSHARD_HAVE_SVE)
        case Path::sve:
            return {adam_sve, lion_sve};
#endif
        default:
            return {adam_scalar, lion_scalar};
    }
}

std::atomic<int>& active_slot() {
    static std::atomic<int> slot{static_cast<int>(best_path())};
    return slot;
}

// Threads take blocks of kBlock elements from a shared counter rather than one fixed share
// each: on a machine where a core is busy with something else, the other threads take over its
// blocks instead of waiting for it. Elementwise math makes the result independent of the split.
template <class Task>
void run_split(int64_t numel, int num_threads, const Task& body) {
    int64_t most = std::max<int64_t>(1, numel / kMinPerThread);
    int threads = static_cast<int>(std::clamp<int64_t>(num_threads, 1, most));
    if (threads == 1) {
        body(0, numel);
        return;
    }
    const int64_t blocks = (numel + kBlock - 1) / kBlock;
    std::atomic<int64_t> next{0};
    ThreadPool::instance().run(threads, [&](int) {
        for (int64_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
            body(b * kBlock, std::min(numel, (b + 1) * kBlock));
        }
    });
}

}  // namespace

const char* path_name(Path path) {
    switch (path) {
        case Path::scalar:
            return "scalar";
        case Path::avx2:
            return "avx2";
        case Path::avx512:
            return "avx512";
        case Path::neon:
            return "neon";
        case Path::sve:
            return "sve";
    }
    return "unknown";
}

std::vector<Path> compiled_paths() {
    std::vector<Path> paths{Path::scalar};
#if defined(DEEPSHARD_HAVE_AVX2)
    paths.push_back(Path::avx2);
#endif
#if defined(DEEPSHARD_HAVE_AVX512)
    paths.push_back(Path::avx512);
#endif
#if defined(DEEPSHARD_HAVE_NEON)
    paths.push_back(Path::neon);
#endif
#if defined(DEEPSHARD_HAVE_SVE)
    paths.push_back(Path::sve);
#endif
    return paths;
}

bool cpu_supports(Path path) {
    switch (path) {
        case Path::scalar:
            return true;
#if defined(__x86_64__) || defined(_M_X64)
        case Path::avx2:
            return x86_avx2();
        case Path::avx512:
            return x86_avx512();
#endif
#if defined(__aarch64__) && defined(__linux__)
        case Path::neon:
            return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
        case Path::sve:
            return (getauxval(AT_HWCAP) & HWCAP_SVE) != 0;
#elif defined(__aarch64__)
        case Path::neon:
            return true;  // Advanced SIMD is mandatory in AArch64
#endif
        default:
            return false;
    }
}

Path best_path() {
    Path best = Path::scalar;
    for (Path path : compiled_paths()) {
        if (cpu_supports(path)) {
            best = path;
        }
    }
    return best;
}

Path active_path() { return static_cast<Path>(active_slot().load()); }

void set_active_path(const std::string& name) {
    std::string known;
    for (Path path : {Path::scalar, Path::avx2, Path::avx512, Path::neon, Path::sve}) {
        known += known.empty() ? path_name(path) : std::string(", ") + path_name(path);
    }
    for (Path path : {Path::scalar, Path::avx2, Path::avx512, Path::neon, Path::sve}) {
        if (name != path_name(path)) {
            continue;
        }
        std::vector<Path> compiled = compiled_paths();
        if (std::find(compiled.begin(), compiled.end(), path) == compiled.end()) {
            throw std::invalid_argument("SIMD path '" + name +
                                        "' is not compiled into this build of deepshard-kernels; "
                                        "pick one of available_simd_paths()");
        }
        if (!cpu_supports(path)) {
            throw std::invalid_argument("SIMD path '" + name +
                                        "' is compiled but this CPU (or its OS) does not support "
                                        "it; pick one of available_simd_paths()");
        }
        active_slot().store(static_cast<int>(path));
        return;
    }
    throw std::invalid_argument("unknown SIMD path '" + name + "'; known paths: " + known);
}

void run_adam(const AdamArgs& args, const StepBuffers& buf, int64_t numel, int num_threads) {
    AdamFn fn = path_fns(active_path()).adam;
    run_split(numel, num_threads, [&](int64_t begin, int64_t end) { fn(args, buf, begin, end); });
}

void run_lion(const LionArgs& args, const StepBuffers& buf, int64_t numel, int num_threads) {
    LionFn fn = path_fns(active_path()).lion;
    run_split(numel, num_threads, [&](int64_t begin, int64_t end) { fn(args, buf, begin, end); });
}

}  // namespace deepshard::cpu
