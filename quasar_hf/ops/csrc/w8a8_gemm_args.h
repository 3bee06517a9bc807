/* The arguments of one W8A8 GEMM with its fused epilogue, shared by both builds (w8a8_vnni.c,
 * w8a8_avx2.c), and how one weight (a segment of a multi-weight call) fills them. The including file
 * defines act_t before it: its activation byte (uint8_t q + 128 for VNNI, int8_t q for AVX2). */
#ifndef QHF_W8A8_GEMM_ARGS_H
#define QHF_W8A8_GEMM_ARGS_H

#include <stddef.h>
#include <stdint.h>

#include "qhf_entry_points.h"

typedef struct {
    const act_t *aq;        /* [M][Kp] quantized activations */
    const float *a_scale;   /* [M] */
    const int8_t *w;        /* packed [Np/16][Kp/4][16][4] */
    const int32_t *wsum128; /* [Np] 128 x each channel's weight sum: VNNI's unsigned-activation correction (AVX2: unread) */
    const float *w_scale;   /* [N] fp32 */
    const void *bias;       /* [N] or NULL */
    int bias_dtype;
    void *out;              /* [M][out_stride] or NULL */
    int out_dtype;
    int64_t out_stride;
    int32_t *acc_out;       /* [M][N] exact accumulators, or NULL (debug / tests) */
    int64_t M, N, Kp;
} gemm_args;

/* A gemm_args for one qhf_weight (its activations and their scales are set by the driver). */
static inline gemm_args segment_args(const qhf_weight *w, void *out, int out_dtype, int64_t M, int64_t Kp) {
    gemm_args g = {NULL, NULL, w->w_packed, w->wsum128, w->w_scale, w->bias, (int)w->bias_dtype, out, out_dtype, w->N,
                   NULL, M, w->N, Kp};
    return g;
}

#endif
