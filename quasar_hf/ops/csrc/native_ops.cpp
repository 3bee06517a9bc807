// The CPU kernels of csrc/ behind torch operators registered in C++ (quasar_hf/ops/native.py builds,
// loads and checks this library). A compiled step calls a Python-registered op through the
// dispatcher, back into Python, through our layout code and ctypes: 30-80 us per call, about 180
// calls per SmolLM2 step. These ops take the same tensors and call the same C entry points (linked
// from the libraries cpu_fused.py and attention_cpu.py built), so they compute the same bits without
// Python. ops/graph_passes.py writes them into compiled graphs; their fakes are in native.py, and
// the fakes' checks (the Python ops' own) are what validates shapes, at trace time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "qhf_entry_points.h"

namespace {

constexpr int64_t kMinBytesPerThread = 32 * 1024;  // cpu_fused._MIN_BYTES_PER_THREAD
constexpr int kMultiMax = MULTI_MAX;
constexpr int64_t kRowstableMinBytesPerThread = 256 * 1024;  // rowstable_linear._MIN_BYTES_PER_THREAD
constexpr int64_t kHadamardMinRowsPerThread = 64;  // hadamard_cpu._MIN_ROWS_PER_THREAD

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

int threads_for(int64_t weight_bytes) {  // cpu_fused._thread_count
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

// What FoldedRMSNorm.prepare binds, offset + weight in fp32 (each element an exact conversion and one
// fp32 add, as torch computes `offset + weight.float()`), without two aten ops per call.
std::vector<float> fold_scale(const at::Tensor &norm_weight, double offset) {
    const at::Tensor w = norm_weight.contiguous();
    const int64_t k = w.numel();
    const float add = static_cast<float>(offset);
    std::vector<float> scale(static_cast<size_t>(k));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "fold_scale", [&] {
        const scalar_t *src = w.data_ptr<scalar_t>();
        for (int64_t i = 0; i < k; ++i) scale[i] = static_cast<float>(src[i]) + add;
    });
    return scale;
}

// quasar::native_w8a8_linear: quasar::w8a8_linear on the "cpu_fused" backend with its packed tensors.
at::Tensor native_w8a8_linear(const at::Tensor &x, const at::Tensor &w_packed, const at::Tensor &wsum128,
                              const at::Tensor &weight_scale, const std::optional<at::Tensor> &bias,
                              const std::optional<at::Tensor> &act_prescale, int64_t out_features) {
    const int64_t k = x.size(-1), n = out_features;
    at::Tensor out = at::empty(with_last(x, n), x.options());
    if (out.numel() == 0) return out;
    const at::Tensor rows = rows_of(x, k), scale = fp32_contiguous(weight_scale);
    const std::optional<at::Tensor> pre = act_prescale ? std::optional<at::Tensor>(fp32_contiguous(*act_prescale)) : std::nullopt;
    const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    const int code = dtype_code(x);
    const int status = qhf_w8a8_linear(rows.data_ptr(), code, rows.size(0), k, rows.stride(0), pre ? pre->data_ptr<float>() : nullptr,
                                       w_packed.data_ptr<int8_t>(), wsum128.data_ptr<int32_t>(), n, w_packed.size(1) * 4,
                                       scale.data_ptr<float>(), b ? b->data_ptr() : nullptr, b ? dtype_code(*b) : 0,
                                       out.data_ptr(), code, n, nullptr, threads_for(n * k));
    TORCH_CHECK(status == 0, "fused W8A8 kernel could not allocate scratch for ", rows.size(0), "x", k, " activations");
    return out;
}

// quasar::native_folded_norm_linears: quasar::w8a8_folded_norm_linears ("cpu_fused"), one C call.
std::vector<at::Tensor> native_folded_norm_linears(const at::Tensor &x, const at::Tensor &norm_weight, double eps,
                                                   double offset, at::TensorList w_packed, at::TensorList wsum128,
                                                   at::TensorList weight_scale, const c10::List<std::optional<at::Tensor>> &bias,
                                                   at::IntArrayRef out_features) {
    const int64_t count = static_cast<int64_t>(out_features.size()), k = x.size(-1);
    TORCH_CHECK(count >= 1 && count <= kMultiMax && static_cast<int64_t>(w_packed.size()) == count &&
                    static_cast<int64_t>(wsum128.size()) == count && static_cast<int64_t>(weight_scale.size()) == count &&
                    static_cast<int64_t>(bias.size()) == count,
                "native_folded_norm_linears: 1 to ", kMultiMax, " weights, each with packed data, sums, scale and bias");
    std::vector<at::Tensor> outs;
    int64_t total = 0;
    for (int64_t s = 0; s < count; ++s) {
        outs.push_back(at::empty(with_last(x, out_features[s]), x.options()));
        total += out_features[s];
    }
    const at::Tensor rows = rows_of(x, k);
    if (rows.size(0) == 0) return outs;
    const std::vector<float> norm_scale = fold_scale(norm_weight, offset);
    std::vector<at::Tensor> scales, biases;  // the converted tensors the structs point into, alive through the call
    qhf_weight structs[kMultiMax];
    void *pointers[kMultiMax];
    for (int64_t s = 0; s < count; ++s) {
        const std::optional<at::Tensor> b = bias.get(s);
        scales.push_back(fp32_contiguous(weight_scale[s]));
        biases.push_back(b ? b->contiguous() : at::Tensor());
        structs[s] = {w_packed[s].data_ptr<int8_t>(), wsum128[s].data_ptr<int32_t>(), scales[s].data_ptr<float>(),
                      b ? biases[s].data_ptr() : nullptr, b ? dtype_code(biases[s]) : 0, out_features[s]};
        pointers[s] = outs[s].data_ptr();
    }
    const int code = dtype_code(x);
    const int status = qhf_w8a8_linear_multi(rows.data_ptr(), code, rows.size(0), k, rows.stride(0), norm_scale.data(),
                                             static_cast<float>(eps), nullptr, w_packed[0].size(1) * 4, static_cast<int>(count),
                                             structs, pointers, code, threads_for(total * k));
    TORCH_CHECK(status == 0, "fused W8A8 kernel could not allocate scratch for ", rows.size(0), "x", k, " activations");
    return outs;
}

// quasar::native_rowstable_attention: quasar::rowstable_attention_cpu (query [B, H, Q, D],
// key/value [B, KVH, N, D], visible bool [B, Q, N] or None) -> [B, Q, H, D].
at::Tensor native_rowstable_attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                                      const std::optional<at::Tensor> &visible, std::optional<double> scale) {
    const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), head_dim = query.size(3);
    const int64_t kv_heads = key.size(1), kv_len = key.size(2);
    at::Tensor out = at::empty({batch, q_len, heads, head_dim}, query.options());
    if (out.numel() == 0) return out;
    const at::Tensor q = inner_contiguous(query), k = inner_contiguous(key), v = inner_contiguous(value);
    at::Tensor mask;
    if (visible) mask = inner_contiguous(*visible).view(at::kByte);
    const float s = static_cast<float>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim)));
    const int status = qhf_rowstable_attention(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2), v.data_ptr(),
        v.stride(0), v.stride(1), v.stride(2), visible ? mask.data_ptr<uint8_t>() : nullptr, visible ? mask.stride(0) : 0,
        visible ? mask.stride(1) : 0, out.data_ptr(), batch, heads, kv_heads, q_len, kv_len, head_dim, s,
        query.scalar_type() == at::kBFloat16 ? 1 : 0, std::max(1, at::get_num_threads()));
    TORCH_CHECK(status != 1, "row-stable attention could not allocate scratch for ", kv_len, " keys");
    TORCH_CHECK(status == 0, "row-stable attention rejected shapes q ", query.sizes(), ", k ", key.sizes());
    return out;
}

// quasar::native_rowstable_linear: quasar::rowstable_linear (x [..., K] @ weight[N, K].T + bias, one dtype,
// float32 or bfloat16; each element independent of the row count).
at::Tensor native_rowstable_linear(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    const int64_t k = weight.size(1), n = weight.size(0);
    TORCH_CHECK(x.scalar_type() == weight.scalar_type() && float_or_bf16(x) && (!bias || bias->scalar_type() == x.scalar_type()),
                "native_rowstable_linear: x, weight and bias of one dtype, float32 or bfloat16");
    at::Tensor out = at::empty(with_last(x, n), x.options());
    if (out.numel() == 0) return out;
    const at::Tensor rows = rows_of(x, k), w = inner_contiguous(weight);
    const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    const int64_t weight_bytes = w.numel() * static_cast<int64_t>(w.element_size());
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), weight_bytes / kRowstableMinBytesPerThread)));
    const int status = qhf_rowstable_linear(rows.data_ptr(), rows.stride(0), rows.size(0), k, w.data_ptr(), w.stride(0), n,
                                            b ? b->data_ptr() : nullptr, out.data_ptr(), n, dtype_code(x), threads);
    TORCH_CHECK(status != 1, "row-stable linear could not allocate ", rows.size(0), " x ", k, " fp32 scratch");
    TORCH_CHECK(status == 0, "row-stable linear rejected shapes x ", x.sizes(), ", weight ", weight.sizes());
    return out;
}

// quasar::native_rms_norm: quasar::rms_norm on CPU (csrc/rms_norm_rows.c), contiguous output in x's dtype
// when the scale is applied in fp32 (Gemma), else in the promotion of weight and x (Llama).
at::Tensor native_rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps, double offset, bool scale_in_float) {
    const int64_t k = x.size(-1);
    TORCH_CHECK(float_or_bf16(x) && float_or_bf16(weight) && weight.dim() == 1 && weight.size(0) == k,
                "native_rms_norm: float32 or bfloat16 rows x [..., K] and weight [K]");
    const at::ScalarType dtype = scale_in_float ? x.scalar_type() : at::promote_types(weight.scalar_type(), x.scalar_type());
    at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
    if (out.numel() == 0) return out;
    const at::Tensor rows = rows_of(x, k), w = weight.contiguous();
    qhf_rms_norm_rows(rows.data_ptr(), dtype_code(x), rows.size(0), k, rows.stride(0), w.data_ptr(), dtype_code(w),
                      static_cast<float>(eps), static_cast<float>(offset), scale_in_float ? 1 : 0, out.data_ptr(), dtype_code(out));
    return out;
}

// quasar::native_hadamard_rows: quasar::hadamard_rows on CPU (csrc/hadamard_rows.h): x [..., K] -> fp32 x Q,
// Q = I_blocks (x) (H_m (x) H_pow2) / sqrt(m pow2) with H_m = signs [m, m] (fp32 +-1) and `scale` its
// fp32 1 / sqrt(m pow2), as ops/hadamard.py's HadamardRotation gives them.
at::Tensor native_hadamard_rows(const at::Tensor &x, const at::Tensor &signs, int64_t blocks, int64_t pow2, double scale) {
    const int64_t m = signs.size(0), k = x.size(-1);
    TORCH_CHECK(float_or_bf16(x), "native_hadamard_rows: float32 or bfloat16 rows");
    TORCH_CHECK(k == blocks * m * pow2 && signs.scalar_type() == at::kFloat && signs.dim() == 2 && signs.size(1) == m,
                "native_hadamard_rows: rows of ", k, " do not match ", blocks, " x ", m, " x ", pow2, " (fp32 signs [m, m])");
    at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
    const at::Tensor rows = x.reshape({-1, k}).contiguous(), s = signs.contiguous();
    const int64_t count = rows.size(0);
    if (count == 0) return out;
    const int threads = count < 2 * kHadamardMinRowsPerThread
                            ? 1
                            : static_cast<int>(std::min<int64_t>(at::get_num_threads(), count / kHadamardMinRowsPerThread));
    const int status = qhf_hadamard_rows(rows.data_ptr(), k, count, dtype_code(x), out.data_ptr<float>(), blocks, m, pow2,
                                         s.data_ptr<float>(), static_cast<float>(scale), threads);
    TORCH_CHECK(status == 0, "the Hadamard kernel could not allocate a scratch row of ", k, " floats");
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quasar, m) {
    m.def("native_w8a8_linear(Tensor x, Tensor w_packed, Tensor wsum128, Tensor weight_scale, Tensor? bias, "
          "Tensor? act_prescale, int out_features) -> Tensor");
    m.def("native_folded_norm_linears(Tensor x, Tensor norm_weight, float eps, float offset, Tensor[] w_packed, "
          "Tensor[] wsum128, Tensor[] weight_scale, Tensor?[] bias, int[] out_features) -> Tensor[]");
    m.def("native_rowstable_attention(Tensor query, Tensor key, Tensor value, Tensor? visible, float? scale) -> Tensor");
    m.def("native_rowstable_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("native_rms_norm(Tensor x, Tensor weight, float eps, float offset, bool scale_in_float) -> Tensor");
    m.def("native_hadamard_rows(Tensor x, Tensor signs, int blocks, int pow2, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(quasar, CPU, m) {
    m.impl("native_w8a8_linear", &native_w8a8_linear);
    m.impl("native_folded_norm_linears", &native_folded_norm_linears);
    m.impl("native_rowstable_attention", &native_rowstable_attention);
    m.impl("native_rowstable_linear", &native_rowstable_linear);
    m.impl("native_rms_norm", &native_rms_norm);
    m.impl("native_hadamard_rows", &native_hadamard_rows);
}
