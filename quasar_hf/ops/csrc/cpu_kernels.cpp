// Which build of each C kernel runs on this CPU (cpu_kernels.h), decided from the CPU's own flags.
#include "cpu_kernels.h"

#include <cstdlib>
#include <set>
#include <sstream>

#include "kernel_builds.def"

// Each build's entry points, as ops/native.py renamed them when it compiled the build (<entry>_<build>).
#define QHF_DECLARE_w8a8(b)                                                       \
    extern "C" decltype(qhf_w8a8_linear) qhf_w8a8_linear_##b;                     \
    extern "C" decltype(qhf_w8a8_linear_multi) qhf_w8a8_linear_multi_##b;        \
    extern "C" decltype(qhf_w8a8_quantize_rows) qhf_w8a8_quantize_rows_##b;      \
    extern "C" decltype(qhf_w8a8_linear_quantized) qhf_w8a8_linear_quantized_##b;
#define QHF_DECLARE_attention(b) extern "C" decltype(qhf_rowstable_attention) qhf_rowstable_attention_##b;
#define QHF_DECLARE_rowstable_linear(b) extern "C" decltype(qhf_rowstable_linear) qhf_rowstable_linear_##b;
#define QHF_DECLARE_rms_norm(b) extern "C" decltype(qhf_rms_norm_rows) qhf_rms_norm_rows_##b;
#define QHF_DECLARE_hadamard(b) extern "C" decltype(qhf_hadamard_rows) qhf_hadamard_rows_##b;
#define QHF_DECLARE(kernel, build, source, cflags, cpu_flags) QHF_DECLARE_##kernel(build)

// How a chosen build fills the table.
#define QHF_INSTALL_w8a8(b)                                      \
    [](quasar::CpuKernels &k) {                                  \
        k.w8a8_linear = &qhf_w8a8_linear_##b;                    \
        k.w8a8_linear_multi = &qhf_w8a8_linear_multi_##b;        \
        k.w8a8_quantize_rows = &qhf_w8a8_quantize_rows_##b;      \
        k.w8a8_linear_quantized = &qhf_w8a8_linear_quantized_##b; \
    }
#define QHF_INSTALL_attention(b) [](quasar::CpuKernels &k) { k.rowstable_attention = &qhf_rowstable_attention_##b; }
#define QHF_INSTALL_rowstable_linear(b) [](quasar::CpuKernels &k) { k.rowstable_linear = &qhf_rowstable_linear_##b; }
#define QHF_INSTALL_rms_norm(b) [](quasar::CpuKernels &k) { k.rms_norm_rows = &qhf_rms_norm_rows_##b; }
#define QHF_INSTALL_hadamard(b) [](quasar::CpuKernels &k) { k.hadamard_rows = &qhf_hadamard_rows_##b; }
#define QHF_ROW(kernel, build, source, cflags, cpu_flags) {#kernel, #build, source, cpu_flags, QHF_INSTALL_##kernel(build)},

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
