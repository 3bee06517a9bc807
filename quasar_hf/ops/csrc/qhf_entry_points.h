/* The C kernels' entry points that C++ calls too (native_ops.cpp), declared once: the W8A8 linears
 * (w8a8_vnni.c and w8a8_avx2.c define the same two), the row-stable attention (rowstable_attention.c),
 * the row-stable float linear (rowstable_linear.c, rowstable_linear_avx2.c), the row-stable RMSNorm
 * (rms_norm_rows.c), the Hadamard rotation of rows (hadamard_rows.h) and the prompt's causal attention
 * (prefill_attention_bf16.c). Each defining file includes
 * this header, so a definition that drifts from its declaration fails to compile. Each build of a
 * kernel (kernel_builds.def) is compiled with these names renamed <name>_<build> (ops/native.py);
 * cpu_kernels.cpp declares the renamed ones from these declarations. */
#ifndef QHF_ENTRY_POINTS_H
#define QHF_ENTRY_POINTS_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One weight of qhf_w8a8_linear_multi. */
typedef struct qhf_weight {
    const int8_t *w_packed;  /* [Np/16][Kp/4][16][4] */
    const int32_t *wsum128;  /* [Np] */
    const float *w_scale;    /* [N] */
    const void *bias;        /* [N] or NULL */
    int64_t bias_dtype;
    int64_t N;
} qhf_weight;

#define MULTI_MAX 8 /* weights per qhf_w8a8_linear_multi call */

int qhf_w8a8_linear(const void *x, int x_dtype, int64_t M, int64_t K, int64_t x_stride, const float *prescale,
                    const int8_t *w_packed, const int32_t *wsum128, int64_t N, int64_t Kp, const float *w_scale,
                    const void *bias, int bias_dtype, void *out, int out_dtype, int64_t out_stride,
                    int32_t *acc_out, int n_threads);

int qhf_w8a8_linear_multi(const void *x, int x_dtype, int64_t M, int64_t K, int64_t x_stride, const float *prescale,
                          float norm_eps, int64_t Kp, int G, const qhf_weight *weights, void *const *outs, int out_dtype,
                          int n_threads);

int qhf_rowstable_attention(const void *q, int64_t q_sb, int64_t q_sh, int64_t q_sq, const void *k, int64_t k_sb,
                            int64_t k_sh, int64_t k_sn, const void *v, int64_t v_sb, int64_t v_sh, int64_t v_sn,
                            const uint8_t *mask, int64_t m_sb, int64_t m_sq, void *out, int64_t B, int64_t H,
                            int64_t KVH, int64_t Q, int64_t N, int64_t D, float scale, int dtype, int n_threads);

int qhf_prefill_attention(const void *q, int64_t q_sb, int64_t q_sh, int64_t q_sl, const void *k, int64_t k_sb,
                          int64_t k_sh, int64_t k_sl, const void *v, int64_t v_sb, int64_t v_sh, int64_t v_sl, void *out,
                          int64_t B, int64_t H, int64_t KVH, int64_t L, int64_t N, int64_t D, float scale, int n_threads);

int qhf_rowstable_linear(const void *x, int64_t x_stride, int64_t M, int64_t K, const void *w, int64_t w_stride,
                         int64_t N, const void *bias, void *out, int64_t out_stride, int dtype, int n_threads);

int qhf_rms_norm_rows(const void *x, int x_dtype, int64_t rows, int64_t k, int64_t x_stride, const void *w, int w_dtype,
                      float eps, float offset, int scale_in_float, void *out, int out_dtype);

int qhf_hadamard_rows(const void *x, int64_t x_stride, int64_t rows, int dtype, float *out, int64_t blocks, int64_t m,
                      int64_t n, const float *signs, float scale, int threads);

#ifdef __cplusplus
}
#endif

/* Each kernel's entry points, by the kernel names of kernel_builds.def: cpu_kernels.{h,cpp} declare,
 * hold and install every build's from these lists, so an entry point is named here and nowhere else. */
#define QHF_ENTRIES_w8a8(X, b) X(qhf_w8a8_linear, b) X(qhf_w8a8_linear_multi, b)
#define QHF_ENTRIES_attention(X, b) X(qhf_rowstable_attention, b)
#define QHF_ENTRIES_prefill_attention(X, b) X(qhf_prefill_attention, b)
#define QHF_ENTRIES_rowstable_linear(X, b) X(qhf_rowstable_linear, b)
#define QHF_ENTRIES_rms_norm(X, b) X(qhf_rms_norm_rows, b)
#define QHF_ENTRIES_hadamard(X, b) X(qhf_hadamard_rows, b)
/* Every kernel: its name (kernel_builds.def's) and what doctor and errors call it (ops/native.py reads this list). */
#define QHF_KERNELS(X)                             \
    X(w8a8, "fused W8A8 linear")                   \
    X(attention, "row-stable attention")           \
    X(prefill_attention, "prefill attention")      \
    X(rowstable_linear, "row-stable linear")       \
    X(rms_norm, "row-stable RMSNorm")              \
    X(hadamard, "Hadamard rotation")
#endif
