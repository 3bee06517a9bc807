// Which build of each C kernel runs on this CPU (cpu_kernels.h), decided from the CPU's own flags.
#include "cpu_kernels.h"

#include <cstdlib>
#include <set>
#include <sstream>

#include "kernel_builds.def"

// Each build's entry points, as ops/native.py renamed them when it compiled the build (<entry>_<build>),
// and how a chosen build fills the table: both from the kernel's list in qhf_entry_points.h.
#define QHF_EXTERN(entry, b) extern "C" decltype(::entry) entry##_##b;
#define QHF_DECLARE(kernel, build, source, cflags, cpu_flags) QHF_ENTRIES_##kernel(QHF_EXTERN, build)
#define QHF_SET(entry, b) k.entry = &::entry##_##b;
#define QHF_ROW(kernel, build, source, cflags, cpu_flags) \
    {#kernel, #build, source, cpu_flags, [](quasar::CpuKernels &k) { QHF_ENTRIES_##kernel(QHF_SET, build) }},

#if defined(QHF_X86)
QHF_X86_BUILDS(QHF_DECLARE)
#endif
QHF_PORTABLE_BUILDS(QHF_DECLARE)

namespace {

struct Build {
    const char *kernel, *build, *source, *cpu_flags;
    void (*install)(quasar::CpuKernels &);
};

const Build kBuilds[] = {
#if defined(QHF_X86)
    QHF_X86_BUILDS(QHF_ROW)
#endif
    QHF_PORTABLE_BUILDS(QHF_ROW)};

// Whether the CPU reports `flag` (a /proc/cpuinfo name), by the compiler's CPUID-based check (which
// also asks the OS whether it saves the AVX and AVX-512 registers).
bool cpu_reports(const std::string &flag) {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (flag == "avx2") return __builtin_cpu_supports("avx2");
    if (flag == "fma") return __builtin_cpu_supports("fma");
    if (flag == "f16c") return __builtin_cpu_supports("f16c");
    if (flag == "avx512f") return __builtin_cpu_supports("avx512f");
    if (flag == "avx512bw") return __builtin_cpu_supports("avx512bw");
    if (flag == "avx512vl") return __builtin_cpu_supports("avx512vl");
    if (flag == "avx512dq") return __builtin_cpu_supports("avx512dq");
    if (flag == "avx512_vnni") return __builtin_cpu_supports("avx512vnni");
    if (flag == "avx512_bf16") return __builtin_cpu_supports("avx512bf16");
#endif
    return false;  // an unknown name is never assumed present
}

std::set<std::string> masked_flags() {  // $QUASAR_HF_CPU_FLAGS_OFF: comma-separated names treated as absent
    std::set<std::string> masked;
    const char *value = std::getenv("QUASAR_HF_CPU_FLAGS_OFF");
    std::stringstream names(value ? value : "");
    for (std::string name; std::getline(names, name, ',');) {
        const auto first = name.find_first_not_of(" \t"), last = name.find_last_not_of(" \t");
        if (first != std::string::npos) masked.insert(name.substr(first, last - first + 1));
    }
    return masked;
}

bool runs_here(const Build &build, const std::set<std::string> &masked) {
    std::stringstream flags(build.cpu_flags);
    for (std::string flag; flags >> flag;) {
        if (masked.count(flag) || !cpu_reports(flag)) return false;
    }
    return true;
}

quasar::CpuKernels choose() {
    quasar::CpuKernels kernels;
    const std::set<std::string> masked = masked_flags();
    std::set<std::string> done;
    for (const Build &build : kBuilds) {
        if (done.count(build.kernel) || !runs_here(build, masked)) continue;
        build.install(kernels);
        done.insert(build.kernel);
        kernels.chosen.push_back(std::string(build.kernel) + " " + build.build + " " + build.source);
    }
    return kernels;
}

}  // namespace

const quasar::CpuKernels &quasar::cpu_kernels() {
    static const CpuKernels kernels = choose();
    return kernels;
}
