// The C kernels the quasar:: ops' CPU implementations call (native_ops.cpp): for each kernel, the
// entry points of the one build this CPU runs, chosen at run time among those kernel_builds.def lists.
#ifndef QHF_CPU_KERNELS_H
#define QHF_CPU_KERNELS_H
#include <string>
#include <vector>

#include "qhf_entry_points.h"

namespace quasar {

struct CpuKernels {
    decltype(&qhf_w8a8_linear) w8a8_linear = nullptr;  // kernel "w8a8"
    decltype(&qhf_w8a8_linear_multi) w8a8_linear_multi = nullptr;
    decltype(&qhf_w8a8_quantize_rows) w8a8_quantize_rows = nullptr;
    decltype(&qhf_w8a8_linear_quantized) w8a8_linear_quantized = nullptr;
    decltype(&qhf_rowstable_attention) rowstable_attention = nullptr;  // "attention"
    decltype(&qhf_rowstable_linear) rowstable_linear = nullptr;  // "rowstable_linear"
    decltype(&qhf_rms_norm_rows) rms_norm_rows = nullptr;  // "rms_norm"
    decltype(&qhf_hadamard_rows) hadamard_rows = nullptr;  // "hadamard"
    std::vector<std::string> chosen;  // "<kernel> <build> <source>" of each kernel that has a build here
};

// Chosen once, at first use: per kernel the first build of kernel_builds.def whose CPU flags this
// CPU reports and $QUASAR_HF_CPU_FLAGS_OFF does not mask. A kernel with none keeps null pointers.
const CpuKernels &cpu_kernels();

}  // namespace quasar
#endif
