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
#include <string.h>

#include "qhf_common.h"
#include "qhf_entry_points.h"

#define CHUNK 512 /* elements converted to fp32 at a time (a multiple of 8, so lanes keep their elements) */

/* Elements start .. start + n of a float32/bf16 array as fp32. One loop per dtype, no branch
 * inside, so the compiler vectorizes it (and the loops over its output below). */
static void to_f32(const void *p, int dtype, int64_t start, int64_t n, float *dst) {
    if (dtype) {
        const uint16_t *src = (const uint16_t *)p + start;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t u = (uint32_t)src[i] << 16;
            memcpy(dst + i, &u, sizeof u);
        }
    } else {
        memcpy(dst, (const float *)p + start, (size_t)n * sizeof(float));
    }
}

static inline float bf16_round(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* sum(x^2) of one row in the fixed order above: lane j adds elements 8i + j in ascending i. */
static float sum_squares(const void *row, int dtype, int64_t k) {
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0}, buf[CHUNK];
    for (int64_t start = 0; start < k; start += CHUNK) {
        const int64_t n = k - start < CHUNK ? k - start : CHUNK, full = n / 8 * 8;
        to_f32(row, dtype, start, n, buf);
        for (int64_t i = 0; i < full; i += 8)
            for (int j = 0; j < 8; j++) lanes[j] += buf[i + j] * buf[i + j];
        for (int64_t i = full; i < n; i++) lanes[i - full] += buf[i] * buf[i];
    }
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/* y[i] for elements start .. start + n of one row (h = x * scale; each formula and dtype its own loop). */
static void scale_chunk(const float *hx, const float *hw, int64_t n, float scale, float offset, int scale_in_float,
                        int x_dtype, float *y) {
    if (scale_in_float) {
        for (int64_t i = 0; i < n; i++) y[i] = (hx[i] * scale) * (offset + hw[i]);
    } else if (x_dtype) {
        for (int64_t i = 0; i < n; i++) y[i] = hw[i] * bf16_round(hx[i] * scale);
    } else {
        for (int64_t i = 0; i < n; i++) y[i] = hw[i] * (hx[i] * scale);
    }
}

int qhf_rms_norm_rows(const void *x, int x_dtype, int64_t rows, int64_t k, int64_t x_stride, const void *w, int w_dtype,
                      float eps, float offset, int scale_in_float, void *out, int out_dtype) {
    float hx[CHUNK], hw[CHUNK], y[CHUNK];
    for (int64_t r = 0; r < rows; r++) {
        const void *row = x_dtype ? (const void *)((const uint16_t *)x + r * x_stride)
                                  : (const void *)((const float *)x + r * x_stride);
        const float scale = 1.0f / sqrtf(sum_squares(row, x_dtype, k) / (float)k + eps);
        for (int64_t start = 0; start < k; start += CHUNK) {
            const int64_t n = k - start < CHUNK ? k - start : CHUNK;
            to_f32(row, x_dtype, start, n, hx);
            to_f32(w, w_dtype, start, n, hw);
            scale_chunk(hx, hw, n, scale, offset, scale_in_float, x_dtype, y);
            if (out_dtype) {
                uint16_t *dst = (uint16_t *)out + r * k + start;
                for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(y[i]);
            } else {
                memcpy((float *)out + r * k + start, y, (size_t)n * sizeof(float));
            }
        }
    }
    return 0;
}
