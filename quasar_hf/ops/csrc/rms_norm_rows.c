/*
 * Row-stable RMSNorm (what `quasar::rms_norm` computes on CPU; ops/reference.py
 * `rowstable_rms_norm_reference` is the oracle, bit for bit):
 *   r = 1 / sqrt(sum(x^2) / K + eps), the sum over 8 lanes (lane j adds x[8i + j]^2 for i ascending),
 *       the lanes combined as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7));
 *   scale_in_float (Gemma): y = (x r) (offset + w), then rounded to the output dtype;
 *   otherwise (Llama, Qwen, ...): y = w * round_to_x_dtype(x r), rounded to the output dtype.
 * All in fp32, each row alone, in an order fixed by K: a row's bits never depend on the other rows.
 * Built with -ffp-contract=off and without -ffast-math (c_build.py): no FMA, no reassociation.
 *
 * dtype codes: 0 = float32, 1 = bfloat16 (x, weight and out each). Returns 0.
 */
#include <math.h>
#include <stdint.h>

#include "qhf_common.h"

static inline float load(const void *p, int dtype, int64_t i) {
    return dtype ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int dtype, int64_t i, float v) {
    if (dtype)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline float round_to(int dtype, float v) { return dtype ? bf16_to_f32(f32_to_bf16(v)) : v; }

int qhf_rms_norm_rows(const void *x, int x_dtype, int64_t rows, int64_t k, int64_t x_stride, const void *w, int w_dtype,
                      float eps, float offset, int scale_in_float, void *out, int out_dtype) {
    for (int64_t r = 0; r < rows; r++) {
        const void *row = x_dtype ? (const void *)((const uint16_t *)x + r * x_stride)
                                  : (const void *)((const float *)x + r * x_stride);
        float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < k; i++) {
            float v = load(row, x_dtype, i);
            lanes[i & 7] += v * v;
        }
        float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        float scale = 1.0f / sqrtf(total / (float)k + eps);
        for (int64_t i = 0; i < k; i++) {
            float h = load(row, x_dtype, i) * scale;
            float y = scale_in_float ? h * (offset + load(w, w_dtype, i)) : load(w, w_dtype, i) * round_to(x_dtype, h);
            store(out, out_dtype, r * k + i, y);
        }
    }
    return 0;
}
