/* The W8A8 kernels' driver, shared by both builds (w8a8_vnni.c, w8a8_avx2.c): rows quantized once,
 * then every weight's GEMM with the threads splitting the weights' channel
 * blocks as one range, and the entry points made of it. The including file defines, before it:
 *   act_t                    its activation byte (uint8_t q + 128 for VNNI, int8_t q for AVX2)
 *   gemm_args, segment_args  by including w8a8_gemm_args.h (after act_t)
 *   quantize_row(...)        one row of x into act_t [Kp], returning its epilogue scale
 *   gemm_range(g, lo, hi)    channel blocks [lo, hi) of one weight, all rows
 * Every arithmetic step is in those functions: this file only orders calls, so both builds keep one
 * numerics. */
#ifndef QHF_W8A8_SEGMENTS_H
#define QHF_W8A8_SEGMENTS_H

/* Thread t of nt: its share of every segment's channel blocks, the segments taken as one range so
 * small weights share a call. */
static void gemm_share(gemm_args *g, int G, int64_t nblocks, int t, int nt) {
    const int64_t begin = nblocks * t / nt, end = nblocks * (t + 1) / nt;
    int64_t offset = 0;
    for (int s = 0; s < G; ++s) {
        const int64_t nb = (g[s].N + 15) / 16;
        const int64_t lo = begin > offset ? begin : offset, hi = end < offset + nb ? end : offset + nb;
        if (lo < hi) gemm_range(&g[s], lo - offset, hi - offset);
        offset += nb;
    }
}

/* The rows of x (times prescale, an RMSNorm folded in when norm_eps >= 0) quantized once into aq /
 * a_scale (filled in every g[s]), then every segment's GEMM. Returns 0 or 1 (no scratch memory). */
static int run_segments(const void *x, int x_dtype, int64_t M, int64_t K, int64_t x_stride, const float *prescale,
                        float norm_eps, int64_t Kp, gemm_args *g, int G, int n_threads) {
    int64_t nblocks = 0;
    for (int s = 0; s < G; ++s) nblocks += (g[s].N + 15) / 16;
    act_t *aq = (act_t *)aligned_alloc(64, (size_t)((M * Kp + 63) / 64 * 64));
    float *a_scale = (float *)malloc(sizeof(float) * (size_t)(M > 0 ? M : 1));
    if (!aq || !a_scale) { free(aq); free(a_scale); return 1; }
    for (int s = 0; s < G; ++s) { g[s].aq = aq; g[s].a_scale = a_scale; }
    const size_t elem = x_dtype == DT_F32 ? 4 : 2;
    if (n_threads > nblocks) n_threads = (int)nblocks;
    if (n_threads < 1) n_threads = 1;
#pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m)
            a_scale[m] = quantize_row((const char *)x + (size_t)(m * x_stride) * elem, x_dtype, prescale, K, Kp, aq + m * Kp, norm_eps);
        /* implicit barrier: all rows laid out before any thread reads them */
        gemm_share(g, G, nblocks, t, nt);
    }
    free(aq);
    free(a_scale);
    return 0;
}

/* outs[s][M, N_s] = W8A8(x[M, K]) with weights[s], s < G <= MULTI_MAX: x quantized once, the same
 * bits as G qhf_w8a8_linear calls (contiguous outputs in out_dtype). norm_eps >= 0: x is an
 * RMSNorm's input and prescale its weight, folded into the quantization (see quantize_row). Returns
 * 0, 1 (no scratch memory) or 2 (G out of range). */
int qhf_w8a8_linear_multi(const void *x, int x_dtype, int64_t M, int64_t K, int64_t x_stride, const float *prescale,
                          float norm_eps, int64_t Kp, int G, const qhf_weight *weights,
                          void *const *outs, int out_dtype, int n_threads) {
    if (G < 1 || G > MULTI_MAX) return 2;
    gemm_args g[MULTI_MAX];
    for (int s = 0; s < G; ++s) g[s] = segment_args(&weights[s], outs[s], out_dtype, M, Kp);
    return run_segments(x, x_dtype, M, K, x_stride, prescale, norm_eps, Kp, g, G, n_threads);
}

#endif
