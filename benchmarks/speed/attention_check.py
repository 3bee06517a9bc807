"""GPU-check section: the row-stable attention kernel on the device (error, row stability, speed vs SDPA)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from quasar_hf.ops.reference import attention_reference
from quasar_hf.ops.rowstable_attention import rowstable_kernel_for


def attention_check(device: str, tiny: bool, median_time: Callable[..., float]) -> dict:
    """Error vs the fp64 oracle, row stability, and time per call vs SDPA at a decode (1 row) and a
    verify (6 rows) shape over a long cache; `median_time(fn, device, iters)` times one call."""
    heads, kv_heads, dim, kv_len = (4, 2, 16, 64) if tiny else (32, 8, 128, 2048)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 6, dim, generator=g).bfloat16().to(device)
    k, v = (torch.randn(1, kv_heads, kv_len, dim, generator=g).bfloat16().to(device) for _ in range(2))
    kernel = rowstable_kernel_for(q, k, v)
    if kernel is None:
        return {"kernel": None, "note": "no row-stable kernel here: verification runs SDPA row by row"}
    out = kernel(q, k, v, None, None)
    ref = attention_reference(q.cpu(), k.cpu(), v.cpu())
    alone = kernel(q[:, :, :1], k[:, :, : kv_len - 5], v[:, :, : kv_len - 5], None, None)
    result = {
        "kernel": f"{kernel.__module__}.{kernel.__name__}",
        "max_rel_error": float((out.double().cpu() - ref).abs().max() / ref.abs().max()),
        "row_equals_decode_step": bool(torch.equal(alone[:, 0], out[:, 0])),
    }
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for rows in (1, 6):
        qq = q[:, :, :rows].contiguous()
        result[f"us_rows{rows}_kernel"] = median_time(lambda: kernel(qq, k, v, None, None), device, 20) * 1e6
        result[f"us_rows{rows}_sdpa"] = median_time(lambda: sdpa(qq, k, v, enable_gqa=True), device, 20) * 1e6
    return result
