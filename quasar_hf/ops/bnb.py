"""W8A8 linear through bitsandbytes' LLM.int8() primitives (no outlier decomposition).

Uses `bitsandbytes.functional.int8_vectorwise_quant` (per-token activation quantization),
`int8_linear_matmul` (int8 x int8 -> int32, `A @ B.T`) and the `int8_mm_dequant` op.

Differences from `ops/reference.py` (so tests bound the error instead of asserting exactness):
  * rounding: bitsandbytes uses `torch.round` / `__float2int_rn` (half to even) on
    `x * (127 / amax)`, the reference `floor(v + 0.5)` (half up): int8 values can differ by one
    on exact ties;
  * scales: bitsandbytes keeps absmax statistics and multiplies by `1 / 127**2` in the epilogue
    (`acc * (row_absmax * col_absmax) * 6.200124e-05` on CPU); that constant is
    `1/127**2 * (1 + 1.8e-5)`, so outputs come out ~1.8e-5 relatively larger than ours, plus a
    few fp32 ulps from the different association (our weight statistic is `weight_scale * 127`);
  * output dtype: `functional.int8_mm_dequant` always returns fp16 (overflow above 65504), so
    we call the registered op `torch.ops.bitsandbytes.int8_mm_dequant` with `dtype=float32`
    and cast to x.dtype ourselves;
  * non-finite rows: a row holding +-Inf would come out +-Inf instead of NaN; its statistic
    is turned into NaN here so the row is NaN, as in every other backend.
"""

from __future__ import annotations

import torch

try:
    import bitsandbytes.functional as bnb_functional
except ImportError as exc:  # pragma: no cover - exercised only where bitsandbytes is missing
    raise ImportError("the 'bitsandbytes' backend needs the bitsandbytes package: pip install 'quasar-hf[bitsandbytes]'") from exc

from quasar_hf.ops.reference import QMAX


def w8a8_linear_bnb(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype via bitsandbytes (inputs validated by ops.dispatch)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if act_prescale is not None:
        x2 = x2.float() * act_prescale
    a_q, row_absmax, _ = bnb_functional.int8_vectorwise_quant(x2.contiguous())  # int8 [M, K], fp32 [M]
    row_absmax = row_absmax + (row_absmax - row_absmax)  # +-Inf -> NaN (Inf - Inf), finite unchanged
    acc = bnb_functional.int8_linear_matmul(a_q, weight_q)  # int32 [M, N]
    col_absmax = weight_scale * QMAX  # [N], bitsandbytes' per-channel statistic
    out = torch.ops.bitsandbytes.int8_mm_dequant(acc, row_absmax, col_absmax, dtype=torch.float32, bias=bias)
    return out.to(x.dtype).reshape(*lead, weight_q.shape[0])
