// The CPU implementations of the quasar:: operators (quasar_hf/ops/native.py builds, loads and checks
// this library; ops/kernel_ops.py and ops/torch_ops.py define the operators, their fakes, their CUDA
// implementations and their plain-PyTorch fallbacks: torch_ops.OPS is the table). Eager modules and compiled graphs call the operators alike, and on
// CPU the dispatcher lands here, then in the build of each C kernel this CPU runs (cpu_kernels.h),
// without Python between the kernels.
// Each function checks what would make its C kernel read out of bounds; the fakes check the rest
// at trace time, and eager callers check their inputs before the call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <memory>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu_kernels.h"

namespace {

// The chosen build's entry point, or an error naming the kernel no build of which runs on this CPU.
template <typename Fn>
Fn require(Fn fn, const char *kernel) {
    TORCH_CHECK(fn != nullptr, "no build of the ", kernel, " kernel runs on this CPU (quasar-hf doctor says why)");
    return fn;
}

// Work per thread below which a call runs on fewer threads (thread start-up would cost more than it saves).
constexpr int64_t kMinBytesPerThread = 32 * 1024;  // W8A8 linear: packed weight bytes
constexpr int64_t kRowstableMinBytesPerThread = 256 * 1024;  // row-stable lm_head: weight bytes
constexpr int64_t kHadamardMinRowsPerThread = 64;  // Hadamard rotation: rows

bool float_or_bf16(const at::Tensor &t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

int dtype_code(const at::Tensor &t) {  // cpu_fused._DTYPE_CODES
    switch (t.scalar_type()) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kHalf: return 2;
        default: TORCH_CHECK(false, "quasar native op: unsupported dtype ", t.scalar_type());
    }
}

at::Tensor fp32_contiguous(const at::Tensor &t) {
    return t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
}

at::Tensor inner_contiguous(const at::Tensor &t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

int threads_for(int64_t weight_bytes) {  // at most one thread per kMinBytesPerThread of weight
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), weight_bytes / kMinBytesPerThread)));
}

at::Tensor rows_of(const at::Tensor &x, int64_t k) {  // x [..., K] -> [M, K] with unit inner stride
    at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, k});
    return inner_contiguous(rows);
}

std::vector<int64_t> with_last(const at::Tensor &x, int64_t n) {
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    return sizes;
}

// What the C kernel reads of a packed weight (cpu_fused.pack_weight: int8 [Np/16, Kp/4, 16, 4] with K
// padded to 4 and N to 16, int32 sums [Np]) must be there for rows of x.size(-1) and `n` outputs.
void check_packed_weight(const at::Tensor &x, const at::Tensor &w_packed, const at::Tensor &wsum128,
                         const at::Tensor &weight_scale, int64_t n) {
    const int64_t k = x.dim() > 0 ? x.size(-1) : -1;
    TORCH_CHECK(x.dim() >= 1 && (float_or_bf16(x) || x.scalar_type() == at::kHalf), "W8A8 linear: float rows x [..., K]");
    TORCH_CHECK(w_packed.scalar_type() == at::kChar && w_packed.dim() == 4 && w_packed.is_contiguous() &&
                    w_packed.size(1) * 4 == (k + 3) / 4 * 4 && w_packed.size(0) * 16 >= n && w_packed.size(2) == 16,
                "W8A8 linear: the packed weight ", w_packed.sizes(), " does not take rows of ", k, " and ", n, " outputs");
    TORCH_CHECK(wsum128.scalar_type() == at::kInt && wsum128.is_contiguous() && wsum128.numel() >= n && weight_scale.numel() == n,
                "W8A8 linear: int32 sums [>= ", n, "] and scales [", n, "] expected");
}

// quasar::w8a8_linear_cpu_packed on CPU: the "cpu_fused" backend's kernel on its packed weight.
at::Tensor native_w8a8_linear(const at::Tensor &x, const at::Tensor &w_packed, const at::Tensor &wsum128,
                              const at::Tensor &weight_scale, const std::optional<at::Tensor> &bias,
                              const std::optional<at::Tensor> &act_prescale, int64_t out_features) {
    const int64_t k = x.size(-1), n = out_features;
    check_packed_weight(x, w_packed, wsum128, weight_scale, n);
    TORCH_CHECK((!bias || bias->numel() == n) && (!act_prescale || act_prescale->numel() == k),
                "w8a8_linear_cpu_packed: bias must be [", n, "] and act_prescale [", k, "]");
    at::Tensor out = at::empty(with_last(x, n), x.options());
    if (out.numel() == 0) return out;
    const at::Tensor rows = rows_of(x, k), scale = fp32_contiguous(weight_scale);
    const std::optional<at::Tensor> pre = act_prescale ? std::optional<at::Tensor>(fp32_contiguous(*act_prescale)) : std::nullopt;
    const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    const int code = dtype_code(x);
    const int status = require(quasar::cpu_kernels().qhf_w8a8_linear, "W8A8")(rows.data_ptr(), code, rows.size(0), k, rows.stride(0), pre ? pre->data_ptr<float>() : nullptr,
                                       w_packed.data_ptr<int8_t>(), wsum128.data_ptr<int32_t>(), n, w_packed.size(1) * 4,
                                       scale.data_ptr<float>(), b ? b->data_ptr() : nullptr, b ? dtype_code(*b) : 0,
                                       out.data_ptr(), code, n, nullptr, threads_for(n * k));
    TORCH_CHECK(status == 0, "fused W8A8 kernel could not allocate scratch for ", rows.size(0), "x", k, " activations");
    return out;
}

// quasar::w8a8_folded_norm_linear_cpu_packed on CPU: W8A8(RMSNorm(x)) on the packed weight, the norm
// folded into the rows' quantization (norm_scale: fp32 offset + weight [K]), one C call.
at::Tensor native_folded_norm_linear(const at::Tensor &x, const at::Tensor &norm_scale, double eps, const at::Tensor &w_packed,
                                     const at::Tensor &wsum128, const at::Tensor &weight_scale,
                                     const std::optional<at::Tensor> &bias, int64_t out_features) {
    const int64_t k = x.size(-1), n = out_features;
    check_packed_weight(x, w_packed, wsum128, weight_scale, n);
    TORCH_CHECK(norm_scale.scalar_type() == at::kFloat && norm_scale.numel() == k,
                "w8a8_folded_norm_linear_cpu_packed: norm_scale must be fp32 [", k, "]");
    TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "w8a8_folded_norm_linear_cpu_packed: eps must be a finite number >= 0, got ", eps);
    TORCH_CHECK(!bias || bias->numel() == n, "w8a8_folded_norm_linear_cpu_packed: bias must be [", n, "]");
    at::Tensor out = at::empty(with_last(x, n), x.options());
    if (out.numel() == 0) return out;
    const at::Tensor rows = rows_of(x, k), scale_in = norm_scale.contiguous(), scale = fp32_contiguous(weight_scale);
    const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    const qhf_weight weight = {w_packed.data_ptr<int8_t>(), wsum128.data_ptr<int32_t>(), scale.data_ptr<float>(),
                               b ? b->data_ptr() : nullptr, b ? dtype_code(*b) : 0, n};
    void *outs[1] = {out.data_ptr()};
    const int code = dtype_code(x);
    const int status = require(quasar::cpu_kernels().qhf_w8a8_linear_multi, "W8A8")(
        rows.data_ptr(), code, rows.size(0), k, rows.stride(0), scale_in.data_ptr<float>(), static_cast<float>(eps),
        w_packed.size(1) * 4, 1, &weight, outs, code, threads_for(n * k));
    TORCH_CHECK(status == 0, "fused W8A8 kernel could not allocate scratch for ", rows.size(0), "x", k, " activations");
    return out;
}

// quasar::rowstable_attention on CPU (query [B, H, Q, D],
// key/value [B, KVH, N, D], visible bool [B, Q, N] or None) -> [B, Q, H, D].
at::Tensor rowstable_attention_cpu(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                                      const std::optional<at::Tensor> &visible, std::optional<double> scale) {
    TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes() && float_or_bf16(query) &&
                    key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
                "rowstable_attention: query [B, H, Q, D], key and value [B, KVH, N, D] of one dtype (float32 or bfloat16)");
    const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), head_dim = query.size(3);
    const int64_t kv_heads = key.size(1), kv_len = key.size(2);
    TORCH_CHECK(key.size(0) == batch && key.size(3) == head_dim && kv_heads > 0 && heads % kv_heads == 0 && kv_len >= q_len,
                "rowstable_attention rejected shapes q ", query.sizes(), ", k ", key.sizes());
    TORCH_CHECK(!visible || (visible->scalar_type() == at::kBool && visible->sizes() == at::IntArrayRef({batch, q_len, kv_len})),
                "rowstable_attention: visible must be bool [", batch, ", ", q_len, ", ", kv_len, "]");
    at::Tensor out = at::empty({batch, q_len, heads, head_dim}, query.options());
    if (out.numel() == 0) return out;
    const at::Tensor q = inner_contiguous(query), k = inner_contiguous(key), v = inner_contiguous(value);
    at::Tensor mask;
    if (visible) mask = inner_contiguous(*visible).view(at::kByte);
    const float s = static_cast<float>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim)));
    const int status = require(quasar::cpu_kernels().qhf_rowstable_attention, "row-stable attention")(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2), v.data_ptr(),
        v.stride(0), v.stride(1), v.stride(2), visible ? mask.data_ptr<uint8_t>() : nullptr, visible ? mask.stride(0) : 0,
        visible ? mask.stride(1) : 0, out.data_ptr(), batch, heads, kv_heads, q_len, kv_len, head_dim, s,
        query.scalar_type() == at::kBFloat16 ? 1 : 0, std::max(1, at::get_num_threads()));
    TORCH_CHECK(status != 1, "row-stable attention could not allocate scratch for ", kv_len, " keys");
    TORCH_CHECK(status == 0, "row-stable attention rejected shapes q ", query.sizes(), ", k ", key.sizes());
    return out;
}

// quasar::prefill_attention on CPU: a prompt's causal self-attention, or its continuation over earlier keys
// (query [B, H, Q, D], key/value [B, KVH, N, D], Q <= N: row i sees keys 0 .. N - Q + i; bfloat16,
// D % 32 == 0, D <= 256) -> [B, Q, H, D].
at::Tensor prefill_attention_cpu(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                                 std::optional<double> scale) {
    TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes() && query.scalar_type() == at::kBFloat16 &&
                    key.scalar_type() == at::kBFloat16 && value.scalar_type() == at::kBFloat16,
                "prefill_attention: query [B, H, Q, D], key and value [B, KVH, N, D], all bfloat16");
    const int64_t batch = query.size(0), heads = query.size(1), length = query.size(2), head_dim = query.size(3);
    const int64_t kv_heads = key.size(1), kv_len = key.size(2);
    TORCH_CHECK(key.size(0) == batch && kv_len >= length && key.size(3) == head_dim && kv_heads > 0 &&
                    heads % kv_heads == 0 && head_dim % 32 == 0 && head_dim <= 256,
                "prefill_attention rejected shapes q ", query.sizes(), ", k ", key.sizes(),
                " (needs at least as many keys as queries, head dim a multiple of 32 up to 256)");
    at::Tensor out = at::empty({batch, length, heads, head_dim}, query.options());
    if (out.numel() == 0) return out;
    const at::Tensor q = inner_contiguous(query), k = inner_contiguous(key), v = inner_contiguous(value);
    const float s = static_cast<float>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim)));
    const int status = require(quasar::cpu_kernels().qhf_prefill_attention, "prefill attention")(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2), v.data_ptr(),
        v.stride(0), v.stride(1), v.stride(2), out.data_ptr(), batch, heads, kv_heads, length, kv_len, head_dim, s,
        std::max(1, at::get_num_threads()));
    TORCH_CHECK(status != 1, "prefill attention could not allocate scratch for ", kv_len, " keys");
    TORCH_CHECK(status == 0, "prefill attention rejected shapes q ", query.sizes(), ", k ", key.sizes());
    return out;
}

// quasar::rowstable_linear on CPU (x [..., K] @ weight[N, K].T + bias, one dtype,
// float32 or bfloat16; each element independent of the row count).
at::Tensor rowstable_linear_cpu(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    const int64_t k = weight.size(1), n = weight.size(0);
    TORCH_CHECK(x.scalar_type() == weight.scalar_type() && float_or_bf16(x) && (!bias || bias->scalar_type() == x.scalar_type()),
                "rowstable_linear: x, weight and bias of one dtype, float32 or bfloat16");
    TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == k && (!bias || bias->numel() == n),
                "rowstable_linear: x [..., K], weight [N, K] and bias [N]; got x ", x.sizes(), ", weight ", weight.sizes());
    at::Tensor out = at::empty(with_last(x, n), x.options());
    if (out.numel() == 0) return out;
    const at::Tensor rows = rows_of(x, k), w = inner_contiguous(weight);
    const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    const int64_t weight_bytes = w.numel() * static_cast<int64_t>(w.element_size());
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), weight_bytes / kRowstableMinBytesPerThread)));
    const int status = require(quasar::cpu_kernels().qhf_rowstable_linear, "row-stable linear")(rows.data_ptr(), rows.stride(0), rows.size(0), k, w.data_ptr(), w.stride(0), n,
                                            b ? b->data_ptr() : nullptr, out.data_ptr(), n, dtype_code(x), threads);
    TORCH_CHECK(status != 1, "row-stable linear could not allocate ", rows.size(0), " x ", k, " fp32 scratch");
    TORCH_CHECK(status == 0, "row-stable linear rejected shapes x ", x.sizes(), ", weight ", weight.sizes());
    return out;
}

// quasar::rms_norm on CPU (csrc/rms_norm_rows.c), contiguous output in x's dtype
// when the scale is applied in fp32 (Gemma), else in the promotion of weight and x (Llama).
at::Tensor rms_norm_cpu(const at::Tensor &x, const at::Tensor &weight, double eps, double offset, bool scale_in_float) {
    const int64_t k = x.size(-1);
    TORCH_CHECK(float_or_bf16(x) && float_or_bf16(weight) && weight.dim() == 1 && weight.size(0) == k,
                "rms_norm: float32 or bfloat16 rows x [..., K] and weight [K]");
    const at::ScalarType dtype = scale_in_float ? x.scalar_type() : at::promote_types(weight.scalar_type(), x.scalar_type());
    at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
    if (out.numel() == 0) return out;
    const at::Tensor rows = rows_of(x, k), w = weight.contiguous();
    require(quasar::cpu_kernels().qhf_rms_norm_rows, "RMSNorm")(rows.data_ptr(), dtype_code(x), rows.size(0), k, rows.stride(0), w.data_ptr(), dtype_code(w),
                      static_cast<float>(eps), static_cast<float>(offset), scale_in_float ? 1 : 0, out.data_ptr(), dtype_code(out));
    return out;
}

// quasar::hadamard_rows on CPU (csrc/hadamard_rows.h): x [..., K] -> fp32 x Q,
// Q = I_blocks (x) (H_m (x) H_pow2) / sqrt(m pow2) with H_m = signs [m, m] (fp32 +-1) and `scale` its
// fp32 1 / sqrt(m pow2), as ops/hadamard.py's HadamardRotation gives them.
at::Tensor hadamard_rows_cpu(const at::Tensor &x, const at::Tensor &signs, int64_t blocks, int64_t pow2, double scale) {
    const int64_t m = signs.size(0), k = x.size(-1);
    TORCH_CHECK(float_or_bf16(x), "hadamard_rows: float32 or bfloat16 rows");
    TORCH_CHECK(k == blocks * m * pow2 && signs.scalar_type() == at::kFloat && signs.dim() == 2 && signs.size(1) == m,
                "hadamard_rows: rows of ", k, " do not match ", blocks, " x ", m, " x ", pow2, " (fp32 signs [m, m])");
    at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
    const at::Tensor rows = x.reshape({-1, k}).contiguous(), s = signs.contiguous();
    const int64_t count = rows.size(0);
    if (count == 0) return out;
    const int threads = count < 2 * kHadamardMinRowsPerThread
                            ? 1
                            : static_cast<int>(std::min<int64_t>(at::get_num_threads(), count / kHadamardMinRowsPerThread));
    const int status = require(quasar::cpu_kernels().qhf_hadamard_rows, "Hadamard")(rows.data_ptr(), k, count, dtype_code(x), out.data_ptr<float>(), blocks, m, pow2,
                                         s.data_ptr<float>(), static_cast<float>(scale), threads);
    TORCH_CHECK(status == 0, "the Hadamard kernel could not allocate a scratch row of ", k, " floats");
    return out;
}

// The W8A8 kernel's exact int32 accumulators [M, N] for rows x [..., K] (tests and debugging: the
// integer GEMM checked apart from its float epilogue).
at::Tensor native_w8a8_accumulators(const at::Tensor &x, const at::Tensor &w_packed, const at::Tensor &wsum128,
                                    const std::optional<at::Tensor> &act_prescale, int64_t out_features) {
    const int64_t k = x.size(-1), n = out_features;
    const at::Tensor ones = at::ones({n}, x.options().dtype(at::kFloat));
    check_packed_weight(x, w_packed, wsum128, ones, n);
    TORCH_CHECK(!act_prescale || act_prescale->numel() == k, "w8a8 accumulators: act_prescale must be [", k, "]");
    const at::Tensor rows = rows_of(x, k);
    at::Tensor acc = at::empty({rows.size(0), n}, x.options().dtype(at::kInt));
    if (acc.numel() == 0) return acc;
    const std::optional<at::Tensor> pre = act_prescale ? std::optional<at::Tensor>(fp32_contiguous(*act_prescale)) : std::nullopt;
    const int status = require(quasar::cpu_kernels().qhf_w8a8_linear, "W8A8")(
        rows.data_ptr(), dtype_code(x), rows.size(0), k, rows.stride(0), pre ? pre->data_ptr<float>() : nullptr,
        w_packed.data_ptr<int8_t>(), wsum128.data_ptr<int32_t>(), n, w_packed.size(1) * 4, ones.data_ptr<float>(), nullptr, 0,
        nullptr, dtype_code(x), n, acc.data_ptr<int32_t>(), threads_for(n * k));
    TORCH_CHECK(status == 0, "fused W8A8 kernel could not allocate scratch for ", rows.size(0), "x", k, " activations");
    return acc;
}

// "<kernel> <build> <source>" of the build each kernel runs on this CPU (kernels without one are absent).
std::vector<std::string> kernel_builds() { return quasar::cpu_kernels().chosen; }

// The CPU implementation of each operator ops/kernel_ops.py defines, by its name: the one table of
// what this library serves. C++ defines no schema of its own; it registers implementations only.
using Registrar = void (*)(torch::Library &, const char *);
const std::map<std::string, Registrar> &implementations() {
    static const std::map<std::string, Registrar> table = {
        {"w8a8_linear_cpu_packed", [](torch::Library &l, const char *op) { l.impl(op, &native_w8a8_linear); }},
        {"w8a8_folded_norm_linear_cpu_packed", [](torch::Library &l, const char *op) { l.impl(op, &native_folded_norm_linear); }},
        {"w8a8_accumulators_cpu_packed", [](torch::Library &l, const char *op) { l.impl(op, &native_w8a8_accumulators); }},
        {"rowstable_attention", [](torch::Library &l, const char *op) { l.impl(op, &rowstable_attention_cpu); }},
        {"prefill_attention", [](torch::Library &l, const char *op) { l.impl(op, &prefill_attention_cpu); }},
        {"rowstable_linear", [](torch::Library &l, const char *op) { l.impl(op, &rowstable_linear_cpu); }},
        {"rms_norm", [](torch::Library &l, const char *op) { l.impl(op, &rms_norm_cpu); }},
        {"hadamard_rows", [](torch::Library &l, const char *op) { l.impl(op, &hadamard_rows_cpu); }},
    };
    return table;
}

// One registration per operator, so that ops/native.py can withdraw one whose smoke test fails (the
// registration is dropped with its torch::Library) while the others keep serving.
std::map<std::string, std::unique_ptr<torch::Library>> &registrations() {
    static std::map<std::string, std::unique_ptr<torch::Library>> held;
    return held;
}

void register_cpu_kernel(const std::string &op) {
    const auto &table = implementations();
    const auto found = table.find(op);
    TORCH_CHECK(found != table.end(), "native_register_cpu_kernel: no C++ implementation of quasar::", op);
    TORCH_CHECK(!registrations().count(op), "native_register_cpu_kernel: quasar::", op, " is already registered");
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "quasar", c10::DispatchKey::CPU, __FILE__, __LINE__);
    found->second(*library, op.c_str());
    registrations()[op] = std::move(library);
}

void unregister_cpu_kernel(const std::string &op) { registrations().erase(op); }

std::vector<std::string> implemented_ops() {
    std::vector<std::string> names;
    for (const auto &entry : implementations()) names.push_back(entry.first);
    return names;
}

}  // namespace

// The library's control functions (not operators of the model): which builds run here, which
// operators it implements, and registering or withdrawing one implementation.
TORCH_LIBRARY_FRAGMENT(quasar, m) {
    m.def("native_kernel_builds() -> str[]", &kernel_builds);
    m.def("native_implemented_ops() -> str[]", &implemented_ops);
    m.def("native_register_cpu_kernel(str op) -> ()", &register_cpu_kernel);
    m.def("native_unregister_cpu_kernel(str op) -> ()", &unregister_cpu_kernel);
}
