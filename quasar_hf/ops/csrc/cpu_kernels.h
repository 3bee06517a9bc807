// The C kernels the quasar:: ops' CPU implementations call (native_ops.cpp): for each kernel, the
// entry points of the one build this CPU runs, chosen at run time among those kernel_builds.def lists.
#ifndef QHF_CPU_KERNELS_H
#define QHF_CPU_KERNELS_H
#include <string>
#include <vector>

#include "qhf_entry_points.h"

namespace quasar {

// One slot per entry point of qhf_entry_points.h, named after it (null where no build of its kernel runs).
#define QHF_SLOT(entry, unused) decltype(&::entry) entry = nullptr;
#define QHF_KERNEL_SLOTS(kernel, title) QHF_ENTRIES_##kernel(QHF_SLOT, _)
struct CpuKernels {
    QHF_KERNELS(QHF_KERNEL_SLOTS)
    std::vector<std::string> chosen;  // "<kernel> <build> <source>" of each kernel that has a build here
};

// Chosen once, at first use: per kernel the first build of kernel_builds.def whose CPU flags this
// CPU reports and $QUASAR_HF_CPU_FLAGS_OFF does not mask. A kernel with none keeps null pointers.
const CpuKernels &cpu_kernels();

}  // namespace quasar
#endif
